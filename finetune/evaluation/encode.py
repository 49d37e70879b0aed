"""Encoding an evaluation set for retrieval (:func:`encode_for_retrieval`): every image and caption through a
DualEncoder into the payloads of the recipe's scorer, sharded over processes and gathered in dataset order, unreadable
images named or skipped."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from accelerate.utils import gather_object
from torch import Tensor
from tqdm.auto import tqdm

from finetune.data.images import DataError, read_image
from finetune.data.skipping import undecoded
from finetune.evaluation.scorers import Scorer, concat_payloads, get_scorer, pad_trailing
from finetune.objectives.shapes import bucketed_text_columns, encode_fixed_rows, encoded_row_chunks

__all__ = ["RetrievalEmbeddings", "encode_for_retrieval"]


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
    local = concat_payloads(chunks) if chunks else {}
    if accelerator is None or accelerator.num_processes == 1:
        return local
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



@dataclass
class _Encoded:
    """What one process encoded of its shard: the scorer's payload chunks, the image of each caption (by position
    among this shard's kept images), the truncated captions and the rows left out."""

    image_chunks: list[dict[str, Tensor]] = field(default_factory=list)
    text_chunks: list[dict[str, Tensor]] = field(default_factory=list)
    owners: list[Tensor] = field(default_factory=list)
    truncated: int = 0
    kept: int = 0
    skipped: list[dict] = field(default_factory=list)


@torch.inference_mode()
def encode_for_retrieval(
    model: Any,
    dataset: Any,
    *,
    batch_size: int,
    accelerator: Any = None,
    num_workers: int = 0,
    progress: bool | str = False,
    scorer: str | Scorer = "cosine",
    on_error: str = "raise",
) -> RetrievalEmbeddings:
    """Encode every image and caption of an evaluation set with a DualEncoder, into the payloads of
    ``scorer`` (:mod:`finetune.evaluation.scorers`; cosine keeps the global embeddings).

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
        progress: show a progress bar (main process only); a string labels it (default ``encode``).
        scorer: a registered scorer name or a :class:`finetune.evaluation.scorers.Scorer`.
        on_error: ``"raise"`` (a :class:`~finetune.data.images.DataError` naming the row and the
            file) or ``"skip"`` (leave the row and its captions out, listed in
            ``skipped_examples``) when an image cannot be decoded.

    Returns:
        :class:`RetrievalEmbeddings` ``(image_embeds (Ni, D), text_embeds (Nt, D),
        text_to_image (Nt,), truncated, image_payload, text_payload)``.
    """
    if batch_size < 1:
        raise ValueError(f"encode_for_retrieval: batch_size must be >= 1, got {batch_size}")
    scorer = get_scorer(scorer)
    dual = accelerator.unwrap_model(model) if accelerator is not None else model
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    shard, offset = _shard(undecoded(dataset), rank, world)
    device = accelerator.device if accelerator is not None else dual.device
    loader = torch.utils.data.DataLoader(shard, batch_size=batch_size, shuffle=False,
                                         num_workers=num_workers, collate_fn=_rows)
    if progress and (accelerator is None or accelerator.is_main_process):
        loader = tqdm(loader, desc=progress if isinstance(progress, str) else "encode", unit="batch", leave=False)
    autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
    was_training = dual.training
    dual.eval()
    # evaluation captions are not training captions: keep the model's truncation counter as it was
    stats = dict(getattr(dual, "truncation_stats", None) or {})
    try:
        with autocast:
            done = _encode_shard(dual, loader, scorer, offset, device, on_error, batch_size)
    finally:
        dual.train(was_training)
        if stats:
            dual.truncation_stats = stats
    owners, truncated, skipped = done.owners, done.truncated, done.skipped
    if accelerator is not None and world > 1:
        truncated = int(accelerator.gather(torch.tensor([truncated], device=device)).sum())
        # captions point at images by position in the gathered order: shift by the earlier shards' images
        counts = accelerator.gather(torch.tensor([done.kept], device=device)).tolist()
        owners = [o + sum(counts[:rank]) for o in owners]
        skipped = [e for part in gather_object([skipped]) for e in part]
    image_payload = _gather_payload(accelerator, done.image_chunks, device)
    text_payload = _gather_payload(accelerator, done.text_chunks, device)
    owners = owners or [torch.zeros((0,), dtype=torch.long, device=device)]
    text_to_image = _gather_rows(accelerator, torch.cat(owners))
    return RetrievalEmbeddings(image_payload.get("embeds"), text_payload.get("embeds"), text_to_image, truncated,
                               image_payload, text_payload, skipped)


def _encode_shard(dual: Any, loader: Any, scorer: Scorer, offset: int, device: torch.device,
                  on_error: str, batch_size: int) -> _Encoded:
    """Encode the batches of one process's shard (rows numbered from ``offset``, for messages) in passes of
    ``batch_size`` rows."""
    done = _Encoded()
    row = offset
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
                done.skipped.append({"id": str(r.get("id", row)), "path": path,
                                     "reason": getattr(exc.__cause__, "reason", str(exc))})
                row += 1
                continue
            images.append(image)
            caps = _row_captions(r, row)
            captions.extend(caps)
            owner.extend([done.kept] * len(caps))
            done.kept += 1
            row += 1
        if not images:
            continue
        # batch shapes (finetune.objectives.shapes): every pass batch_size rows, each text pass at the smallest
        # bucket length that holds its longest caption (chosen on the host, from the tokenizer's mask)
        inputs = _to_device(dual.preprocess_images(images), device, dual.dtype)
        names = list(inputs)
        done.image_chunks.append(encode_fixed_rows(lambda *t: scorer.encode_images(dual, dict(zip(names, t))),
                                                   [inputs[k] for k in names], batch_size))
        tokens = dual.tokenize(captions)
        for start in range(0, len(captions), batch_size):
            ids, mask = bucketed_text_columns(dual, tokens.input_ids[start:start + batch_size],
                                              tokens.attention_mask[start:start + batch_size])
            done.text_chunks += encoded_row_chunks(lambda i, m: scorer.encode_texts(dual, i, m),
                                                   [ids.to(device), mask.to(device)], batch_size)
        done.truncated += int(tokens.truncated.sum())
        done.owners.append(torch.tensor(owner, dtype=torch.long, device=device))
    return done
