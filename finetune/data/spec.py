"""A dataset entry of a recipe (``data.train``, each of ``eval.sets``) as one typed value (:class:`SourceSpec`):
its keys, their types and the checks across keys (streams), made once when a recipe is loaded."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from finetune.data.images import DataError

__all__ = ["STREAM_SOURCES", "SourceSpec"]

#: sources that can be read as a stream (``finetune.data.streams``); the first two only as a stream
STREAM_SOURCES = ("webdataset", "hub", "parquet")


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
