"""Batch shapes (issues 29 and 37): every text pass of a training step is padded to one of a few lengths planned
before training, so that after the first steps no step brings a new shape, and a pass computes about what its texts
hold instead of the model's maximum.

A new (rows, length) shape costs a GPU run more than its FLOPs: PyTorch's cuDNN attention (its first choice on
sm90 with cuDNN >= 9.15) builds a graph for it, and a compiled block or a CUDA graph is recompiled or
re-recorded for it. Padding every text to ``max_text_len`` gave one shape but computed mostly padding (the
quickstart's captions fill 97 of 248 columns, COCO's about 13 of BERT's 512). So a run's passes take their shapes
from :class:`BatchShapes`:

- **columns, by length buckets**: the run's lengths (:func:`run_buckets`: ``train.text_buckets``, by default the
  multiples of :data:`BUCKET_STEP` below ``max_text_len`` and ``max_text_len`` itself; under
  ``train.group_by_length`` four lengths per doubling, :func:`grouped_buckets`). The texts of one *kind* go
  through the tower in one pass, padded on the right to the smallest length that holds the pass's longest row:
  :data:`TEXT` (captions and the texts like them: filtered captions, FLAIR's sub-captions, GRM's BERT captions),
  :data:`SHORT` (the requests a term marks as short: StructXLIP's chunks, FAST-GOAL's sentences, Long-CLIP's
  first sentences) and the kinds a term encodes itself (F-CAST's chunks, ``fcast/chunks``). The length is chosen on
  the host where the batch is collated (:meth:`~finetune.objectives.base.Objective.plan`, in the data-loader
  workers), never read from the device. Right padding does not change a causal (CLIP) tower's embedding, and
  towers with a padding mask (BERT) ignore it; towers that read their padding (SigLIP pools the last position,
  trained on captions padded to the full length) keep ``max_text_len`` for every pass;
- **planned lengths**: a map-style training set is scanned once before training (:func:`plan_shapes`: every
  caption and every text a term lists in its :meth:`~finetune.objectives.base.Term.shape_scan`, tokenised), so
  that a kind plans only the buckets some example reaches (the bucket of each example's longest text of that
  kind), each cut down to the longest text that reaches it (:func:`tight_buckets`); kinds whose texts are drawn
  during training (FLAIR's and F-CAST's sub-captions) and streams plan every
  length. The training loop runs every planned length once before its first step (:meth:`BatchShapes.warmup_lengths`,
  run by :meth:`finetune.training.step_setup.StepSetup.warm_up`), so that no later step meets a new shape;
- **rows**: every request has a fixed number of rows per sample: one caption, one filtered caption, ``k``
  sentences, ``K`` sub-captions, and for the requests whose count varies per sample (StructXLIP's chunks and
  region crops) a capacity per sample (:attr:`BatchShapes.capacities`) with a validity mask, so that a
  micro-batch of ``b`` samples always has ``b * capacity`` rows. Padded rows take no part in the losses.

The text tower runs in at most one pass per text kind per step, and the image tower in one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("xlipkit")

#: the default bucket lengths are the multiples of this below ``max_text_len`` (tensor-core tiles;
#: ``train.text_buckets`` sets other lengths)
BUCKET_STEP = 32
#: a planned length is the longest text reaching its bucket rounded up to a multiple of this (:func:`tight_buckets`)
LENGTH_ALIGN = 8
#: texts tokenised per call when the training set's texts are measured
SCAN_CHUNK = 4096
#: the text kinds of the objective's requests: captions and the texts like them, and short texts
TEXT, SHORT = "text", "short"
#: the recipe key of the bucket lengths, for messages
BUCKETS_KEY = "train.text_buckets"


def default_buckets(max_len: int, step: int = BUCKET_STEP) -> tuple[int, ...]:
    """The multiples of ``step`` below ``max_len``, then ``max_len``: ``(32, 64, ..., 224, 248)`` for 248."""
    max_len = int(max_len)
    return tuple(range(step, max_len, step)) + (max_len,)


def grouped_buckets(max_len: int) -> tuple[int, ...]:
    """The default bucket lengths under ``train.group_by_length``: four per doubling (multiples of a quarter of the
    power of two below, at least 4) below ``max_len``, then ``max_len``: ``(8, 12, 16, 20, 24, 28, 32, 40, 48, 56,
    64, 80, ..., 224, 248)`` for 248. A grouped batch's longest text sits near its others, so the gap to the next
    bucket is most of the padding left: no bucket is more than 1.5x the one below it (1.25x from 16 on), where the
    multiples of 32 leave COCO's captions of 11-28 tokens at 32."""
    max_len, out, n = int(max_len), [], 8
    while n < max_len:
        out.append(n)
        n += max(4, 1 << (n.bit_length() - 3))
    return tuple(out) + (max_len,)


def run_buckets(max_len: int, setting: Sequence[int] | None = None, *, key: str = BUCKETS_KEY) -> tuple[int, ...]:
    """The bucket lengths of a run: ``setting`` (``train.text_buckets``) checked against the model's ``max_text_len``,
    with ``max_len`` added as the last length when the list stops below it; None: :func:`default_buckets`.

    Raises:
        ValueError: an empty list, a length that is not a whole number >= 1, lengths not strictly increasing, or a
            length above ``max_len`` (the message names ``key``, the model's length and a list that works).
    """
    max_len = int(max_len)
    if setting is None:
        return default_buckets(max_len)
    values = list(setting)
    example = f"e.g. {key}: {list(default_buckets(max_len))}, or null for that default"
    if not values:
        raise ValueError(f"{key}: an empty list; give the lengths text passes are padded to ({example})")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}: {v!r} is not a whole number of tokens >= 1 ({example})")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{key}: {values} must be strictly increasing ({example})")
    if values[-1] > max_len:
        raise ValueError(f"{key}: {values[-1]} is above the model's {max_len} text positions (model.max_text_len); "
                         f"the lengths must be at most {max_len} ({example})")
    return tuple(values) if values[-1] == max_len else tuple(values) + (max_len,)


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """The smallest of ``buckets`` (increasing) that is ``>= length``; the last one when none is (a text is never
    longer than the model's length, the last bucket)."""
    for b in buckets:
        if b >= length:
            return int(b)
    return int(buckets[-1])


@dataclass(frozen=True)
class ShapeScan:
    """What a term needs planned before training (:meth:`~finetune.objectives.base.Term.shape_scan`).

    Attributes:
        texts: ``{kind: per example of the training set (in row order), the texts of that kind its requests will
            tokenise}`` (:data:`SHORT`: StructXLIP's chunks, FAST-GOAL's sentences; :data:`TEXT`: texts encoded
            with the captions, such as StructXLIP's filtered captions). The bucket of each example's longest text
            is planned.
        open_kinds: kinds whose texts are drawn during training (FLAIR's and F-CAST's sub-captions): every bucket
            length is planned for them.
        capacities: ``{name: most rows per sample}`` of its requests whose count varies per sample.
    """

    texts: Mapping[str, Sequence[Sequence[str]]] = field(default_factory=dict)
    open_kinds: frozenset[str] = frozenset()
    capacities: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchShapes:
    """The planned shapes of a run's passes (module docstring).

    Attributes:
        buckets: the run's bucket lengths (:func:`run_buckets`), increasing; the last is ``max_text_len``.
        planned: ``{kind: lengths}``, the lengths the passes of each kind take (a subset of ``buckets``, or
            ``(max_text_len,)`` for a tower that reads its padding).
        capacities: rows per sample of the requests whose count varies (``structxlip/chunks``, ...).
        text_lengths: per example of a scanned map-style training set (row order), the tokens of its longest
            :data:`TEXT` text (its caption, or a longer text a term encodes with it), which decides the length of the
            pass it joins; None when nothing was scanned (a stream). What ``train.group_by_length`` groups by
            (:class:`finetune.training.loaders.LengthGroupedEpochSampler`), so that the texts are tokenised once.
    """

    buckets: tuple[int, ...]
    planned: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    capacities: Mapping[str, int] = field(default_factory=dict)
    text_lengths: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def text_length(self) -> int:
        """The longest length (``max_text_len``)."""
        return int(self.buckets[-1])

    def capacity(self, name: str) -> int | None:
        """The rows per sample of ``name``, or None when nothing fixed it."""
        return self.capacities.get(name)

    def lengths(self, kind: str) -> tuple[int, ...]:
        """The lengths planned for ``kind`` (every bucket for a kind nothing planned)."""
        return tuple(self.planned.get(kind) or self.buckets)

    def length(self, kind: str, longest: int) -> int:
        """Columns of a pass of ``kind`` whose longest row has ``longest`` tokens: the smallest planned length that
        holds it, else (a row the plan did not foresee) the smallest bucket that does (a new shape)."""
        for b in self.lengths(kind):
            if b >= longest:
                return int(b)
        return bucket_of(longest, self.buckets)

    def planned_pairs(self) -> int:
        """How many (kind, length) pairs are planned: the text shapes a run may meet (per rows count)."""
        return sum(len(v) for v in self.planned.values())

    def warmup_lengths(self, kinds: Iterable[str]) -> list[dict[str, int]]:
        """The text lengths of the warm-up passes, so that every planned (kind, length) pair of ``kinds`` (a batch's
        :attr:`TextPlan.lengths`) runs once: as many passes as the kind with the most planned lengths, the i-th pass
        each kind at its i-th length (its last when it has fewer). The first batch's own lengths are run too: the
        first step runs under the FLOP counter's dispatch mode, which compiled blocks do not compile under."""
        planned = {kind: self.lengths(kind) for kind in kinds}
        count = max((len(v) for v in planned.values()), default=0)
        return [{kind: v[min(i, len(v) - 1)] for kind, v in planned.items()} for i in range(count)]

    def summary(self) -> dict[str, Any]:
        """What the log and ``metrics.json`` record."""
        return {"text_length": self.text_length, "buckets": list(self.buckets),
                "planned": {k: list(v) for k, v in sorted(self.planned.items())},
                "capacities": dict(sorted(self.capacities.items()))}


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-int(n) // multiple) * multiple


def is_causal_tower(model: Any) -> bool:
    """Whether ``model``'s text tower ignores right padding (CLIP's causal towers pooling the end token; BERT's
    under its padding mask), so that its passes may take fewer columns than ``max_text_len``."""
    return getattr(model, "family", "clip") == "clip"


def token_counts(model: Any, texts: Sequence[str]) -> list[int]:
    """The tokens ``model.tokenize`` gives each of ``texts`` (start and end tokens included, truncation applied),
    without counting them in the model's truncation statistics (they are not training captions)."""
    texts = list(texts)
    stats = dict(getattr(model, "truncation_stats", None) or {})
    counts: list[int] = []
    try:
        for start in range(0, len(texts), SCAN_CHUNK):
            mask = model.tokenize(texts[start:start + SCAN_CHUNK]).attention_mask
            counts += mask.sum(dim=1).tolist() if mask.numel() else [0] * mask.shape[0]
    finally:
        if stats:
            model.truncation_stats = stats
    return [int(c) for c in counts]


def longest_tokens(model: Any, texts: Iterable[str]) -> int:
    """The most tokens ``model.tokenize`` gives any of ``texts`` (0 for none), not counted in the model's truncation
    statistics."""
    return max(token_counts(model, list(texts)), default=0)


def example_longest(model: Any, per_example: Sequence[Sequence[str]]) -> list[int]:
    """Per example, the most tokens of any of its texts (0 for an example without one)."""
    flat = [t for texts in per_example for t in texts]
    counts = iter(token_counts(model, flat))
    return [max((next(counts) for _ in texts), default=0) for texts in per_example]


def _streamed(dataset: Any) -> bool:
    return (dataset is None or isinstance(dataset, torch.utils.data.IterableDataset)
            or not hasattr(dataset, "__len__"))


def _merge(a: list[int] | None, b: list[int]) -> list[int]:
    """Per-example maxima of two scans of one training set (the same rows), or both lists when they differ in
    length."""
    if a is None:
        return list(b)
    if len(a) == len(b):
        return [max(x, y) for x, y in zip(a, b)]
    return a + b


def plan_shapes(objective: Any, model: Any, dataset: Any = None, buckets: Sequence[int] | None = None, *,
                grouped: bool = False) -> BatchShapes:
    """The :class:`BatchShapes` of a run, decided before training from the model and, for map-style data, the
    training set after the objective's preprocessing: its ``caption`` column (the :data:`TEXT` kind) and each
    term's :meth:`~finetune.objectives.base.Term.shape_scan`.

    Args:
        objective: the run's :class:`~finetune.objectives.base.Objective`.
        model: the DualEncoder being trained.
        dataset: the preprocessed training set (``len`` and rows), or None / a stream: then no text is scanned and
            every kind plans every bucket.
        buckets: ``train.text_buckets`` (None: the default, :func:`default_buckets`, or :func:`grouped_buckets`
            with ``grouped``).
        grouped: ``train.group_by_length``: batches of similar lengths, which the finer default ladder serves.

    Raises:
        ValueError: a bad ``buckets`` list (:func:`run_buckets`).
    """
    max_len = int(model.max_text_len)
    run = grouped_buckets(max_len) if grouped and buckets is None else run_buckets(max_len, buckets)
    rows = None if _streamed(dataset) else dataset
    longest: dict[str, list[int] | None] = {}
    open_kinds: set[str] = set()
    capacities: dict[str, int] = {}
    if rows is not None:
        cols = dataset_columns(rows, ["caption"])
        if cols is not None:
            longest[TEXT] = token_counts(model, [c or "" for c in cols["caption"]])
    for term in objective.all_terms:
        scan = term.shape_scan(rows, model)
        if scan is None:
            continue
        for kind, per_example in scan.texts.items():
            longest[kind] = _merge(longest.get(kind), example_longest(model, per_example))
        open_kinds |= set(scan.open_kinds)
        for name, value in scan.capacities.items():
            capacities[name] = max(int(value), capacities.get(name, 0))
    planned: dict[str, tuple[int, ...]] = {}
    kinds = {TEXT} | set(longest) | open_kinds | ({SHORT} if rows is None or not is_causal_tower(model) else set())
    for kind in sorted(kinds):
        if kind in (TEXT, SHORT) and not is_causal_tower(model):
            planned[kind] = (run[-1],)
        elif rows is None or kind in open_kinds or not longest.get(kind):
            planned[kind] = run
        else:
            planned[kind] = tight_buckets(longest[kind], run)
    text_lengths = longest.get(TEXT)
    return BatchShapes(run, planned, capacities, None if text_lengths is None else tuple(text_lengths))


def tight_buckets(lengths: Sequence[int], buckets: Sequence[int]) -> tuple[int, ...]:
    """The lengths planned for texts of ``lengths`` tokens: each bucket some text reaches, cut down to the longest
    text that reaches it, rounded up to :data:`LENGTH_ALIGN` (the quickstart's captions of 69-119 tokens: 96 and
    120, not 96 and 128). As many lengths as buckets reached, each holding every text that reaches its bucket."""
    most: dict[int, int] = {}
    for n in lengths:
        b = bucket_of(max(int(n), 1), buckets)
        most[b] = max(most.get(b, 0), max(int(n), 1))
    return tuple(sorted(min(b, round_up(n, LENGTH_ALIGN)) for b, n in most.items()))


def fit_columns(ids: Tensor, mask: Tensor, length: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """``(n, L)`` ids and mask right-padded (or cut) to ``(n, length)``; unchanged when ``L == length``. Cutting is
    for columns that hold padding only (``length >= text_extent(mask)``), or a warm-up pass, whose values are not
    used."""
    extra = length - ids.shape[-1]
    if extra < 0:
        return ids[:, :length], mask[:, :length]
    if not extra:
        return ids, mask
    return (torch.nn.functional.pad(ids, (0, extra), value=pad_id),
            torch.nn.functional.pad(mask, (0, extra), value=0))


def pad_columns(ids: Tensor, mask: Tensor, length: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad ``(n, L)`` ids and mask to ``(n, length)`` (``length >= L``; unchanged when equal)."""
    if length < ids.shape[-1]:
        raise ValueError(f"cannot pad {ids.shape[-1]} token columns down to {length}")
    return fit_columns(ids, mask, length, pad_id)


def text_extent(masks: Iterable[Tensor]) -> int:
    """The columns the real tokens of ``(n, L)`` masks (on the host) reach: one past the last column holding a real
    token in any row (the longest row under right padding), 0 for none. It reads the masks: call it where they are
    on the CPU (the collate function)."""
    extent = 0
    for mask in masks:
        if mask.numel():
            cols = mask.bool().any(dim=0).nonzero()
            if cols.numel():
                extent = max(extent, int(cols.max()) + 1)
    return extent


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
    parts = encoded_row_chunks(encode, inputs, rows)
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}


def encoded_row_chunks(encode: Callable[..., Mapping[str, Tensor]], inputs: Sequence[Tensor], rows: int
                       ) -> list[dict[str, Tensor]]:
    """The payloads of :func:`encode_fixed_rows`, one per chunk of ``rows`` rows (cut back to its real rows)."""
    n = inputs[0].shape[0]
    parts = []
    for start in range(0, n, rows):
        chunk = [t[start:start + rows] for t in inputs]
        real = chunk[0].shape[0]
        out = encode(*(pad_rows(t, rows, t[0]) for t in chunk))
        parts.append({k: v[:real] for k, v in out.items()})
    return parts


def eval_buckets(model: Any) -> tuple[int, ...]:
    """The lengths evaluation pads its text passes to: the default buckets of ``max_text_len`` for a tower that
    ignores right padding (:func:`is_causal_tower`), else ``max_text_len`` alone."""
    max_len = int(getattr(model, "max_text_len", 0) or 0)
    if max_len < 1:
        return ()
    return default_buckets(max_len) if is_causal_tower(model) else (max_len,)


def bucketed_text_columns(model: Any, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Token rows (on the host) right-padded, or cut where only padding is cut, to the smallest of
    :func:`eval_buckets` that holds their longest row, so that evaluation's text passes take a few shapes. Rows
    wider than ``max_text_len`` (F-CAST's N x 77 chunks side by side) keep their width."""
    buckets = eval_buckets(model)
    if not buckets or ids.shape[-1] > buckets[-1]:
        return ids, mask
    return fit_columns(ids, mask, bucket_of(max(text_extent([mask]), 1), buckets), pad_token_id(model))
