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

Each process reads its own shards (``datasets.distributed.split_dataset_by_node``: whole shards when their
number is a multiple of the number of processes, else every ``world_size``-th example), so a step's global
batch is the processes' local batches together. :class:`ExampleStream` turns the raw examples into the
examples every source yields (``{"id", "image": RGB PIL image, "caption"}``, plus ``captions``), skips and
counts bad ones (unreadable image, empty caption) or stops on the first (``data.on_error``), runs the
objective's per-example work (:meth:`finetune.objectives.base.Term.stream_map`) and saves and restores its
position (``state_dict`` / ``load_state_dict``, the ``datasets`` iterable dataset's own state plus the epoch
and the counts), so that a resumed run sees exactly the examples an uninterrupted one would.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import torch

from finetune.data.images import DataError, ImageReadError, read_image
from finetune.data.sources import STREAM_SOURCES, SourceSpec, _data_files, register_source

__all__ = [
    "STREAM_SOURCES",
    "WEBDATASET_IMAGE_KEYS",
    "ExampleStream",
    "check_stream_recipe",
    "expand_urls",
    "open_stream",
]

logger = logging.getLogger(__name__)

#: webdataset keys tried, in order, for the image when ``image_column`` is left at ``image``
WEBDATASET_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
#: keys tried, in order, for the caption when ``caption_column`` is left at ``caption``
#: (``json.caption``: the ``caption`` field of a webdataset ``KEY.json``)
DEFAULT_CAPTION_KEYS = ("txt", "text", "json.caption")
_SKIPPED_EXAMPLES_KEPT = 5
_STATE_VERSION = 1
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


def open_stream(spec: SourceSpec | dict | str, *, rank: int = 0, world_size: int = 1) -> datasets.IterableDataset:
    """Open a stream source as a ``datasets.IterableDataset`` holding this process's share.

    Image columns are not decoded (``{"bytes", "path"}`` dicts): :class:`ExampleStream` decodes them, so
    that an unreadable image is a counted bad example, not an error inside the iterator.

    Args:
        spec: a stream entry (:attr:`SourceSpec.is_stream`).
        rank, world_size: this process and the number of processes
            (``datasets.distributed.split_dataset_by_node``).
    Returns:
        the raw stream: shuffled as ``shuffle_buffer`` says (seeded by ``seed``), split by process.
    Raises:
        DataError: not a stream, missing shard files, a source ``datasets`` cannot read.
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
    try:
        if spec.name == "webdataset":
            files = _stream_files(spec, ".tar")
            ds = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
        elif spec.name == "parquet":
            files = _stream_files(spec, ".parquet")
            ds = datasets.load_dataset("parquet", data_files={"train": files}, split="train", streaming=True)
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
        raise DataError(f"data source {spec.name!r} ({where!r}): cannot open as a stream: {error}") from error
    if not isinstance(ds, datasets.IterableDataset):
        raise DataError(f"data source {spec.name!r}: expected one split as a stream, got {type(ds).__name__}; "
                        "set split")
    ds = ds.decode(False)
    if spec.shuffle_buffer:
        ds = ds.shuffle(seed=spec.seed, buffer_size=spec.shuffle_buffer)
    if world_size > 1:
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
    return ds


def _check_fields(spec: SourceSpec) -> list[str]:
    """``options.fields``: raw columns (``json.FIELD`` for a field of a webdataset ``KEY.json``) carried into
    every example under their last name (FLAIR's pre-split DreamLIP caption fields)."""
    fields = spec.options.get("fields", [])
    if not isinstance(fields, list) or not all(isinstance(f, str) and f for f in fields):
        raise DataError(f"data source {spec.name!r}: options.fields must be a list of column names (json.FIELD for a "
                        f"field of KEY.json), got {fields!r}")
    return list(fields)


def check_stream_recipe(recipe: Any) -> None:
    """Recipe checks for a streamed ``data.train``, run before the model loads.

    Raises:
        RecipeError: ``train.max_steps`` is null (a stream has no length to count epochs with), an
            objective term cannot run on streamed examples (naming the option that makes it streamable), or a
            term reads an example field the stream does not pass through (``data.train.options.fields``).
    """
    from finetune.config import RecipeError

    try:
        spec = SourceSpec.parse(recipe.data.train)
        streaming = spec.is_stream
    except DataError as error:
        raise RecipeError(f"data.train: {error}", key="data.train") from None
    if not streaming:
        return
    if recipe.train.max_steps is None:
        raise RecipeError(
            f"data.train is a stream ({spec.name}) whose length is unknown, so train.epochs cannot be counted: "
            "set train.max_steps (the number of optimiser steps)", key="train.max_steps")
    from finetune.objectives import build_objective

    try:
        objective = build_objective(recipe.objective)
        objective.check_stream()
    except ValueError as error:
        raise RecipeError(str(error), key="objective") from None
    _check_example_fields(spec, objective, recipe)


#: the fields every streamed example has (:class:`ExampleStream`), besides ``options.fields``
STREAM_EXAMPLE_FIELDS = frozenset({"id", "image", "caption", "captions", "url"})


def _check_example_fields(spec: SourceSpec, objective: Any, recipe: Any) -> None:
    """A RecipeError when a term reads an example field (:meth:`~finetune.objectives.base.Term.example_fields`)
    that the stream does not pass through: without it the first batch would raise, after the evaluation."""
    from finetune.config import RecipeError

    try:
        fields = _check_fields(spec)
    except DataError as error:
        raise RecipeError(f"data.train: {error}", key="data.train.options.fields") from None
    passed = {key.rpartition(".")[2] for key in fields} | STREAM_EXAMPLE_FIELDS
    missing: dict[str, list[str]] = {}
    for term in objective.all_terms:
        for name, key in term.example_fields().items():
            if name not in passed:
                missing.setdefault(key, []).append(name)
    if missing:
        key, names = next(iter(missing.items()))
        given = ", ".join(fields) or "none"
        where = f"{recipe.source}: " if getattr(recipe, "source", None) else ""
        raise RecipeError(
            f"{where}{key} reads {', '.join(names)} from every example, which data.train (a {spec.name} stream) does not "
            f"pass through (data.train.options.fields: {given}): add "
            f"{', '.join('json.' + n if spec.name == 'webdataset' else n for n in names)} to data.train.options.fields "
            f"(json.FIELD for a field of a webdataset KEY.json), or set {key}: null",
            file=getattr(recipe, "source", None), key="data.train.options.fields")


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


class ExampleStream(torch.utils.data.IterableDataset):
    """This process's endless stream of validated examples, epoch after epoch, with a resumable position.

    Yields ``{"id": str, "image": RGB PIL image, "caption": str}`` (plus ``captions`` when the caption
    column holds lists, ``url`` for webdataset shards) updated with what ``transform`` returns (the
    objective's :meth:`~finetune.objectives.base.Objective.stream_map`). Columns map as for map-style
    sources: ``image_column`` (default ``image``, else the first webdataset key of
    :data:`WEBDATASET_IMAGE_KEYS`), ``caption_column`` (default ``caption``, else ``txt``, ``text`` or the
    ``caption`` field of ``json``; ``json.FIELD`` reads another field), ``options.fields`` (more raw columns,
    each kept under its last name: ``json.long_IB_captions`` -> ``long_IB_captions``), ``id_column`` (default ``id``, else
    the webdataset ``__key__``, else ``<name>-<rank>-<epoch>-<position>``).

    Iterate it once (the trainer's loader does): every epoch calls ``set_epoch`` on the raw stream (a new
    shard order when shuffling) and continues.

    Args:
        dataset: the raw stream (:func:`open_stream`).
        spec: its entry (names the columns).
        on_error: ``skip`` (count bad examples, keep the first few) or ``raise`` (:class:`DataError` on the
            first, naming its id and shard).
        transform: ``example -> extra fields``, run on every good example.
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
        self._resumed = False
        self._keys: tuple[str, str, str | None] | None = None

    # -- columns ---------------------------------------------------------------------------------
    def _resolve_keys(self, raw: dict[str, Any]) -> tuple[str, str, str | None]:
        spec = self.spec
        columns = list(self.dataset.column_names or raw.keys())

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

    def _example(self, raw: dict[str, Any]) -> tuple[dict[str, Any], str | None, str]:
        """(example, reason it is bad or None, where it came from)."""
        if self._keys is None:
            self._keys = self._resolve_keys(raw)
        image_key, caption_key, id_key = self._keys
        value = _lookup(raw, id_key) if id_key else None
        ident = str(value) if value is not None else f"{self.spec.name}-{self.rank}-{self.epoch}-{self.position - 1}"
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
        if isinstance(caption, (list, tuple)):
            example["captions"] = [str(c) for c in caption if isinstance(c, str)]
            caption = next((c for c in example["captions"] if c.strip()), "")
        if not isinstance(caption, str) or not caption.strip():
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
        return example, None, url

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        resumed = self._resumed
        while True:
            self.dataset.set_epoch(self.epoch)
            usable = 0
            for raw in self.dataset:
                self.position += 1
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
                raise DataError(
                    f"data source {self.spec.name!r}: process {self.rank} of {self.world_size} found no usable "
                    f"examples in epoch {self.epoch} ({self.position} read, {self.skipped} skipped in all; first: "
                    f"{self.skipped_examples[:1]}); check data.train (urls, columns) and that there are at least "
                    "as many shards as processes"
                )
            resumed = False
            self.epoch += 1
            self.position = 0

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
        """The position after the last example yielded (JSON-serialisable): the raw stream's
        ``state_dict()``, the epoch and the counts."""
        return {
            "version": _STATE_VERSION,
            "name": self.spec.name,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "position": self.position,
            "read": self.read,
            "yielded": self.yielded,
            "skipped": self.skipped,
            "skipped_examples": list(self.skipped_examples),
            "dataset": self.dataset.state_dict() if self.read else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (call before iterating).

        Raises:
            DataError: the state was saved by another process layout (rank / number of processes).
        """
        if state.get("version") != _STATE_VERSION:
            raise DataError(f"stream state version {state.get('version')!r} is not {_STATE_VERSION}")
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise DataError(
                f"the checkpoint's stream position was saved by process {state['rank']} of {state['world_size']}, "
                f"this is process {self.rank} of {self.world_size}: resume with the same number of processes"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.read = int(state["read"])
        self.yielded = int(state["yielded"])
        self.skipped = int(state["skipped"])
        self.skipped_examples = list(state["skipped_examples"])
        if state["dataset"] is not None:
            self.dataset.load_state_dict(state["dataset"])
        self._resumed = True

    def report(self) -> dict[str, Any]:
        """Counts for ``metrics.json``: examples read, used and skipped (this process) and the first skipped."""
        return {"epoch": self.epoch, "read": self.read, "used": self.yielded, "skipped": self.skipped,
                "skipped_examples": list(self.skipped_examples)}


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
