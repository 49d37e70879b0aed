"""Fixed batch shapes (issue 29 item 1): the shapes of every text and image pass of a training step are decided
before training, so that after the first steps no step brings a new shape.

A new (rows, length) shape costs a GPU run more than its FLOPs: PyTorch's cuDNN attention (its first choice on
sm90 with cuDNN >= 9.15) builds a graph for it, and a compiled block or a CUDA graph is recompiled or
re-recorded for it. So a run's passes take their shapes from :class:`BatchShapes`:

- **columns**: text requests are padded on the right to one of two lengths: ``text_length`` (the model's
  ``max_text_len``) for captions and the texts like them, ``short_length`` for the requests a term marks as
  short (StructXLIP's chunks, FAST-GOAL's sentences, Long-CLIP's first sentences). ``short_length`` is the
  longest such text of the training set (tokenised before training by :func:`plan_shapes`), rounded up to a
  multiple of :data:`LENGTH_ALIGN`; towers that read their padding (SigLIP pools the last position, trained on
  captions padded to the full length) and streamed data use ``text_length`` for all. Right padding does not
  change a causal (CLIP) tower's embedding, and towers with a padding mask ignore it;
- **rows**: every request has a fixed number of rows per sample: one caption, one filtered caption, ``k``
  sentences, ``K`` sub-captions, and for the requests whose count varies per sample (StructXLIP's chunks and
  region crops) a capacity per sample (:attr:`BatchShapes.capacities`) with a validity mask, so that a
  micro-batch of ``b`` samples always has ``b * capacity`` rows. Padded rows take no part in the losses.

With at most two text lengths the text tower runs in at most two passes per step (one per length: the requests
of one length go through it together), and the image tower in one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("xlipkit")

#: short text lengths are rounded up to a multiple of this (tensor-core tiles; a few more padded tokens)
LENGTH_ALIGN = 8
#: texts tokenised per call when the training set's short texts are measured
SCAN_CHUNK = 4096


@dataclass(frozen=True)
class ShapeScan:
    """What a term needs fixed before training (:meth:`~finetune.objectives.base.Term.shape_scan`).

    Attributes:
        short_texts: every text its short requests will tokenise over the training set (their longest sets
            :attr:`BatchShapes.short_length`).
        capacities: ``{name: most rows per sample}`` of its requests whose count varies per sample.
    """

    short_texts: tuple[str, ...] = ()
    capacities: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchShapes:
    """The fixed shapes of a run's passes (module docstring).

    Attributes:
        text_length: columns of every text request that is not short (captions), ``max_text_len``.
        short_length: columns of short text requests (``<= text_length``).
        capacities: rows per sample of the requests whose count varies (``structxlip/chunks``, ...).
    """

    text_length: int
    short_length: int
    capacities: Mapping[str, int] = field(default_factory=dict)

    def capacity(self, name: str) -> int | None:
        """The rows per sample of ``name``, or None when nothing fixed it."""
        return self.capacities.get(name)

    def length(self, short: bool) -> int:
        """Columns of a short or of a long text request."""
        return self.short_length if short else self.text_length

    def summary(self) -> dict[str, Any]:
        """What the log and ``metrics.json`` record."""
        return {"text_length": self.text_length, "short_length": self.short_length,
                "capacities": dict(sorted(self.capacities.items()))}


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-int(n) // multiple) * multiple


def is_causal_tower(model: Any) -> bool:
    """Whether ``model``'s text tower pools the end token under a causal mask (CLIP family), so that right padding
    never changes an embedding and short texts may take fewer columns than captions."""
    return getattr(model, "family", "clip") == "clip"


def longest_tokens(model: Any, texts: Iterable[str]) -> int:
    """The most tokens ``model.tokenize`` gives any of ``texts`` (0 for none), without counting them in the model's
    truncation statistics (they are not training captions)."""
    texts = list(texts)
    stats = dict(getattr(model, "truncation_stats", None) or {})
    longest = 0
    try:
        for start in range(0, len(texts), SCAN_CHUNK):
            mask = model.tokenize(texts[start:start + SCAN_CHUNK]).attention_mask
            if mask.numel():
                longest = max(longest, int(mask.sum(dim=1).max()))
    finally:
        if stats:
            model.truncation_stats = stats
    return longest


def plan_shapes(objective: Any, model: Any, dataset: Any = None) -> BatchShapes:
    """The :class:`BatchShapes` of a run, decided before training from the model and, for map-style data, the
    training set after the objective's preprocessing (each term's :meth:`~finetune.objectives.base.Term.shape_scan`).

    Args:
        objective: the run's :class:`~finetune.objectives.base.Objective`.
        model: the DualEncoder being trained.
        dataset: the preprocessed training set (``len`` and rows), or None / a stream: then no text is scanned and
            short requests take ``text_length``.
    """
    text_length = int(model.max_text_len)
    streamed = (dataset is None or isinstance(dataset, torch.utils.data.IterableDataset)
                or not hasattr(dataset, "__len__"))
    rows = None if streamed else dataset
    short_texts: list[str] = []
    capacities: dict[str, int] = {}
    for term in objective.all_terms:
        scan = term.shape_scan(rows, model)
        if scan is None:
            continue
        short_texts += scan.short_texts
        for name, value in scan.capacities.items():
            capacities[name] = max(int(value), capacities.get(name, 0))
    short_length = text_length
    if short_texts and is_causal_tower(model):
        short_length = min(text_length, round_up(max(longest_tokens(model, short_texts), 1), LENGTH_ALIGN))
    return BatchShapes(text_length, short_length, capacities)


def pad_columns(ids: Tensor, mask: Tensor, length: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad ``(n, L)`` ids and mask to ``(n, length)`` (``length >= L``; unchanged when equal)."""
    extra = length - ids.shape[-1]
    if extra < 0:
        raise ValueError(f"cannot pad {ids.shape[-1]} token columns down to {length}")
    if not extra:
        return ids, mask
    return (torch.nn.functional.pad(ids, (0, extra), value=pad_id),
            torch.nn.functional.pad(mask, (0, extra), value=0))


def pad_rows(t: Tensor, rows: int, fill: Tensor | float = 0) -> Tensor:
    """``t`` ``(n, ...)`` with rows appended up to ``(rows, ...)``: copies of ``fill`` (a ``(...)`` row) or a
    constant. ``n > rows`` is an error (the capacity was planned too small)."""
    n = t.shape[0]
    if n > rows:
        raise ValueError(f"{n} rows exceed the planned capacity of {rows}")
    if n == rows:
        return t
    if isinstance(fill, Tensor):
        extra = fill.to(dtype=t.dtype, device=t.device).expand(rows - n, *t.shape[1:])
    else:
        extra = t.new_full((rows - n, *t.shape[1:]), fill)
    return torch.cat([t, extra])


def pad_token_id(model: Any) -> int:
    """The id the model's tokenizer pads with (0 when it has none)."""
    return getattr(getattr(model, "tokenizer", None), "pad_token_id", None) or 0


def dataset_columns(dataset: Any, names: Iterable[str]) -> dict[str, list] | None:
    """The columns ``names`` of a map-style training set as lists, read without decoding images: from the
    ``datasets.Dataset`` inside wrappers (``SkippingDataset``, ``EpochIndexed``: their ``.dataset``), else row by row.
    None when ``dataset`` is None or lacks a column."""
    names = list(names)
    if dataset is None:
        return None
    base = dataset
    while not hasattr(base, "select_columns") and hasattr(base, "dataset"):
        base = base.dataset
    if hasattr(base, "select_columns"):
        if any(n not in base.column_names for n in names):
            return None
        return base.select_columns(names).to_dict()
    rows = [dataset[i] for i in range(len(dataset))]
    if any(n not in row for row in rows for n in names):
        return None
    return {n: [row[n] for row in rows] for n in names}


def empty_text_row(model: Any) -> tuple[Tensor, Tensor]:
    """The token ids and mask ``(L0,)`` of the empty text (start and end tokens): what padded text rows hold, so
    that they run through the tower like any text (a row of padding alone could give NaN under a padding mask).
    Not counted in the model's truncation statistics."""
    stats = dict(getattr(model, "truncation_stats", None) or {})
    try:
        tok = model.tokenize([""])
    finally:
        if stats:
            model.truncation_stats = stats
    keep = max(int(tok.attention_mask[0].sum()), 1)
    return tok.input_ids[0, :keep], tok.attention_mask[0, :keep]


def encode_fixed_rows(encode: Callable[..., Mapping[str, Tensor]], inputs: Sequence[Tensor], rows: int
                      ) -> dict[str, Tensor]:
    """``encode(*inputs)`` run on passes of exactly ``rows`` rows (evaluation: every pass one shape): the inputs
    ``(n, ...)`` are cut into chunks of ``rows``, the last one filled with copies of its first row, and the payloads
    (``{key: (rows, ...)}``) cut back to the real rows and concatenated: ``{key: (n, ...)}``."""
    n = inputs[0].shape[0]
    parts = []
    for start in range(0, n, rows):
        chunk = [t[start:start + rows] for t in inputs]
        real = chunk[0].shape[0]
        out = encode(*(pad_rows(t, rows, t[0]) for t in chunk))
        parts.append({k: v[:real] for k, v in out.items()})
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}


def fixed_text_columns(model: Any, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Token rows right-padded to the model's fixed text length (``max_text_len``, or the width its tokenizer always
    gives when wider: F-CAST's N x 77 chunks), so that every evaluation text pass has one shape."""
    length = max(int(getattr(model, "max_text_len", 0) or 0), int(ids.shape[-1]))
    return pad_columns(ids, mask, length, pad_token_id(model))
