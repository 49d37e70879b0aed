"""What FLAIR costs per training step and how fast its text-conditioned retrieval runs, measured in one run.

    python bench/flair.py [--model small-flair] [--batch 32] [--k 8] [--rounds 3] [--threads N]
                          [--images 256] [--texts 1280] [--top-k 128]

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
- ``full``: ``finetune.scorers.retrieval_ranks`` with the ``flair`` scorer (texts projected once, images in
  chunks);
- ``topk``: the same with the global-cosine top-k prefilter (``rerank_top_k = --top-k``).

Modes run interleaved in rounds (after a warm-up), each keeping its best time, so that load from other
processes on a shared machine hits every mode alike. Results go to ``bench/results/flair.json``; ratios
compare numbers of this run only.
"""

from __future__ import annotations

import argparse
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
    from finetune.scorers_flair import FlairScorer, public_code_scores
    from finetune.models.registry import build_model
    from finetune.scorers import CosineScorer, retrieval_ranks

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
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from finetune.report import write_json_atomic

    result = {"machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "threads": torch.get_num_threads()},
              "train_step": training_steps(args), "retrieval": retrieval(args)}
    write_json_atomic(Path(args.out), result)
    step, ret = result["train_step"], result["retrieval"]
    print(f"train step ({args.model}, B={step['batch']}, K={step['k']}): flair {step['seconds']['flair']:.3f} s, "
          f"siglip {step['seconds']['siglip']:.3f} s, ratio {step['flair_over_siglip']:.2f}")
    print(f"retrieval {ret['images']} x {ret['texts']}: public {ret['seconds']['public']:.3f} s, full "
          f"{ret['seconds']['full']:.3f} s, top-{ret['top_k']} {ret['seconds']['topk']:.3f} s; public/full "
          f"{ret['public_over_full']:.2f}, public/top-k {ret['public_over_topk']:.2f}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
