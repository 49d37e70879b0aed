"""Retrieval scorers: how a block of texts is scored against a block of images (DESIGN 4, Seams: Scorers).

One module per scorer, each registering itself (``@register_scorer("name")``, over
:data:`finetune.plugins.SCORERS`, whose first lookup imports every module of this package):

- :mod:`~finetune.evaluation.scorers.base`: payloads, the :class:`Scorer` interface, ``register_scorer`` /
  ``get_scorer``;
- :mod:`~finetune.evaluation.scorers.cosine`: ``cosine``, the global embeddings (the default ``eval.scorer``);
- :mod:`~finetune.evaluation.scorers.grm`: GRM's token-wise scorers (``grm``, ``grm_ori``);
- :mod:`~finetune.evaluation.scorers.flair`: FLAIR's text-conditioned scorers (``flair``, ``flair_global``);
- :mod:`~finetune.evaluation.scorers.ranking`: Recall@K from blocks with any scorer (:func:`retrieval_ranks`).

``from finetune.evaluation.scorers import Scorer, register_scorer, get_scorer, retrieval_ranks, ...``.
"""

from __future__ import annotations

from finetune.evaluation.scorers.base import (
    Payload,
    Scorer,
    available_scorers,
    concat_payloads,
    get_scorer,
    pad_trailing,
    payload_len,
    register_scorer,
    take,
)
from finetune.evaluation.scorers.cosine import CosineScorer
from finetune.evaluation.scorers.ranking import (RetrievalRanks, exact_float32_matmul, recall_from_ranks,
                                                 retrieval_ranks)

__all__ = [
    "CosineScorer",
    "Payload",
    "RetrievalRanks",
    "Scorer",
    "available_scorers",
    "concat_payloads",
    "exact_float32_matmul",
    "get_scorer",
    "pad_trailing",
    "payload_len",
    "recall_from_ranks",
    "register_scorer",
    "retrieval_ranks",
    "take",
]
