"""The data-source registry and the generic local formats (JSONL, CSV, parquet, image folders).

A recipe names its data as a :class:`SourceSpec` (``data.train: {name: synthetic, size: 2000}``,
``eval.sets: [docci, urban1k]``). :func:`load_source` looks the name up in the registry
(:func:`register_source`), calls the builder, then validates and normalises what it returns in
one place: columns ``id`` (str), ``image`` (``datasets.Image()`` decoding to RGB) and ``caption``
(str), plus ``captions`` (list[str]) where a source has several per image. Examples with a
missing, empty (0-byte) or corrupt image or an empty caption are skipped and counted
(``on_error="skip"``, the default) or stop loading with a :class:`DataError` naming the id and
path (``on_error="raise"``).

Validation stays fast for large sets: each image is only probed (header + PIL ``verify()``, see
:func:`finetune.data.images.probe_image`), the image bytes are never rewritten unless an image
needs a conversion that ``PIL.Image.convert("RGB")`` gets wrong (alpha, 16-bit), and skipped rows
are dropped through an index mapping (``Dataset.select``), not a copy.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import hashlib
import io
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import datasets

import finetune.plugins as plugins
from finetune.data.bad_rows import collecting, decode_utf8, read_utf8_text, report_bad_row, utf8_jsonl
from finetune.data.images import (IMAGE_EXTENSIONS, DataError, ImageReadError, broken_link_reason, image_files,
                                  probe_image, read_image)
from finetune.data.text import as_captions, lone_surrogate

__all__ = [
    "DataError",
    "SourceSpec",
    "SourceBuilder",
    "LoadedSource",
    "register_source",
    "available_sources",
    "source_takes_path",
    "load_source",
    "source_cache_dir",
]

logger = logging.getLogger(__name__)

SourceBuilder = Callable[["SourceSpec"], datasets.Dataset]

#: sources that can be read as a stream (``finetune.data.streams``); the first two only as a stream
STREAM_SOURCES = ("webdataset", "hub", "parquet")
_ON_ERROR = ("skip", "raise")
_VALIDATE = ("header", "quick", "full")  # "quick" is the older name of "header"
_SKIPPED_EXAMPLES_KEPT = 5
_cache_dir: contextvars.ContextVar[str | None] = contextvars.ContextVar("xlipkit_source_cache_dir", default=None)


def _closest(word: str, options: list[str]) -> str:
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


@dataclass
class SourceSpec:
    """What a recipe's ``data.train`` or an ``eval.sets`` entry holds.

    Attributes:
        name: registered source name (``synthetic``, ``jsonl``, ``csv``, ``parquet``,
            ``imagefolder``, ``docci``, ...; see :func:`available_sources`).
        path: a local folder or file.
        split: ``train`` / ``test`` / ...; for a folder of files, selects ``SPLIT*.ext`` files or
            the ``SPLIT/`` sub-folder.
        protocol: a benchmark's evaluation protocol (default: the first one it registers).
        size: number of scenes (synthetic).
        seed: random seed (synthetic).
        limit: keep the first N examples (after the split / protocol, before validation).
        image_column, caption_column, id_column: column names in the raw data (generic formats);
            without ``id_column`` an ``id`` column is used if present, else the row index (tables)
            or the file name (image folders).
        options: source-specific extras (``hub`` streams: ``config``, ``revision``,
            ``data_files``).
        urls: shard files or URLs of a stream (``webdataset``, ``parquet``): a string or a list of
            strings with webdataset-style brace ranges, ``shards/{00000..00099}.tar`` (see
            :func:`finetune.data.streams.expand_urls`).
        streaming: read the source as a stream (``finetune.data.streams``) instead of a map-style
            dataset; ``null`` (default): ``webdataset`` and ``hub`` stream, ``parquet`` streams when
            ``urls`` is set. Only ``data.train`` can be a stream.
        format: the format of a stream, ``webdataset`` / ``parquet`` / ``hub``: an alias of ``name``
            for stream entries (``{"format": "webdataset", "urls": ...}`` is
            ``{"name": "webdataset", "urls": ...}``); given with ``name``, the two must agree.
        shuffle_buffer: stream shuffling: ``0`` keeps the shard and example order; ``1`` (default)
            reshuffles the shard order every epoch from ``seed`` (resume is exact); ``N > 1`` also
            passes the examples through a shuffle buffer of N (a resumed run refills the buffer, so
            the up to N examples held in it at the checkpoint are not seen in that epoch).
    """

    name: str
    path: str | None = None
    split: str | None = None
    protocol: str | None = None
    size: int | None = None
    seed: int = 0
    limit: int | None = None
    image_column: str = "image"
    caption_column: str = "caption"
    id_column: str | None = None
    options: dict = field(default_factory=dict)
    urls: str | list[str] | None = None
    streaming: bool | None = None
    format: str | None = None
    shuffle_buffer: int = 1

    #: the recipe keys this entry was written with (set when a recipe is loaded: ``finetune.config.sources``),
    #: so that the resolved recipe writes it back as written; empty: ``name`` and the keys off their defaults
    given_keys: ClassVar[tuple[str, ...]] = ()

    def recipe_entry(self) -> dict[str, Any]:
        """The entry as a recipe writes it (plain YAML values): the keys it was given
        (:attr:`given_keys`), else ``name`` and every key that differs from its default. Loading the result
        gives an equal spec (``recipe.yaml`` of a run folder)."""
        keys = self.given_keys or ["name", *(f.name for f in dataclasses.fields(self)
                                             if f.name != "name" and getattr(self, f.name) != _default(f))]
        out = {}
        for key in keys:
            value = getattr(self, key)
            out[key] = dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value
        return out

    # read access by key, as when recipes kept entries as mappings (``spec["name"]``, ``dict(spec)``)
    def __getitem__(self, key: str) -> Any:
        if key not in _SPEC_TYPES:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """``spec[key]``, or ``default`` for a key that is no ``SourceSpec`` field."""
        return getattr(self, key) if key in _SPEC_TYPES else default

    def keys(self) -> list[str]:
        """The keys of :meth:`recipe_entry` (so that ``dict(spec)`` is the entry as written)."""
        return list(self.recipe_entry())

    @classmethod
    def parse(cls, value: str | dict | SourceSpec) -> SourceSpec:
        """Build a spec from a recipe value: ``"docci"``, ``"docci:goal"`` (name and protocol, as
        in recipes) or ``{"name": "docci", ...}``.

        Raises:
            DataError: naming the key and how to fix it, on an unknown key (with the closest
                valid one), a wrong type or a missing ``name``.
        """
        if isinstance(value, SourceSpec):
            return value
        if isinstance(value, str):
            name, _, protocol = value.strip().partition(":")
            value = {"name": name.strip(), "protocol": protocol.strip() or None}
        if not isinstance(value, dict):
            raise DataError(
                f"a data source must be a name (e.g. 'synthetic') or a mapping with a 'name' key, "
                f"got {type(value).__name__}: {value!r}"
            )
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in valid:
                raise DataError(
                    f"unknown data source key {key!r}{_closest(str(key), valid)}; valid keys: {', '.join(valid)}"
                )
        fmt = value.get("format")
        if fmt is not None:
            if fmt not in STREAM_SOURCES:
                raise DataError(f"data source key 'format' must be one of {', '.join(STREAM_SOURCES)}, got {fmt!r}")
            if value.get("name", fmt) != fmt:
                raise DataError(f"data source has name {value['name']!r} and format {fmt!r}: give one of them")
            value = {**value, "name": fmt}
        if "name" not in value:
            raise DataError(f"a data source needs a 'name' (one of the registered sources), got {value!r}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in value:
                kwargs[f.name] = _check_type(f.name, value[f.name])
        spec = cls(**kwargs)
        if not spec.name:
            raise DataError("data source 'name' must not be empty")
        spec.is_stream  # checks streaming / urls against the name
        return spec

    @property
    def is_stream(self) -> bool:
        """Whether this entry is read as a stream (``finetune.data.streams``): ``webdataset`` and ``hub``
        always, ``parquet`` with ``urls`` or ``streaming: true``.

        Raises:
            DataError: ``streaming``/``urls`` on a source that cannot stream, or ``streaming: false`` on
                one that only streams.
        """
        if self.name in STREAM_SOURCES[:2]:
            if self.streaming is False:
                raise DataError(f"data source {self.name!r} is read as a stream only: remove streaming: false")
            return True
        if self.name == "parquet":
            if self.streaming is False and self.urls is not None:
                raise DataError("data source 'parquet': urls are read as a stream; use path for a map-style "
                                "parquet source, or remove streaming: false")
            return bool(self.streaming) or self.urls is not None
        if self.streaming or self.urls is not None:
            key = "streaming: true" if self.streaming else "urls"
            raise DataError(f"data source {self.name!r} cannot be streamed ({key}); streams are "
                            f"{', '.join(STREAM_SOURCES)}")
        return False


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# key -> (accepted types, expected type in words, may be None)
_SPEC_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {
    "name": ((str,), "a string", False),
    "path": ((str, os.PathLike), "a path string", True),
    "split": ((str,), "a string", True),
    "protocol": ((str,), "a string", True),
    "size": ((int,), "an integer", True),
    "seed": ((int,), "an integer", False),
    "limit": ((int,), "an integer", True),
    "image_column": ((str,), "a string", False),
    "caption_column": ((str,), "a string", False),
    "id_column": ((str,), "a string", True),
    "options": ((dict,), "a mapping", False),
    "urls": ((str, list), "a string or a list of strings", True),
    "streaming": ((bool,), "true or false", True),
    "format": ((str,), "a string", True),
    "shuffle_buffer": ((int,), "an integer >= 0", False),
}


def _check_type(key: str, value: Any) -> Any:
    types, words, nullable = _SPEC_TYPES[key]
    if value is None and nullable:
        return None
    if key == "streaming":
        if not isinstance(value, bool):
            raise DataError(
                f"data source key 'streaming' must be true, false or null, got {type(value).__name__}: {value!r}"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, types):
        raise DataError(
            f"data source key {key!r} must be {words}{' or null' if nullable else ''}, "
            f"got {type(value).__name__}: {value!r}"
        )
    if key in ("size", "limit") and value < 1:
        raise DataError(f"data source key {key!r} must be positive, got {value}")
    if key == "shuffle_buffer" and value < 0:
        raise DataError(f"data source key 'shuffle_buffer' must be >= 0, got {value}")
    if key == "urls" and isinstance(value, list):
        if not value or not all(isinstance(u, str) and u for u in value):
            raise DataError(f"data source key 'urls' must be a non-empty list of non-empty strings, got {value!r}")
        return list(value)
    if key == "path":
        return os.fspath(value)
    if key == "options":
        return dict(value)
    return value


@dataclass(frozen=True)
class _Entry:
    builder: SourceBuilder
    description: str
    protocols: tuple[str, ...]
    splits: tuple[str, ...]
    takes_path: bool = True


    @property
    def target(self) -> SourceBuilder:
        return self.builder


# the registry is finetune.plugins.DATA_SOURCES: its first lookup imports every module of finetune.data
_REGISTRY = plugins.DATA_SOURCES


def register_source(
    name: str, *, description: str = "", protocols: tuple[str, ...] = (), splits: tuple[str, ...] = (),
    takes_path: bool = True,
) -> Callable[[SourceBuilder], SourceBuilder]:
    """Register a source builder under ``name`` (a decorator).

    Args:
        name: the name recipes use.
        description: one line for :func:`available_sources` and ``run.py --list``.
        protocols: the evaluation protocols the builder knows, default first; a spec without a
            protocol gets the first, an unknown one is an error listing them.
        splits: the splits the builder knows (empty: any); an unknown one is an error.
        takes_path: whether the source reads ``path`` (``False`` for one that makes its own data,
            as ``synthetic``: a recipe that gives it a path is an error).
    Returns:
        the decorator, which returns the builder unchanged.
    """

    def decorator(builder: SourceBuilder) -> SourceBuilder:
        existing = _REGISTRY.peek(name)
        if existing is not None and existing.builder.__qualname__ != builder.__qualname__:
            raise ValueError(f"data source {name!r} is already registered by {existing.builder.__module__}")
        _REGISTRY.add(name, _Entry(builder, description, tuple(protocols), tuple(splits), takes_path), replace=True)
        return builder

    return decorator


def _import_builtins() -> None:
    _REGISTRY.discover()  # the discovery rule of finetune.plugins: every module of finetune.data


def available_sources() -> dict[str, str]:
    """The registered sources: name -> description (built-ins imported first)."""
    _import_builtins()
    return {name: entry.description for name, entry in sorted(_REGISTRY.items())}


def source_takes_path(name: str) -> bool:
    """Whether the registered source ``name`` reads a ``path`` (built-ins imported first);
    ``True`` for a name that is not registered (its own error comes from the name check)."""
    _import_builtins()
    entry = _REGISTRY.peek(name)
    return True if entry is None else entry.takes_path


def source_cache_dir() -> str | None:
    """The ``cache_dir`` passed to the running :func:`load_source` (for builders that download)."""
    return _cache_dir.get()


@dataclass
class LoadedSource:
    """A validated source.

    Attributes:
        dataset: columns ``id`` (str), ``image`` (``datasets.Image(mode="RGB")``, decodes to an
            RGB PIL image), ``caption`` (str, non-empty); optional ``captions`` (list[str]),
            ``sentences``, ``objects`` and any other column the builder returned.
        name, split, protocol: as resolved (protocol defaults to the builder's first).
        skipped: number of examples dropped by validation.
        skipped_examples: the first few dropped, as ``{"id", "path", "reason"}``.
        skipped_ids: the ids of all dropped examples, in order (for ``metrics.json``).
        info: ``num_examples``, ``num_read`` (before skipping), ``ids_sha256`` (of the kept ids,
            in order, newline-joined), ``path``, ``columns``.
    """

    dataset: datasets.Dataset
    name: str
    split: str | None
    protocol: str | None
    skipped: int
    skipped_examples: list[dict]
    info: dict
    skipped_ids: list[str] = field(default_factory=list)


def load_source(
    spec: SourceSpec | str | dict,
    *,
    on_error: str = "skip",
    cache_dir: str | None = None,
    validate: str = "quick",
) -> LoadedSource:
    """Build a registered source, validate every example and normalise its columns.

    Args:
        spec: a :class:`SourceSpec` or what :meth:`SourceSpec.parse` accepts.
        on_error: ``"skip"`` (count and drop bad examples; the count and the first ids are
            logged and returned) or ``"raise"`` (stop at the first, naming its id and path).
        cache_dir: where builders cache what they read or download (``datasets`` cache for
            the generic formats); None: the ``datasets`` default.
        validate: ``"header"`` (or its older name ``"quick"``) probes each image (header, size,
            ``verify()``, and a full decode of a JPEG without its end marker); ``"full"`` decodes
            every image (the recipe's ``data.validate``).
    Returns:
        the :class:`LoadedSource`.
    Raises:
        DataError: unknown source (listing the registered ones), unknown split or protocol,
            missing columns, or, with ``on_error="raise"``, the first bad example.
    """
    if on_error not in _ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(_ON_ERROR)}, got {on_error!r}")
    if validate not in _VALIDATE:
        raise ValueError(f"validate must be one of {', '.join(_VALIDATE)}, got {validate!r}")
    spec = SourceSpec.parse(spec)
    if spec.is_stream:
        raise DataError(
            f"data source {spec.name!r} is a stream (urls, streaming or a stream-only source): only data.train "
            "can be a stream, read with finetune.data.streams.open_stream; for a map-style parquet source set "
            "path and remove urls / streaming"
        )
    _import_builtins()
    entry = _REGISTRY.peek(spec.name)
    if entry is None:
        names = _REGISTRY.names()
        raise DataError(
            f"unknown data source {spec.name!r}{_closest(spec.name, names)}; registered sources: {', '.join(names)}"
        )
    spec = _resolve_split_and_protocol(spec, entry)
    token = _cache_dir.set(cache_dir)
    try:
        with collecting(on_error) as unreadable_rows:  # rows the builder could not read (not UTF-8, ...)
            dataset = entry.builder(spec)
    finally:
        _cache_dir.reset(token)
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"the builder of data source {spec.name!r} returned {type(dataset).__name__}, not a datasets.Dataset")
    dataset = _standardise_columns(dataset, spec)
    if spec.limit is not None and spec.limit < len(dataset):
        dataset = dataset.select(range(spec.limit))
    num_read = len(dataset)
    dataset, skipped = _validate(dataset, spec, on_error=on_error, full=validate == "full")
    num_read += len(unreadable_rows)
    skipped = unreadable_rows + skipped
    _check_unique_ids(dataset, spec, on_error)
    if skipped:
        shown = "; ".join(f"id={e['id']} path={e['path']}: {e['reason']}" for e in skipped[:_SKIPPED_EXAMPLES_KEPT])
        logger.warning(
            "data source %r: skipped %d of %d examples (first: %s). Set data.on_error: raise to stop on the first one.",
            spec.name, len(skipped), num_read, shown,
        )
    if len(dataset) == 0:
        first = "; ".join(f"id={e['id']}: {e['reason']}" for e in skipped[:_SKIPPED_EXAMPLES_KEPT])
        raise DataError(
            f"data source {spec.name!r}{_where(spec)} has no usable examples ({num_read} read"
            + (f", all skipped; first: {first})" if skipped else ")")
        )
    ids = list(dataset["id"])
    info = {
        "num_examples": len(dataset),
        "num_read": num_read,
        "ids_sha256": hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest(),
        "path": spec.path,
        "columns": list(dataset.column_names),
    }
    return LoadedSource(
        dataset=dataset,
        name=spec.name,
        split=spec.split,
        protocol=spec.protocol,
        skipped=len(skipped),
        skipped_examples=skipped[:_SKIPPED_EXAMPLES_KEPT],
        info=info,
        skipped_ids=[str(e["id"]) for e in skipped],
    )


def _check_unique_ids(dataset: datasets.Dataset, spec: SourceSpec, on_error: str) -> None:
    """Duplicate ids break per-id caches and skipped-id lists: an error with ``on_error="raise"``,
    else a warning naming the first few."""
    counts: dict[str, int] = {}
    for id_ in dataset["id"]:
        counts[id_] = counts.get(id_, 0) + 1
    repeated = [(id_, n) for id_, n in counts.items() if n > 1]
    if not repeated:
        return
    shown = ", ".join(f"{id_!r} ({n}x)" for id_, n in repeated[:_SKIPPED_EXAMPLES_KEPT])
    message = (f"data source {spec.name!r}{_where(spec)} has {len(repeated)} duplicate ids (first: {shown}); "
               "ids must be unique per source: set id_column to a unique column or fix the data")
    if on_error == "raise":
        raise DataError(message)
    logger.warning(message)


def _resolve_split_and_protocol(spec: SourceSpec, entry: _Entry) -> SourceSpec:
    if entry.protocols:
        if spec.protocol is None:
            spec = dataclasses.replace(spec, protocol=entry.protocols[0])
        elif spec.protocol not in entry.protocols:
            raise DataError(
                f"data source {spec.name!r} has no protocol {spec.protocol!r}; protocols: {', '.join(entry.protocols)}"
            )
    elif spec.protocol is not None:
        raise DataError(f"data source {spec.name!r} has no protocols; remove protocol: {spec.protocol!r}")
    if entry.splits and spec.split is not None and spec.split not in entry.splits:
        raise DataError(f"data source {spec.name!r} has no split {spec.split!r}; splits: {', '.join(entry.splits)}")
    return spec


# --------------------------------------------------------------------------- normalisation


def _is_string_list(feature: Any) -> bool:
    return isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)) and getattr(
        feature.feature, "dtype", None
    ) in ("string", "large_string")


def _standardise_columns(dataset: datasets.Dataset, spec: SourceSpec) -> datasets.Dataset:
    """Rename the spec's columns to ``image``/``caption``/``id`` and derive what is missing."""
    columns = dataset.column_names
    for target, key in (("image", "image_column"), ("caption", "caption_column")):
        source = getattr(spec, key)
        if target in columns:
            continue
        if source in columns:
            dataset = dataset.rename_column(source, target)
            columns = dataset.column_names
            continue
        raise DataError(
            f"data source {spec.name!r}{_where(spec)} has no {target} column {source!r}; columns: "
            f"{', '.join(columns)}. Set {key} to the column that holds the {target}{_closest(source, columns)}."
        )
    # Undecoded from here on: maps below must not decode images.
    dataset = dataset.cast_column("image", datasets.Image(decode=False))
    if _is_string_list(dataset.features["caption"]):
        if "captions" in columns:
            raise DataError(
                f"data source {spec.name!r}{_where(spec)}: 'caption' holds lists and a 'captions' column exists too; "
                "set caption_column to the single-caption column"
            )
        dataset = dataset.rename_column("caption", "captions")
        dataset = dataset.map(
            lambda lists: {"caption": [_first_non_empty(captions) for captions in lists]},
            input_columns=["captions"],
            batched=True,
            desc="first caption",
        )
    if "id" not in dataset.column_names:
        if spec.id_column is not None and spec.id_column in dataset.column_names:
            dataset = dataset.rename_column(spec.id_column, "id")
        elif spec.id_column is not None:
            raise DataError(
                f"data source {spec.name!r}{_where(spec)} has no id column {spec.id_column!r}; columns: "
                f"{', '.join(dataset.column_names)}{_closest(spec.id_column, dataset.column_names)}"
            )
        else:
            dataset = dataset.map(
                lambda _, indices: {"id": [str(i) for i in indices]},
                input_columns=["caption"],
                with_indices=True,
                batched=True,
                desc="row ids",
            )
    if dataset.features["id"] != datasets.Value("string"):
        dataset = dataset.cast_column("id", datasets.Value("string"))
    return dataset


def _first_non_empty(captions: list | None) -> str:
    return next((c for c in (captions or []) if isinstance(c, str) and c.strip()), "")


def _caption_problem(caption: Any) -> str:
    """Why a caption that is not a string cannot be used (its type, not "empty caption")."""
    try:
        as_captions(caption)
    except (TypeError, ValueError) as error:
        return str(error).split(";")[0]
    return "empty caption"


def _where(spec: SourceSpec) -> str:
    return f" ({spec.path})" if spec.path else ""


def _validate(
    dataset: datasets.Dataset, spec: SourceSpec, *, on_error: str, full: bool
) -> tuple[datasets.Dataset, list[dict]]:
    """Probe every example; return the dataset without the bad ones and what was dropped."""
    keep: list[int] = []
    skipped: list[dict] = []
    converted: dict[int, dict] = {}
    view = dataset.select_columns(["id", "image", "caption"])
    index = 0
    for batch in view.iter(batch_size=256):
        for id_, image, caption in zip(batch["id"], batch["image"], batch["caption"]):
            path = (image or {}).get("path") or ("<bytes>" if image and image.get("bytes") else "<none>")
            reason = None
            if not isinstance(caption, str):
                reason = _caption_problem(caption)
            elif not caption.strip():
                reason = "empty caption"
            elif image is None:
                reason = "no image"
            else:
                try:
                    info = probe_image(image)
                    if full or info.needs_conversion:
                        rgb = read_image(image)
                        if info.needs_conversion:
                            buffer = io.BytesIO()
                            rgb.save(buffer, format="PNG")
                            converted[index] = {"bytes": buffer.getvalue(), "path": image.get("path")}
                except ImageReadError as error:
                    reason = error.reason
            if reason is None:
                keep.append(index)
            else:
                if on_error == "raise":
                    raise DataError(
                        f"data source {spec.name!r}: example id={id_!r} (image {path}): {reason}. Fix or remove "
                        "the example, or set data.on_error: skip to skip and count such examples."
                    )
                skipped.append({"id": id_, "path": path, "reason": reason})
            index += 1
    if converted:
        image_feature = datasets.Image(decode=False)

        def replace(images: list, indices: list[int]) -> dict:
            return {"image": [converted.get(i, image) for image, i in zip(images, indices)]}

        dataset = dataset.map(
            replace,
            input_columns=["image"],
            with_indices=True,
            batched=True,
            features=datasets.Features({**dataset.features, "image": image_feature}),
            desc="converting images to RGB",
        )
    if skipped:
        dataset = dataset.select(keep)
    return dataset.cast_column("image", datasets.Image(mode="RGB")), skipped


# --------------------------------------------------------------------------- generic formats


def _require_path(spec: SourceSpec) -> Path:
    if not spec.path:
        raise DataError(f"data source {spec.name!r} needs a path: set path to a file or a folder of files")
    path = Path(spec.path).expanduser()
    if not path.exists():
        raise DataError(f"data source {spec.name!r}: path {str(path)!r} does not exist")
    return path


def _data_files(spec: SourceSpec, extensions: tuple[str, ...]) -> list[Path]:
    """The files of a tabular source: the file itself, or a folder's files (of a split)."""
    path = _require_path(spec)
    if path.is_file():
        return [path]
    if spec.split and (path / spec.split).is_dir():
        path = path / spec.split
        split = None
    else:
        split = spec.split
    files = sorted(p for p in path.rglob("*") if p.name.lower().endswith(extensions)
                   and (p.is_file() or broken_link_reason(p) is not None))
    if split:
        files = [p for p in files if p.stem == split or p.stem.startswith((f"{split}-", f"{split}_", f"{split}."))]
    broken = [(p, broken_link_reason(p)) for p in files if broken_link_reason(p) is not None]
    if broken:  # its rows can be neither read nor counted: never passed over in silence
        shown = "; ".join(f"{str(p)!r}: {reason}" for p, reason in broken[:5])
        raise DataError(f"data source {spec.name!r}: {len(broken)} data file(s) cannot be read ({shown}); fix the "
                        "link (or copy the file in its place) or remove it")
    if not files:
        wanted = " or ".join(f"*{e}" for e in extensions)
        which = f" for split {split!r} (named {split}*{extensions[0]} or in a {split}/ folder)" if split else ""
        raise DataError(f"data source {spec.name!r}: no {wanted} files{which} in {str(path)!r}")
    return files


def _resolve_image_paths(dataset: datasets.Dataset, base: Path) -> datasets.Dataset:
    """Image paths relative to the data file become absolute; bytes are left alone."""

    def resolve(images: list) -> dict:
        out = []
        for image in images:
            if image is not None and image.get("bytes") is None and image.get("path"):
                path = Path(os.path.expanduser(image["path"]))
                image = {"bytes": None, "path": str(path if path.is_absolute() else base / path)}
            out.append(image)
        return {"image": out}

    return dataset.map(resolve, input_columns=["image"], batched=True, desc="resolving image paths")


def _error_text(error: BaseException) -> str:
    """The most telling message of an exception and its causes (``datasets`` wraps the parser's error in
    one that says only "An error occurred while generating the dataset")."""
    messages = []
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).strip()
        if text:
            messages.append(text)
        error = error.__cause__ or error.__context__
    return messages[-1] if messages else type(error).__name__


def _load_table(spec: SourceSpec, builder: str, extensions: tuple[str, ...]) -> datasets.Dataset:
    parts = []
    offset = 0
    empty = []
    for file in _data_files(spec, extensions):
        with tempfile.TemporaryDirectory(prefix="xlipkit-utf8-") as workdir:
            rows = None
            if builder == "json":  # every line checked here: the one bad line is named, and follows on_error
                text_file, rows, first_problem = _clean_json(file, workdir, spec, offset)
                if text_file is None:
                    empty.append(f"{str(file)!r} (" + (f"every row unreadable; first: {first_problem}" if rows
                                                      else "the file is empty") + ")")
                    offset += rows
                    continue
            else:
                text_file = utf8_jsonl(file, workdir) if builder == "csv" else file
            try:
                table = datasets.load_dataset(builder, data_files=str(text_file), split="train",
                                              cache_dir=source_cache_dir())
            except Exception as error:  # datasets wraps parser errors in several types
                raise DataError(f"data source {spec.name!r}: cannot read {str(file)!r} as {builder}: "
                                f"{_error_text(error)}") from error
        columns = table.column_names
        for key in ("image_column", "caption_column"):
            column = getattr(spec, key)
            if column not in columns:
                raise DataError(
                    f"data source {spec.name!r}: {str(file)!r} has no column {column!r}{_closest(column, columns)}; "
                    f"columns: {', '.join(columns)}. Set {key} to the column that holds the "
                    f"{key.split('_')[0]}."
                )
        renames = {spec.image_column: "image", spec.caption_column: "caption"}
        id_source = spec.id_column or ("id" if "id" in columns else None)
        if id_source is not None:
            if id_source not in columns:
                raise DataError(
                    f"data source {spec.name!r}: {str(file)!r} has no id column {id_source!r}"
                    f"{_closest(id_source, columns)}; columns: {', '.join(columns)}"
                )
            renames[id_source] = "id"
        clashes = [target for source, target in renames.items() if target in columns and source != target]
        if clashes:
            table = table.remove_columns(clashes)
        table = table.rename_columns({s: t for s, t in renames.items() if s != t})
        if id_source is None:
            table = table.map(
                lambda _, indices, start=offset: {"id": [str(start + i) for i in indices]},
                input_columns=["caption"],
                with_indices=True,
                batched=True,
                desc="row ids",
            )
        else:
            table = table.cast_column("id", datasets.Value("string"))
        table = table.cast_column("image", datasets.Image(decode=False))
        parts.append(_resolve_image_paths(table, file.parent))
        offset += len(table) if rows is None else rows
    if not parts:
        raise DataError(f"data source {spec.name!r}: no readable rows in {', '.join(empty)}; give a file with one "
                        "JSON object per line, e.g. {\"image\": \"cat.jpg\", \"caption\": \"A cat ...\"}")
    if empty:
        logger.warning("data source %r: no readable rows in %s", spec.name, ", ".join(empty))
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as error:
        raise DataError(f"data source {spec.name!r}: the files in {spec.path!r} have different columns: {error}") from error


def _json_msg(error: json.JSONDecodeError) -> str:
    """``json``'s message without its dangling position words (``Unterminated string starting at``)."""
    return error.msg.removesuffix(" starting at").removesuffix(" at")


def _json_entries(file: Path) -> tuple[list[tuple[str, Any]], bool]:
    """``(where, parsed row or the problem)`` of each row of a JSON-lines file (``"line N"``) or of a JSON
    array (``"item N"``); a row that is not UTF-8 or not JSON comes as a ``DataError`` naming the line. The
    flag says whether ``datasets`` reads the file as it is (False for one object written over several lines)."""
    data = file.read_bytes()
    head = data.lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        try:
            items = json.loads(decode_utf8(data, file))
        except json.JSONDecodeError as error:
            raise DataError(f"{file}: line {error.lineno}, column {error.colno}: not valid JSON ({_json_msg(error)}); "
                            "a JSON "
                            "array is read whole, so fix it (or write one JSON object per line)") from error
        if isinstance(items, list):
            return [(f"item {i + 1}", item) for i, item in enumerate(items)], True
    entries: list[tuple[str, Any]] = []
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            entries.append((f"line {number}", DataError(
                f"line {number}, column {error.start + 1}: not UTF-8 "
                f"(byte 0x{raw[error.start:error.start + 1].hex()}); "
                "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")))
            continue
        try:
            entries.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            entries.append((f"line {number}", DataError(f"line {number}, column {error.colno}: not valid JSON "
                                                        f"({_json_msg(error)})")))
    if entries and all(isinstance(row, DataError) for _, row in entries) and head.startswith(b"{"):
        try:  # one JSON object over several lines
            whole = json.loads(decode_utf8(data, file))
        except (json.JSONDecodeError, DataError):
            return entries, True
        return ([("item 1", whole)], False) if isinstance(whole, dict) else (entries, True)
    return entries, True


def _clean_json(file: Path, workdir: str, spec: SourceSpec, first_id: int) -> tuple[Path | None, int, str | None]:
    """Check every row of a JSON-lines file (or JSON array) before ``datasets`` reads it, so that one bad row
    is named (``FILE:LINE``) and skipped or raised per ``data.on_error`` (:func:`report_bad_row`) instead of
    failing the whole file, and captions of another type are named for what they are.

    A row is bad when it is not UTF-8 or not JSON, not an object, holds a lone surrogate (not valid text),
    lacks the caption key, or its caption is not a string or a list of strings (:func:`as_captions`). When
    some rows hold a list of captions and others one string, every caption becomes a list (the list rows
    are kept: ``captions`` and ``caption``, see :func:`load_source`).

    Returns:
        the file to read (``file`` itself when nothing needs changing, else a cleaned copy under
        ``workdir``, with an ``id`` per row when the rows have none, so that ids stay the row numbers the
        file would give), or None when no row is left; the number of rows read (for the next file's ids); the
        first bad row's problem, or None.
    """
    entries, readable = _json_entries(file)
    column = spec.caption_column
    has_column = any(isinstance(row, dict) and column in row for _, row in entries)
    kept: list[tuple[int, dict]] = []
    dropped = 0
    first_problem = None
    kinds = set()
    for index, (where, row) in enumerate(entries):
        problem = None
        if isinstance(row, DataError):
            problem = str(row)
        elif not isinstance(row, dict):
            problem = (f"{where}: a row must be a JSON object ({{\"image\": ..., \"{column}\": ...}}), "
                       f"got {type(row).__name__}")
        elif has_column and column not in row:
            problem = f"{where} has no {column!r} key"
        else:
            try:
                if has_column:
                    as_captions(row[column])
                    kinds.add(type(row[column]).__name__)
                bad = lone_surrogate(row)
                if bad:
                    raise ValueError(f"holds a lone surrogate ({bad}, an unpaired \\u escape), which is not valid text")
            except (TypeError, ValueError) as error:
                problem = f"{where}: {str(error).split('; ')[0]}"
        if problem is None:
            kept.append((index, row))
        else:
            dropped += 1
            first_problem = first_problem or problem
            report_bad_row(f"{file.name}:{where.split()[-1]}", str(file), problem)
    if not kept:
        return None, len(entries), first_problem
    mixed = {"str", "list"} <= kinds
    if not dropped and not mixed and readable:
        return file, len(entries), None
    give_ids = spec.id_column is None and not any("id" in row for _, row in kept)
    handle, name = tempfile.mkstemp(prefix=file.stem + ".checked-", suffix=".jsonl", dir=workdir)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        for index, row in kept:
            if mixed and isinstance(row[column], str):
                row = {**row, column: [row[column]]}
            if give_ids:
                row = {**row, "id": str(first_id + index)}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return Path(name), len(entries), first_problem


@register_source("jsonl", description="JSON lines file(s): an image path (relative to the file) or bytes, and a caption")
def build_jsonl(spec: SourceSpec) -> datasets.Dataset:
    """JSONL source: a ``.jsonl``/``.json`` file or a folder of them, read by ``datasets``' json builder.

    Each row holds the image (a path relative to its file, an absolute path, or
    ``{"bytes", "path"}``) in ``image_column`` and the caption (a string, or a list of strings:
    then ``captions`` holds the list and ``caption`` its first entry) in ``caption_column``.
    """
    return _load_table(spec, "json", (".jsonl", ".json"))


@register_source("csv", description="CSV file(s): an image path column (relative to the file) and a caption column")
def build_csv(spec: SourceSpec) -> datasets.Dataset:
    """CSV source: a ``.csv`` file or a folder of them; one caption per row, image paths relative to the file."""
    return _load_table(spec, "csv", (".csv",))


@register_source("parquet", description="parquet file(s): image bytes or paths, and a caption")
def build_parquet(spec: SourceSpec) -> datasets.Dataset:
    """Parquet source: a ``.parquet`` file or a folder of them; the image column holds raw bytes,
    ``{"bytes", "path"}`` structs (what ``datasets.Image`` writes) or paths."""
    return _load_table(spec, "parquet", (".parquet",))


def _read_mapping(file: Path, spec: SourceSpec) -> tuple[list[str], list[Any], list[str | None]]:
    """(file names, captions, ids) from ``metadata.jsonl`` or ``captions.json``."""
    names, captions, ids = [], [], []
    if file.name == "metadata.jsonl":
        with open(file, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as error:
                    report_bad_row(f"{file.name}:{number}", str(file),
                                   f"line {number}, column {error.start + 1}: not UTF-8 "
                                   f"(byte 0x{raw[error.start:error.start + 1].hex()}); save the file as UTF-8")
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    report_bad_row(f"{file.name}:{number}", str(file),
                                   f"line {number}, column {error.colno}: not valid JSON ({_json_msg(error)})")
                    continue
                if not isinstance(row, dict) or "file_name" not in row:
                    raise DataError(f"{file}: line {number} needs a 'file_name' key (the image path relative to the folder)")
                if spec.caption_column not in row:
                    raise DataError(
                        f"{file}: line {number} has no {spec.caption_column!r} key{_closest(spec.caption_column, list(row))}; "
                        "set caption_column to the key that holds the caption"
                    )
                problem = _row_problem(row, spec.caption_column)
                if problem:
                    report_bad_row(f"{file.name}:{number}", str(file), f"line {number}: {problem}")
                    continue
                names.append(str(row["file_name"]))
                captions.append(row[spec.caption_column])
                ids.append(str(row[spec.id_column]) if spec.id_column and spec.id_column in row else None)
        return names, captions, ids
    try:
        mapping = json.loads(read_utf8_text(file))
    except json.JSONDecodeError as error:
        raise DataError(f"{file} is not valid JSON ({error})") from error
    if not isinstance(mapping, dict):
        raise DataError(f"{file} must map image file names to captions, e.g. {{\"cat.jpg\": \"A cat ...\"}}")
    for name, caption in mapping.items():
        problem = _row_problem({"name": name, "caption": caption}, "caption")
        if problem:
            report_bad_row(str(name), str(file), f"entry {name!r}: {problem}")
            continue
        names.append(str(name))
        captions.append(caption)
        ids.append(None)
    return names, captions, ids


def _row_problem(row: dict, column: str) -> str | None:
    """Why a mapping row cannot be used (a caption that is not text, a lone surrogate), or None."""
    try:
        as_captions(row[column])
        bad = lone_surrogate(row)
        if bad:
            raise ValueError(f"holds a lone surrogate ({bad}, an unpaired \\u escape), which is not valid text")
    except (TypeError, ValueError) as error:
        return str(error).split("; ")[0]
    return None


def _find_image(root: Path, name: str) -> Path:
    """``name`` under ``root``; a name without extension (captions.json keyed by stem) is looked up."""
    path = root / name
    if path.suffix or path.exists():
        return path
    for extension in sorted(IMAGE_EXTENSIONS):
        candidate = path.with_suffix(extension)
        if candidate.exists():
            return candidate
    return path


@register_source(
    "imagefolder",
    description="a folder of images with NAME.txt captions beside them, or a metadata.jsonl / captions.json mapping",
)
def build_imagefolder(spec: SourceSpec) -> datasets.Dataset:
    """Image-folder source (split: the ``SPLIT/`` sub-folder).

    Captions come from, in order of precedence: ``metadata.jsonl`` (one ``{"file_name": ...,
    CAPTION_COLUMN: ...}`` per line, as ``datasets``' imagefolder writes it), ``captions.json``
    (``{file name or stem: caption}``), or a ``NAME.txt`` beside each ``NAME.jpg``. With a
    mapping, its entries are the examples (a listed file that is missing is counted as
    missing); otherwise every image in the folder tree is, broken symbolic links included, and one
    without a ``.txt`` gets an empty caption (counted as such). A broken link, for an image or its
    caption file, is skipped and counted like a missing file (or stops loading with
    ``on_error="raise"``), never dropped from the listing. Ids are the image paths relative to the folder, without
    extension. Written by hand because ``datasets``' imagefolder reads neither ``.txt``
    captions nor ``captions.json``.
    """
    root = _require_path(spec)
    if not root.is_dir():
        raise DataError(f"data source 'imagefolder': path {str(root)!r} is a file; set path to the folder of images")
    if spec.split:
        if not (root / spec.split).is_dir():
            raise DataError(f"data source 'imagefolder': no {spec.split!r} folder in {str(root)!r} for split {spec.split!r}")
        root = root / spec.split
    mapping_file = next((root / n for n in ("metadata.jsonl", "captions.json") if (root / n).is_file()), None)
    if mapping_file is not None:
        names, captions, given_ids = _read_mapping(mapping_file, spec)
        paths = [_find_image(root, name) for name in names]
    else:
        paths = image_files(root)  # broken symbolic links included: validation skips and counts them
        readable, captions = [], []
        for path in paths:
            text_file = path.with_suffix(".txt")
            link_problem = broken_link_reason(text_file)
            if link_problem is not None:  # skipped or raised per data.on_error, like an unreadable caption
                report_bad_row(path.relative_to(root).with_suffix("").as_posix(), str(text_file),
                               f"caption file: {link_problem}")
                continue
            try:
                captions.append(read_utf8_text(text_file).strip() if text_file.is_file() else "")
            except DataError as error:  # names the file and line; skipped or raised per data.on_error
                report_bad_row(path.relative_to(root).with_suffix("").as_posix(), str(text_file),
                               str(error).removeprefix(f"{text_file}: "))
                continue
            readable.append(path)
        if paths and not readable:
            raise DataError(f"data source 'imagefolder': no caption file in {str(root)!r} is readable as UTF-8")
        paths = readable
        given_ids = [None] * len(paths)
    if not paths:
        raise DataError(
            f"data source 'imagefolder': no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) in {str(root)!r}"
        )
    ids = [
        given if given is not None else path.relative_to(root).with_suffix("").as_posix()
        for path, given in zip(paths, given_ids)
    ]
    columns: dict[str, list] = {"id": ids, "image": [str(p) for p in paths]}
    if any(isinstance(c, list) for c in captions):
        columns["captions"] = [c if isinstance(c, list) else [c] for c in captions]
        columns["caption"] = [_first_non_empty(c) for c in columns["captions"]]
    else:
        columns["caption"] = list(captions)
    return datasets.Dataset.from_dict(columns)
