"""Recall@K of a model on evaluation sets (:func:`evaluate_sets`): each set loaded (or taken as loaded by a run's
checks), encoded (:func:`finetune.evaluation.encode.encode_for_retrieval`) and ranked under the recipe's scorer
(:func:`finetune.evaluation.retrieval.recall_at_k`); the options of a recipe's ``eval`` section travel as one value
(:class:`RetrievalOptions`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from finetune.data.images import DataError
from finetune.data.protocols import PROTOCOLS, get_protocol
from finetune.data.sources import SourceSpec, load_source
from finetune.evaluation.encode import encode_for_retrieval
from finetune.evaluation.retrieval import DEFAULT_KS, fold_recall, recall_at_k, recall_sum
from finetune.evaluation.scorers import Scorer, get_scorer, payload_len

log = logging.getLogger("xlipkit")

__all__ = ["RetrievalOptions", "evaluate_sets", "set_label"]


@dataclasses.dataclass(frozen=True)
class RetrievalOptions:
    """How :func:`evaluate_sets` evaluates: a recipe's ``eval`` section and the data options it loads sets with.

    Attributes:
        batch_size: rows per forward pass (``eval.batch_size``).
        ks: the cut-offs K (``eval.ks``).
        scorer: ``eval.scorer``: a registered scorer name (``cosine``) or a
            :class:`~finetune.evaluation.scorers.Scorer`.
        rerank_top_k: ``eval.rerank_top_k``: re-score only each query's global-cosine top-k; None: all.
        block_size: ``eval.block_size``: texts x images per score block.
        on_error: ``data.on_error`` for the sets' images (``skip`` or ``raise``).
        cache_dir: ``data.cache_dir``, passed to ``load_source``.
        num_workers: data-loader workers that fetch rows while encoding.
        progress: progress bars while encoding (main process only).
    """

    batch_size: int = 64
    ks: Sequence[int] = DEFAULT_KS
    scorer: str | Scorer = "cosine"
    rerank_top_k: int | None = None
    block_size: int = 1024
    on_error: str = "skip"
    cache_dir: str | None = None
    num_workers: int = 0
    progress: bool = True

    @classmethod
    def from_recipe(cls, recipe: Any, **changes: Any) -> RetrievalOptions:
        """The options of a loaded :class:`finetune.config.Recipe` (its ``eval`` section, ``data.on_error`` and
        ``data.cache_dir``; the scorer built once), with ``changes`` (fields) applied."""
        ev = recipe.eval
        options = cls(batch_size=ev.batch_size, ks=tuple(ev.ks), scorer=get_scorer(ev.scorer),
                      rerank_top_k=ev.rerank_top_k, block_size=ev.block_size, on_error=recipe.data.on_error,
                      cache_dir=recipe.data.cache_dir)
        return dataclasses.replace(options, **changes)


def set_label(spec: Any) -> str:
    """The name a set's results go under: ``name`` or ``name:protocol``.

    Args:
        spec: a :class:`finetune.data.sources.SourceSpec` (a recipe's ``eval.sets`` entry), or what
            ``SourceSpec.parse`` accepts (``"docci:goal"``, a mapping).
    """
    spec = SourceSpec.parse(spec)
    return f"{spec.name}:{spec.protocol}" if spec.protocol else str(spec.name)


def evaluate_sets(model: Any, sets: Sequence[Any], options: RetrievalOptions | None = None, *,
                  accelerator: Any = None, sources: Sequence[Any] | None = None,
                  **changes: Any) -> dict[str, dict[str, Any]]:
    """Recall@K of ``model`` on each evaluation set (loaded with ``finetune.data.sources.load_source``).

    Args:
        model: a DualEncoder.
        sets: ``SourceSpec`` objects, mappings with its keys, or names (``docci``, ``docci:goal``).
        options: how to evaluate (:class:`RetrievalOptions`; default: its defaults).
        accelerator: an ``accelerate.Accelerator`` (device, autocast, one shard per process), or None.
        sources: the sets already loaded (``LoadedSource``, one per entry of ``sets``, e.g. by a
            run's checks before the model loads); None: each set is loaded here.
        changes: :class:`RetrievalOptions` fields that replace those of ``options``
            (``evaluate_sets(model, sets, batch_size=8, ks=(1, 5))``).

    Raises:
        TypeError: a keyword that is no :class:`RetrievalOptions` field.
        ValueError: for an unknown scorer (before any set is loaded), naming the registered ones.
        DataError: naming the set, when it cannot be loaded (unknown name or protocol, missing
            files); bad examples with ``on_error="raise"``.

    Returns:
        ``{label: {"protocol", "n_images", "n_texts", "t2i", "i2t", "truncated", "skipped", "scorer"}}``
        where ``label`` is :func:`set_label` (a repeated label gets ``#2``, ``#3`` ...) and ``scorer``
        names the scorer (with ``@top{k}`` under ``rerank_top_k``).
    """
    options = dataclasses.replace(options or RetrievalOptions(), **changes)
    options = dataclasses.replace(options, scorer=get_scorer(options.scorer))
    if sources is not None and len(sources) != len(sets):
        raise ValueError(f"evaluate_sets: {len(sources)} loaded sources for {len(sets)} sets")
    results: dict[str, dict[str, Any]] = {}
    for number, spec in enumerate(sets):
        spec = SourceSpec.parse(spec)  # a recipe's entries are typed already; names and mappings from code
        label = set_label(spec)
        if label in results:
            n = 2
            while f"{label}#{n}" in results:
                n += 1
            label = f"{label}#{n}"
        source = sources[number] if sources is not None else _load(spec, label, options, accelerator)
        results[label] = _evaluate_set(model, source, label, options, accelerator)
    return results


def _load(spec: SourceSpec, label: str, options: RetrievalOptions, accelerator: Any) -> Any:
    """Load one set (the main process first: a download or a cache is made once)."""
    ctx = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
    with ctx:
        try:
            return load_source(spec, on_error=options.on_error, cache_dir=options.cache_dir)
        except (DataError, OSError) as exc:  # say which set: builders' messages may not
            raise DataError(f"evaluation set {label!r} could not be loaded: {exc}") from exc


def _evaluate_set(model: Any, source: Any, label: str, options: RetrievalOptions,
                  accelerator: Any) -> dict[str, Any]:
    """The results of one loaded set (an entry of :func:`evaluate_sets`)."""
    scorer, rerank_top_k = options.scorer, options.rerank_top_k
    emb = encode_for_retrieval(model, source.dataset, batch_size=options.batch_size, accelerator=accelerator,
                               num_workers=options.num_workers, progress=options.progress and f"eval {label}",
                               scorer=scorer, on_error=options.on_error)
    folds = _protocol_folds(source)
    ranking = dict(block_size=options.block_size, scorer=scorer, rerank_top_k=rerank_top_k)
    if folds:
        metrics = fold_recall(emb.image_payload, emb.text_payload, emb.text_to_image, options.ks, folds, **ranking)
    else:
        metrics = recall_at_k(emb.image_payload, emb.text_payload, emb.text_to_image, options.ks, **ranking)
    result = {
        "protocol": getattr(source, "protocol", None) or "default",
        "n_images": payload_len(emb.image_payload),
        "n_texts": int(emb.text_to_image.shape[0]),
        "t2i": metrics["t2i"],
        "i2t": metrics["i2t"],
        "truncated": emb.truncated,
        "skipped": int(getattr(source, "skipped", 0) or 0) + len(emb.skipped_examples),
        "scorer": (scorer.name or type(scorer).__name__) + (f"@top{rerank_top_k}" if rerank_top_k else ""),
    }
    if folds:
        result["folds"] = folds
    rsum = recall_sum(metrics)
    if rsum is not None:
        result["rsum"] = rsum
    skipped_ids = [*(getattr(source, "skipped_ids", None) or []), *(e["id"] for e in emb.skipped_examples)]
    if skipped_ids:
        result["skipped_ids"] = skipped_ids
    log.info("eval %s: %d images, %d texts, %d captions truncated; t2i %s; i2t %s", label, result["n_images"],
             result["n_texts"], emb.truncated, metrics["t2i"], metrics["i2t"])
    return result


def _protocol_folds(source: Any) -> int | None:
    """The folds of a set's protocol (COCO 1K: 5), or None."""
    name, protocol = getattr(source, "name", None), getattr(source, "protocol", None)
    if getattr(source, "split", None) is not None or name not in PROTOCOLS or protocol is None:
        return None
    return get_protocol(name, protocol).folds
