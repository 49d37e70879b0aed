"""What FAST-GOAL's preprocessing and training step cost, measured in one run.

    python bench/flism.py [--images 4] [--batch 8] [--rounds 3] [--detector yolos-base] [--sam vit-h]
                          [--sam-points 64] [--clip random:clip-vit-base-patch16] [--threads N] [--skip-step]

1. FLISM vs LISM, seconds per image on the same images (DOCCI-sized, 640 x 480) in one process: FLISM
   (FAST-GOAL III-A) = YOLOS detection + 4 quadrants + the centre box, crops and sentences through CLIP, eq. 1-2
   matching; LISM (GOAL) = SAM automatic mask generation (transformers ``mask-generation`` pipeline, GOAL's
   64 x 64 points per image by default), masks covering 1-80 % of the image, their boxes' crops and the sentences
   through the same CLIP, the same matching. Both run :class:`finetune.preprocess.flism.FLISMMatcher`; only the
   candidate generator differs. The detector and SAM are random-weight models built from the real configurations
   (``yolos-base``: transformers' YolosConfig defaults, hustvl/yolos-base's architecture, 512 x 864 input;
   ``vit-h``: SAM ViT-H, the pipeline's default checkpoint's architecture) unless ``--detector`` / ``--sam`` name
   a folder or hub id: the cost of a forward pass does not depend on the weights, but the number of SAM masks
   that pass its filters does (random weights give fewer), so the LISM time here is a lower bound. The paper
   measured 97.63 vs 1239.7 minutes on DOCCI (12.7x) with real weights on a GPU.
2. The TSL step vs the plain CLIP step: one training step (forward, backward, fused AdamW) of ``clip`` and of
   ``clip + fastgoal`` (L_local + L_TSL, one local pair per image) on the same model (CLIP ViT-B/16, random
   weights, 248 text positions) and batch, interleaved over ``--rounds`` rounds, each keeping its best step
   (load from other processes hits both alike).

Results go to ``bench/results/flism.json`` (``finetune.files.write_json_atomic``); ratios compare numbers of
this run only.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results" / "flism.json"


def _yolos(name: str, folder: Path) -> str:
    """A YOLOS folder: ``yolos-base`` / ``yolos-small`` with random weights, else ``name`` itself."""
    if name not in ("yolos-base", "yolos-small"):
        return name
    from transformers import YolosConfig, YolosForObjectDetection, YolosImageProcessor

    cfg = YolosConfig() if name == "yolos-base" else YolosConfig(hidden_size=384, num_attention_heads=6,
                                                                 intermediate_size=1536, image_size=[800, 1333])
    torch.manual_seed(0)
    YolosForObjectDetection(cfg).save_pretrained(folder)
    YolosImageProcessor().save_pretrained(folder)
    return str(folder)


def _sam(name: str, folder: Path) -> str:
    """A SAM folder: ``vit-h`` / ``vit-b`` with random weights, else ``name`` itself."""
    if name not in ("vit-h", "vit-b"):
        return name
    from transformers import SamConfig, SamImageProcessor, SamModel, SamProcessor, SamVisionConfig

    vision = SamVisionConfig() if name == "vit-b" else SamVisionConfig(
        hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, global_attn_indexes=[7, 15, 23, 31])
    torch.manual_seed(0)
    SamModel(SamConfig(vision_config=vision.to_dict())).save_pretrained(folder)
    SamProcessor(SamImageProcessor()).save_pretrained(folder)
    return str(folder)


def _data(n: int) -> Any:
    import datasets
    from structxlip import _images, docci_style_captions

    return datasets.Dataset.from_dict(
        {"id": [f"bench-{i}" for i in range(n)], "image": _images(n), "caption": docci_style_captions(n)},
        features=datasets.Features({"id": datasets.Value("string"), "image": datasets.Image(),
                                    "caption": datasets.Value("string")}))


def preprocessing_costs(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Seconds per image of FLISM and LISM on the same images (detector / SAM loaded before timing; one
    warm-up image each)."""
    from finetune import load_model
    from finetune.preprocess.frozen import FrozenEncoders
    from finetune.preprocess.flism import FLISMMatcher, SamMasks, YolosDetector

    model = load_model(args.clip, max_text_len=248).eval()
    enc = FrozenEncoders(model)
    data = _data(args.images + 1)
    proposers = {
        "flism": YolosDetector(_yolos(args.detector, root / "yolos"), threshold=args.threshold),
        "lism": SamMasks(_sam(args.sam, root / "sam"), points_per_side=args.sam_points,
                         points_per_batch=args.sam_points_per_batch, min_area=0.01, max_area=0.8),
    }
    out: dict[str, Any] = {}
    for name, proposer in proposers.items():
        matcher = FLISMMatcher(proposer, enc.images, enc.texts, model_id="bench", default=name == "flism")
        matcher(data[:1])  # warm-up: loads the detector / SAM, first-call allocations
        start, start_cpu = time.perf_counter(), time.process_time()
        found = matcher(data[1:])
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        out[name] = {"seconds_per_image": wall / args.images, "cpu_seconds_per_image": cpu / args.images,
                     "candidates_per_image": sum(found["flism_num_candidates"]) / args.images}
        print(f"  {name}: {out[name]['seconds_per_image']:.2f} s/image wall, {out[name]['cpu_seconds_per_image']:.2f}"
              f" s CPU, {out[name]['candidates_per_image']:.1f} candidates per image", flush=True)
    out["lism_vs_flism"] = out["lism"]["seconds_per_image"] / out["flism"]["seconds_per_image"]
    out["lism_vs_flism_cpu_time"] = out["lism"]["cpu_seconds_per_image"] / out["flism"]["cpu_seconds_per_image"]
    print(f"  LISM / FLISM: {out['lism_vs_flism']:.1f}x (wall clock), {out['lism_vs_flism_cpu_time']:.1f}x (CPU time)")
    return out


def step_costs(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Best seconds per step of ``clip`` and ``clip + fastgoal``, interleaved on one model and batch."""
    from structxlip import _OptimCfg, _step

    from finetune import load_model
    from finetune.data.collate import Collator
    from finetune.objectives import ClipTerm, Objective
    from finetune.objectives.fastgoal import FastGoalOptions, FastGoalTerm, FlismOptions
    from finetune.training import TrainModule, build_optimizer

    torch.manual_seed(0)
    model = load_model(args.clip, max_text_len=248)
    data = _data(args.batch)
    term = FastGoalTerm(FastGoalOptions(regions=FlismOptions(detector=None)))  # default regions: cheap to build
    data = term.preprocess(data, model, cache_dir=str(root / "cache"))
    fastgoal = Objective(ClipTerm(), [(term, term.weights)])
    batch = Collator(model, fastgoal)([data[i] for i in range(args.batch)])
    modules = {"clip": TrainModule(model, Objective(ClipTerm())), "fastgoal": TrainModule(model, fastgoal)}
    optimizer = build_optimizer(torch.nn.ModuleList(list(modules.values())), _OptimCfg())
    for module in modules.values():
        _step(module, batch, optimizer)
    wall: dict[str, list[float]] = {m: [] for m in modules}
    cpu: dict[str, list[float]] = {m: [] for m in modules}
    for round_ in range(args.rounds):
        for mode, module in modules.items():
            w, c = _step(module, batch, optimizer)
            wall[mode].append(w)
            cpu[mode].append(c)
            print(f"  round {round_ + 1} {mode:9s} {w:7.2f} s/step wall, {c:7.2f} s CPU", flush=True)
    steps = {m: {"seconds_per_step": min(wall[m]), "cpu_seconds_per_step": min(cpu[m]),
                 "all_seconds_per_step": wall[m]} for m in modules}
    ratio = steps["fastgoal"]["seconds_per_step"] / steps["clip"]["seconds_per_step"]
    ratio_cpu = steps["fastgoal"]["cpu_seconds_per_step"] / steps["clip"]["cpu_seconds_per_step"]
    print(f"  fastgoal / clip step: {ratio:.2f}x (wall clock), {ratio_cpu:.2f}x (CPU time)")
    return {"step": steps, "fastgoal_vs_clip": ratio, "fastgoal_vs_clip_cpu_time": ratio_cpu,
            "caption_tokens": batch["attention_mask"].sum(1).tolist()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from finetune.files import write_json_atomic

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=4, help="timed images of each preprocessing")
    ap.add_argument("--detector", default="yolos-base", help="yolos-base / yolos-small (random weights) or a folder")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--sam", default="vit-h", help="vit-h / vit-b (random weights) or a SAM folder / hub id")
    ap.add_argument("--sam-points", type=int, default=64, help="points per side (GOAL: the pipeline's 64)")
    ap.add_argument("--sam-points-per-batch", type=int, default=128)
    ap.add_argument("--clip", default="random:clip-vit-base-patch16", help="the matching / training model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-preprocess", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "settings": vars(args), "device": "cpu", "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "paper": {"flism_minutes_docci": 97.63, "lism_minutes_docci": 1239.7, "speedup": 12.7},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if not args.skip_preprocess:
            print(f"FLISM ({args.detector}) vs LISM (SAM {args.sam}, {args.sam_points}^2 points), "
                  f"{args.images} images, matching with {args.clip}")
            result["preprocessing"] = preprocessing_costs(args, root)
        if not args.skip_step:
            print(f"training step, {args.clip}, batch {args.batch}, 248 text positions")
            result["training_step"] = step_costs(args, root)
    write_json_atomic(RESULTS, result)
    print(f"wrote {RESULTS}")
    return result


if __name__ == "__main__":
    main()
