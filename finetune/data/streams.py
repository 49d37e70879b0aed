"""Streaming training data: webdataset tar shards, parquet shards and hub datasets (DESIGN 4, "Streams").

FLAIR and F-CAST pretrain on 3M-30M image-text pairs that live in shards, which a map-style dataset (a
fingerprinted cache, a length) does not fit. A recipe's ``data.train`` streams when it is

- ``{name: webdataset, urls: "shards/{00000..00099}.tar"}``: webdataset tar shards (``KEY.jpg`` /
  ``KEY.png`` ... beside ``KEY.txt`` or ``KEY.json``), read by ``datasets``' ``webdataset`` builder;
- ``{name: parquet, urls: "shards/train-{0000..0031}.parquet"}`` (or ``path`` + ``streaming: true``):
  parquet shards with an image column (bytes, ``{"bytes", "path"}`` structs or paths) and a caption
  column;
- ``{name: hub, path: org/dataset, split: train}``: a hub dataset (or a local dataset folder) in streaming
  mode; ``options`` may give ``config``, ``revision`` and ``data_files``.

Who reads what. Process ``r`` of ``P`` opens only its own shards, ``shards[r::P]`` (:func:`open_stream`;
the counts differ by at most one when ``P`` does not divide the number of shards, and fewer shards than
processes is an error that says how many to write). Inside a process, ``data.num_workers`` DataLoader
workers split that process's shards again (worker ``w`` of ``W`` reads the shards ``[w::W]`` of the
epoch's order): no shard is read by two readers, none is skipped. Each worker decodes,
validates and transforms its examples (:class:`ExampleStream`: images decoded, bad examples skipped and
counted, the objective's :meth:`~finetune.objectives.base.Term.stream_map`) and collates them (the
model's ``preprocess_images``, e.g. F-CAST's superpixels, and ``tokenize``), so the training process only
receives finished batches. A process's global-batch share is ``train.batch_size / P``.

How the position is kept (exact resume). :class:`StreamLoader` is torchdata's ``StatefulDataLoader`` over
the process's :class:`ExampleStream`. Every batch carries the state of the worker that made it; the
loader's ``state_dict()`` is the state after the last batch handed to the training loop (not the
batches workers prefetched), and holds, per worker, the :meth:`ExampleStream.state_dict` (its epoch, the
raw examples read in that epoch, its counts, and ``datasets``' own position in its shards) and which
worker yields next. A checkpoint writes one such file per process (``stream_state_<rank>.json``); on
resume each process restores its loader, every worker continues where it stood and the round-robin
continues with the right worker, so a resumed run trains on exactly the batches an uninterrupted one
would, with ``shuffle_buffer`` 0 or 1 (a larger buffer's content is lost on resume: ``datasets`` refills
it). Resume with the same number of processes and ``data.num_workers``.
"""

from __future__ import annotations

import io
import itertools
import logging
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import datasets
import torch

from finetune.data.formats import _data_files
from finetune.data.images import DataError, ImageReadError, read_image
from finetune.data.sources import register_source
from finetune.data.spec import STREAM_SOURCES, SourceSpec
from finetune.data.text import as_captions

__all__ = [
    "STREAM_SOURCES",
    "WEBDATASET_IMAGE_KEYS",
    "ExampleStream",
    "StreamCollate",
    "StreamLoader",
    "check_stream_columns",
    "check_stream_shards",
    "expand_urls",
    "open_stream",
    "set_terms_epoch",
    "shard_layout",
]

logger = logging.getLogger(__name__)

#: webdataset keys tried, in order, for the image when ``image_column`` is left at ``image``
WEBDATASET_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
#: keys tried, in order, for the caption when ``caption_column`` is left at ``caption``
#: (``json.caption``: the ``caption`` field of a webdataset ``KEY.json``)
DEFAULT_CAPTION_KEYS = ("txt", "text", "json.caption")
#: a sample's precomputed superpixels (``KEY.superpixels.png``, written by ``xlipkit superpixels``), passed through
#: as the example's :data:`SUPERPIXELS_FIELD` (its raw PNG)
SUPERPIXELS_ENTRY = "superpixels.png"
SUPERPIXELS_FIELD = "superpixels_entry"
_SKIPPED_EXAMPLES_KEPT = 5
_STATE_VERSION = 2
_LOADER_STATE_VERSION = 2  # 1 was the single-reader ExampleStream state
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


# --------------------------------------------------------------------------- urls


def expand_urls(urls: str | list[str]) -> list[str]:
    """Expand webdataset / braceexpand-style patterns into the list of shard urls.

    ``{00000..00099}`` is a numeric range (zero-padded to the width of its bounds when one starts with
    ``0``; descending when the first bound is larger), ``{a,b,c}`` alternatives; several braces in one
    pattern multiply out, left to right. A list expands each pattern in order.

    Args:
        urls: a pattern or a list of patterns (``"shards/{00000..00002}.tar"``).
    Returns:
        the urls, in order (``["shards/00000.tar", "shards/00001.tar", "shards/00002.tar"]``).
    Raises:
        DataError: an empty pattern list.
    """
    patterns = [urls] if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for pattern in patterns:
        out.extend(_expand_one(pattern))
    if not out:
        raise DataError("data.train.urls is empty: give a shard pattern like shards/{00000..00099}.tar")
    return out


def _expand_one(pattern: str) -> list[str]:
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end():]
    numeric = _RANGE.match(body)
    if numeric:
        first, last = numeric.group(1), numeric.group(2)
        a, b = int(first), int(last)
        padded = any(len(s.lstrip("-")) > 1 and s.lstrip("-").startswith("0") for s in (first, last))
        width = max(len(first), len(last)) if padded else 0
        step = 1 if b >= a else -1
        choices = [str(i).zfill(width) for i in range(a, b + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:  # not a brace expression: keep it literally
        return [head + "{" + body + "}" + rest for rest in _expand_one(tail)]
    tails = _expand_one(tail)
    return [head + choice + rest for choice in choices for rest in tails]


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def _stream_files(spec: SourceSpec, extension: str) -> list[str]:
    """The shard files of a webdataset / parquet stream: ``urls`` expanded, or the files under ``path``."""
    if spec.urls is not None:
        if spec.path is not None:
            raise DataError(f"data source {spec.name!r}: set either urls or path, not both")
        files = [u if _is_remote(u) else str(Path(u.removeprefix("file://")).expanduser())
                 for u in expand_urls(spec.urls)]
        missing = [f for f in files if not _is_remote(f) and not Path(f).is_file()]
        if missing:
            raise DataError(
                f"data source {spec.name!r}: {len(missing)} of {len(files)} shard files do not exist (first: "
                f"{missing[0]!r}); check data.train.urls ({spec.urls!r})"
            )
        return files
    if spec.path is None:
        raise DataError(f"data source {spec.name!r} needs urls (shard files, e.g. shards/{{00000..00099}}{extension}) "
                        "or a path (a file or a folder of them)")
    return [str(p) for p in _data_files(spec, (extension,))]


# --------------------------------------------------------------------------- opening


def shard_layout(num_shards: int, world_size: int = 1, num_workers: int = 0) -> str:
    """How ``num_shards`` shards spread over processes and their workers, in words (for the log and errors):
    ``"332 shards over 8 processes: 41 or 42 each, 5 or 6 per worker (8 workers)"``."""
    per = [len(range(r, num_shards, world_size)) for r in range(world_size)]
    text = f"{num_shards} shards over {world_size} process{'es' if world_size > 1 else ''}: "
    text += f"{min(per)} each" if min(per) == max(per) else f"{min(per)} or {max(per)} each"
    if num_workers > 1:
        low, high = min(per) // num_workers, -(-max(per) // num_workers)
        text += f", {low} per worker" if low == high else f", {low} to {high} per worker"
        text += f" ({num_workers} workers)"
    return text


#: the member name (``KEY.err``) that marks where a webdataset shard broke (:class:`_WholeSamples`)
_UNREADABLE_SHARD = "__xlipkit_unreadable_shard__"
#: why each shard that broke could not be read, keyed by its path (in the process that read it)
_SHARD_ERRORS: dict[str, str] = {}
_SAMPLE_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # datasets' (webdataset's) base_plus_ext


class _WholeSamples:
    """One webdataset shard's members, as ``datasets``' webdataset builder iterates them (``(name, file)``), read
    here one whole sample at a time. A shard that breaks (a truncated last member: ``tarfile.ReadError: unexpected
    end of data``, a damaged header) drops the sample it broke in and ends with a marker member, so that
    :class:`ExampleStream` skips the rest of the shard (counted, named) or raises naming it, per ``data.on_error``,
    and ``datasets`` goes on with the next shard; its own position stays exact for a resume."""

    def __init__(self, path: str, members: Iterable) -> None:
        self.path = path
        self.members = members

    def __iter__(self) -> Iterator[tuple[str, io.BytesIO]]:
        pending: list[tuple[str, io.BytesIO]] = []
        key = None
        members = iter(self.members)
        while True:
            try:
                name, handle = next(members)
                data = handle.read()
            except StopIteration:
                break
            except Exception as error:  # tarfile, gzip, OS errors: the rest of this shard cannot be read
                _SHARD_ERRORS[self.path] = f"{type(error).__name__}: {error}"
                yield f"{_UNREADABLE_SHARD}.err", io.BytesIO(b"")
                return
            match = _SAMPLE_KEY.match(name)
            sample = match.group(1) if match else None
            if pending and sample != key:
                yield from pending
                pending = []
            key = sample
            pending.append((name, io.BytesIO(data)))
        yield from pending


def _read_whole_samples(ds: datasets.IterableDataset) -> None:
    """Wrap each shard of a webdataset stream in :class:`_WholeSamples` (in ``datasets``' generator arguments, which
    its shuffling and sharding carry along); left as it is where ``datasets`` keeps them otherwise."""
    ex = getattr(ds, "_ex_iterable", None)
    while ex is not None and not hasattr(ex, "kwargs"):
        ex = getattr(ex, "ex_iterable", None)
    kwargs = getattr(ex, "kwargs", None)
    if not isinstance(kwargs, dict) or not isinstance(kwargs.get("tar_iterators"), list):
        logger.debug("webdataset stream: datasets keeps its shards otherwise; broken shards are not skipped")
        return
    kwargs["tar_iterators"] = [m if isinstance(m, _WholeSamples) else _WholeSamples(str(path), m)
                               for path, m in zip(kwargs["tar_paths"], kwargs["tar_iterators"])]


def _shard_files(ds: datasets.IterableDataset) -> list[str]:
    """The shard files a stream view reads, where ``datasets`` says (else ``[]``), for messages."""
    ex = getattr(ds, "_ex_iterable", None)
    while ex is not None and not hasattr(ex, "kwargs"):
        ex = getattr(ex, "ex_iterable", None)
    kwargs = getattr(ex, "kwargs", None) or {}
    files = kwargs.get("tar_paths") or kwargs.get("files") or []
    return [str(f) for f in files] if isinstance(files, list) else []


def _own_shards(files: list[str], spec: SourceSpec, rank: int, world_size: int) -> list[str]:
    """Process ``rank``'s shard files, ``files[rank::world_size]`` (DataError when some process gets none)."""
    if len(files) < world_size:
        raise DataError(
            f"data source {spec.name!r} has {len(files)} shard file(s) for {world_size} processes: every process "
            f"needs its own shards. Write at least {world_size} shards (better a multiple of {world_size} x "
            "data.num_workers, so that every worker of every process reads the same number) or launch fewer processes"
        )
    return files[rank::world_size]


def check_stream_shards(spec: SourceSpec | dict | str, world_size: int) -> int | None:
    """Recipe-time check that a webdataset / parquet stream has at least one shard file per process (the
    files are listed, not opened), so that a launch with too many processes stops before the model loads.

    Returns:
        the number of shard files (None for a hub stream, whose files ``datasets`` resolves when opening it).
    Raises:
        DataError: missing shard files, or fewer shard files than processes (saying how many to write).
    """
    spec = SourceSpec.parse(spec)
    if not (spec.is_stream and spec.name in ("webdataset", "parquet")):
        return None
    files = _stream_files(spec, ".tar" if spec.name == "webdataset" else ".parquet")
    _own_shards(files, spec, 0, world_size)
    return len(files)


def open_stream(spec: SourceSpec | dict | str, *, rank: int = 0, world_size: int = 1) -> datasets.IterableDataset:
    """Open a stream source as a ``datasets.IterableDataset`` of this process's shards, unshuffled.

    Webdataset and parquet: only the files ``shards[rank::world_size]`` are opened. A hub dataset is opened
    whole and cut to its shards ``[rank::world_size]`` (``IterableDataset.shard``). Either way no two
    processes read one shard, and when ``world_size`` does not divide the number of shards the processes'
    counts differ by one (never every process reading everything). :class:`ExampleStream` shuffles each
    epoch (``shuffle_buffer``, ``seed``).

    Image columns are not decoded (``{"bytes", "path"}`` dicts): :class:`ExampleStream` decodes them, so
    that an unreadable image is a counted bad example, not an error inside the iterator.

    Args:
        spec: a stream entry (:attr:`SourceSpec.is_stream`).
        rank, world_size: this process and the number of processes.
    Returns:
        the raw stream of this process's shards (``num_shards`` of them).
    Raises:
        DataError: not a stream, missing shard files, fewer shards than processes (saying how many to
            write), a source ``datasets`` cannot read.
    """
    spec = SourceSpec.parse(spec)
    if not spec.is_stream:
        raise DataError(f"data source {spec.name!r} is not a stream; set streaming: true or urls (webdataset, "
                        "parquet) or use name: hub")
    unused = [key for key in ("protocol", "size", "limit") if getattr(spec, key) is not None]
    if spec.name != "hub" and set(spec.options) - {"fields"}:
        unused.append("options other than fields")
    _check_fields(spec)
    if unused:
        raise DataError(f"data source {spec.name!r}: {', '.join(unused)} is not used by a stream; remove it")
    own: list[str] = []
    try:
        if spec.name in ("webdataset", "parquet"):
            files = _stream_files(spec, ".tar" if spec.name == "webdataset" else ".parquet")
            own = _own_shards(files, spec, rank, world_size)
            ds = datasets.load_dataset(spec.name, data_files={"train": own}, split="train", streaming=True)
            if spec.name == "webdataset":
                _read_whole_samples(ds)
        else:
            if not spec.path:
                raise DataError("data source 'hub' needs path: a hub dataset id (org/dataset) or a local dataset "
                                "folder")
            unknown = sorted(set(spec.options) - {"config", "revision", "data_files", "fields"})
            if unknown:
                raise DataError(f"data source 'hub': unknown option(s) {', '.join(unknown)}; valid options are "
                                "config, revision, data_files, fields")
            ds = datasets.load_dataset(
                spec.path, name=spec.options.get("config"), revision=spec.options.get("revision"),
                data_files=spec.options.get("data_files"), split=spec.split or "train", streaming=True,
            )
    except DataError:
        raise
    except Exception as error:  # datasets raises several types for unreadable / unknown sources
        where = spec.path or spec.urls
        first = f" (datasets reads the first examples of {own[0]} to learn the columns)" if own else ""
        raise DataError(f"data source {spec.name!r} ({where!r}): cannot open as a stream: {type(error).__name__}: "
                        f"{error}{first}") from error
    if not isinstance(ds, datasets.IterableDataset):
        raise DataError(f"data source {spec.name!r}: expected one split as a stream, got {type(ds).__name__}; "
                        "set split")
    if spec.name == "hub" and world_size > 1:
        if ds.num_shards < world_size:
            raise DataError(
                f"data source 'hub' ({spec.path}) has {ds.num_shards} shard(s) for {world_size} processes: every "
                f"process needs its own. Use a dataset with at least {world_size} data files (better a multiple of "
                f"{world_size} x data.num_workers), e.g. options.data_files, or launch fewer processes")
        ds = ds.shard(num_shards=world_size, index=rank, contiguous=False)
    return ds.decode(False)


def _check_fields(spec: SourceSpec) -> list[str]:
    """``options.fields``: raw columns (``json.FIELD`` for a field of a webdataset ``KEY.json``) carried into
    every example under their last name (FLAIR's pre-split DreamLIP caption fields)."""
    fields = spec.options.get("fields", [])
    if not isinstance(fields, list) or not all(isinstance(f, str) and f for f in fields):
        raise DataError(f"data source {spec.name!r}: options.fields must be a list of column names (json.FIELD for a "
                        f"field of KEY.json), got {fields!r}")
    return list(fields)


#: the fields every streamed example has (:class:`ExampleStream`), besides ``options.fields``
STREAM_EXAMPLE_FIELDS = frozenset({"id", "image", "caption", "captions", "url"})


def _caption_feature_problem(feature: Any) -> str | None:
    """What a caption column's ``datasets`` feature holds when it cannot hold text (``"int64 values"``), else None:
    strings, or lists of strings (several captions of one image), are captions."""
    inner = getattr(feature, "feature", None)
    if inner is not None and getattr(feature, "dtype", None) is None:  # List / Sequence / LargeList
        problem = _caption_feature_problem(inner)
        return f"lists of {problem}" if problem else None
    dtype = getattr(feature, "dtype", None)
    if dtype in ("string", "large_string"):
        return None
    return f"{dtype} values" if dtype else f"{type(feature).__name__} values"


def check_stream_columns(spec: SourceSpec | dict | str, *, rank: int = 0, world_size: int = 1) -> None:
    """Recipe-time check of a stream's columns (before the model loads): the image and caption columns exist, and
    the caption column's type (the parquet schema, or what ``datasets`` learned from the first examples of a
    webdataset shard) can hold text. A parquet column of numbers would otherwise make every example a bad one,
    found only when training starts.

    Raises:
        DataError: a missing column, or a caption column that cannot hold text (naming it, its type and the
            shard, and the key to set).
    """
    spec = SourceSpec.parse(spec)
    if not spec.is_stream:
        return
    ds = open_stream(spec, rank=rank, world_size=world_size)
    features = ds.features
    if not features:
        return  # a hub stream whose columns datasets only learns while reading
    _, caption, _ = _resolve_columns(spec, list(features))
    if caption not in features:  # json.FIELD of a webdataset KEY.json: checked example by example
        return
    problem = _caption_feature_problem(features[caption])
    if problem:
        shard = _shard_files(ds)[:1]
        raise DataError(
            f"data source {spec.name!r}: the caption column {caption!r} holds {problem}, not text"
            + (f" (in {shard[0]})" if shard else "") + f"; columns: {', '.join(features)}. Set data.train.caption_column "
            "to the column that holds the captions (strings, or lists of strings)")


# --------------------------------------------------------------------------- examples


def _lookup(raw: dict[str, Any], key: str) -> Any:
    """``raw[key]``; ``"json.caption"`` reads the ``caption`` field of the ``json`` column."""
    if key in raw:
        return raw[key]
    head, _, rest = key.partition(".")
    value = raw.get(head)
    if rest and isinstance(value, (bytes, str)) and head == "json":
        import json

        try:
            value = json.loads(value)
        except ValueError:
            return None
    return _lookup(value, rest) if rest and isinstance(value, dict) else None


def _has(columns: list[str], key: str) -> bool:
    return key in columns or key.partition(".")[0] in columns and "." in key


def _resolve_columns(spec: SourceSpec, columns: list[str]) -> tuple[str, str, str | None]:
    """``(image, caption, id or None)``: the columns of a stream that hold each (see :class:`ExampleStream`).

    Raises:
        DataError: a missing image, caption or (given) id column, naming the recipe key to set.
    """

    def pick(given: str, default: str, fallbacks: tuple[str, ...], what: str, key: str) -> str:
        candidates = (given, *fallbacks) if given == default else (given,)
        for candidate in candidates:
            if _has(columns, candidate):
                return candidate
        raise DataError(
            f"data source {spec.name!r}: no {what} column {given!r}"
            + (f" (nor {', '.join(fallbacks)})" if given == default else "")
            + f"; columns: {', '.join(columns)}. Set data.train.{key} to the column that holds the {what}."
        )

    image = pick(spec.image_column, "image", WEBDATASET_IMAGE_KEYS, "image", "image_column")
    caption = pick(spec.caption_column, "caption", DEFAULT_CAPTION_KEYS, "caption", "caption_column")
    if spec.id_column is not None:
        if not _has(columns, spec.id_column):
            raise DataError(f"data source {spec.name!r}: no id column {spec.id_column!r}; columns: "
                            f"{', '.join(columns)}. Set data.train.id_column or remove it.")
        ident: str | None = spec.id_column
    else:
        ident = next((c for c in ("id", "__key__") if c in columns), None)
    return image, caption, ident


class ExampleStream(torch.utils.data.IterableDataset):
    """One reader's endless stream of validated examples, epoch after epoch, with a resumable position.

    Yields ``{"id": str, "image": RGB PIL image, "caption": str}`` (plus ``captions`` when the caption
    column holds lists, ``url`` for webdataset shards) updated with what ``transform`` returns (the
    objective's :meth:`~finetune.objectives.base.Objective.stream_map`). Columns map as for map-style
    sources: ``image_column`` (default ``image``, else the first webdataset key of
    :data:`WEBDATASET_IMAGE_KEYS`), ``caption_column`` (default ``caption``, else ``txt``, ``text`` or the
    ``caption`` field of ``json``; ``json.FIELD`` reads another field), ``options.fields`` (more raw columns,
    each kept under its last name: ``json.long_IB_captions`` -> ``long_IB_captions``; a webdataset
    ``KEY.superpixels.png`` entry, written by ``xlipkit superpixels``, as ``superpixels_entry``), ``id_column`` (default
    ``id``, else the webdataset ``__key__``, else ``<name>-<rank>-<worker>-<epoch>-<position>``).

    Iterated in the training process it reads all of ``dataset``; iterated in DataLoader worker ``w`` of
    ``W``, the shards ``[w::W]``. Each epoch reads a fresh view (:meth:`_epoch_dataset`): with
    ``shuffle_buffer`` > 0 the shards reordered from ``seed + epoch`` (and examples mixed through the buffer
    when it holds more than one), the same order in every worker; with 0, the shards in the given order.
    (The epoch is counted here, not with ``datasets``' ``set_epoch``, whose value all the workers of a
    loader share.)

    Args:
        dataset: the raw stream (:func:`open_stream`).
        spec: its entry (names the columns, ``seed``, ``shuffle_buffer``).
        on_error: ``skip`` (count bad examples, keep the first few) or ``raise`` (:class:`DataError` on the
            first, naming its id and shard).
        transform: ``example -> extra fields``, run on every good example (in the reader's process).
        rank, world_size: recorded in the state, checked on resume.
        keep: good examples kept in :attr:`preview` (for report previews).
    """

    def __init__(
        self,
        dataset: datasets.IterableDataset,
        spec: SourceSpec | dict | str,
        *,
        on_error: str = "skip",
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        rank: int = 0,
        world_size: int = 1,
        keep: int = 8,
    ) -> None:
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be skip or raise, got {on_error!r}")
        self.dataset = dataset
        self.spec = SourceSpec.parse(spec)
        self.on_error = on_error
        self.transform = transform
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.preview: list[dict[str, Any]] = []
        self.epoch = 0
        self.position = 0  # raw examples read in this epoch
        self.read = 0
        self.yielded = 0
        self.skipped = 0
        self.skipped_examples: list[dict[str, str]] = []
        #: webdataset shards whose rest was skipped (every time; the first few named, each once)
        self.skipped_shard_count = 0
        self.skipped_shards: list[dict[str, str]] = []
        self._resumed = False
        self._dataset_state: dict | None = None  # datasets' position in the current epoch, from a checkpoint
        self._current: datasets.IterableDataset | None = None  # the current epoch's view of ``dataset``
        self._keys: tuple[str, str, str | None] | None = None

    @property
    def worker(self) -> int:
        """The DataLoader worker reading this stream (0 in the training process)."""
        info = torch.utils.data.get_worker_info()
        return info.id if info is not None else 0

    @property
    def num_workers(self) -> int:
        """The number of DataLoader workers of the loader reading this stream (0: read in the training process)."""
        info = torch.utils.data.get_worker_info()
        return info.num_workers if info is not None else 0

    # -- columns ---------------------------------------------------------------------------------
    def _resolve_keys(self, raw: dict[str, Any]) -> tuple[str, str, str | None]:
        return _resolve_columns(self.spec, list(self.dataset.column_names or raw.keys()))

    def _example(self, raw: dict[str, Any]) -> tuple[dict[str, Any], str | None, str]:
        """(example, reason it is bad or None, where it came from)."""
        if self._keys is None:
            self._keys = self._resolve_keys(raw)
        image_key, caption_key, id_key = self._keys
        value = _lookup(raw, id_key) if id_key else None
        ident = (str(value) if value is not None else
                 f"{self.spec.name}-{self.rank}-{self.worker}-{self.epoch}-{self.position - 1}")
        url = str(raw.get("__url__") or "")
        example: dict[str, Any] = {"id": ident}
        if url:
            example["url"] = url
        caption = _lookup(raw, caption_key)
        if isinstance(caption, bytes):
            try:
                caption = caption.decode("utf-8")
            except UnicodeDecodeError:
                return example, "caption is not UTF-8 text", url
        if caption is None:
            return example, f"no caption ({caption_key!r} is missing)", url
        try:  # the caption rules of map-style sources: a string, or a list of strings
            captions = as_captions(caption)
        except (TypeError, ValueError) as error:
            return example, str(error), url
        if not isinstance(caption, str):
            example["captions"] = captions
        caption = next((c for c in captions if c.strip()), "")
        if not caption.strip():
            return example, "empty caption", url
        example["caption"] = caption
        image = _lookup(raw, image_key)
        if image is None:
            return example, "no image", url
        for key in _check_fields(self.spec):
            value = _lookup(raw, key)
            if value is None:
                return example, f"no field {key!r} (data.train.options.fields)", url
            example[key.rpartition(".")[2]] = value
        try:
            example["image"] = read_image(image)
        except ImageReadError as error:
            return example, error.reason, url
        except (TypeError, ValueError, OSError) as error:
            return example, f"unreadable image ({error})", url
        if raw.get(SUPERPIXELS_ENTRY) is not None:  # F-CAST's term decodes and checks it (stream_map)
            example[SUPERPIXELS_FIELD] = raw[SUPERPIXELS_ENTRY]
        return example, None, url

    # -- iteration -------------------------------------------------------------------------------
    def _epoch_dataset(self, epoch: int) -> datasets.IterableDataset:
        """This reader's view of ``dataset`` for ``epoch``: the shards shuffled from ``seed + epoch`` (with
        ``shuffle_buffer`` > 0; the same order in every worker of the process), then worker ``w`` of ``W``
        keeps the shards ``[w::W]`` of that order (``IterableDataset.shard``), so the workers' shares are
        disjoint and cover every shard once. A fresh object every epoch: a checkpoint's position is loaded
        into the resumed epoch's view only."""
        ds = self.dataset
        if self.spec.shuffle_buffer:
            ds = ds.shuffle(seed=self.spec.seed + epoch, buffer_size=self.spec.shuffle_buffer)
        return ds.shard(num_shards=max(1, self.num_workers), index=self.worker, contiguous=False)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        resumed = self._resumed
        while True:
            self._current = self._epoch_dataset(self.epoch)
            if resumed and self._dataset_state is not None:
                self._current.load_state_dict(self._dataset_state)
            usable = 0
            # ``iter`` reads exactly this view: iterating the dataset itself in a DataLoader worker would split
            # it by worker again (and datasets 5.2 then cannot load a shuffled stream's saved position)
            rows_of_epoch = self._current.iter(batch_size=1)
            while True:
                try:
                    rows = next(rows_of_epoch)
                except StopIteration:
                    break
                except Exception as error:  # a shard datasets cannot read (webdataset shards end in a marker)
                    self._unreadable(error)
                raw = {key: values[0] for key, values in rows.items()}
                self.position += 1
                if raw.get("__key__") == _UNREADABLE_SHARD:
                    self._skip_shard(str(raw.get("__url__") or ""))
                    continue
                self.read += 1
                example, reason, url = self._example(raw)
                if reason is not None:
                    self._skip(example["id"], url, reason)
                    continue
                if self.transform is not None:
                    example.update(self.transform(example))
                usable += 1
                self.yielded += 1
                if len(self.preview) < self.keep:
                    self.preview.append(example)
                yield example
            if not usable and not resumed:
                where = f"process {self.rank} of {self.world_size}"
                if self.num_workers:
                    where += f", data-loader worker {self.worker} of {self.num_workers},"
                first = self.skipped_examples[0] if self.skipped_examples else None
                why = (f"; the first skipped: id={first['id']!r} in {first['path']}: {first['reason']}" if first else "")
                broken = (f"; broken shards skipped: {', '.join(e['shard'] for e in self.skipped_shards)}"
                          if self.skipped_shards else "")
                raise DataError(
                    f"data source {self.spec.name!r}: {where} found no usable examples in epoch {self.epoch} "
                    f"({self.read} read, {self.skipped} skipped in all{why}{broken}); check data.train (urls, "
                    "columns) and that there are at least as many shards as processes x data.num_workers"
                )
            resumed = False
            self._dataset_state = None
            self._current = None
            self.epoch += 1
            self.position = 0

    def _where(self) -> str:
        where = f"process {self.rank} of {self.world_size}"
        if self.num_workers:
            where += f", data-loader worker {self.worker} of {self.num_workers}"
        return where

    def _skip_shard(self, shard: str) -> None:
        """A webdataset shard broke (:class:`_WholeSamples`): raise naming it, or skip its rest, counted."""
        reason = _SHARD_ERRORS.pop(shard, "it ended early")
        if self.on_error == "raise":
            raise DataError(
                f"data source {self.spec.name!r}: shard {shard} cannot be read to its end ({reason}): it is truncated "
                "or damaged (the samples before the break were read). Replace or remove the shard, or set "
                "data.on_error: skip to skip the rest of a broken shard (counted in metrics.json)")
        self.skipped_shard_count += 1
        if shard not in {e["shard"] for e in self.skipped_shards} and len(self.skipped_shards) < _SKIPPED_EXAMPLES_KEPT:
            self.skipped_shards.append({"shard": shard, "reason": reason})
        logger.warning("data source %r (%s): skipped the rest of shard %s, which cannot be read to its end (%s); "
                       "data.on_error: skip", self.spec.name, self._where(), shard, reason)

    def _unreadable(self, error: Exception) -> None:
        """A read error of ``datasets`` with no shard to skip to (a parquet or hub shard): a DataError naming this
        reader's shards."""
        files = _shard_files(self._current) if self._current is not None else []
        shards = (f"one of its {len(files)} shard(s) ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})"
                  if files else "one of its shards")
        raise DataError(
            f"data source {self.spec.name!r}: {self._where()} cannot read {shards} in epoch {self.epoch}: "
            f"{type(error).__name__}: {error}. Replace or remove the damaged shard (data.on_error: skip passes over "
            "a broken webdataset shard, not a parquet or hub one)") from error

    def _skip(self, ident: str, url: str, reason: str) -> None:
        if self.on_error == "raise":
            raise DataError(
                f"data source {self.spec.name!r}: example id={ident!r}" + (f" (shard {url})" if url else "")
                + f": {reason}. Fix or remove the example, or set data.on_error: skip to skip and count such examples."
            )
        self.skipped += 1
        if len(self.skipped_examples) < _SKIPPED_EXAMPLES_KEPT:
            self.skipped_examples.append({"id": ident, "path": url or "<stream>", "reason": reason})
        logger.debug("skipped stream example %s (%s): %s", ident, url, reason)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last example yielded (JSON-serialisable): the epoch, the raw examples
        read in it (``position``), the counts, and ``datasets``' own position in this epoch's shards
        (``dataset``; None before the epoch's first example). In a DataLoader worker this is the worker's
        position; torchdata's ``StatefulDataLoader`` collects one per worker (:class:`StreamLoader`)."""
        current = self._current.state_dict() if self._current is not None and self.position else None
        return {
            "version": _STATE_VERSION,
            "name": self.spec.name,
            "rank": self.rank,
            "world_size": self.world_size,
            "worker": self.worker,
            "num_workers": self.num_workers,
            "epoch": self.epoch,
            "position": self.position,
            "read": self.read,
            "yielded": self.yielded,
            "skipped": self.skipped,
            "skipped_examples": list(self.skipped_examples),
            "skipped_shard_count": self.skipped_shard_count,
            "skipped_shards": list(self.skipped_shards),
            "dataset": current if current is not None else self._dataset_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (call before iterating; in a worker, the worker's own state).

        Raises:
            DataError: the state was saved by another process layout (rank / number of processes / number of
                data-loader workers) or by an older xlipkit.
        """
        if state.get("version") != _STATE_VERSION:
            raise DataError(
                f"stream state version {state.get('version')!r} is not {_STATE_VERSION}: the checkpoint was saved "
                "by an older xlipkit whose stream position does not carry over to the multi-worker reader; resume "
                "with that version or start the run again")
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise DataError(
                f"the checkpoint's stream position was saved by process {state['rank']} of {state['world_size']}, "
                f"this is process {self.rank} of {self.world_size}: resume with the same number of processes"
            )
        if (state["worker"], state["num_workers"]) != (self.worker, self.num_workers):
            raise DataError(
                f"the checkpoint's stream position was saved by data-loader worker {state['worker']} of "
                f"{state['num_workers']}, this reader is worker {self.worker} of {self.num_workers}: resume with the "
                "same data.num_workers")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.read = int(state["read"])
        self.yielded = int(state["yielded"])
        self.skipped = int(state["skipped"])
        self.skipped_examples = list(state["skipped_examples"])
        self.skipped_shard_count = int(state.get("skipped_shard_count", 0))
        self.skipped_shards = list(state.get("skipped_shards", []))
        self._dataset_state = state["dataset"]
        self._resumed = True

    def report(self) -> dict[str, Any]:
        """Counts for ``metrics.json``: examples read, used and skipped (this reader) and the first skipped."""
        return {"epoch": self.epoch, "read": self.read, "used": self.yielded, "skipped": self.skipped,
                "skipped_examples": list(self.skipped_examples), "skipped_shard_count": self.skipped_shard_count,
                "skipped_shards": list(self.skipped_shards)}


# --------------------------------------------------------------------------- loader


def _unique_shards(entries: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    """The first few skipped shards, each once."""
    out: dict[str, dict[str, str]] = {}
    for entry in entries:
        out.setdefault(entry["shard"], entry)
    return list(out.values())[:_SKIPPED_EXAMPLES_KEPT]


def set_terms_epoch(objective: Any, epoch: int) -> None:
    """``Term.set_epoch(epoch)`` on every term of ``objective`` (the :class:`StreamLoader`'s ``on_epoch``)."""
    for term in objective.all_terms:
        term.set_epoch(epoch)


#: batch key under which a stream batch carries its reader's epoch and counts to the training process
STREAM_KEY = "_stream"


class StreamCollate:
    """The collate function of a :class:`StreamLoader`, run where the batch's examples were read (a worker):
    tells the objective the reader's epoch before collating (its per-example work, e.g. FLAIR's sub-caption
    draws, depends on it) and adds ``batch[STREAM_KEY]`` = the reader's worker id, epoch and counts after
    this batch, which the loader collects for ``metrics.json``.

    Args:
        collate_fn: examples -> batch (the model's image preprocessing and tokenizer, the objective's fields).
        stream: the stream iterated in the training process (``num_workers`` 0); in a worker the worker's
            copy (``get_worker_info().dataset``) is read instead.
        on_epoch: called with the reader's epoch whenever it changes (``Term.set_epoch`` of every term).
    """

    def __init__(self, collate_fn: Callable[[list[dict]], dict[str, Any]], stream: ExampleStream,
                 on_epoch: Callable[[int], None] | None = None) -> None:
        self.collate_fn = collate_fn
        self.stream = stream
        self.on_epoch = on_epoch
        self._epoch: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        stream = info.dataset if info is not None else self.stream
        if self.on_epoch is not None and stream.epoch != self._epoch:
            self.on_epoch(stream.epoch)
        self._epoch = stream.epoch
        batch = self.collate_fn(examples)
        batch[STREAM_KEY] = {"worker": stream.worker, **stream.report()}
        return batch


class StreamLoader:
    """This process's batches of a stream, read by ``num_workers`` DataLoader workers, with an exact,
    resumable position (torchdata's ``StatefulDataLoader`` over an :class:`ExampleStream`).

    Workers: ``min(num_workers, stream shards)`` (a warning says how many shards to write when a worker
    would have none). Each worker reads its own shards (:class:`ExampleStream`), decodes, transforms and
    collates, ``prefetch_factor`` batches ahead; the loader takes one batch from each worker in turn. The
    stream is endless and iterated once per run, so the workers live as long as the run (persistent without
    ``persistent_workers``).

    Position (:meth:`state_dict`, JSON): ``loader``, torchdata's state after the last batch this loader
    yielded: one :meth:`ExampleStream.state_dict` per worker (epoch, examples read in it, counts, and
    ``datasets``' position in the worker's shards) and which worker yields next; ``reports``, each worker's
    counts at its last batch; the process layout (``rank``, ``world_size``, ``num_workers``,
    ``num_shards``), checked by :meth:`load_state_dict`.

    Args:
        stream: this process's stream.
        batch_size: examples per batch (the process's share of the global batch).
        collate_fn: examples -> batch.
        num_workers: the recipe's ``data.num_workers`` (0: read in this process).
        pin_memory: page-locked batches, for fast non-blocking copies to an accelerator.
        prefetch_factor: batches each worker prepares ahead.
        on_epoch: ``Term.set_epoch`` of every term (see :class:`StreamCollate`).
        worker_init_fn: run in each worker as it starts (the trainer's makes workers ignore SIGINT / SIGTERM).
    """

    def __init__(self, stream: ExampleStream, *, batch_size: int, collate_fn: Callable[[list[dict]], dict[str, Any]],
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2,
                 on_epoch: Callable[[int], None] | None = None,
                 worker_init_fn: Callable[[int], None] | None = None) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.stream = stream
        self.spec = stream.spec
        self.num_shards = int(stream.dataset.num_shards)
        self.num_workers = min(num_workers, self.num_shards)
        if self.num_workers < num_workers:
            world = stream.world_size
            logger.warning(
                "data.num_workers=%d but process %d of %d has only %d shard(s) of %s: it reads them with %d worker(s). "
                "Write at least %d shards (processes x data.num_workers), best a multiple of it, to use every worker",
                num_workers, stream.rank, world, self.num_shards, self.spec.name, self.num_workers, world * num_workers)
        with warnings.catch_warnings():  # torchdata 0.11 on torch >= 2.10: "'set_vital' is deprecated"
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(
                stream, batch_size=batch_size, collate_fn=StreamCollate(collate_fn, stream, on_epoch), drop_last=True,
                num_workers=self.num_workers, pin_memory=pin_memory,
                prefetch_factor=prefetch_factor if self.num_workers else None, snapshot_every_n_steps=1,
                worker_init_fn=worker_init_fn if self.num_workers else None,
            )
        #: the epoch of the reader of the last batch yielded
        self.epoch = 0
        self._reports: dict[str, dict[str, Any]] = {}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            info = batch.pop(STREAM_KEY)
            self._reports[str(info.pop("worker"))] = info
            self.epoch = info["epoch"]
            yield batch

    # -- state -----------------------------------------------------------------------------------
    def _layout(self) -> dict[str, int]:
        return {"rank": self.stream.rank, "world_size": self.stream.world_size, "num_workers": self.num_workers,
                "num_shards": self.num_shards}

    def state_dict(self) -> dict[str, Any]:
        """This process's position after the last batch yielded (JSON-serialisable; see the class)."""
        return {"version": _LOADER_STATE_VERSION, "name": self.spec.name, **self._layout(), "epoch": self.epoch,
                "reports": self._reports, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (before iterating).

        Raises:
            DataError: saved with another number of processes, workers or shards, or by an older xlipkit.
        """
        if state.get("version") != _LOADER_STATE_VERSION or "loader" not in state:
            raise DataError(
                "the checkpoint's stream position was saved by an older xlipkit (one reader per process), which "
                "does not carry over to data-loader workers: resume with that version or start the run again")
        saved = {key: state.get(key) for key in self._layout()}
        if saved != self._layout():
            raise DataError(
                f"the checkpoint's stream position was saved by process {saved['rank']} of {saved['world_size']} "
                f"reading {saved['num_shards']} shards with {saved['num_workers']} data-loader worker(s); this is "
                f"process {self.stream.rank} of {self.stream.world_size} reading {self.num_shards} shards with "
                f"{self.num_workers}: resume with the same number of processes, data.train and data.num_workers")
        self.loader.load_state_dict(state["loader"])
        self._reports = {str(k): dict(v) for k, v in state["reports"].items()}
        self.epoch = int(state["epoch"])

    def report(self) -> dict[str, Any]:
        """This process's counts summed over its workers (as of the last batch yielded): ``read``, ``used``,
        ``skipped``, the first ``skipped_examples``, ``epoch`` (whole passes over all of the process's shards:
        the slowest worker's epoch) and ``num_workers``."""
        reports = list(self._reports.values()) or [self.stream.report()]
        return {"epoch": min(r["epoch"] for r in reports), "read": sum(r["read"] for r in reports),
                "used": sum(r["used"] for r in reports), "skipped": sum(r["skipped"] for r in reports),
                "skipped_examples": [e for r in reports for e in r["skipped_examples"]][:_SKIPPED_EXAMPLES_KEPT],
                "skipped_shard_count": sum(r.get("skipped_shard_count", 0) for r in reports),
                "skipped_shards": _unique_shards(e for r in reports for e in r.get("skipped_shards", [])),
                "num_workers": self.num_workers}

    def preview(self) -> list[dict[str, Any]]:
        """The first examples of this process's stream (``stream.keep`` of them, with ``transform`` applied),
        for the report: those the training process read itself or, when workers read the stream, the first
        examples of epoch 0 of this process's shards, read again here (examples the workers trained on)."""
        if self.stream.preview:
            return list(self.stream.preview)
        s = self.stream
        fresh = ExampleStream(s.dataset, s.spec, on_error="skip", transform=s.transform, rank=s.rank,
                              world_size=s.world_size, keep=s.keep)
        return list(itertools.islice(iter(fresh), s.keep))


# --------------------------------------------------------------------------- registry entries


def _stream_only(spec: SourceSpec) -> datasets.Dataset:
    raise DataError(
        f"data source {spec.name!r} is read as a stream and can only be data.train (with train.max_steps); "
        "evaluation sets are map-style sources"
    )


register_source("webdataset", description="webdataset tar shards (urls with {00000..00099} ranges), streamed; "
                "data.train only")(_stream_only)
register_source("hub", description="a hub dataset id (or local dataset folder) streamed with datasets; "
                "data.train only")(_stream_only)
