"""What recording and verifying the sha256 of every checkpoint file costs, against writing the checkpoint.

Run ``python bench/checkpoint_hash.py``: prints the numbers and writes ``bench/results/checkpoint_hash.json``.

The checkpoint is a real one: CLIP ViT-B/16 (``random:clip-vit-base-patch16``, 150M parameters, fp32) with its
AdamW state, written by ``accelerator.save_state`` as :func:`finetune.training.save_checkpoint` writes it, once for
full fine-tuning (weights and both AdamW moments: about 1.8 GB) and once for LoRA (the frozen weights are saved too,
the moments only for the adapter: about 0.6 GB). For each it times, interleaved and repeated:

- ``save``: ``accelerator.save_state`` into a fresh folder (the baseline: what a checkpoint costs already);
- ``manifest``: :func:`finetune.runs.checkpoints.file_manifest`, the size and sha256 of every file (what a save adds;
  the files were just written, so they are read from the page cache, as on a real save);
- ``verify``: :func:`finetune.runs.checkpoints.checkpoint_problem` (what a resume adds before the model loads).

It reports the medians and the ratios to ``save`` measured in the same run. The machine this ran on is shared,
so absolute numbers move with its load; sha256 speed depends on the CPU's SHA extensions (``sha_ni`` here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _accelerator_with_state(adapter: str):
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from finetune import load_model
    from finetune.models.adapters import AdapterConfig, apply_adapter

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    model = load_model("random:clip-vit-base-patch16")
    if adapter != "full":
        model = apply_adapter(model, AdapterConfig(type=adapter, r=16, alpha=32))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:  # one step, so that AdamW holds its two moments, as in any checkpoint after step 1
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model, optimizer = acc.prepare(model, optimizer)
    return acc, sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "checkpoint_hash.json"))
    args = p.parse_args()

    from finetune.runs.checkpoints import checkpoint_problem, file_manifest

    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for adapter in ("full", "lora"):
            acc, numel = _accelerator_with_state(adapter)
            times: dict[str, list[float]] = {"save": [], "manifest": [], "verify": []}
            size = 0
            for r in range(args.repeats):
                folder = Path(tmp) / f"{adapter}-{r}"
                start = time.perf_counter()
                acc.save_state(str(folder))
                times["save"].append(time.perf_counter() - start)
                start = time.perf_counter()
                manifest = file_manifest(folder)
                times["manifest"].append(time.perf_counter() - start)
                (folder / "train_state.json").write_text(json.dumps({"step": 1, "files": manifest}))
                start = time.perf_counter()
                assert checkpoint_problem(folder) is None
                times["verify"].append(time.perf_counter() - start)
                size = sum(e["bytes"] for e in manifest.values())
                shutil.rmtree(folder)
            med = {k: statistics.median(v) for k, v in times.items()}
            results[adapter] = {
                "parameters": numel, "checkpoint_bytes": size, "median_s": med,
                "manifest_over_save": statistics.median(m / s for m, s in zip(times["manifest"], times["save"])),
                "verify_over_save": statistics.median(v / s for v, s in zip(times["verify"], times["save"])),
                "hash_gb_per_s": size / med["manifest"] / 1e9,
            }
            print(adapter, json.dumps(results[adapter], indent=2), flush=True)
    summary = {"model": "random:clip-vit-base-patch16 (fp32)", "repeats": args.repeats, "results": results,
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()[0],
                           "sha_ni": "sha_ni" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists()
                           else None, "note": "shared machine: absolute numbers move with its load"}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
