"""Recall@K, the metric of the long-caption retrieval papers (Long-CLIP 4.2, StructXLIP 4, FAST-GOAL IV, FLAIR 4,
F-CAST 4): the percentage of queries whose ground truth is among the K best-scoring items under the recipe's scorer
(``eval.scorer``, cosine similarity by default; :mod:`finetune.evaluation.scorers`). Several captions per image are
supported (COCO, Flickr30k): a text query has one correct image; an image query is answered by its best-ranked
caption. The similarity matrix is never materialised: it is computed block by block (``eval.block_size``), so
memory stays bounded for 100k items; ``eval.rerank_top_k`` re-scores only each query's global-cosine top-k.

Also here: rSum (:func:`recall_sum`), COCO's 5-fold 1K protocol (:func:`fold_recall`) and the before -> after table
of a run's report (:func:`format_table`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from finetune.evaluation.scorers import (Scorer, get_scorer, payload_len, recall_from_ranks, retrieval_ranks,
                                         take)

DEFAULT_KS: tuple[int, ...] = (1, 5, 10, 25, 50)

__all__ = ["DEFAULT_KS", "fold_recall", "format_table", "recall_at_k", "recall_sum"]


def _check_inputs(image_embeds: Any, text_embeds: Any, text_to_image: Tensor, ks: Sequence[int],
                  block_size: int) -> tuple[int, int]:
    """Validate the inputs of :func:`recall_at_k`; returns ``(n_images, n_texts)``."""
    tensors = isinstance(image_embeds, Tensor) and isinstance(text_embeds, Tensor)
    if tensors:
        if image_embeds.ndim != 2 or text_embeds.ndim != 2:
            raise ValueError(f"recall_at_k: image_embeds and text_embeds must be (N, D), got shapes "
                             f"{tuple(image_embeds.shape)} and {tuple(text_embeds.shape)}")
        if image_embeds.shape[1] != text_embeds.shape[1]:
            raise ValueError(f"recall_at_k: image and text embeddings have different widths "
                             f"({image_embeds.shape[1]} vs {text_embeds.shape[1]})")
        n_images, n_texts = image_embeds.shape[0], text_embeds.shape[0]
    elif isinstance(image_embeds, Mapping) and isinstance(text_embeds, Mapping):
        n_images = payload_len(image_embeds) if image_embeds else 0
        n_texts = payload_len(text_embeds) if text_embeds else 0
    else:
        raise ValueError(f"recall_at_k: give two (N, D) tensors or two scorer payloads (dicts of tensors), got "
                         f"{type(image_embeds).__name__} and {type(text_embeds).__name__}")
    if n_images == 0 or n_texts == 0:
        raise ValueError(f"recall_at_k: nothing to rank ({n_images} images, {n_texts} texts)")
    if text_to_image.ndim != 1 or text_to_image.shape[0] != n_texts:
        raise ValueError(f"recall_at_k: text_to_image must be (Nt,) = ({n_texts},), "
                         f"got {tuple(text_to_image.shape)}")
    if text_to_image.dtype.is_floating_point or text_to_image.dtype == torch.bool:
        raise ValueError(f"recall_at_k: text_to_image must hold integer image indices, got {text_to_image.dtype}")
    low, high = int(text_to_image.min()), int(text_to_image.max())
    if low < 0 or high >= n_images:
        raise ValueError(f"recall_at_k: text_to_image holds index {low if low < 0 else high}, outside "
                         f"[0, {n_images}) images")
    if not ks or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
        raise ValueError(f"recall_at_k: ks must be positive integers, got {list(ks)!r}")
    if block_size < 1:
        raise ValueError(f"recall_at_k: block_size must be >= 1, got {block_size}")
    if tensors:
        for name, x in (("image_embeds", image_embeds), ("text_embeds", text_embeds)):
            if not torch.isfinite(x).all():
                raise ValueError(f"recall_at_k: {name} contains NaN or inf; the model's outputs are broken")
    return n_images, n_texts


@torch.no_grad()
def recall_at_k(
    image_embeds: Tensor | Mapping[str, Tensor],
    text_embeds: Tensor | Mapping[str, Tensor],
    text_to_image: Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    block_size: int = 1024,
    scorer: str | Scorer = "cosine",
    rerank_top_k: int | None = None,
    chunk_size: int | None = None,
) -> dict[str, dict[str, float]]:
    """Text-to-image and image-to-text Recall@K (in percent) under a scorer (cosine by default).

    The rank of a query is the number of *wrong* items that score at least as high as its correct
    item (0 = retrieved first); Recall@K is the percentage of queries with rank < K.

    - text -> image: each text has one correct image, ``text_to_image[t]``.
    - image -> text: an image is scored by its best caption (the highest-scoring of the texts
      pointing to it), against all texts of other images; this equals the usual "best rank over
      its captions". Images without any caption are left out of image -> text.

    Ties count against the model (pessimistic). Under cosine, scores within ``D * eps`` of the
    correct one (the float32 rounding bound of a dot product of unit vectors, about 6e-5 for D = 512)
    count as ties, so the result does not depend on the order of the items and a collapsed model that
    gives every item the same embedding gets the recall of a random ranking's worst case, not 100 %.

    Memory: blocks of ``block_size x block_size`` scores, never the full ``Nt x Ni`` matrix (see
    :func:`finetune.evaluation.scorers.retrieval_ranks`). Works on any device; cosine is computed in float32
    (float64 inputs stay float64) without TF32 or autocast.

    Args:
        image_embeds: ``(Ni, D)`` raw image embeddings (normalised by the cosine scorer), or the image
            payload of ``scorer`` (``encode_for_retrieval(...).image_payload``).
        text_embeds: ``(Nt, D)`` raw text embeddings, or the text payload.
        text_to_image: ``(Nt,)`` long, the index of each text's image.
        ks: the cut-offs K.
        block_size: texts and images per score block.
        scorer: a registered scorer name or a :class:`finetune.evaluation.scorers.Scorer`.
        rerank_top_k: re-score only each query's global-cosine top-k (FLAIR's inference); None: all.
        chunk_size: the former name of ``block_size`` (used when given).

    Returns:
        ``{"t2i": {"R@1": pct, ...}, "i2t": {"R@1": pct, ...}}``.

    Raises:
        ValueError: on mismatched shapes, out-of-range indices, non-positive K, non-finite embeddings
            or an unknown scorer.
    """
    if chunk_size is not None:
        block_size = chunk_size
    _check_inputs(image_embeds, text_embeds, text_to_image, ks, block_size)
    scorer = get_scorer(scorer)
    images = {"embeds": image_embeds} if isinstance(image_embeds, Tensor) else dict(image_embeds)
    texts = {"embeds": text_embeds} if isinstance(text_embeds, Tensor) else dict(text_embeds)
    ranks = retrieval_ranks(scorer, texts, images, text_to_image, block_size=block_size,
                            rerank_top_k=rerank_top_k)
    return recall_from_ranks(ranks, ks)



def recall_sum(metrics: Mapping[str, Mapping[str, float]]) -> float | None:
    """rSum: R@1 + R@5 + R@10 of both directions (VSE++, LAPS, GRM), or None when one is missing.

    Args:
        metrics: ``{"t2i": {"R@1": pct, ...}, "i2t": {...}}``.
    """
    keys = ("R@1", "R@5", "R@10")
    try:
        return float(sum(metrics[d][k] for d in ("t2i", "i2t") for k in keys))
    except KeyError:
        return None



def fold_recall(
    image_payload: Mapping[str, Tensor],
    text_payload: Mapping[str, Tensor],
    text_to_image: Tensor,
    ks: Sequence[int],
    folds: int,
    **kwargs: Any,
) -> dict[str, dict[str, float]]:
    """Recall@K averaged over ``folds`` consecutive blocks of images, each ranked against its own captions
    only (COCO 1K: the 5,000 test images as 5 folds of 1,000, VSE++ / LAPS ``evalrank(fold5=True)``).

    Args:
        image_payload, text_payload: the scorer's payloads of ``Ni`` images and ``Nt`` texts.
        text_to_image: ``(Nt,)`` the image of each text.
        ks: the cut-offs K.
        folds: the number of blocks; ``Ni`` must divide evenly.
        kwargs: passed to :func:`recall_at_k` (``block_size``, ``scorer``, ``rerank_top_k``).

    Returns:
        ``{"t2i": {"R@K": mean pct}, "i2t": {...}}``.

    Raises:
        ValueError: ``Ni`` is not a multiple of ``folds``.
    """
    n_images = payload_len(image_payload)
    if folds < 1 or n_images % folds:
        raise ValueError(f"{n_images} images cannot be split into {folds} folds of equal size")
    size = n_images // folds
    owner = text_to_image.to(torch.long)
    parts = []
    for f in range(folds):
        lo, hi = f * size, (f + 1) * size
        rows = ((owner >= lo) & (owner < hi)).nonzero().flatten()
        parts.append(recall_at_k(take(image_payload, slice(lo, hi)), take(text_payload, rows.to(owner.device)),
                                 owner[rows] - lo, ks, **kwargs))
    return {d: {k: float(sum(p[d][k] for p in parts) / folds) for k in parts[0][d]} for d in ("t2i", "i2t")}


_DIRECTIONS = (("t2i", "text→image"), ("i2t", "image→text"))


def format_table(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> str:
    """A markdown table of Recall@K per set and direction: ``before → after`` cells when
    ``before`` is given (and holds the set), else the ``after`` values alone.

    Args:
        before: :func:`evaluate_sets` results before training, or None.
        after: :func:`evaluate_sets` results (after training, or the only ones).
    """
    if not after:
        return "(no evaluation sets)"
    ks: list[str] = []
    for res in after.values():
        for direction, _ in _DIRECTIONS:
            ks.extend(k for k in res.get(direction, {}) if k not in ks)
    header = "| set | images / texts | direction | " + " | ".join(ks) + " |"
    lines = [header, "|" + "---|" * (3 + len(ks))]
    for name, res in after.items():
        prev = (before or {}).get(name)
        size = f"{res.get('n_images', '?')} / {res.get('n_texts', '?')}"
        for direction, words in _DIRECTIONS:
            if direction not in res:
                continue
            cells = []
            for k in ks:
                value = res[direction].get(k)
                if value is None:
                    cells.append("")
                elif prev is not None and k in prev.get(direction, {}):
                    cells.append(f"{prev[direction][k]:.1f} → {value:.1f}")
                else:
                    cells.append(f"{value:.1f}")
            lines.append(f"| {name} | {size} | {words} | " + " | ".join(cells) + " |")
        if res.get("rsum") is not None:
            was = prev.get("rsum") if prev is not None else None
            value = f"{was:.1f} → {res['rsum']:.1f}" if was is not None else f"{res['rsum']:.1f}"
            lines.append(f"| {name} | {size} | rSum (R@1+5+10, both) | {value} |" + " |" * (len(ks) - 1))
    return "\n".join(lines)

