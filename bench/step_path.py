"""The path of one training step through the packages, traced, not read: how many calls lead from
``finetune/run.py`` to the loss, through how many files, and which calls of one step cross a package boundary.

A tiny recipe (``tiny-clip``, synthetic scenes, the clip loss, batch 8, 4 steps, no evaluation, data read in the
training process so that the collate function runs where it is traced) runs through ``finetune/run.py`` as a user
launches it. ``sys.setprofile`` records every call of a Python function of ``finetune/`` or ``losses/`` from the end
of step 2 to the end of step 3 (both ends: the objective's per-step work, which every version calls once per
step), so the window holds one whole step: its stop vote, fetching its batch (sampler, collate, planning, the copy to
the device), the forward, the loss, the backward, the optimiser step. For each call the caller is the nearest frame
of the toolkit below it (torch's and accelerate's frames in between are skipped), so a call through
``DataLoader`` or a DDP wrapper counts as the toolkit's call it serves.

Printed (and written to ``bench/results/step_path.json``):

- the path to the loss: the toolkit's frames on the stack when the loss function of ``losses/`` is entered, from
  ``finetune/run.py`` down, file by file (the calls are the frames below the entry point);
- the crossings of one step: the distinct call edges (caller function -> called function) whose two ends lie in
  different packages (``training``, ``objectives``, ``data``, ``models``, ``losses``, ...), and among them the
  calls back up: a lower package calling into a higher one (a callback, e.g. the collator calling the
  objective's ``collate``), each listed.

Run: ``python bench/step_path.py`` (about a minute on 2 shared CPU cores). The numbers count code paths, not
time: they do not depend on the machine.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

#: the packages, bottom first (the floors of docs/architecture.md and tests/test_import_graph.py)
FLOORS = ("losses", "ground", "data", "config", "runs", "preprocess", "models", "objectives", "evaluation", "hub",
          "training", "cli", "entry")
_GROUND = {"plugins.py", "files.py", "extras.py", "threads.py", "credentials.py"}


def package_of(path: str) -> str | None:
    """The package of a toolkit file (``training``, ``losses``, ``entry`` for the entry points), None outside."""
    try:
        rel = Path(path).resolve().relative_to(ROOT)
    except ValueError:
        return None
    parts = rel.parts
    if parts[0] == "losses":
        return "losses"
    if parts[0] != "finetune":
        return None
    if len(parts) == 2:
        return "ground" if parts[1] in _GROUND else "entry"
    return parts[1]


def _where(frame: Any) -> tuple[str, str]:
    code = frame.f_code
    return str(Path(code.co_filename).resolve().relative_to(ROOT)), getattr(code, "co_qualname", code.co_name)


class StepTracer:
    """``sys.setprofile`` hook: the toolkit's calls while :attr:`on`, and the stack at the first loss call."""

    def __init__(self) -> None:
        self.on = False
        self.calls: Counter[tuple[str, str]] = Counter()
        self.edges: Counter[tuple[tuple[str, str], tuple[str, str]]] = Counter()
        self.loss_stack: list[tuple[str, str]] | None = None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        callee_pkg = package_of(frame.f_code.co_filename)
        if callee_pkg is None:
            return
        callee = _where(frame)
        self.calls[callee] += 1
        caller = frame.f_back
        while caller is not None and package_of(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is not None:
            self.edges[(_where(caller), callee)] += 1
        if callee_pkg == "losses" and self.loss_stack is None:
            stack, f = [], frame
            while f is not None:
                if package_of(f.f_code.co_filename) is not None:
                    stack.append(_where(f))
                f = f.f_back
            self.loss_stack = stack[::-1]


def _recipe(folder: Path) -> Path:
    import yaml

    recipe = {
        "model": {"name_or_path": "tiny-clip", "max_text_len": 77},
        "data": {"train": {"name": "synthetic", "size": 64, "seed": 0, "options": {"image_size": 32}},
                 "num_workers": 0},
        "eval": {"sets": []},
        "objective": {"base": "clip"},
        "train": {"batch_size": 8, "max_steps": 4, "log_every": 100, "trackers": [], "warmup_steps": 0,
                  "checkpoint_every": 0, "seed": 0},
        "output": {"dir": str(folder / "run")},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def trace(folder: Path) -> StepTracer:
    """Run the tiny recipe through ``finetune/run.py`` with the tracer on from the end of step 2 to the end of 3."""
    from finetune.objectives.base import Term

    tracer = StepTracer()
    original = Term.after_optimizer_step
    done = [0]

    def counted(self: Any) -> None:  # every version calls it once per step, at the step's end
        original(self)
        done[0] += 1
        tracer.on = done[0] == 2

    Term.after_optimizer_step = counted
    import finetune.process_exit

    ending = finetune.process_exit.exit_process
    finetune.process_exit.exit_process = sys.exit  # run.py ends its process; this one goes on to count the path
    argv = sys.argv
    sys.argv = ["finetune/run.py", str(_recipe(folder))]
    sys.setprofile(tracer)
    try:
        runpy.run_path(str(ROOT / "finetune" / "run.py"), run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            raise RuntimeError(f"the tiny run failed with status {exc.code}") from None
    finally:
        sys.setprofile(None)
        sys.argv = argv
        finetune.process_exit.exit_process = ending
        Term.after_optimizer_step = original
    return tracer


def summary(tracer: StepTracer) -> dict[str, Any]:
    """The path to the loss and the step's crossings (module docstring)."""
    stack = tracer.loss_stack or []
    crossings, upward = [], []
    for (caller, callee), n in sorted(tracer.edges.items()):
        a, b = package_of(str(ROOT / caller[0])), package_of(str(ROOT / callee[0]))
        if a == b:
            continue
        entry = {"from": f"{caller[0]}::{caller[1]}", "to": f"{callee[0]}::{callee[1]}", "packages": f"{a} -> {b}",
                 "times": n}
        crossings.append(entry)
        if FLOORS.index(b) > FLOORS.index(a):
            upward.append(entry)
    return {
        "path_to_the_loss": [f"{f}::{q}" for f, q in stack],
        "calls_to_the_loss": max(0, len(stack) - 1),
        "files_to_the_loss": len({f for f, _ in stack}),
        "functions_called_in_one_step": len(tracer.calls),
        "calls_in_one_step": sum(tracer.calls.values()),
        "crossings": crossings,
        "crossing_edges": len(crossings),
        "crossing_calls": sum(c["times"] for c in crossings),
        "upward_edges": len(upward),
        "upward": upward,
        "package_pairs": dict(Counter(c["packages"] for c in crossings).most_common()),
    }


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        result = summary(trace(Path(tmp)))
    print(f"path to the loss: {result['calls_to_the_loss']} calls through {result['files_to_the_loss']} files")
    for line in result["path_to_the_loss"]:
        print(f"  {line}")
    print(f"one step: {result['calls_in_one_step']} calls of {result['functions_called_in_one_step']} toolkit "
          f"functions; {result['crossing_edges']} distinct calls cross a package boundary "
          f"({result['crossing_calls']} times), {result['upward_edges']} of them into a higher package")
    for c in result["crossings"]:
        mark = "  ^" if c in result["upward"] else "   "
        print(f"{mark} {c['packages']:>24}  {c['from']}  ->  {c['to']}  (x{c['times']})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "step_path.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
