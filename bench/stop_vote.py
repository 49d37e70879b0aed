"""What the per-step stop vote of several processes costs (:class:`finetune.training.StopVote`).

Run ``python bench/stop_vote.py``: prints the numbers and writes ``bench/results/stop_vote.json``.

A signal (SIGTERM from SLURM, Ctrl-C) may reach one process of a launch first, and every process must stop after
the same step. With one process the loop checks a host flag (free). With several, after each step every process
posts its flag in a MAX all-reduce over a gloo group on the CPU without waiting, and reads the one it posted after
the previous step, which finished while the step ran. This bench times two processes running ``--steps`` steps of
a stand-in step (``--step-ms`` of host time, plus an all-reduce of ``--grad-mb`` MB over the default group, as a
gradient all-reduce would be) in three settings, interleaved and repeated:

- ``none``: no vote (what a single process does);
- ``deferred``: the vote as the loop does it (post now, read next step);
- ``blocking``: post and wait at once (what agreeing on the same step without the one-step delay costs).

It reports the extra time per step against ``none`` (median over repetitions, measured in the same run). The
device is never involved: on GPUs the vote stays on the CPU (its own gloo group), so these host-side numbers are
what it adds there too. The machine this ran on is shared, so absolute numbers move with its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from finetune.training import StopSignals, StopVote

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    grads = torch.zeros(int(args.grad_mb * 2**20 / 4))

    def step() -> None:
        deadline = time.perf_counter() + args.step_ms / 1000
        while time.perf_counter() < deadline:  # host time, as a step that queues kernels spends it
            pass
        if grads.numel():
            dist.all_reduce(grads)

    def run(mode: str) -> float:
        vote = StopVote(StopSignals(), world, group)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
            if mode == "deferred":
                vote()
            elif mode == "blocking":
                flag = torch.zeros(1, dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                int(flag[0])
        vote.close()
        dist.barrier()
        return (time.perf_counter() - start) / args.steps

    modes = ["none", "deferred", "blocking"]
    results: dict[str, list[float]] = {m: [] for m in modes}
    run("deferred")  # warm-up
    for r in range(args.repeats):
        for mode in modes[r % 3:] + modes[:r % 3]:  # interleaved, rotated
            results[mode].append(run(mode))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--grad-mb", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "stop_vote.json"))
    args = p.parse_args()

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        raw = os.path.join(tmp, "raw.json")
        mp.start_processes(_worker, args=(2, init, args, raw), nprocs=2, start_method="spawn")
        results = json.loads(Path(raw).read_text())
    per_repeat = {m: [(t - n) * 1e6 for t, n in zip(results[m], results["none"])] for m in ("deferred", "blocking")}
    summary = {
        "settings": vars(args) | {"processes": 2, "backend": "gloo (CPU)"},
        "step_ms_median": {m: statistics.median(v) * 1e3 for m, v in results.items()},
        "extra_us_per_step_median": {m: statistics.median(v) for m, v in per_repeat.items()},
        "extra_share_of_step_median": {m: statistics.median((t - n) / n for t, n in zip(results[m], results["none"]))
                                       for m in ("deferred", "blocking")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()[0],
                    "note": "shared machine: absolute numbers move with its load"},
    }
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
