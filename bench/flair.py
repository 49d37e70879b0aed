"""What FLAIR costs per training step and how fast its text-conditioned retrieval runs, measured in one run.

    python bench/flair.py [--model small-flair] [--batch 32] [--k 8] [--rounds 3] [--threads N]
                          [--images 256] [--texts 1280] [--top-k 128]
                          [--draw-batch 6144] [--draw-world 32] [--sections train,retrieval,draws]

Training step, on one FLAIR model from the registry (random weights) and one batch of ``--batch`` synthetic
scenes with ``--k`` sub-captions each (forward, backward, AdamW step):

- ``siglip``: the plain SigLIP step at the same batch and K: the B images (global embeddings, no patch
  tokens) against all B*K sub-captions, multi-positive (``losses.siglip_loss`` with each image's K
  sub-captions as positives);
- ``flair``: the ``flair`` objective term: patch tokens projected, L_tcs over B x (K+B-1) text-conditioned
  pairs through the attention pool, L_mps, ``(L_tcs + L_mps) / 2``.

Retrieval of ``--images`` images x ``--texts`` texts (random local tokens and text embeddings of the model's
shapes, scored with its pool; five texts per image):

- ``public``: the public code's way, one image at a time conditioned on all texts (``public_code_scores``),
  then the ranks from the full matrix;
- ``full``: ``finetune.evaluation.scorers.retrieval_ranks`` with the ``flair`` scorer (texts projected once, images in
  chunks);
- ``topk``: the same with the global-cosine top-k prefilter (``rerank_top_k = --top-k``).

The negative draw of one training step at a real global batch (``--draw-batch`` images on ``--draw-world``
processes, ``--k`` sub-captions each), on the CPU:

- ``whole``: what each process did before (issue 22): the whole global ``(B, K + B - 1)`` int64 index
  matrix drawn with a seeded generator (a ``(B, B)`` byte matrix of picks first), of which it used its rows;
- ``own``: now: :func:`losses.sample_flair_text_indices` with ``rows`` = the process's own images (a
  counter-based draw), ``B / W`` rows.

Each reports its best time and the largest single CPU allocation (the profiler's memory events).

Modes run interleaved in rounds (after a warm-up), each keeping its best time, so that load from other
processes on a shared machine hits every mode alike. Results go to ``bench/results/flair.json``; ratios
compare numbers of this run only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results" / "flair.json"


def _batch(model: Any, batch: int, k: int) -> tuple[Any, dict]:
    from finetune.data.collate import Collator
    from finetune.data.sources import load_source
    from finetune.objectives import Objective, build_term
    from finetune.objectives.flair import FlairOptions

    term, weights = build_term("flair", FlairOptions(k=k))
    objective = Objective(None, [(term, weights)])
    rows = load_source({"name": "synthetic", "size": batch, "options": {"image_size": model.image_size}}).dataset
    return objective, Collator(model, objective)([rows[i] for i in range(batch)])


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def training_steps(args: argparse.Namespace) -> dict:
    """Best wall-clock time of the FLAIR and the SigLIP step."""
    from finetune.models.registry import build_model
    from finetune.models.weight_decay import param_groups
    from losses import siglip_loss

    model = build_model(args.model).train()
    objective, batch = _batch(model, args.batch, args.k)
    optimizer = torch.optim.AdamW(param_groups(model, 0.5), lr=1e-6, betas=(0.9, 0.98), eps=1e-8)
    b, k = args.batch, args.k
    positives = torch.zeros(b, b * k, dtype=torch.bool)
    for i in range(b):
        positives[i, i * k:(i + 1) * k] = True

    def flair() -> None:
        out = objective.loss(model, objective.encode(model, batch))
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def siglip() -> None:
        image = model.encode_image(batch["image_inputs"]["pixel_values"]).embeds
        text = model.encode_text(batch["flair_input_ids"], batch["flair_attention_mask"]).embeds
        siglip_loss(image, text, model.logit_scale.exp(), model.logit_bias, positives=positives).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    modes = {"siglip": siglip, "flair": flair}
    for fn in modes.values():
        fn()  # warm-up
    best = {name: float("inf") for name in modes}
    for _ in range(args.rounds):
        for name, fn in modes.items():
            best[name] = min(best[name], _timed(fn))
    return {"model": args.model, "batch": b, "k": k, "seconds": best, "flair_over_siglip": best["flair"] / best["siglip"]}


def retrieval(args: argparse.Namespace) -> dict:
    """Best wall-clock time of text-conditioned retrieval: public way, full, top-k prefilter."""
    from finetune.evaluation.scorers.flair import FlairScorer, public_code_scores
    from finetune.models.registry import build_model
    from finetune.evaluation.scorers import CosineScorer, retrieval_ranks

    model = build_model(args.model).eval()
    n_local = (model.image_size // model.patch_size) ** 2
    dim = model.embed_dim
    torch.manual_seed(0)
    n_i, n_t = args.images, args.texts
    texts = {"embeds": torch.randn(n_t, dim)}
    images = {"embeds": torch.randn(n_i, dim), "local": torch.randn(n_i, n_local, dim)}
    owner = torch.arange(n_t) % n_i
    scorer = FlairScorer()
    scorer.pool = model.pool

    class _Matrix(CosineScorer):
        """Ranks from a precomputed (Nt, Ni) matrix: the public path's ranking step."""

        def __init__(self, sim: torch.Tensor) -> None:
            self.sim = sim

        def prepare(self, t: dict, i: dict) -> tuple[dict, dict]:
            return {"row": torch.arange(n_t)}, {"col": torch.arange(n_i)}

        def score(self, t: dict, i: dict) -> torch.Tensor:
            return self.sim[t["row"]][:, i["col"]]

        def score_pairs(self, t: dict, i: dict) -> torch.Tensor:
            return self.sim[t["row"], i["col"]]

        def tie_tolerance(self, t: dict, i: dict) -> float:
            return 0.0

    def public() -> None:
        with torch.no_grad():
            sim = public_code_scores(model.pool, texts["embeds"], images["local"])
        retrieval_ranks(_Matrix(sim), texts, images, owner)

    def full() -> None:
        retrieval_ranks(scorer, texts, images, owner)

    def topk() -> None:
        retrieval_ranks(scorer, texts, images, owner, rerank_top_k=args.top_k)

    modes = {"public": public, "full": full, "topk": topk}
    for fn in modes.values():
        fn()
    best = {name: float("inf") for name in modes}
    for _ in range(args.rounds):
        for name, fn in modes.items():
            best[name] = min(best[name], _timed(fn))
    return {"images": n_i, "texts": n_t, "local_tokens": n_local, "dim": dim, "top_k": args.top_k,
            "seconds": best, "public_over_full": best["public"] / best["full"],
            "public_over_topk": best["public"] / best["topk"], "full_over_topk": best["full"] / best["topk"]}


def _whole_draw_before(num_images: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """The draw every process made before: the whole global matrix (the former
    ``sample_flair_text_indices`` without ``rows``, as ``FlairTerm._text_indices`` called it)."""
    offsets = torch.randint(0, k, (num_images, num_images), generator=generator, dtype=torch.uint8).long()
    image = torch.arange(num_images).unsqueeze(1)
    column = torch.arange(k + num_images - 1).unsqueeze(0)
    own = (column >= image) & (column < image + k)
    other = torch.where(column < image, column, column - k + 1).clamp(0, num_images - 1)
    negatives = other * k + offsets.gather(1, other.expand(num_images, -1))
    return torch.where(own, image * k + column - image, negatives)


def negative_draws(args: argparse.Namespace) -> dict:
    """Best time and largest allocation of one step's negative draw, the whole matrix vs own rows."""
    from torch.profiler import ProfilerActivity, profile

    from losses import flair_draw_seed, sample_flair_text_indices

    n, k, world = args.draw_batch, args.k, args.draw_world
    per = n // world
    rank = world - 1  # the last process: its rows are the longest to reach in the whole matrix
    generator = torch.Generator()

    def whole() -> torch.Tensor:
        generator.manual_seed(0)
        return _whole_draw_before(n, k, generator)[rank * per:(rank + 1) * per]

    def own() -> torch.Tensor:
        return sample_flair_text_indices(n, k, rows=slice(rank * per, (rank + 1) * per), seed=flair_draw_seed(0, 1))

    modes = {"whole": whole, "own": own}
    largest, held = {}, {}
    for name, fn in modes.items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
        largest[name] = max((e.cpu_memory_usage for e in prof.events()), default=0)
        held[name] = out.numel() * out.element_size()
    best = {name: float("inf") for name in modes}
    for _ in range(args.rounds):
        for name, fn in modes.items():
            best[name] = min(best[name], _timed(fn))
    whole_matrix = n * (k + n - 1) * 8
    return {"global_batch": n, "processes": world, "rows_per_process": per, "k": k, "seconds": best,
            "largest_allocation_bytes": largest, "result_bytes": held, "whole_matrix_bytes": whole_matrix,
            "whole_over_own_seconds": best["whole"] / best["own"],
            "whole_over_own_largest_allocation": largest["whole"] / largest["own"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-flair", help="a FLAIR registry config (flair-vit-b-16 for the paper's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--texts", type=int, default=1280)
    ap.add_argument("--top-k", type=int, default=128)
    ap.add_argument("--draw-batch", type=int, default=6144, help="global batch of the negative-draw bench")
    ap.add_argument("--draw-world", type=int, default=32, help="processes of the negative-draw bench")
    ap.add_argument("--sections", default="train,retrieval,draws", help="comma-separated: train, retrieval, draws")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from finetune.files import write_json_atomic

    sections = {name.strip() for name in args.sections.split(",") if name.strip()}
    unknown = sections - {"train", "retrieval", "draws"}
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}; choose among train, retrieval, draws")
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {}  # sections not run keep their last numbers
    machine = {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if sections & {"train", "retrieval"}:
        result["machine"] = machine  # of the train step and retrieval numbers
    if "train" in sections:
        result["train_step"] = step = training_steps(args)
        print(f"train step ({args.model}, B={step['batch']}, K={step['k']}): flair {step['seconds']['flair']:.3f} s, "
              f"siglip {step['seconds']['siglip']:.3f} s, ratio {step['flair_over_siglip']:.2f}")
    if "retrieval" in sections:
        result["retrieval"] = ret = retrieval(args)
        print(f"retrieval {ret['images']} x {ret['texts']}: public {ret['seconds']['public']:.3f} s, full "
              f"{ret['seconds']['full']:.3f} s, top-{ret['top_k']} {ret['seconds']['topk']:.3f} s; public/full "
              f"{ret['public_over_full']:.2f}, public/top-k {ret['public_over_topk']:.2f}")
    if "draws" in sections:
        result["negative_draws"] = draw = {**negative_draws(args), "machine": machine}
        mb = 1 / 2 ** 20
        print(f"negative draw, global batch {draw['global_batch']} on {draw['processes']} processes, K={draw['k']}: "
              f"whole matrix {draw['seconds']['whole']:.3f} s, largest allocation "
              f"{draw['largest_allocation_bytes']['whole'] * mb:.1f} MiB; own rows {draw['seconds']['own']:.4f} s, "
              f"{draw['largest_allocation_bytes']['own'] * mb:.1f} MiB; ratios {draw['whole_over_own_seconds']:.1f}x "
              f"time, {draw['whole_over_own_largest_allocation']:.1f}x largest allocation")
    write_json_atomic(out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
