"""Evaluation: retrieval Recall@K before and after training, zero-shot classification, the scorers ranking reads,
and the run report.

- :mod:`~finetune.evaluation.retrieval`: Recall@K (:func:`recall_at_k`), rSum, COCO's 5 folds, the results table;
- :mod:`~finetune.evaluation.encode`: an evaluation set through a model into a scorer's payloads;
- :mod:`~finetune.evaluation.sets`: Recall@K of a model on a recipe's ``eval.sets`` (:func:`evaluate_sets`);
- :mod:`~finetune.evaluation.zeroshot`: zero-shot classification of an image folder (FLAIR's ImageNet protocol);
- :mod:`~finetune.evaluation.scorers`: how texts and images are scored (``eval.scorer``; cosine, GRM, FLAIR);
- :mod:`~finetune.evaluation.report`: ``report.md`` and the plots of a run folder.

Its command line is :mod:`finetune.cli.evaluate` (``xlipkit eval``, ``python -m finetune.evaluate``)::

    xlipkit eval runs/quickstart
    python -m finetune.evaluate openai/clip-vit-base-patch16 --sets docci,urban1k --max-text-len 248
"""

from __future__ import annotations

from finetune.evaluation.encode import RetrievalEmbeddings, encode_for_retrieval
from finetune.evaluation.retrieval import DEFAULT_KS, fold_recall, format_table, recall_at_k, recall_sum
from finetune.evaluation.sets import RetrievalOptions, evaluate_sets, set_label

__all__ = ["DEFAULT_KS", "RetrievalEmbeddings", "RetrievalOptions", "encode_for_retrieval", "evaluate_sets",
           "fold_recall", "format_table", "recall_at_k", "recall_sum", "set_label"]
