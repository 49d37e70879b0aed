"""Recipe value types and options classes: numbers and words as YAML 1.1 writes them (``1e-5`` without a
dot is a number, ``no`` a word where a choice has it), range-checked numbers, and the building of an
options class (a stdlib or pydantic dataclass, or a pydantic model: term options, dataset entries, model
family options) from a recipe mapping with unknown keys, non-finite numbers and ``metadata={"check": fn}``
range checks reported as recipe errors."""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, Strict, StrictBool, StrictStr, TypeAdapter
from pydantic_core import InitErrorDetails, PydanticCustomError

from finetune.config.errors import _arms, _fields_of, _finite_errors, _raise_errors

# -- value types: YAML 1.1 quirks and range checks ------------------------------------------------
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _yaml_float(value: Any) -> Any:
    # YAML 1.1 reads `1e-5` (no dot) as a string; it is a number here
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        return float(value)
    return value


def _yaml_int(value: Any) -> Any:
    value = _yaml_float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _yaml_word(value: Any) -> Any:
    # YAML 1.1 reads unquoted no/yes/off/on as booleans: `mixed_precision: no`
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value


def _float(**bounds: float) -> Any:
    """A finite number within ``bounds`` (``gt``, ``ge``, ``lt``, ``le``); ``1e-5`` written without a dot (a
    string in YAML 1.1) is read as one; ``.inf`` and ``.nan`` are errors. (The bounds sit inside the YAML
    conversion, so that the JSON schema states them as ``minimum`` / ``exclusiveMinimum`` / ...)"""
    return Annotated[float, Strict(), Field(allow_inf_nan=False, **bounds), BeforeValidator(_yaml_float)]


def _int(**bounds: int) -> Any:
    """An integer within ``bounds``; ``1e3`` and ``8.0`` are read as 1000 and 8, ``8.5`` and
    ``true`` are errors."""
    return Annotated[int, Strict(), Field(**bounds), BeforeValidator(_yaml_int)]


Float = _float()
Int = _int()
Bool = StrictBool
Str = StrictStr


def _non_empty(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


def _betas(value: tuple[float, float]) -> tuple[float, float]:
    if any(not 0.0 <= b < 1.0 for b in value):
        raise ValueError(f"both betas must be in [0, 1), got {list(value)!r}")
    return value


#: the recipe key of length-grouped batches, and why a stream refuses it (the recipe check and the loader say it)
GROUP_KEY = "train.group_by_length"
STREAM_GROUPING = (f"{GROUP_KEY}: true needs a map-style data.train: a stream (webdataset, hub, parquet urls) is read "
                   "shard by shard, so its captions' lengths are not known before training and cannot be sorted into "
                   f"batches; set {GROUP_KEY}: false, or train on a map-style source")


def _text_buckets(value: list[int] | None) -> list[int] | None:
    """``train.text_buckets``: null, or token counts >= 1 in strictly increasing order."""
    if value is None:
        return None
    if not value:
        raise ValueError("is an empty list; give the lengths text passes are padded to (e.g. [32, 64, 96, 128]) or "
                         "null for the multiples of 32 up to model.max_text_len")
    if any(v < 1 for v in value):
        raise ValueError(f"must hold token counts >= 1, got {list(value)!r}")
    if any(b <= a for a, b in zip(value, value[1:])):
        raise ValueError(f"must be strictly increasing, got {list(value)!r}")
    return list(value)


def _positive_ints(value: list[int]) -> list[int]:
    if not value:
        raise ValueError("must list at least one K, e.g. [1, 5, 10]")
    bad = [k for k in value if k < 1]
    if bad:
        raise ValueError(f"every K must be >= 1, got {bad!r}")
    return value


NonEmptyStr = Annotated[str, Strict(), AfterValidator(_non_empty)]
UnitInterval = _float(ge=0.0, lt=1.0)


def _doc(text: str) -> Any:
    """A key's description in the JSON schema (editors show it on hover)."""
    return Field(description=text)



def _json_schema_of(cls: type, handler: Any) -> dict[str, Any]:
    schema = handler(_adapter(cls).core_schema)
    target = handler.resolve_ref_schema(schema) if "$ref" in schema else schema
    _close_objects(target, handler)
    return schema


def _close_objects(schema: dict[str, Any], handler: Any) -> None:
    """``additionalProperties: false`` on an options object and the objects nested in it (stdlib
    dataclasses do not say it themselves; the recipe rejects unknown keys)."""
    if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
        for sub in schema["properties"].values():
            for arm in [sub, *sub.get("anyOf", [])]:
                _close_objects(handler.resolve_ref_schema(arm) if "$ref" in arm else arm, handler)



@functools.lru_cache(maxsize=None)
def _adapter(cls: Any) -> TypeAdapter:
    return TypeAdapter(cls)


def _unknown_keys(value: Any, cls: Any, loc: tuple[Any, ...] = ()) -> list[InitErrorDetails]:
    """``extra_forbidden`` errors for the keys of ``value`` that ``cls`` (and the options classes
    nested in it) does not have: stdlib dataclasses ignore unknown keys otherwise."""
    fields = _fields_of(cls)
    if fields is None or not isinstance(value, Mapping):
        return []
    errors = []
    for key, sub in value.items():
        if key not in fields:
            errors.append(InitErrorDetails(type="extra_forbidden", loc=loc + (key,), input=sub))
        else:
            nested = [a for a in _arms(fields[key]) if _is_options_class(a)]
            if nested:
                errors.extend(_unknown_keys(sub, nested[0], loc + (key,)))
    return errors


def _checks(value: Any, loc: tuple[Any, ...] = ()) -> list[InitErrorDetails]:
    """The ``metadata={"check": fn}`` range checks of a dataclass and those nested in it."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return []
    errors = []
    for f in dataclasses.fields(value):
        sub = getattr(value, f.name)
        check = f.metadata.get("check")
        problem = check(sub) if check is not None else None
        if problem:
            errors.append(InitErrorDetails(type=PydanticCustomError("recipe_value", problem.replace("{", "{{")
                                                                    .replace("}", "}}")),
                                           loc=loc + (f.name,), input=sub))
        errors.extend(_checks(sub, loc + (f.name,)))
    return errors


def _yaml_quirks(value: Mapping[str, Any], cls: Any) -> dict[str, Any]:
    """``value`` with the YAML 1.1 readings fixed for the field types of ``cls`` (an options class
    that does not state them itself): ``1e-5`` / ``1e3`` strings for numbers, ``no`` / ``yes``
    booleans for a choice that has those words; nested options classes too."""
    fields = _fields_of(cls) or {}
    out = dict(value)
    for key, sub in value.items():
        arms = _arms(fields.get(key, Any))
        nested = next((a for a in arms if _is_options_class(a)), None)
        words = [w for a in arms if typing.get_origin(a) is Literal for w in typing.get_args(a)]
        if nested is not None and isinstance(sub, Mapping):
            out[key] = _yaml_quirks(sub, nested)
        elif float in arms:
            out[key] = _yaml_float(sub)
        elif int in arms:
            out[key] = _yaml_int(sub)
        elif isinstance(sub, bool) and bool not in arms:
            out[key] = next((w for w in (("yes", "on", "true") if sub else ("no", "off", "false")) if w in words),
                            sub)
    return out


def _build_options(cls: type, options: Any) -> Any:
    """``options`` (a mapping, ``None`` for the defaults, or an instance) built as ``cls``."""
    if isinstance(options, cls):
        instance = options
    else:
        if options is None:
            options = {}
        if isinstance(options, Mapping):
            _raise_errors(_unknown_keys(options, cls), cls.__name__)
            options = _yaml_quirks(options, cls)
        instance = _adapter(cls).validate_python(options)
    _raise_errors(_finite_errors(instance) or _checks(instance), cls.__name__)
    return instance


def _is_options_class(cls: Any) -> bool:
    return isinstance(cls, type) and (dataclasses.is_dataclass(cls) or issubclass(cls, BaseModel))
