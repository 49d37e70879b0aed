"""The cosine scorer (CLIP, SigLIP; the default ``eval.scorer``), registered as ``cosine``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from finetune.evaluation.scorers.base import Payload, Scorer, register_scorer

__all__ = ["CosineScorer"]


@register_scorer("cosine")
class CosineScorer(Scorer):
    """Cosine similarity of the global embeddings (CLIP, SigLIP; the default ``eval.scorer``).

    Payloads are the raw ``(N, D)`` float32 embeddings; :meth:`prepare` L2-normalises both sides in
    float32 (float64 when the images are float64), so ``score`` is ``texts @ images.T``.
    """

    def prepare(self, texts: Payload, images: Payload) -> tuple[Payload, Payload]:
        """L2-normalise ``embeds`` of both sides, in the image embeddings' float precision."""
        dtype = torch.float64 if images["embeds"].dtype == torch.float64 else torch.float32
        device = images["embeds"].device
        return ({"embeds": F.normalize(texts["embeds"].to(device=device, dtype=dtype), dim=-1)},
                {"embeds": F.normalize(images["embeds"].to(dtype), dim=-1)})

    def score(self, texts: Payload, images: Payload) -> Tensor:
        """``(Tt, Ti)`` cosine: ``texts @ images.T`` of the normalised embeddings."""
        return texts["embeds"] @ images["embeds"].T

    def score_pairs(self, texts: Payload, images: Payload) -> Tensor:
        """``(n,)`` elementwise dot products."""
        return (texts["embeds"] * images["embeds"]).sum(-1)

    def score_candidates(self, queries: Payload, items: Payload, candidates: Tensor, *,
                         query_side: str) -> Tensor:
        """``(Q, K)`` batched dot products with the gathered candidate embeddings."""
        return torch.einsum("qd,qkd->qk", queries["embeds"], items["embeds"][candidates])

    def tie_tolerance(self, texts: Payload, images: Payload) -> float:
        """``D * eps``: the float rounding bound of a dot product of unit vectors (6e-5 for D = 512),
        so a matmul score and an elementwise score of the same pair compare as equal."""
        x = images["embeds"]
        return x.shape[-1] * torch.finfo(x.dtype).eps
