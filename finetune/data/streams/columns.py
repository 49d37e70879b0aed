"""A stream's columns: which raw entry holds the image, the caption and the id (:func:`resolve_columns`), the extra
fields a recipe passes through (``options.fields``), and a raw sample made into an example (:func:`make_example`),
with the reason when it cannot be one."""

from __future__ import annotations

import json
from typing import Any

from finetune.data.images import DataError, ImageReadError, read_image
from finetune.data.spec import SourceSpec
from finetune.data.text import as_captions

__all__ = ["DEFAULT_CAPTION_KEYS", "STREAM_EXAMPLE_FIELDS", "SUPERPIXELS_ENTRY", "SUPERPIXELS_FIELD",
           "WEBDATASET_IMAGE_KEYS", "caption_type_problem", "check_fields", "make_example", "resolve_columns"]

#: webdataset keys tried, in order, for the image when ``image_column`` is left at ``image``
WEBDATASET_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
#: keys tried, in order, for the caption when ``caption_column`` is left at ``caption``
#: (``json.caption``: the ``caption`` field of a webdataset ``KEY.json``)
DEFAULT_CAPTION_KEYS = ("txt", "text", "json.caption")
#: a sample's precomputed superpixels (``KEY.superpixels.png``, written by ``xlipkit superpixels``), passed through
#: as the example's :data:`SUPERPIXELS_FIELD` (its raw PNG)
SUPERPIXELS_ENTRY = "superpixels.png"
SUPERPIXELS_FIELD = "superpixels_entry"


def check_fields(spec: SourceSpec) -> list[str]:
    """``options.fields``: raw columns (``json.FIELD`` for a field of a webdataset ``KEY.json``) carried into
    every example under their last name (FLAIR's pre-split DreamLIP caption fields)."""
    fields = spec.options.get("fields", [])
    if not isinstance(fields, list) or not all(isinstance(f, str) and f for f in fields):
        raise DataError(f"data source {spec.name!r}: options.fields must be a list of column names (json.FIELD for a "
                        f"field of KEY.json), got {fields!r}")
    return list(fields)


#: the fields every streamed example has (:class:`ExampleStream`), besides ``options.fields``
STREAM_EXAMPLE_FIELDS = frozenset({"id", "image", "caption", "captions", "url"})


def caption_type_problem(dtype: Any) -> str | None:
    """What a caption column of pyarrow type ``dtype`` holds when it cannot hold text (``"int64 values"``), else None:
    strings, or lists of strings (several captions of one image), are captions."""
    import pyarrow as pa

    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        inner = caption_type_problem(dtype.value_type)
        return f"lists of {inner}" if inner else None
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_binary(dtype):
        return None
    return f"{dtype} values"


def _lookup(raw: dict[str, Any], key: str) -> Any:
    """``raw[key]``; ``"json.caption"`` reads the ``caption`` field of the ``json`` column."""
    if key in raw:
        return raw[key]
    head, _, rest = key.partition(".")
    value = raw.get(head)
    if rest and isinstance(value, (bytes, str)) and head == "json":
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return _lookup(value, rest) if rest and isinstance(value, dict) else None


def _has(columns: list[str], key: str) -> bool:
    return key in columns or key.partition(".")[0] in columns and "." in key


def resolve_columns(spec: SourceSpec, columns: list[str]) -> tuple[str, str, str | None]:
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




def make_example(raw: dict[str, Any], spec: SourceSpec, keys: tuple[str, str, str | None],
                 fallback_id: str) -> tuple[dict[str, Any], str | None, str]:
    """A raw sample (``{entry: value}``, with ``__key__`` / ``__url__`` for webdataset) as an example ``{"id", "image"
    (RGB PIL), "caption"}`` (+ ``captions``, ``url``, ``options.fields``, the precomputed superpixels), or why it
    cannot be one.

    Returns:
        ``(example, reason or None, the shard it came from)``.
    """
    image_key, caption_key, id_key = keys
    value = _lookup(raw, id_key) if id_key else None
    ident = str(value) if value is not None else fallback_id
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
    for key in check_fields(spec):
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
