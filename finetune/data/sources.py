"""The data-source registry (:func:`register_source`) and :func:`load_source`; the generic local formats (JSONL, CSV,
parquet, image folders) are :mod:`finetune.data.formats`, the dataset entry :mod:`finetune.data.spec`.

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
import hashlib
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import datasets

import finetune.plugins as plugins
from finetune.data.bad_rows import collecting
from finetune.data.images import DataError, ImageReadError, probe_image, read_image
from finetune.data.spec import STREAM_SOURCES, SourceSpec, _closest
from finetune.data.text import as_captions

__all__ = [
    "DataError",
    "STREAM_SOURCES",
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

_ON_ERROR = ("skip", "raise")
_VALIDATE = ("header", "quick", "full")  # "quick" is the older name of "header"
_SKIPPED_EXAMPLES_KEPT = 5
_cache_dir: contextvars.ContextVar[str | None] = contextvars.ContextVar("xlipkit_source_cache_dir", default=None)

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
