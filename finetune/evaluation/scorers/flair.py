"""FLAIR's retrieval scorers (FLAIR section 3.2 and 4; public ``train.py`` inference), registered as
``eval.scorer: flair`` and ``eval.scorer: flair_global``.

- ``flair``: the text-conditioned score ``<n(pool(t_j, v_loc_i)), n(t_j)>``: every image is conditioned on
  every text (the image's local tokens attended by the text's global embedding), in chunks of images so
  that memory stays bounded: the paper's inference (section 4, "Inference with FLAIR"), the number the
  recipes report. ``eval.rerank_top_k: 128`` is the public code's shortcut (``--inference-with-flair-topk``,
  not in the paper): the global-cosine pass of :func:`finetune.evaluation.scorers.retrieval_ranks` picks each query's
  top-k and only those are conditioned (:meth:`FlairScorer.score_candidates`), the rest ranked below them.
- ``flair_global``: the class token against the text (FLAIR-CLIP, the public ``--direct-global-matching``),
  the cosine of the global embeddings.

The scale and bias are left out: they do not change a ranking (as the authors' code, which drops the bias).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from finetune.evaluation.scorers.base import Payload, Scorer, payload_len, register_scorer
from finetune.evaluation.scorers.cosine import CosineScorer

__all__ = ["FlairGlobalScorer", "FlairScorer", "candidate_scores", "conditioned_scores", "public_code_scores"]


def conditioned_scores(pool: Any, texts: Tensor, local: Tensor, *, max_elements: int = 2 ** 24) -> Tensor:
    """``(Tt, Ti)`` text-conditioned cosine scores of ``Tt`` texts against ``Ti`` images (FLAIR eq. 2).

    The pool's attention is computed here from its own weights so that the texts' LayerNorm and query
    projection run ONCE for all images (``pool(texts, local)`` per image, the public code's way, repeats them
    for every image); keys and values get the empty slot (a zero key and value after the in-projection) as
    in :class:`losses.flair.TextConditionedAttentionPool`, so the result equals calling the pool.

    Args:
        pool: the model's :class:`losses.flair.TextConditionedAttentionPool`.
        texts: ``(Tt, D)`` raw global text embeddings (the pool's queries).
        local: ``(Ti, N, D)`` the images' local tokens.
        max_elements: bound on the ``images x texts x D`` conditioned embeddings held at once (images
            are processed in chunks of ``max(1, max_elements // (Tt * D))``).

    Returns:
        ``score[j, i] = <n(pool(t_j, v_loc_i)), n(t_j)>``.
    """
    n_texts, dim = texts.shape
    n_images = local.shape[0]
    q = _queries(pool, texts)  # (H, Tt, dh)
    unit = F.normalize(texts, dim=-1)
    step = max(1, max_elements // max(1, n_texts * dim))
    out = []
    for i0 in range(0, n_images, step):
        k, v = _keys_values(pool, local[i0:i0 + step])  # (ti, H, N+1, dh)
        tc = _attend(pool, q.unsqueeze(0).expand(k.shape[0], -1, -1, -1), k, v)  # (ti, Tt, D)
        out.append((F.normalize(tc, dim=-1) * unit.unsqueeze(0)).sum(-1))  # (ti, Tt)
    if not out:
        return texts.new_zeros((n_texts, 0))
    return torch.cat(out).T


def _check_pool(pool: Any) -> None:
    attn = pool.attn
    if attn.bias_k is not None or not attn._qkv_same_embed_dim or not attn.batch_first:
        raise ValueError("conditioned_scores expects FLAIR's pool: packed in-projection, batch_first, no bias_k/v")


def _queries(pool: Any, texts: Tensor) -> Tensor:
    """``(T, D)`` texts -> ``(H, T, dh)`` the pool's projected queries (``ln_q`` and the query projection)."""
    _check_pool(pool)
    attn = pool.attn
    b = attn.in_proj_bias
    q = F.linear(pool.ln_q(texts), attn.in_proj_weight.chunk(3)[0], None if b is None else b.chunk(3)[0])
    return q.view(texts.shape[0], attn.num_heads, -1).transpose(0, 1)


def _keys_values(pool: Any, local: Tensor) -> tuple[Tensor, Tensor]:
    """``(B, N, D)`` local tokens -> keys and values ``(B, H, N + 1, dh)`` each, with the pool's empty slot
    (a zero key and value after the in-projection, :class:`losses.flair.TextConditionedAttentionPool`)."""
    _check_pool(pool)
    attn = pool.attn
    n_images, n_local, dim = local.shape
    _, wk, wv = attn.in_proj_weight.chunk(3)
    b = attn.in_proj_bias
    _, bk, bv = (None, None, None) if b is None else b.chunk(3)
    zero = local.new_zeros(n_images, 1, dim)
    k = torch.cat([F.linear(pool.ln_k(local), wk, bk), zero], 1)
    v = torch.cat([F.linear(pool.ln_v(local), wv, bv), zero], 1)
    shape = (n_images, n_local + 1, attn.num_heads, -1)
    return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)


def _attend(pool: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Queries ``(B, H, T, dh)`` on keys / values ``(B, H, N + 1, dh)`` -> ``(B, T, D)`` after ``out_proj``."""
    tc = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, dh)
    return pool.attn.out_proj(tc.transpose(1, 2).flatten(2))


def candidate_scores(pool: Any, texts: Tensor, local: Tensor, candidates: Tensor, *,
                     max_elements: int = 2 ** 24) -> Tensor:
    """``(Q, K)`` text-conditioned scores of ``Q`` texts against their ``K`` candidate images each (the top-k
    prefilter, public ``--inference-with-flair-topk``), grouped by image.

    The candidate pairs are grouped by image and the images taken in blocks: each image's keys and values
    (``ln_k`` / ``ln_v`` and their projections) are computed ONCE, and attended by all the texts that have it as
    a candidate in one batched call (the texts' queries, projected once in all, padded to the largest group),
    instead of once per (text, candidate) pair.

    Args:
        pool: the model's :class:`losses.flair.TextConditionedAttentionPool`.
        texts: ``(Q, D)`` raw global text embeddings (the queries).
        local: ``(Ti, N, D)`` the local tokens of all images.
        candidates: ``(Q, K)`` long, indices into ``local``.
        max_elements: bound on the padded queries / keys held at once (images x ``max(group, N + 1) x D``).

    Returns:
        ``score[q, c] = <n(pool(t_q, v_loc_{candidates[q, c]})), n(t_q)>``.
    """
    n_q, n_k = candidates.shape
    out = texts.new_zeros(n_q * n_k)
    if out.numel() == 0:
        return out.view(n_q, n_k)
    q = _queries(pool, texts).transpose(0, 1)  # (Q, H, dh), once for all texts
    unit = F.normalize(texts, dim=-1)
    flat = candidates.reshape(-1).to(local.device)
    images, inverse = torch.unique(flat, return_inverse=True)  # (U,), (Q*K,)
    order = torch.argsort(inverse, stable=True)  # the pairs grouped by image
    pair_query = torch.div(order, n_k, rounding_mode="floor")
    pair_image = inverse[order]
    counts = torch.bincount(inverse, minlength=len(images))
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(order), device=flat.device) - starts[pair_image]  # the pair's row in its image's queries
    width = int(counts.max())
    # each image's texts padded to `width` queries: (ub, H, width, dh) against its own keys / values
    step = max(1, max_elements // (max(width, local.shape[1] + 1) * local.shape[2]))
    for b0 in range(0, len(images), step):
        k, v = _keys_values(pool, local[images[b0:b0 + step]])  # (ub, H, N+1, dh), once per image
        lo, hi = int(starts[b0]), int(starts[min(b0 + step, len(images)) - 1] + counts[min(b0 + step, len(images)) - 1])
        rows, which, at = pair_query[lo:hi], pair_image[lo:hi] - b0, slot[lo:hi]
        padded = q.new_zeros(k.shape[0], width, *q.shape[1:])  # (ub, width, H, dh)
        padded[which, at] = q[rows]
        tc = _attend(pool, padded.transpose(1, 2), k, v)[which, at]  # (P, D)
        out[order[lo:hi]] = (F.normalize(tc, dim=-1) * unit[rows]).sum(-1)
    return out.view(n_q, n_k)


def public_code_scores(pool: Any, texts: Tensor, local: Tensor) -> Tensor:
    """``(Tt, Ti)`` the same scores the public code's way (``train.py`` inference): one image at a time,
    conditioned on all texts in one call of the pool. For the benchmark and as a reference."""
    unit = F.normalize(texts, dim=-1)
    cols = [(F.normalize(pool(texts.unsqueeze(0), local[i:i + 1])[0], dim=-1) * unit).sum(-1)
            for i in range(local.shape[0])]
    return torch.stack(cols, 1) if cols else texts.new_zeros((texts.shape[0], 0))


def _require_flair(model: Any, name: str) -> None:
    if not (callable(getattr(model, "local_tokens", None)) and hasattr(model, "pool")):
        raise ValueError(f"eval.scorer {name!r} needs a FLAIR model (model family 'flair', with the attention "
                         f"pool); {getattr(model, 'name_or_path', model)!r} is a {getattr(model, 'backend', '?')!r} "
                         f"model: use eval.scorer cosine (or flair_global, the same for non-FLAIR models)")


@register_scorer("flair")
class FlairScorer(Scorer):
    """FLAIR's text-conditioned scorer (see the module docstring).

    Payloads: texts ``{"embeds": (B, D)}`` (raw, the pool's queries; the prefilter normalises them),
    images ``{"embeds": (B, D) class token, "local": (B, N, D)}``. The pool is read from the model that
    encoded the images (:meth:`encode_images` keeps it), so a scorer serves one model at a time.

    Args:
        max_elements: bound on the conditioned embeddings held at once (:func:`conditioned_scores`).
    """

    def __init__(self, max_elements: int = 2 ** 24) -> None:
        if max_elements < 1:
            raise ValueError(f"flair scorer: max_elements must be >= 1, got {max_elements}")
        self.max_elements = int(max_elements)
        self.pool: Any = None

    def encode_images(self, model: Any, inputs: Any) -> Payload:
        """``{"embeds": (B, D), "local": (B, N, D)}`` float32; keeps ``model.pool`` for scoring."""
        _require_flair(model, self.name or "flair")
        self.pool = model.pool
        feats = model.encode_image(**inputs, states=True)
        return {"embeds": feats.embeds.float(), "local": model.local_tokens(feats.states).float()}

    def _pool(self) -> Any:
        if self.pool is None:
            raise ValueError("flair scorer: no attention pool yet: encode the images with encode_images first "
                             "(finetune.evaluation does)")
        return self.pool

    def _run(self, fn: Any, *args: Any) -> Tensor:
        pool = self._pool()
        param = next(pool.parameters())
        ref = args[0]
        if param.device != ref.device or param.dtype != ref.dtype:  # the ranks run in float32, maybe float64
            import copy

            pool = copy.deepcopy(pool).to(device=ref.device, dtype=ref.dtype)
            self.pool = pool
        with torch.no_grad():
            return fn(pool, *args)

    def score(self, texts: Payload, images: Payload) -> Tensor:
        """``(Tt, Ti)`` every image conditioned on every text (:func:`conditioned_scores`)."""
        return self._run(lambda pool, t, v: conditioned_scores(pool, t, v, max_elements=self.max_elements),
                         texts["embeds"], images["local"])

    def score_pairs(self, texts: Payload, images: Payload) -> Tensor:
        """``(n,)`` text j conditioned on image j only."""
        def pairs(pool: Any, t: Tensor, v: Tensor) -> Tensor:
            tc = pool(t.unsqueeze(1), v).squeeze(1)
            return (F.normalize(tc, dim=-1) * F.normalize(t, dim=-1)).sum(-1)

        return self._run(pairs, texts["embeds"], images["local"])

    def score_candidates(self, queries: Payload, items: Payload, candidates: Tensor, *, query_side: str) -> Tensor:
        """``(Q, K)``: a text against its K candidate images (each image conditioned on that text), or an image
        conditioned on its K candidate texts in one pool call."""
        if query_side not in ("text", "image"):
            raise ValueError(f"score_candidates: query_side must be 'text' or 'image', got {query_side!r}")

        def run(pool: Any, t: Tensor, v: Tensor) -> Tensor:
            if query_side == "text":  # t: (Q, D) queries, v: (Ti, N, D) all images, grouped by candidate image
                return candidate_scores(pool, t, v, candidates.to(v.device), max_elements=self.max_elements)
            tc = pool(t, v)  # t: (Q, K, D) candidate texts, v: (Q, N, D) the query images
            return (F.normalize(tc, dim=-1) * F.normalize(t, dim=-1)).sum(-1)

        if query_side == "text":
            return self._run(run, queries["embeds"], items["local"])
        return self._run(run, items["embeds"][candidates.to(items["embeds"].device)], queries["local"])

    def tie_tolerance(self, texts: Payload, images: Payload) -> float:
        """``16 D eps``: the same pair scored in different batch shapes (a block, a pair, a candidate list)
        goes through attention kernels that round differently."""
        x = images["local"]
        return 16 * x.shape[-1] * torch.finfo(x.dtype).eps

    def prepare(self, texts: Payload, images: Payload) -> tuple[Payload, Payload]:
        """Texts moved to the images' device and float precision; nothing normalised (the raw text
        embeddings are the pool's queries)."""
        device, dtype = images["local"].device, images["local"].dtype
        payload_len(texts)
        return {k: v.to(device=device, dtype=dtype) for k, v in texts.items()}, images


@register_scorer("flair_global")
class FlairGlobalScorer(CosineScorer):
    """FLAIR-CLIP: the class token (``encode_image(...).embeds`` of a FLAIR model) against the text, by
    cosine; for other models the same as ``cosine``."""
