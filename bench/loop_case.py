"""One case of ``bench/loop.py``, measured in a process of its own (the parent starts ``python bench/loop_case.py
SPEC.json`` once per case, so no case inherits another's warm caches, compiled graphs or attention plans).

In that fresh process: build the case's loop as a run does (``build_loop``), run the run's loop
(``FinetuneRecipe.train``) for ``warmup + steady`` steps (the steady rate is taken from the loop's own read at step ``warmup`` to its last read), then draw the next
``bare_warmup + steady + 2`` batches from the same loader (the sampler continues past the loop's steps, so each
batch holds rows neither the loop nor the bare step has seen), move them all to the device, and time
the step alone on them (``TrainStep`` and the objective's ``after_step``), one batch per step, each used once. Every step's batch ids are recorded and
checked: a bare batch that repeats a loop row, or a bare batch used twice, stops the case with an error.

Per step it records, at no cost to the timing: the batch's tensor shapes as the loader gives them (the step pads texts
to the run's planned bucket lengths, so these change from step to step where the attention's repeat the planned
ones), the real and the computed text tokens of its text plan (chosen where the batch was collated), and (eager runs
only, where a Python-level call is not traced by dynamo) every ``scaled_dot_product_attention`` call's query / key /
mask shapes, from which the new shapes per steady step follow. Compiled runs report dynamo's graph count after the
warm-up and after each timed window (a recompilation adds a graph). After the timed windows, two more fresh batches:
one step under ``torch.profiler`` (the SDPA aten op and, on CUDA, the attention kernels that ran, e.g. ``flash`` /
``fmha`` / ``cudnn`` in their names) and one under ``torch.utils.flop_counter`` twice: at its text plan and with every
text pass at half its length, which gives the FLOPs per computed text token. A step's FLOPs are then the probe's plus
that rate times the step's computed text tokens beyond the probe's (linear in the tokens: attention's L^2 part is a
few per cent of a text block at these widths), and the MFU is given twice: on the computed tokens (padding counted
as work) and on the real tokens (padding's FLOPs taken out).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from finetune.training.throughput import LoopClock, count_flops, peak_tflops  # noqa: E402

#: attention kernel families by a substring of a CUDA kernel's or aten op's name (lower case), first match wins
KERNEL_FAMILIES = (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"), ("efficient", "efficient"),
                   ("mem_eff", "efficient"), ("attention_math", "math"))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def count_syncs(device: str):
    """Counts CUDA host syncs inside the block (``torch.cuda.set_sync_debug_mode("warn")``: every D2H read,
    blocking copy and stream synchronisation warns); yields a list holding one message per sync afterwards (always
    empty off CUDA)."""
    found: list[str] = []
    if device != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower())


def batch_signature(batch: Any, prefix: str = "") -> tuple:
    """The shapes and dtypes of every tensor of a (nested) batch: ``((key, shape, dtype), ...)``, sorted."""
    out: list[tuple] = []
    if isinstance(batch, dict):
        for key, value in batch.items():
            out.extend(batch_signature(value, f"{prefix}{key}."))
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            out.extend(batch_signature(value, f"{prefix}{i}."))
    elif isinstance(batch, torch.Tensor):
        out.append((prefix.rstrip("."), tuple(batch.shape), str(batch.dtype)))
    return tuple(sorted(out))


class StepRecorder:
    """What every step ran with: batch ids, batch shapes, and (when ``sdpa`` is on) the attention calls' shapes.

    ``sdpa`` replaces ``torch.nn.functional.scaled_dot_product_attention`` by a wrapper that notes
    ``(query shape, key shape, mask shape, is_causal)`` and calls the original: transformers' attention, this
    package's pooled tower and ``nn.MultiheadAttention`` all look the function up there at call time. Shapes are
    metadata: noting them reads nothing from the device."""

    def __init__(self, sdpa: bool) -> None:
        self.phase, self.step = "setup", 0
        self.ids: dict[str, list[list[str]]] = {"loop": [], "bare": []}
        self.batches: dict[str, list[tuple]] = {"loop": [], "bare": []}
        #: the attention shapes of each step, and of the warm-up (every planned text length, before step 1)
        self.attention: dict[str, list[set]] = {"loop": [], "bare": [], "warmup": [set()]}
        self.sdpa_calls: dict[str, list[int]] = {"loop": [], "bare": [], "warmup": [0]}
        #: per step, the (real, computed) text tokens of its text plan
        self.tokens: dict[str, list[tuple[int, int]]] = {"loop": [], "bare": []}
        self._original = None
        self.sdpa = sdpa
        if sdpa:
            import torch.nn.functional as F

            self._original = original = F.scaled_dot_product_attention

            def noted(query, key, value, attn_mask=None, *args, **kwargs):
                if self.phase in self.attention and self.attention[self.phase]:
                    mask = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else None
                    causal = kwargs.get("is_causal", args[1] if len(args) > 1 else False)
                    self.attention[self.phase][-1].add((tuple(query.shape), tuple(key.shape), mask, bool(causal)))
                    self.sdpa_calls[self.phase][-1] += 1
                return original(query, key, value, attn_mask, *args, **kwargs)

            F.scaled_dot_product_attention = noted

    def close(self) -> None:
        if self._original is not None:
            import torch.nn.functional as F

            F.scaled_dot_product_attention = self._original
            self._original = None

    def begin(self, phase: str, batch: dict[str, Any]) -> None:
        """A step of ``phase`` (``loop`` / ``bare``) starts on ``batch``."""
        self.phase = phase
        self.ids[phase].append([str(i) for i in batch.get("ids", ())])
        self.batches[phase].append(batch_signature({k: v for k, v in batch.items() if k != "ids"}))
        self.attention[phase].append(set())
        self.sdpa_calls[phase].append(0)
        plan = batch.get("_text_plan")
        self.tokens[phase].append((int(getattr(plan, "real_tokens", 0)), int(getattr(plan, "computed_tokens", 0))))

    def new_per_step(self, phase: str, first: int, last: int) -> dict[str, Any]:
        """New input (batch tensor) shapes and new attention shapes per step over steps ``first..last`` (1-based,
        inclusive) of ``phase``, new meaning seen in no earlier step of the loop or of the bare step, nor in the
        warm-up."""
        order = [("loop", i) for i in range(len(self.batches["loop"]))] + \
                [("bare", i) for i in range(len(self.batches["bare"]))]
        seen_b: set = set()
        seen_a: set = set(self.attention["warmup"][0])
        new_b = new_a = 0
        for ph, i in order:
            window = ph == phase and first - 1 <= i <= last - 1
            b, a = self.batches[ph][i], self.attention[ph][i]
            if window:
                new_b += b not in seen_b
                new_a += len(a - seen_a)
            seen_b.add(b)
            seen_a |= a
        steps = max(1, last - first + 1)
        calls = self.sdpa_calls[phase][first - 1:last]
        return {"new_input_shapes_per_step": new_b / steps,
                "new_attention_shapes_per_step": new_a / steps if self.sdpa else None,
                "attention_calls_per_step": (sum(calls) / len(calls)) if calls and self.sdpa else None}


def _graphs() -> int:
    """Graphs dynamo compiled in this process so far."""
    from finetune.models.compile import compiled_graphs

    return compiled_graphs()


def attention_kernels(run: Callable[[], Any], device: str) -> dict[str, Any]:
    """Run ``run`` once under ``torch.profiler`` and return the attention ops and kernels it ran: ``aten`` (the SDPA
    aten ops by name and count), ``kernels`` (CUDA kernels whose names say attention, by name and count) and
    ``family`` (flash / efficient / cudnn / math / none, from those names: the kernels on CUDA, the aten op on
    the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        _sync(device)
    aten: Counter = Counter()
    kernels: Counter = Counter()
    device_names: list[str] = []
    for event in prof.events():
        name = event.name
        if name.startswith("aten::") and "scaled_dot_product" in name and "backward" not in name:
            aten[name] += 1
        if str(getattr(event, "device_type", "")).endswith("CUDA"):  # a kernel listed as an event of its own
            device_names.append(name)
        device_names.extend(k.name for k in getattr(event, "kernels", ()))  # or attached to its launching op
    for name in device_names:
        if any(k in name.lower() for k in ("flash", "fmha", "cudnn", "attention", "sdpa", "attn")):
            kernels[name] += 1
    names = [k.lower() for k in kernels] if kernels else [a.lower() for a in aten]
    family = "none"
    for key, fam in KERNEL_FAMILIES:
        if any(key in n for n in names):
            family = fam
            break
    else:
        if aten:  # the math backend runs as matmuls and a softmax under the composite op
            family = "math"
    return {"family": family, "aten": dict(aten.most_common(6)), "kernels": dict(kernels.most_common(6))}


def _device_batches(parts: Any, start: int, n: int) -> list[dict]:
    """``n`` batches of the loop's own loader from step ``start`` on (the rows after the loop's), on the device
    as the loop moves them; the loader's iterator (and its workers' prefetching) is shut before returning."""
    out = []
    parts.batches.total_steps = start + n
    batches = parts.batches.from_step(start)
    for _, batch in batches:
        out.append(batch)
        if len(out) == n:
            break
    # the loader's workers stop here, not during the timed steps, where their work would take the CPU from the
    # thread that launches the step
    if hasattr(batches, "close"):
        batches.close()
    del batches
    gc.collect()
    if len(out) < n:
        raise RuntimeError(f"the loader gave {len(out)} of the {n} fresh batches the bare step needs: write more rows")
    return out


def text_flops(parts: Any, batch: dict[str, Any]) -> tuple[float | None, int, int]:
    """``(FLOPs per computed text token, FLOPs of a step on batch, its computed text tokens)``: one step counted at
    the batch's text plan and one with every text pass at half its length (a warm-up plan: rows cut, values not
    used); the difference over the tokens' difference. None for the rate where the batch has no planned text."""
    from dataclasses import replace

    plan = batch.get("_text_plan")
    _, flops_a = count_flops(lambda: parts.step(batch, 200_002))
    if plan is None or not plan.lengths or not plan.rows:
        return None, flops_a, 0
    half = {k: max(1, n // 2) for k, n in plan.lengths.items()}
    _, flops_b = count_flops(lambda: parts.step(
        {**batch, "_text_plan": replace(plan, lengths=half, warmup=True)}, 200_003))
    fewer = plan.computed_tokens - sum(plan.rows[k] * half[k] for k in plan.rows)
    return ((flops_a - flops_b) / fewer if fewer else None), flops_a, plan.computed_tokens


def _tiny_setup() -> None:
    """A ``--tiny`` case checks the code path and measures nothing that counts, so two costs of its start go:
    accelerate's ``unwrap_model`` imports deepspeed whenever it is installed (no case runs under it; about 1.5 s of
    CPU), and a compiled case compiles with ``aot_eager`` (dynamo and AOT autograd without code generation: the
    same graphs, guards and recompiles, as tests/finetune/objectives/test_shapes.py has it, without a minute of C++
    compilation on a cold cache)."""
    import accelerate.utils.other

    import finetune.training.step_setup as step_setup

    accelerate.utils.other.is_deepspeed_available = lambda: False
    step_setup.compile_options = lambda setting: {"backend": "aot_eager", "dynamic": False} if setting else None


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Build and measure one case (the module docstring); ``spec`` is what the parent wrote (``loop.case_spec``)."""
    import loop

    from finetune.training import FinetuneRecipe, TrainStep

    if spec["tiny"]:
        _tiny_setup()
    case = {c.name: c for c in loop.CASES}[spec["case"]]
    device, warmup, steady, bare_warmup = spec["device"], spec["warmup"], spec["steady"], spec["bare_warmup"]
    work = Path(spec["work"])
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    recipe = loop.case_recipe(case, spec, work)
    acc = loop.accelerator(device, recipe.train.mixed_precision)
    parts = loop.build_run_loop(recipe, acc)
    parts.setup.warm_up_always = True  # a CPU dry run takes the GPU's path: every planned length warmed up
    model = parts.trained_model()
    compiled = bool(recipe.train.compile)
    built = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rec = StepRecorder(sdpa=not compiled)
    graphs = {"after_build": _graphs()}
    step_fn, warm_up = TrainStep.__call__, TrainStep.warm_up

    def loop_step(self: Any, batch: dict[str, Any], step: int) -> None:
        if step == warmup + 1:
            graphs["after_loop_warmup"] = _graphs()
        rec.begin("loop", batch)
        step_fn(self, batch, step)

    def recorded_warm_up(self: Any, batch: dict[str, Any]) -> None:
        rec.phase = "warmup"
        warm_up(self, batch)

    TrainStep.__call__, TrainStep.warm_up = loop_step, recorded_warm_up  # every step of the loop is recorded
    t1 = time.perf_counter()
    try:
        result = FinetuneRecipe.from_loop(parts).train()
    finally:
        TrainStep.__call__, TrainStep.warm_up = step_fn, warm_up
    loop_s = time.perf_counter() - t1
    graphs["after_loop"] = _graphs()
    thr = result.throughput
    marks = parts.progress.clock.marks
    window = LoopClock(skip_steps=warmup, marks=marks).steady()
    if window is None or window["first_step"] != warmup or window["steps"] < steady:
        raise RuntimeError(f"{case.name}: the loop's reads do not bound steps {warmup}..{warmup + steady} "
                           f"(marks at {[m.step for m in marks]})")
    batch_size = recipe.train.batch_size

    # the bare step: fresh batches, each once, all on the device before timing
    fresh = _device_batches(parts, warmup + steady, bare_warmup + steady + 2)
    timed, probes = fresh[:bare_warmup + steady], fresh[bare_warmup + steady:]
    parts.wrapped.train()

    def bare_step(batch: dict[str, Any], step: int) -> None:  # what one step of the loop computes
        parts.step(batch, step)
        parts.objective.after_step()

    t2 = time.perf_counter()
    for i, batch in enumerate(timed[:bare_warmup]):
        rec.begin("bare", batch)
        bare_step(batch, 100_001 + i)
    _sync(device)
    graphs["after_bare_warmup"] = _graphs()
    with count_syncs(device) as syncs:
        start = time.perf_counter()
        for i, batch in enumerate(timed[bare_warmup:]):
            rec.begin("bare", batch)
            bare_step(batch, 100_001 + bare_warmup + i)
        _sync(device)
        bare_s = time.perf_counter() - start
    graphs["after_bare"] = _graphs()
    rec.phase = "probe"
    kernels = attention_kernels(lambda: parts.step(probes[0], 200_001), device)
    per_token, probe_flops, probe_computed = text_flops(parts, probes[1])
    probe_s = time.perf_counter() - t2 - bare_s
    rec.close()

    loop_ids = {i for b in rec.ids["loop"] for i in b}
    bare_ids = [i for b in rec.ids["bare"] for i in b]
    if set(bare_ids) & loop_ids or len(set(bare_ids)) != len(bare_ids):
        raise RuntimeError(f"{case.name}: the bare step saw rows the loop or an earlier bare step had: the data "
                           f"has too few rows for {warmup + steady} loop and {bare_warmup + steady} bare steps")
    bare = batch_size * steady / bare_s
    loop_rate = window["samples_per_s"]
    peak = peak_tflops(acc.device)
    windows = {"loop": rec.tokens["loop"][warmup:warmup + steady], "bare": rec.tokens["bare"][bare_warmup:]}

    def step_flops(tokens: list[tuple[int, int]], real: bool) -> float | None:
        """Mean FLOPs of the window's steps (module docstring): on the computed text tokens, or the real ones."""
        if not probe_flops or not tokens:
            return None
        rate = per_token or 0.0
        return sum(probe_flops + rate * ((r if real else c) - probe_computed) for r, c in tokens) / len(tokens)

    def tflops(phase: str, rate: float | None, real: bool = False) -> float | None:
        f = step_flops(windows[phase], real)
        return f * rate / batch_size / 1e12 if f and rate else None

    def mfu(phase: str, rate: float | None, real: bool = False) -> float | None:
        t = tflops(phase, rate, real)
        return t / peak if t and peak else None

    def share(phase: str) -> float | None:
        real, computed = sum(r for r, _ in windows[phase]), sum(c for _, c in windows[phase])
        return 1 - real / computed if computed else None

    flops = result.throughput["flops_per_sample"]
    flops_step = flops * batch_size if flops else None
    attention = thr.get("attention") or {}
    out = {
        "case": case.name, "recipe": case.recipe, "model": recipe.model.name_or_path, "note": case.note,
        "pid": os.getpid(), "parent_pid": os.getppid(),
        "batch": batch_size, "text_len": int(model.max_text_len), "adapter": recipe.adapter.type,
        "objective": recipe.objective.base + "".join(f" + {t}" for t in recipe.objective.terms),
        "compiled": compiled, "mixed_precision": recipe.train.mixed_precision,
        "compile_backend": ("aot_eager" if spec["tiny"] else "inductor") if compiled else None,
        "loop_samples_per_s": loop_rate, "bare_samples_per_s": bare, "loop_vs_bare": loop_rate / bare,
        "data_wait_share": window["data_wait_share"],
        "loop_steady_steps": window["steps"], "loop_steady_from_step": window["first_step"],
        "bare_steady_steps": steady, "bare_warmup_steps": bare_warmup,
        "shapes": {"fixed": thr.get("shapes"),
                   "loop": rec.new_per_step("loop", warmup + 1, warmup + steady),
                   "bare": rec.new_per_step("bare", bare_warmup + 1, bare_warmup + steady),
                   "distinct_input_shapes": len(set(rec.batches["loop"]) | set(rec.batches["bare"]))},
        "attention": {"setting": attention.get("setting"), "order": attention.get("order"),
                      "first_step_kernels": attention.get("first_step_kernels"), "ran": kernels["family"],
                      "profiled": {"aten": kernels["aten"], "kernels": kernels["kernels"]}},
        "recompiles": ({"graphs": graphs,
                        "loop_after_warmup": graphs["after_loop"] - graphs["after_loop_warmup"],
                        "bare_timed": graphs["after_bare"] - graphs["after_bare_warmup"]} if compiled else None),
        "flops": {"per_step_first": flops_step, "per_step_probe": probe_flops,
                  "per_computed_text_token": per_token,
                  "per_step_bare": step_flops(windows["bare"], False),
                  "per_step_bare_real_tokens": step_flops(windows["bare"], True),
                  "counted": "torch.utils.flop_counter on the shapes that ran (matmul, conv, SDPA fwd+bwd), a probe "
                             "step at its text plan and at half its text lengths; the steps' FLOPs from their text "
                             "tokens (module docstring)"},
        "text_tokens": {"loop_padding_share": share("loop"), "bare_padding_share": share("bare"),
                        "bare_real_per_step": sum(r for r, _ in windows["bare"]) / max(1, len(windows["bare"])),
                        "bare_computed_per_step": sum(c for _, c in windows["bare"]) / max(1, len(windows["bare"]))},
        "loop_tflops": tflops("loop", loop_rate), "bare_tflops": tflops("bare", bare),
        "loop_mfu": mfu("loop", loop_rate), "bare_mfu": mfu("bare", bare),
        "loop_mfu_real_tokens": mfu("loop", loop_rate, True), "bare_mfu_real_tokens": mfu("bare", bare, True),
        "peak_tflops": peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "host_syncs_per_bare_step": len(syncs) / steady if device == "cuda" else None,
        "first_syncs": sorted(set(syncs))[:3],
        "batches": {"loop": len(rec.ids["loop"]), "bare": len(rec.ids["bare"]), "bare_rows_seen_before": 0},
        "seconds": {"build": built, "loop": loop_s, "bare": bare_s, "probes": probe_s,
                    "case": time.perf_counter() - t0, "process_cpu": time.process_time()},
    }
    if spec.get("record_ids"):
        out["batch_ids"] = rec.ids
    return out


def main(argv: list[str] | None = None) -> None:
    """Measure the case of ``SPEC.json`` (``argv[0]``) and write its result where the spec says."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python bench/loop_case.py SPEC.json (written by bench/loop.py)")
    spec = json.loads(Path(argv[0]).read_text())
    from finetune.files import write_json_atomic

    write_json_atomic(Path(spec["out"]), measure(spec))


if __name__ == "__main__":
    main()
    from finetune.process_exit import exit_process

    exit_process(0)  # the case's result is written: no module teardown (2 s of 16 processes in the every-case run)
