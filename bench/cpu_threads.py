"""CPU threads under contention: seconds per training step of the quickstart's model (``random:small-clip``, 248
text positions, batch 16 as ``quickstart.yaml``, clip term, AdamW) with each thread setting, on a quiet machine and
with one other busy process (a Python busy loop, pinned nowhere), all measured in the same run; prints each case's
ratio against the quiet run of the same setting and writes ``bench/results/cpu_threads.json``.

    python bench/cpu_threads.py [--steps 30] [--busy 1] [--repeats 3]

A case is a fresh ``python`` process with the environment of the setting, so that the OpenMP runtime reads it at
start-up: ``torch default`` (every core, OpenMP's active wait), ``1 thread`` (``OMP_NUM_THREADS=1``) and ``every
core, passive wait`` (``OMP_WAIT_POLICY=PASSIVE``). The load average before the run is printed: other users of the
machine are contention too, and the "quiet" figures are only as quiet as it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

#: setting -> environment added to the case's process
SETTINGS: dict[str, dict[str, str]] = {
    "torch default": {},  # every core, OpenMP's active wait: what a run had before finetune.threads
    "1 thread": {"OMP_NUM_THREADS": "1"},  # what `accelerate launch` gives a CPU process
    "every core, passive wait": {"OMP_WAIT_POLICY": "PASSIVE"},  # `python finetune/run.py`, `xlipkit train` now
}


def _worker(steps: int) -> None:
    """One case: print ``{"threads": N, "seconds_per_step": S}`` for ``steps`` steps after two warm-up steps."""
    sys.path.insert(0, str(ROOT))
    import torch

    from finetune import load_model
    from finetune.objectives import ClipTerm, Objective
    from finetune.training import TrainModule, build_optimizer

    class _Optim:
        lr, weight_decay, betas, eps, fused_optimizer = 3e-4, 0.05, (0.9, 0.98), 1e-6, "auto"

    torch.manual_seed(0)
    model = load_model("random:small-clip", max_text_len=248)
    module = TrainModule(model, Objective(ClipTerm()))
    opt = build_optimizer(module, _Optim())
    caption = " ".join(("a small red circle left of a large blue square near the top edge".split() * 30)[:240])
    tok = model.tokenize([caption] * 16)
    data = {"image_inputs": {"pixel_values": torch.randn(16, 3, model.image_size, model.image_size)},
            "input_ids": tok.input_ids, "attention_mask": tok.attention_mask}
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        module(data)["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t)
    times.sort()
    print(json.dumps({"threads": torch.get_num_threads(), "seconds_per_step": sum(times) / len(times),
                      "median": times[len(times) // 2]}))


def _busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _case(setting: str, steps: int, busy: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    env.update(SETTINGS[setting], PYTHONPATH=str(ROOT))
    others = [_busy() for _ in range(busy)]
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(steps)], env=env, check=True,
                             capture_output=True, text=True).stdout
    finally:
        for p in others:
            p.kill()
            p.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--busy", type=int, default=1, help="other busy processes in the contended cases")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every case, interleaved; the table gives medians")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.steps)
        return
    load = os.getloadavg()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cores} cores, load average before the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    runs: dict[str, dict[str, list[dict]]] = {s: {"quiet": [], "busy": []} for s in SETTINGS}
    for _ in range(args.repeats):  # interleaved, so that other users' load falls on every case alike
        for setting in SETTINGS:
            runs[setting]["quiet"].append(_case(setting, args.steps, 0))
            runs[setting]["busy"].append(_case(setting, args.steps, args.busy))

    def median(cases: list[dict]) -> float:
        values = sorted(c["seconds_per_step"] for c in cases)
        return values[len(values) // 2] if len(values) % 2 else sum(values[len(values) // 2 - 1:][:2]) / 2

    rows = {s: {"threads": r["quiet"][0]["threads"], "quiet": median(r["quiet"]), "busy": median(r["busy"]),
                "runs": r} for s, r in runs.items()}
    base = rows["torch default"]["quiet"]
    print(f"seconds per step (median of {args.repeats}), small-clip batch 16, 248 tokens; {args.busy} busy "
          f"process(es) in the contended cases")
    print(f"{'setting':26s} {'threads':>7s} {'quiet':>8s} {'busy':>8s} {'busy/quiet':>10s} {'busy/default quiet':>18s}")
    for setting, r in rows.items():
        r["busy_vs_quiet"] = r["busy"] / r["quiet"]
        print(f"{setting:26s} {r['threads']:7d} {r['quiet']:8.3f} {r['busy']:8.3f} {r['busy_vs_quiet']:10.2f} "
              f"{r['busy'] / base:18.2f}")
    end = os.getloadavg()
    print(f"load average after the run {end[0]:.2f} / {end[1]:.2f} / {end[2]:.2f}")
    import torch

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_threads.json").write_text(json.dumps(
        {"cores": cores, "load_average_before": load, "load_average_after": end, "steps": args.steps,
         "repeats": args.repeats, "busy_processes": args.busy, "torch": torch.__version__,
         "machine": platform.processor() or platform.machine(), "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
