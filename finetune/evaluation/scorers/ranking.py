"""Ranking from blocks: Recall@K with any scorer in memory bounded by the block size.

:func:`retrieval_ranks` ranks every text and image from ``block_size x block_size`` blocks: it keeps,
per query, the score of its correct item and the count of wrong items that score at least as high,
so memory is bounded by the block size and never by ``Nt x Ni``. With ``rerank_top_k`` a global-cosine
pass first picks each query's top-k candidates (FLAIR's inference, 4 / public ``train.py``
``--inference-with-flair-topk``), only those are re-scored by the scorer, and every other item ranks
below them in cosine order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from finetune.evaluation.scorers.base import Payload, Scorer, get_scorer, payload_len, take
from finetune.evaluation.scorers.cosine import CosineScorer

__all__ = ["RetrievalRanks", "exact_float32_matmul", "recall_from_ranks", "retrieval_ranks"]


class RetrievalRanks(NamedTuple):
    """Ranks of every query: the number of *wrong* items that score at least as high as its correct
    item (0 = retrieved first).

    Attributes:
        t2i: ``(Nt,)`` long, one per text.
        i2t: ``(Ni',)`` long, one per image that has at least one caption (dataset order).
    """

    t2i: Tensor
    i2t: Tensor


@contextlib.contextmanager
def exact_float32_matmul(device: torch.device) -> Iterator[None]:
    """Full-precision float32 matmuls (no TF32) and no autocast, restored on exit: the ranks
    compare scores from a matmul with scores from an elementwise product."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    no_autocast = (torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda")
                   else contextlib.nullcontext())
    try:
        with no_autocast:
            yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _device(payload: Mapping[str, Tensor]) -> torch.device:
    return next(iter(payload.values())).device


def _check_finite(side: str, payload: Mapping[str, Tensor]) -> None:
    for key, value in payload.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError(f"retrieval: the {side} payload entry {key!r} contains NaN or inf; "
                             f"the model's outputs are broken")


def _check_block(scorer: Scorer, scores: Tensor, shape: tuple[int, ...], what: str) -> Tensor:
    if not isinstance(scores, Tensor) or tuple(scores.shape) != shape:
        got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"scorer {scorer.name or type(scorer).__name__!r}: {what} returned {got}, expected {shape}")
    return scores


def _targets(scorer: Scorer, texts: Payload, images: Payload, owner: Tensor, block_size: int) -> Tensor:
    """``(Nt,)`` score of each text with its own image, in blocks of texts."""
    n_texts = owner.shape[0]
    out = []
    for t0 in range(0, n_texts, block_size):
        t1 = min(t0 + block_size, n_texts)
        pairs = scorer.score_pairs(take(texts, slice(t0, t1)), take(images, owner[t0:t1]))
        out.append(_check_block(scorer, pairs, (t1 - t0,), "score_pairs"))
    target = torch.cat(out)
    if target.is_floating_point() and not torch.isfinite(target).all():
        raise ValueError(f"scorer {scorer.name!r} gave a text's own image a NaN or inf score")
    return target


def _full_ranks(scorer: Scorer, texts: Payload, images: Payload, owner: Tensor, n_images: int,
                block_size: int) -> tuple[Tensor, Tensor, Tensor, float]:
    """Pessimistic ranks of all texts and all images under ``scorer`` over every block.

    Returns ``(text_rank (Nt,), image_rank (Ni,), best (Ni,) each image's best-caption score, tol)``;
    images without a caption have ``best = -inf`` (their rank is meaningless).
    """
    device = owner.device
    target = _targets(scorer, texts, images, owner, block_size)
    tol = float(scorer.tie_tolerance(texts, images))
    best = torch.full((n_images,), float("-inf"), dtype=target.dtype, device=device)
    best = best.scatter_reduce(0, owner, target, reduce="amax")
    text_threshold, image_threshold = target - tol, best - tol

    n_texts = owner.shape[0]
    text_rank = torch.zeros(n_texts, dtype=torch.long, device=device)
    image_rank = torch.zeros(n_images, dtype=torch.long, device=device)
    for t0 in range(0, n_texts, block_size):
        t1 = min(t0 + block_size, n_texts)
        block_texts, block_owner, block_threshold = take(texts, slice(t0, t1)), owner[t0:t1], text_threshold[t0:t1]
        for i0 in range(0, n_images, block_size):
            i1 = min(i0 + block_size, n_images)
            scores = _check_block(scorer, scorer.score(block_texts, take(images, slice(i0, i1))),
                                  (t1 - t0, i1 - i0), "score")
            text_rank[t0:t1] += (scores >= block_threshold[:, None]).sum(1)
            image_rank[i0:i1] += (scores >= image_threshold[None, i0:i1]).sum(0)
            # the pairs (text, its own image) in this block are not wrong items: take them back out
            rows = ((block_owner >= i0) & (block_owner < i1)).nonzero().flatten()
            if rows.numel():
                cols = block_owner[rows] - i0
                own = scores[rows, cols]
                text_rank[t0 + rows] -= (own >= block_threshold[rows]).long()
                image_rank.index_add_(0, i0 + cols, -(own >= image_threshold[i0 + cols]).long())
    return text_rank, image_rank, best, tol


def _top_candidates(texts: Payload, images: Payload, owner: Tensor, k_text: int, k_image: int,
                    block_size: int, tol: float) -> tuple[Tensor, Tensor]:
    """Global-cosine candidates: ``(Nt, k_text)`` image indices per text and ``(Ni, k_image)`` text
    indices per image, from a running top-k over blocks. A query's own items enter with their score
    lowered by ``tol``, so a tie at the cut goes against the model."""
    n_texts, n_images = owner.shape[0], payload_len(images)
    device = owner.device
    cosine = CosineScorer()
    dtype = images["embeds"].dtype
    t_val = torch.full((n_texts, k_text), float("-inf"), dtype=dtype, device=device)
    t_idx = torch.zeros((n_texts, k_text), dtype=torch.long, device=device)
    i_val = torch.full((n_images, k_image), float("-inf"), dtype=dtype, device=device)
    i_idx = torch.zeros((n_images, k_image), dtype=torch.long, device=device)
    for t0 in range(0, n_texts, block_size):
        t1 = min(t0 + block_size, n_texts)
        block_owner = owner[t0:t1]
        for i0 in range(0, n_images, block_size):
            i1 = min(i0 + block_size, n_images)
            keys = cosine.score(take(texts, slice(t0, t1)), take(images, slice(i0, i1)))
            rows = ((block_owner >= i0) & (block_owner < i1)).nonzero().flatten()
            keys[rows, block_owner[rows] - i0] -= tol
            image_ids = torch.arange(i0, i1, device=device).expand(t1 - t0, -1)
            val, pos = torch.cat([t_val[t0:t1], keys], 1).topk(k_text, dim=1)
            t_idx[t0:t1] = torch.cat([t_idx[t0:t1], image_ids], 1).gather(1, pos)
            t_val[t0:t1] = val
            text_ids = torch.arange(t0, t1, device=device).expand(i1 - i0, -1)
            val, pos = torch.cat([i_val[i0:i1], keys.T], 1).topk(k_image, dim=1)
            i_idx[i0:i1] = torch.cat([i_idx[i0:i1], text_ids], 1).gather(1, pos)
            i_val[i0:i1] = val
    return t_idx, i_idx


class _Shortlist(NamedTuple):
    """Each query's global-cosine top-K items: ``candidates`` ``(n, K)`` their indices, ``own`` ``(n, K)`` whether
    each is a correct item, ``fallback`` ``(n,)`` the query's cosine rank."""

    candidates: Tensor
    own: Tensor
    fallback: Tensor


def _reranked(scorer: Scorer, queries: Payload, items: Payload, shortlist: _Shortlist, tol: float, query_side: str,
              block_size: int) -> Tensor:
    """Ranks of queries whose candidates are re-scored: the number of wrong candidates scoring at
    least the best own candidate's score; a query with no own candidate keeps its ``fallback`` (its
    cosine rank, at least K: every candidate ranks above it)."""
    candidates, own, fallback = shortlist
    n, k = candidates.shape
    ranks = torch.empty(n, dtype=torch.long, device=candidates.device)
    step = max(1, block_size // k)
    for q0 in range(0, n, step):
        q1 = min(q0 + step, n)
        scores = scorer.score_candidates(take(queries, slice(q0, q1)), items, candidates[q0:q1],
                                         query_side=query_side)
        scores = _check_block(scorer, scores, (q1 - q0, k), "score_candidates")
        mine = own[q0:q1]
        best = scores.masked_fill(~mine, float("-inf")).amax(1)
        wrong_above = ((scores >= (best - tol)[:, None]) & ~mine).sum(1)
        found = mine.any(1)
        ranks[q0:q1] = torch.where(found, wrong_above, fallback[q0:q1].clamp(min=k))
    return ranks


@torch.no_grad()
def retrieval_ranks(
    scorer: Scorer,
    texts: Payload,
    images: Payload,
    text_to_image: Tensor,
    *,
    block_size: int = 1024,
    rerank_top_k: int | None = None,
) -> RetrievalRanks:
    """Rank every text (text -> image) and every captioned image (image -> text) from blocks.

    A text has one correct image, ``text_to_image[t]``; an image is answered by its best caption
    (the highest-scoring of its texts) against all texts of other images, which is the usual "best
    rank over its captions" of COCO and Flickr30k. Ties count against the model: wrong items within
    ``scorer.tie_tolerance`` of the correct score rank above it.

    Memory: one ``block_size x block_size`` block of scores at a time plus ``O(Nt + Ni)`` counters
    (with ``rerank_top_k = k``: ``O((Nt + Ni) k)`` candidates). Computed in float32 without TF32 or
    autocast.

    Args:
        scorer: a :class:`Scorer`.
        texts: payload of ``Nt`` texts; images: payload of ``Ni`` images (as the scorer encoded them).
        text_to_image: ``(Nt,)`` long, the index of each text's image.
        block_size: texts and images per block.
        rerank_top_k: ``k``: rank each query's global-cosine top-k candidates (payload key
            ``embeds``) by the scorer, every other item below them in cosine order. ``k`` at least
            the number of items gives the full scoring.

    Raises:
        ValueError: on non-positive ``block_size`` / ``rerank_top_k``, a payload without ``embeds``
            under ``rerank_top_k``, non-finite payloads or blocks of the wrong shape.
    """
    if block_size < 1:
        raise ValueError(f"retrieval: block_size must be >= 1, got {block_size}")
    if rerank_top_k is not None and (isinstance(rerank_top_k, bool) or rerank_top_k < 1):
        raise ValueError(f"retrieval: rerank_top_k must be >= 1 or None, got {rerank_top_k!r}")
    n_texts, n_images = payload_len(texts), payload_len(images)
    device = _device(images)
    owner = text_to_image.to(device=device, dtype=torch.long)
    with exact_float32_matmul(device):
        if rerank_top_k is None:
            texts, images = scorer.prepare(texts, images)
            _check_finite("text", texts)
            _check_finite("image", images)
            text_rank, image_rank, best, _ = _full_ranks(scorer, texts, images, owner, n_images, block_size)
            return RetrievalRanks(text_rank, image_rank[torch.isfinite(best)])

        missing = [side for side, p in (("text", texts), ("image", images)) if "embeds" not in p]
        if missing:
            raise ValueError(f"eval.rerank_top_k needs the global embeddings: scorer {scorer.name!r} keeps no "
                             f"'embeds' in its {' and '.join(missing)} payloads; keep them or set rerank_top_k "
                             f"to null")
        cosine = CosineScorer()
        g_texts, g_images = cosine.prepare({"embeds": texts["embeds"]}, {"embeds": images["embeds"]})
        _check_finite("text", g_texts)
        _check_finite("image", g_images)
        cos_text_rank, cos_image_rank, best, cos_tol = _full_ranks(cosine, g_texts, g_images, owner, n_images,
                                                                   block_size)
        k_text, k_image = min(rerank_top_k, n_images), min(rerank_top_k, n_texts)
        text_cands, image_cands = _top_candidates(g_texts, g_images, owner, k_text, k_image, block_size, cos_tol)
        del g_texts, g_images

        texts, images = scorer.prepare(texts, images)
        _check_finite("text", texts)
        _check_finite("image", images)
        tol = float(scorer.tie_tolerance(texts, images))
        shortlist = _Shortlist(text_cands, text_cands == owner[:, None], cos_text_rank)
        text_rank = _reranked(scorer, texts, images, shortlist, tol, "text", block_size)
        has_text = torch.isfinite(best)
        image_ids = has_text.nonzero().flatten()
        image_cands = image_cands[image_ids]
        shortlist = _Shortlist(image_cands, owner[image_cands] == image_ids[:, None], cos_image_rank[image_ids])
        image_rank = _reranked(scorer, take(images, image_ids), texts, shortlist, tol, "image", block_size)
        return RetrievalRanks(text_rank, image_rank)


def recall_from_ranks(ranks: RetrievalRanks, ks: Sequence[int]) -> dict[str, dict[str, float]]:
    """``{"t2i": {"R@K": pct}, "i2t": {...}}``: the percentage of queries with rank < K."""
    return {
        "t2i": {f"R@{k}": float((ranks.t2i < k).double().mean() * 100) for k in ks},
        "i2t": {f"R@{k}": float((ranks.i2t < k).double().mean() * 100) for k in ks},
    }
