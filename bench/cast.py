"""CAST-B (F-CAST's image encoder) forward + backward on one 224 px image on the CPU, beside a ViT-B/16
forward + backward on the same image in the same run; prints both times, their ratio and the encoders'
parameter counts, and writes ``bench/results/cast.json``.

    python bench/cast.py [--repeats 3] [--superpixels slic]

CAST-B is ``finetune.models.cast.CastEncoder(CAST_CONFIGS["cast-b"])`` (C 768, 12 heads, blocks 3-3-3-2,
196 superpixels pooled 196 -> 64 -> 32 -> 16); the ViT-B/16 is open_clip's image tower (width 768, 12
layers, 196 patches). Both are random-weight, in train mode, float32; the loss is the sum of the final
embedding. The superpixels are computed once before timing (their time is reported on its own).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.models.cast import CAST_CONFIGS, CastEncoder  # noqa: E402
from finetune.preprocess.superpixels import SuperpixelSettings, compute_superpixels  # noqa: E402
from finetune.files import write_json_atomic  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _scene() -> np.ndarray:
    from finetune.data.synthetic import synthetic_scenes

    return np.asarray(synthetic_scenes(1, image_size=224)[0]["image"].convert("RGB"), dtype=np.uint8)


def _time(step, repeats: int) -> tuple[list[float], list[float]]:
    """Wall-clock and process CPU seconds of each of ``repeats`` calls after a warm-up (CPU time is the
    steadier of the two on a shared machine)."""
    step()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--superpixels", default="slic", choices=["slic", "seeds"])
    args = parser.parse_args()
    torch.manual_seed(0)

    image = _scene()
    t = time.perf_counter()
    labels = compute_superpixels(image, SuperpixelSettings(args.superpixels, n_segments=196))
    superpixel_s = time.perf_counter() - t
    pixels = torch.from_numpy(image).permute(2, 0, 1).float()[None] / 255.0
    labels_t = torch.from_numpy(labels)[None]

    cast = CastEncoder(CAST_CONFIGS["cast-b"]).train()
    import open_clip

    vit = open_clip.create_model("ViT-B-16").visual.train()

    def cast_step() -> None:
        cast.zero_grad(set_to_none=True)
        cast(pixels, labels_t).coarse.sum().backward()

    def vit_step() -> None:
        vit.zero_grad(set_to_none=True)
        vit(pixels).sum().backward()

    cast_times, cast_cpu = _time(cast_step, args.repeats)
    vit_times, vit_cpu = _time(vit_step, args.repeats)
    result = {
        "what": "one 224 px image, forward + backward, float32, train mode, CPU",
        "cast_b": {"seconds": min(cast_times), "all_seconds": cast_times, "cpu_seconds": min(cast_cpu),
                   "parameters": sum(p.numel() for p in cast.parameters()),
                   "superpixels": args.superpixels, "segments": int(labels.max()) + 1,
                   "superpixel_seconds": superpixel_s},
        "vit_b_16": {"seconds": min(vit_times), "all_seconds": vit_times, "cpu_seconds": min(vit_cpu),
                     "parameters": sum(p.numel() for p in vit.parameters())},
        "ratio_cast_over_vit": min(cast_times) / min(vit_times),
        "cpu_ratio_cast_over_vit": min(cast_cpu) / min(vit_cpu),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    print(f"CAST-B  : {result['cast_b']['seconds']:.3f} s wall, {result['cast_b']['cpu_seconds']:.3f} s CPU  ({result['cast_b']['parameters'] / 1e6:.1f}M params, "
          f"{result['cast_b']['segments']} {args.superpixels} superpixels in {superpixel_s:.3f} s)")
    print(f"ViT-B/16: {result['vit_b_16']['seconds']:.3f} s wall, {result['vit_b_16']['cpu_seconds']:.3f} s CPU  ({result['vit_b_16']['parameters'] / 1e6:.1f}M params)")
    print(f"ratio CAST-B / ViT-B/16: {result['ratio_cast_over_vit']:.2f} wall, "
          f"{result['cpu_ratio_cast_over_vit']:.2f} CPU")
    write_json_atomic(RESULTS / "cast.json", result)
    print(f"wrote {RESULTS / 'cast.json'}")


if __name__ == "__main__":
    main()
