"""A stream's shards, opened (:func:`open_stream` -> :class:`ShardSet`): webdataset tar shards and parquet shards from
local paths, object storage or ``pipe:`` commands, and hub datasets (their parquet or tar data files, resolved by
``datasets``), counted once (:mod:`~finetune.data.streams.index`) and read by sample position
(:meth:`ShardSet.read`); the recipe-time checks of a stream's shards and columns."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from finetune.credentials import mask_text
from finetune.data.images import DataError
from finetune.data.spec import SourceSpec
from finetune.data.streams.columns import caption_type_problem, check_fields, resolve_columns
from finetune.data.streams.index import EpochOrder, ShardIndex, build_index, load_index_file
from finetune.data.streams.plan import Intervals
from finetune.data.streams.tar import ShardEndedEarly, iter_samples
from finetune.data.streams.urls import ReadPolicy, check_commands, failure, open_shard, shard_urls, storage_options

__all__ = ["ShardBreak", "ShardSet", "check_stream_columns", "check_stream_shards", "open_stream", "shard_layout",
           "stream_shards"]

logger = logging.getLogger(__name__)

_OPTIONS = {"webdataset": {"fields", "storage_options", "index"}, "parquet": {"fields", "storage_options", "index"},
            "hub": {"config", "revision", "data_files", "fields", "storage_options", "index"}}
_TEXT_ENTRIES = ("txt", "text")


@dataclass(frozen=True)
class ShardBreak:
    """A tar shard that ends early (:class:`~finetune.data.streams.tar.ShardEndedEarly`): its url (as shown: the
    credentials inside it masked) and why."""

    url: str
    reason: str


def shard_layout(num_shards: int, world_size: int = 1, num_workers: int = 0, num_examples: int | None = None) -> str:
    """How a stream spreads over processes and their data-loader workers, in words (for the log and errors):
    ``"332 shards (3,320,000 samples) over 8 processes x 8 workers: 51,875 samples per reader"``."""
    readers = world_size * max(1, num_workers)
    text = f"{num_shards} shard{'s' if num_shards != 1 else ''}"
    if num_examples is not None:
        text += f" ({num_examples:,} samples)"
    text += f" over {world_size} process{'es' if world_size > 1 else ''}"
    if num_workers > 0:
        text += f" x {num_workers} worker{'s' if num_workers > 1 else ''}"
    if num_examples is not None:
        q, r = divmod(num_examples, readers)
        text += f": {q:,} samples per reader" if not r else f": {q:,} or {q + 1:,} samples per reader"
    return text


def _kind(urls: list[str], spec: SourceSpec) -> str:
    if spec.name != "hub":
        return spec.name
    kinds = {"parquet" if u.endswith(".parquet") else "webdataset" if u.endswith(".tar") else None for u in urls}
    if kinds == {"parquet"} or kinds == {"webdataset"}:
        return kinds.pop()
    others = sorted({u.rsplit(".", 1)[-1] for u in urls if not u.endswith((".parquet", ".tar"))})
    raise DataError(f"data source 'hub' ({spec.path}): its data files are {', '.join(others) or 'mixed'} files; a hub "
                    "stream reads parquet or webdataset (.tar) data files. Convert the dataset (datasets' to_parquet) "
                    "or choose its parquet files with options.data_files")


def stream_shards(spec: SourceSpec) -> tuple[str, list[str]]:
    """``(kind, shard urls)`` of a stream entry: ``webdataset`` or ``parquet``; a hub dataset's data files of
    ``split`` as ``datasets`` resolves them (``hf://`` urls for a hub id, paths for a local folder).

    Raises:
        DataError: missing local shards, a hub dataset that cannot be resolved or whose files are neither parquet
            nor tar.
    """
    if spec.name in ("webdataset", "parquet"):
        return spec.name, shard_urls(spec, ".tar" if spec.name == "webdataset" else ".parquet")
    if not spec.path:
        raise DataError("data source 'hub' needs path: a hub dataset id (org/dataset) or a local dataset folder")
    import datasets

    split = spec.split or "train"
    try:
        builder = datasets.load_dataset_builder(spec.path, name=spec.options.get("config"),
                                                revision=spec.options.get("revision"),
                                                data_files=spec.options.get("data_files"))
        files = builder.config.data_files[split] if builder.config.data_files else None
    except KeyError:
        files = None
    except Exception as error:  # datasets raises several types for unknown / unreadable datasets
        raise DataError(f"data source 'hub' ({spec.path!r}): cannot open as a stream: {type(error).__name__}: "
                        f"{error}") from None
    if not files:
        raise DataError(f"data source 'hub' ({spec.path!r}): no data files for split {split!r}; set split or "
                        "options.data_files")
    urls = [str(f) for f in files]
    return _kind(urls, spec), urls


def _check_entry(spec: SourceSpec) -> None:
    if not spec.is_stream:
        raise DataError(f"data source {spec.name!r} is not a stream; set streaming: true or urls (webdataset, "
                        "parquet) or use name: hub")
    unused = [key for key in ("protocol", "size", "limit") if getattr(spec, key) is not None]
    unknown = sorted(set(spec.options) - _OPTIONS[spec.name])
    if unknown:
        raise DataError(f"data source {spec.name!r}: unknown option(s) {', '.join(unknown)}; valid options are "
                        f"{', '.join(sorted(_OPTIONS[spec.name]))}")
    check_fields(spec)
    storage_options(spec)
    if unused:
        raise DataError(f"data source {spec.name!r}: {', '.join(unused)} is not used by a stream; remove it")


def check_stream_shards(spec: SourceSpec | dict | str, world_size: int = 1,
                        policy: ReadPolicy | None = None) -> int | None:
    """Recipe-time check of a webdataset / parquet stream's shard files (listed, not opened), before the model loads.

    Returns:
        the number of shard files (None for a hub stream, whose files ``datasets`` resolves when opening it).
    Raises:
        DataError: unknown options, missing shard files, a ``pipe:`` command that ``policy`` does not allow (with no
            ``policy`` the commands are not judged here: nothing is run to list the shards).
    """
    spec = SourceSpec.parse(spec)
    _check_entry(spec)
    if policy is not None:
        check_commands(spec, policy)
    if spec.name not in ("webdataset", "parquet"):
        return None
    return len(stream_shards(spec)[1])


def open_stream(spec: SourceSpec | dict | str, *, rank: int = 0, world_size: int = 1,
                index: ShardIndex | None = None, policy: ReadPolicy | None = None) -> "ShardSet":
    """Open a stream: its shards listed and their samples counted (``index``, when given, is used instead: the one
    a checkpoint saved or the main process counted), for process ``rank`` of ``world_size``, read as ``policy``
    allows (``pipe:`` commands, the timeout of a remote read).

    Raises:
        DataError: not a stream, unknown options, missing shards, a ``pipe:`` command not allowed, a shard that
            cannot be read, an index that does not describe the shards; a tar shard that ends early under
            ``on_error: raise`` is left to the reader.
    """
    spec = SourceSpec.parse(spec)
    policy = policy or ReadPolicy()
    _check_entry(spec)
    check_commands(spec, policy)
    kind, urls = stream_shards(spec)
    options = storage_options(spec)
    if index is None and spec.options.get("index"):
        index = load_index_file(str(spec.options["index"]), kind, options, policy)
    if index is None:
        index = build_index(urls, kind, options, name=spec.name, policy=policy)
    elif not index.matches(urls):
        first = next((a for a, b in zip(index.urls, urls) if mask_text(a) != mask_text(b)), "(count)")
        raise DataError(
            f"data source {spec.name!r}: the shard index lists {len(index.urls)} shards that are not data.train's "
            f"{len(urls)} (first difference: {first}); write the index for these shards, or give the urls it was "
            "written for")
    else:
        index = index.for_urls(urls)
    if index.total == 0:
        raise DataError(f"data source {spec.name!r}: its {len(urls)} shard(s) hold no samples; check data.train.urls")
    return ShardSet(spec, index, rank=rank, world_size=world_size, policy=policy)


class ShardSet:
    """A stream's shards with their sample counts, read by sample position (what :func:`open_stream` returns).

    Args:
        spec: the stream entry.
        index: the shards and their counts.
        rank, world_size: the process that reads them and the number of processes.
        policy: how its shards may be read (``pipe:`` commands, the timeout); pickled with the set into every
            data-loader worker.
    """

    def __init__(self, spec: SourceSpec, index: ShardIndex, *, rank: int = 0, world_size: int = 1,
                 policy: ReadPolicy | None = None) -> None:
        self.spec = spec
        self.index = index
        self.rank = rank
        self.world_size = world_size
        self.policy = policy or ReadPolicy()
        self.options = storage_options(spec)
        #: broken shards without a whole sample: no position of an epoch reads them, one reader reports each
        self._empty = {u for u, n in zip(index.urls, index.counts) if not n and u in index.broken}

    @property
    def num_shards(self) -> int:
        """Shard files of the whole stream."""
        return len(self.index.urls)

    @property
    def num_examples(self) -> int:
        """Samples in one epoch (every shard once; bad samples included)."""
        return self.index.total

    def order(self, epoch: int) -> EpochOrder:
        """The epoch's shard order (reshuffled every epoch from ``seed`` unless ``shuffle_buffer`` is 0)."""
        return self.index.order(epoch, self.spec.seed, self.spec.shuffle_buffer > 0)

    def read(self, order: EpochOrder, intervals: Intervals) -> Iterator[tuple[int | None, dict[str, Any] | ShardBreak]]:
        """The raw samples at the positions ``intervals`` of an epoch, in position order: ``(position, raw)``, or
        ``(position, ShardBreak)`` for a position lost to a shard that ends early, and ``(None, ShardBreak)`` after
        the last sample of a shard the index knows to end early.

        Raises:
            DataError: a shard that cannot be opened or read (naming it).
        """
        for url in self._empty_broken(order, intervals):
            yield None, ShardBreak(mask_text(url), self.index.broken[url])
        for shard, runs in order.segments(intervals):
            url = self.index.urls[shard]
            base = order.starts[order.perm.index(shard)]
            try:
                yield from self._read_shard(url, base, runs)
            except DataError:
                raise
            except Exception as error:  # OS, fsspec, pyarrow, pipe errors: name the shard and the cause
                raise DataError(f"{failure(self.spec.name, url, error, self.policy)}. Replace or remove the shard, "
                                "or check the server") from error
            if url in self.index.broken and runs[-1][1] == self.index.counts[shard]:
                yield None, ShardBreak(mask_text(url), self.index.broken[url])

    def _empty_broken(self, order: EpochOrder, intervals: Intervals) -> list[str]:
        """The broken shards without a whole sample (a 0-byte file, not a tar at all) that a reader of ``intervals``
        reports: the one whose positions hold the shard's place in the epoch (the last reader for one at the end)."""
        out = []
        for k, shard in enumerate(order.perm if self._empty else ()):
            url = self.index.urls[shard]
            if url not in self._empty:
                continue
            at = order.starts[k]
            if any(a <= at < b or at == b == order.total for a, b in intervals):
                out.append(url)
        return out

    def _read_shard(self, url: str, base: int, runs: list[tuple[int, int]]) -> Iterator[tuple[int, Any]]:
        first, stop = runs[0][0], runs[-1][1]
        wanted = (lambda i: True) if len(runs) == 1 else (lambda i: any(a <= i < b for a, b in runs))
        shown = mask_text(url)
        with open_shard(url, self.options, self.policy) as handle:
            if self.index.kind == "parquet":
                yield from ((base + i, row) for i, row in _parquet_rows(handle, first, stop, wanted))
                return
            got = first - 1
            try:
                for i, key, entries in iter_samples(handle, start=first, stop=stop, keep=wanted):
                    got = i
                    yield base + i, _raw_sample(key, shown, entries)
                reason = f"it holds {got + 1} samples, fewer than the {stop} its index says"
            except ShardEndedEarly as broken:
                reason = broken.reason
            for i in (i for a, b in runs for i in range(max(a, got + 1), b)):  # the positions it could not give
                yield base + i, ShardBreak(shown, reason)

    def first_raw(self) -> tuple[dict[str, Any] | None, str]:
        """The first sample of the first non-empty shard (for the column checks) and its url."""
        shard = next(i for i, n in enumerate(self.index.counts) if n)
        order = EpochOrder(self.index, list(range(self.num_shards)))
        for position, raw in self.read(order, [(order.starts[shard], order.starts[shard] + 1)]):
            if position is not None:
                return (raw if isinstance(raw, dict) else None), self.index.urls[shard]
        return None, self.index.urls[shard]


def _raw_sample(key: str, url: str, entries: dict[str, bytes]) -> dict[str, Any]:
    raw: dict[str, Any] = {"__key__": key, "__url__": url}
    for entry, data in entries.items():
        if entry in _TEXT_ENTRIES:
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError:
                pass  # the example check says "not UTF-8 text"
        raw[entry] = data
    return raw


def _parquet_rows(handle: Any, first: int, stop: int, wanted: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows ``first <= i < stop`` that ``wanted(i)`` keeps, reading only the row groups that hold them."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(handle)
    start = 0
    for group in range(pf.metadata.num_row_groups):
        rows = pf.metadata.row_group(group).num_rows
        if start + rows > first and start < stop:
            table = pf.read_row_group(group)
            for offset, row in enumerate(table.to_pylist()):
                i = start + offset
                if first <= i < stop and wanted(i):
                    yield i, row
        start += rows
        if start >= stop:
            break


def check_stream_columns(spec: SourceSpec | dict | str, *, rank: int = 0, world_size: int = 1,
                         source: ShardSet | None = None) -> None:
    """Recipe-time check of a stream's columns (before the model loads): the image and caption columns exist, and the
    caption column's type (a parquet schema) can hold text. A parquet column of numbers would otherwise make every
    example a bad one, found only when training starts.

    Raises:
        DataError: a missing column, or a caption column that cannot hold text (naming it, its type and the shard,
            and the key to set).
    """
    spec = SourceSpec.parse(spec)
    if not spec.is_stream:
        return
    source = source or open_stream(spec, rank=rank, world_size=world_size)
    raw, url = source.first_raw()
    if raw is None:
        return  # the first shard breaks at once: the reader reports it
    columns = [c for c in raw if not c.startswith("__")] + (["__key__"] if "__key__" in raw else [])
    _, caption, _ = resolve_columns(spec, columns)
    if source.index.kind != "parquet" or caption not in raw:
        return  # webdataset entries are bytes; json.FIELD is checked example by example
    import pyarrow.parquet as pq

    with open_shard(url, source.options, source.policy) as handle:
        schema = pq.ParquetFile(handle).schema_arrow
    problem = caption_type_problem(schema.field(caption).type)
    if problem:
        raise DataError(
            f"data source {spec.name!r}: the caption column {caption!r} holds {problem}, not text (in {url}); columns: "
            f"{', '.join(schema.names)}. Set data.train.caption_column to the column that holds the captions "
            "(strings, or lists of strings)")
