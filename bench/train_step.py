"""Samples/s of one training step of the ``clip`` base term on CLIP ViT-B/16 (random weights) with 77 and
with 248 text positions (Long-CLIP KPS), measured in the same run; prints the ratio and writes
``bench/results/train_step.json``.

    python bench/train_step.py [--batch 8] [--steps 3] [--model random:clip-vit-base-patch16]

A step is what the trainer runs: both towers forward, InfoNCE, backward, fused AdamW step. Captions are
long enough to fill 248 tokens, so the 248-token model really reads 248 positions.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune import load_model  # noqa: E402
from finetune.objectives import ClipTerm, Objective  # noqa: E402
from finetune.files import write_json_atomic  # noqa: E402
from finetune.training import TrainModule, build_optimizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class _OptimCfg:
    lr = 1e-5
    weight_decay = 0.05
    betas = (0.9, 0.98)
    eps = 1e-6
    fused_optimizer = "auto"


def _batch(model, batch: int) -> dict:
    words = "a small red circle sits left of a large blue square near the top edge of the picture".split()
    caption = " ".join(words[i % len(words)] for i in range(400))
    tok = model.tokenize([caption] * batch)
    pixels = torch.randn(batch, 3, model.image_size, model.image_size)
    return {"image_inputs": {"pixel_values": pixels}, "input_ids": tok.input_ids,
            "attention_mask": tok.attention_mask}


def time_steps(name: str, max_text_len: int | None, batch: int, steps: int) -> dict:
    """Mean seconds per step (after one warm-up step) and samples/s for one model configuration."""
    torch.manual_seed(0)
    model = load_model(name, max_text_len=max_text_len)
    module = TrainModule(model, Objective(ClipTerm()))
    opt = build_optimizer(module, _OptimCfg())
    data = _batch(model, batch)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        out = module(data)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t)
    sec = sum(times) / len(times)
    return {"text_len": model.max_text_len, "seconds_per_step": sec, "samples_per_s": batch / sec,
            "tokens_per_caption": int(data["attention_mask"][0].sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:clip-vit-base-patch16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    short = time_steps(args.model, None, args.batch, args.steps)
    long = time_steps(args.model, 248, args.batch, args.steps)
    result = {
        "model": args.model,
        "batch": args.batch,
        "steps": args.steps,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "77_tokens": short,
        "248_tokens": long,
        "ratio_248_vs_77_samples_per_s": long["samples_per_s"] / short["samples_per_s"],
    }
    print(f"{args.model}, batch {args.batch}, {torch.get_num_threads()} threads")
    for key in ("77_tokens", "248_tokens"):
        r = result[key]
        print(f"  {r['text_len']:>3} positions: {r['seconds_per_step']:.2f} s/step, {r['samples_per_s']:.2f} samples/s")
    print(f"  ratio (248 / 77 samples/s): {result['ratio_248_vs_77_samples_per_s']:.3f}")
    write_json_atomic(RESULTS / "train_step.json", result)


if __name__ == "__main__":
    main()
