"""Retrieval evaluation: text-to-image and image-to-text Recall@K, before and after training.

``recall_at_k`` is the metric of the long-caption retrieval papers (Long-CLIP 4.2, StructXLIP 4,
FAST-GOAL IV, FLAIR 4, F-CAST 4): the percentage of queries whose ground truth is among the K
best-scoring items under the recipe's scorer (``eval.scorer``, cosine similarity by default;
``finetune.scorers``). Several captions per image are supported (COCO,
Flickr30k): a text query has one correct image; an image query is answered by its best-ranked
caption. The similarity matrix is never materialised: it is computed block by block
(``eval.block_size``), so memory stays bounded for 100k items; ``eval.rerank_top_k`` re-scores only
each query's global-cosine top-k.

Its command line (:mod:`finetune.cli.evaluate`) re-evaluates a run folder or any model ``load_model``
accepts::

    python -m finetune.evaluate runs/quickstart
    python -m finetune.evaluate openai/clip-vit-base-patch16 --sets docci,urban1k --max-text-len 248
    xlipkit eval runs/quickstart
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from finetune.scorers import Scorer

log = logging.getLogger("xlipkit")

DEFAULT_KS: tuple[int, ...] = (1, 5, 10, 25, 50)

__all__ = [
    "DEFAULT_KS",
    "RetrievalEmbeddings",
    "encode_for_retrieval",
    "evaluate_sets",
    "format_table",
    "main",
    "recall_at_k",
    "set_label",
]


# -- the metric -----------------------------------------------------------------------------------
def _check_inputs(image_embeds: Any, text_embeds: Any, text_to_image: Tensor, ks: Sequence[int],
                  block_size: int) -> tuple[int, int]:
    """Validate the inputs of :func:`recall_at_k`; returns ``(n_images, n_texts)``."""
    from finetune.scorers import payload_len

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
    :func:`finetune.scorers.retrieval_ranks`). Works on any device; cosine is computed in float32
    (float64 inputs stay float64) without TF32 or autocast.

    Args:
        image_embeds: ``(Ni, D)`` raw image embeddings (normalised by the cosine scorer), or the image
            payload of ``scorer`` (``encode_for_retrieval(...).image_payload``).
        text_embeds: ``(Nt, D)`` raw text embeddings, or the text payload.
        text_to_image: ``(Nt,)`` long, the index of each text's image.
        ks: the cut-offs K.
        block_size: texts and images per score block.
        scorer: a registered scorer name or a :class:`finetune.scorers.Scorer`.
        rerank_top_k: re-score only each query's global-cosine top-k (FLAIR's inference); None: all.
        chunk_size: the former name of ``block_size`` (used when given).

    Returns:
        ``{"t2i": {"R@1": pct, ...}, "i2t": {"R@1": pct, ...}}``.

    Raises:
        ValueError: on mismatched shapes, out-of-range indices, non-positive K, non-finite embeddings
            or an unknown scorer.
    """
    from finetune.scorers import get_scorer, recall_from_ranks, retrieval_ranks

    if chunk_size is not None:
        block_size = chunk_size
    _check_inputs(image_embeds, text_embeds, text_to_image, ks, block_size)
    scorer = get_scorer(scorer)
    images = {"embeds": image_embeds} if isinstance(image_embeds, Tensor) else dict(image_embeds)
    texts = {"embeds": text_embeds} if isinstance(text_embeds, Tensor) else dict(text_embeds)
    ranks = retrieval_ranks(scorer, texts, images, text_to_image, block_size=block_size,
                            rerank_top_k=rerank_top_k)
    return recall_from_ranks(ranks, ks)


# -- encoding -------------------------------------------------------------------------------------
class RetrievalEmbeddings(NamedTuple):
    """What :func:`encode_for_retrieval` returns (a tuple: unpack it or use the names).

    Attributes:
        image_embeds: ``(Ni, D)`` float32 image embeddings, in dataset order (the payload's
            ``embeds``; None when the scorer keeps none).
        text_embeds: ``(Nt, D)`` float32 text embeddings, the captions of each row in order (or None).
        text_to_image: ``(Nt,)`` long, the row (image) of each text.
        truncated: how many captions were longer than the model's text length and were cut.
        image_payload: what the scorer keeps per image (``{"embeds": (Ni, D)}`` for cosine).
        text_payload: what the scorer keeps per text.
        skipped_examples: rows left out because their image could not be decoded
            (``on_error="skip"``), as ``{"id", "path", "reason"}``, from every process.
    """

    image_embeds: Tensor | None
    text_embeds: Tensor | None
    text_to_image: Tensor
    truncated: int
    image_payload: dict[str, Tensor] | None = None
    text_payload: dict[str, Tensor] | None = None
    skipped_examples: list = []


def _rows(batch: list[Any]) -> list[Any]:
    """DataLoader collate: keep the rows as they are (images are read in the main loop)."""
    return batch


def _row_captions(row: Mapping[str, Any], index: int) -> list[str]:
    from finetune.data.images import DataError

    captions = row.get("captions")
    if captions is None or (isinstance(captions, (list, tuple)) and len(captions) == 0):
        captions = [row.get("caption")]
    if isinstance(captions, str):
        captions = [captions]
    bad = [c for c in captions if not isinstance(c, str) or not c.strip()]
    if bad:
        raise DataError(f"evaluation example {row.get('id', index)!r} has an empty or missing caption "
                         f"({bad[0]!r}); fix the data or load it with on_error='skip'")
    return list(captions)


def _row_image(row: Mapping[str, Any], index: int) -> Any:
    from finetune.data.images import DataError, read_image

    if row.get("image") is None:
        raise DataError(f"evaluation example {row.get('id', index)!r} has no image; fix the data or load it "
                        f"with on_error='skip'")
    try:
        return read_image(row["image"])
    except DataError as exc:
        raise DataError(f"evaluation example {row.get('id', index)!r}: {exc}") from exc


def _shard(dataset: Any, rank: int, world: int) -> tuple[Any, int]:
    """The contiguous part ``[start, end)`` of ``dataset`` that process ``rank`` encodes."""
    n = len(dataset)
    start, end = n * rank // world, n * (rank + 1) // world
    if hasattr(dataset, "select"):  # datasets.Dataset: no copy, keeps lazy image decoding
        return dataset.select(range(start, end)), start
    return torch.utils.data.Subset(dataset, range(start, end)), start


def _gather_payload(accelerator: Any, chunks: list[dict[str, Tensor]], device: torch.device) -> dict[str, Tensor]:
    """Concatenate a process's per-batch payloads and gather all processes' in rank order.

    Trailing dims are zero-padded to the largest over batches and processes; a process with an
    empty shard takes the keys, shapes and dtypes from the others.
    """
    from finetune.scorers import concat_payloads, pad_trailing

    local = concat_payloads(chunks) if chunks else {}
    if accelerator is None or accelerator.num_processes == 1:
        return local
    from accelerate.utils import gather_object

    schemas = [s for s in gather_object([{k: (tuple(v.shape[1:]), v.dtype) for k, v in local.items()}]) if s]
    if not schemas:  # an empty set: recall_at_k says "nothing to rank"
        return {}
    out = {}
    for key in schemas[0]:
        shapes = [s[key][0] for s in schemas]
        shape = [max(sizes) for sizes in zip(*shapes)]
        x = local[key] if key in local else torch.zeros((0, *shape), dtype=schemas[0][key][1], device=device)
        out[key] = _gather_rows(accelerator, pad_trailing(x, shape))
    return out


def _gather_rows(accelerator: Any, x: Tensor) -> Tensor:
    """Concatenate the ``(n_rank, ...)`` tensors of all processes in rank order (sizes may differ).

    ``accelerator.gather`` needs equal shapes, so rows are padded and the padding cut afterwards;
    ``gather_for_metrics`` is not used because its de-duplication assumes a prepared dataloader.
    """
    if accelerator is None or accelerator.num_processes == 1:
        return x
    sizes = accelerator.gather(torch.tensor([x.shape[0]], device=accelerator.device)).tolist()
    padded = accelerator.pad_across_processes(x.contiguous(), dim=0)
    gathered = accelerator.gather(padded)
    per = gathered.shape[0] // accelerator.num_processes
    return torch.cat([gathered[r * per: r * per + n] for r, n in enumerate(sizes)])


def _to_device(inputs: Mapping[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    for key, value in inputs.items():
        if isinstance(value, Tensor):
            value = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        out[key] = value
    return out


@torch.inference_mode()
def encode_for_retrieval(
    model: Any,
    dataset: Any,
    *,
    batch_size: int,
    accelerator: Any = None,
    num_workers: int = 0,
    progress: bool = False,
    desc: str = "encode",
    scorer: str | Scorer = "cosine",
    on_error: str = "raise",
) -> RetrievalEmbeddings:
    """Encode every image and caption of an evaluation set with a DualEncoder, into the payloads of
    ``scorer`` (``finetune.scorers``; cosine keeps the global embeddings).

    Uses only the encoder interface (DESIGN 4): ``preprocess_images(list[PIL]) -> dict`` (holds
    ``pixel_values`` and any other ``encode_image`` keyword), ``tokenize(list[str]) ->
    TokenizedText``, and what the scorer calls (``encode_image(**inputs).embeds`` and
    ``encode_text(ids, mask).embeds`` for cosine).
    Rows have ``image`` (a PIL image, or a path / bytes / ``{"bytes", "path"}`` read with
    ``finetune.data.images.read_image``) and ``caption``, or ``captions`` (a list) for sets with
    several captions per image. The model is put in eval mode for the call and restored after.

    Under an ``accelerator`` with several processes each process encodes a contiguous shard and
    the embeddings are gathered, so every process returns the whole set in dataset order.

    Args:
        model: a DualEncoder (or an Accelerate-wrapped one; it is unwrapped).
        dataset: a ``datasets.Dataset`` or any sequence of row mappings.
        batch_size: rows per forward pass: every image and text pass has exactly this many (the last ones filled),
            texts at the model's fixed length, so that evaluation brings no new shape after its first batch.
        accelerator: an ``accelerate.Accelerator`` (device, autocast, sharding), or None.
        num_workers: DataLoader workers that fetch rows.
        progress: show a progress bar (main process only).
        desc: the progress bar's label.
        scorer: a registered scorer name or a :class:`finetune.scorers.Scorer`.
        on_error: ``"raise"`` (a :class:`~finetune.data.images.DataError` naming the row and the
            file) or ``"skip"`` (leave the row and its captions out, listed in
            ``skipped_examples``) when an image cannot be decoded.

    Returns:
        :class:`RetrievalEmbeddings` ``(image_embeds (Ni, D), text_embeds (Nt, D),
        text_to_image (Nt,), truncated, image_payload, text_payload)``.
    """
    from finetune.scorers import get_scorer

    if batch_size < 1:
        raise ValueError(f"encode_for_retrieval: batch_size must be >= 1, got {batch_size}")
    scorer = get_scorer(scorer)
    dual = accelerator.unwrap_model(model) if accelerator is not None else model
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    from finetune.data.images import DataError
    from finetune.data.skipping import undecoded
    from finetune.objectives.shapes import encode_fixed_rows, fixed_text_columns

    shard, offset = _shard(undecoded(dataset), rank, world)
    device = accelerator.device if accelerator is not None else dual.device
    dtype = dual.dtype
    loader = torch.utils.data.DataLoader(shard, batch_size=batch_size, shuffle=False,
                                         num_workers=num_workers, collate_fn=_rows)
    autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
    show = progress and (accelerator is None or accelerator.is_main_process)
    if show:
        from tqdm.auto import tqdm

        loader = tqdm(loader, desc=desc, unit="batch", leave=False)

    was_training = dual.training
    dual.eval()
    # evaluation captions are not training captions: keep the model's truncation counter as it was
    stats = dict(getattr(dual, "truncation_stats", None) or {})
    image_chunks, text_chunks, owners = [], [], []
    truncated = 0
    row = offset
    kept = 0  # images of this shard encoded so far: the owner index of a caption, before the gather
    skipped: list[dict] = []
    try:
        with autocast:
            for rows in loader:
                images, captions, owner = [], [], []
                for r in rows:
                    try:
                        image = _row_image(r, row)
                    except DataError as exc:
                        if on_error == "raise":
                            raise
                        raw = r.get("image")
                        path = (raw.get("path") if isinstance(raw, Mapping) else None) or "<bytes>"
                        skipped.append({"id": str(r.get("id", row)), "path": path,
                                        "reason": getattr(exc.__cause__, "reason", str(exc))})
                        row += 1
                        continue
                    images.append(image)
                    caps = _row_captions(r, row)
                    captions.extend(caps)
                    owner.extend([kept] * len(caps))
                    kept += 1
                    row += 1
                if not images:
                    continue
                # fixed shapes (finetune.objectives.shapes): every pass batch_size rows, texts at the fixed length
                inputs = _to_device(dual.preprocess_images(images), device, dtype)
                names = list(inputs)
                image_chunks.append(encode_fixed_rows(lambda *t: scorer.encode_images(dual, dict(zip(names, t))),
                                                      [inputs[k] for k in names], batch_size))
                tokens = dual.tokenize(captions)
                ids, mask = fixed_text_columns(dual, tokens.input_ids.to(device), tokens.attention_mask.to(device))
                text_chunks.append(encode_fixed_rows(lambda i, m: scorer.encode_texts(dual, i, m), [ids, mask],
                                                     batch_size))
                truncated += int(tokens.truncated.sum())
                owners.append(torch.tensor(owner, dtype=torch.long, device=device))
    finally:
        dual.train(was_training)
        if stats:
            dual.truncation_stats = stats

    if accelerator is not None and world > 1:
        truncated = int(accelerator.gather(torch.tensor([truncated], device=device)).sum())
        # captions point at images by position in the gathered order: shift by the earlier shards' images
        counts = accelerator.gather(torch.tensor([kept], device=device)).tolist()
        owners = [o + sum(counts[:rank]) for o in owners]
        from accelerate.utils import gather_object

        skipped = [e for part in gather_object([skipped]) for e in part]
    image_payload = _gather_payload(accelerator, image_chunks, device)
    text_payload = _gather_payload(accelerator, text_chunks, device)
    owners = owners or [torch.zeros((0,), dtype=torch.long, device=device)]
    text_to_image = _gather_rows(accelerator, torch.cat(owners))
    return RetrievalEmbeddings(image_payload.get("embeds"), text_payload.get("embeds"), text_to_image, truncated,
                               image_payload, text_payload, skipped)


# -- evaluation sets ------------------------------------------------------------------------------
def set_label(spec: Any) -> str:
    """The name a set's results go under: ``name`` or ``name:protocol``.

    Args:
        spec: a :class:`finetune.data.sources.SourceSpec` (a recipe's ``eval.sets`` entry), or what
            ``SourceSpec.parse`` accepts (``"docci:goal"``, a mapping).
    """
    from finetune.data.sources import SourceSpec

    spec = SourceSpec.parse(spec)
    return f"{spec.name}:{spec.protocol}" if spec.protocol else str(spec.name)


def evaluate_sets(
    model: Any,
    sets: Sequence[Any],
    *,
    batch_size: int = 64,
    ks: Sequence[int] = DEFAULT_KS,
    on_error: str = "skip",
    cache_dir: str | None = None,
    accelerator: Any = None,
    num_workers: int = 0,
    progress: bool = True,
    scorer: str | Scorer = "cosine",
    rerank_top_k: int | None = None,
    block_size: int = 1024,
    sources: Sequence[Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Recall@K of ``model`` on each evaluation set (loaded with ``finetune.data.sources.load_source``).

    Args:
        model: a DualEncoder.
        sets: ``SourceSpec`` objects, mappings with its keys, or names (``docci``, ``docci:goal``).
        batch_size, ks, accelerator, num_workers: as in :func:`encode_for_retrieval` and
            :func:`recall_at_k`.
        on_error, cache_dir: passed to ``load_source``.
        progress: progress bars while encoding.
        scorer: ``eval.scorer``: a registered scorer name (``cosine``) or a
            :class:`finetune.scorers.Scorer`.
        rerank_top_k: ``eval.rerank_top_k``: re-score only each query's global-cosine top-k.
        block_size: ``eval.block_size``: texts x images per score block.
        sources: the sets already loaded (``LoadedSource``, one per entry of ``sets``, e.g. by a
            run's checks before the model loads); None: each set is loaded here.

    Raises:
        ValueError: for an unknown scorer (before any set is loaded), naming the registered ones.
        DataError: naming the set, when it cannot be loaded (unknown name or protocol, missing
            files); bad examples with ``on_error="raise"``.

    Returns:
        ``{label: {"protocol", "n_images", "n_texts", "t2i", "i2t", "truncated", "skipped", "scorer"}}``
        where ``label`` is :func:`set_label` (a repeated label gets ``#2``, ``#3`` ...) and ``scorer``
        names the scorer (with ``@top{k}`` under ``rerank_top_k``).
    """
    from finetune.data.images import DataError
    from finetune.data.sources import SourceSpec, load_source
    from finetune.scorers import get_scorer, payload_len

    scorer = get_scorer(scorer)
    scorer_label = (scorer.name or type(scorer).__name__) + (f"@top{rerank_top_k}" if rerank_top_k else "")

    results: dict[str, dict[str, Any]] = {}
    if sources is not None and len(sources) != len(sets):
        raise ValueError(f"evaluate_sets: {len(sources)} loaded sources for {len(sets)} sets")
    for number, spec in enumerate(sets):
        spec = SourceSpec.parse(spec)  # a recipe's entries are typed already; names and mappings from code
        label = set_label(spec)
        if label in results:
            n = 2
            while f"{label}#{n}" in results:
                n += 1
            label = f"{label}#{n}"
        ctx = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
        if sources is not None:
            source = sources[number]
        else:
            with ctx:
                try:
                    source = load_source(spec, on_error=on_error, cache_dir=cache_dir)
                except (DataError, OSError) as exc:  # say which set: builders' messages may not
                    raise DataError(f"evaluation set {label!r} could not be loaded: {exc}") from exc
        emb = encode_for_retrieval(model, source.dataset, batch_size=batch_size, accelerator=accelerator,
                                   num_workers=num_workers, progress=progress, desc=f"eval {label}",
                                   scorer=scorer, on_error=on_error)
        folds = _protocol_folds(source)
        if folds:
            metrics = fold_recall(emb.image_payload, emb.text_payload, emb.text_to_image, ks, folds,
                                  block_size=block_size, scorer=scorer, rerank_top_k=rerank_top_k)
        else:
            metrics = recall_at_k(emb.image_payload, emb.text_payload, emb.text_to_image, ks, block_size=block_size,
                                  scorer=scorer, rerank_top_k=rerank_top_k)
        results[label] = {
            "protocol": getattr(source, "protocol", None) or "default",
            "n_images": payload_len(emb.image_payload),
            "n_texts": int(emb.text_to_image.shape[0]),
            "t2i": metrics["t2i"],
            "i2t": metrics["i2t"],
            "truncated": emb.truncated,
            "skipped": int(getattr(source, "skipped", 0) or 0) + len(emb.skipped_examples),
            "scorer": scorer_label,
        }
        if folds:
            results[label]["folds"] = folds
        rsum = recall_sum(metrics)
        if rsum is not None:
            results[label]["rsum"] = rsum
        skipped_ids = [*(getattr(source, "skipped_ids", None) or []), *(e["id"] for e in emb.skipped_examples)]
        if skipped_ids:
            results[label]["skipped_ids"] = skipped_ids
        log.info("eval %s: %d images, %d texts, %d captions truncated; t2i %s; i2t %s", label,
                 results[label]["n_images"], results[label]["n_texts"], emb.truncated,
                 metrics["t2i"], metrics["i2t"])
    return results


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


def _protocol_folds(source: Any) -> int | None:
    from finetune.data.protocols import PROTOCOLS, get_protocol

    name, protocol = getattr(source, "name", None), getattr(source, "protocol", None)
    if getattr(source, "split", None) is not None or name not in PROTOCOLS or protocol is None:
        return None
    return get_protocol(name, protocol).folds


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
    from finetune.scorers import payload_len, take

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


def __getattr__(name: str) -> Any:
    # ``finetune.evaluate.main``, the command line before it moved to finetune.cli.evaluate; imported by name on
    # first use so that this library does not import its own command line (which imports the library)
    if name == "main":
        import importlib

        return importlib.import_module("finetune.cli.evaluate").main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # python -m finetune.evaluate ...
    import runpy

    runpy.run_module("finetune.cli.evaluate", run_name="__main__", alter_sys=True)
