"""Dataset entries of a recipe (``data.train`` and each of ``eval.sets``): a source name (``docci``), the
shorthand ``name:protocol`` (``docci:goal``) or a mapping of :class:`finetune.data.sources.SourceSpec`
keys, validated at load time against that dataclass and the data-source registry (the name is registered,
a source that makes its own data takes no ``path``, an evaluation set is no stream)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from finetune.config.errors import _fields_of, _Origins, _raise_errors, _recipe_error, _type_name
from finetune.config.values import _adapter, _build_options, _json_schema_of

# -- schema markers: dataset entries and objective terms ------------------------------------------
class _SourceEntry:
    """Marks a dataset entry (``SourceSpec`` mapping or shorthand); gives its JSON schema and, to the error
    messages, its keys."""

    describe = "a dataset name or a mapping"
    plural = "datasets"

    def recipe_fields(self) -> dict[str, Any] | None:
        return _fields_of(_source_spec_class())

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        spec = _json_schema_of(_source_spec_class(), handler)
        return {"anyOf": [{"type": "string", "description": "a registered source name, or `name:protocol`"},
                          spec]}


_SOURCE_MARK = _SourceEntry()


def _default_train_source() -> Any:
    return _source_entry({"name": "synthetic", "size": 2000, "seed": 0})


def _default_eval_sets() -> list[Any]:
    return [_source_entry({"name": "synthetic", "split": "test", "size": 256, "seed": 1})]


def _validate_source_entry(value: Any) -> Any:
    return _source_entry(value)


def _validate_source_list(value: Any) -> Any:
    if isinstance(value, (str, Mapping)):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise PydanticCustomError(
            "recipe_value", "expected a list of datasets (names like `docci` or mappings with {keys}), got {got}",
            {"keys": ", ".join(source_spec_keys()), "got": repr(value)})
    return value


#: a dataset entry of the schema: validated into a ``finetune.data.sources.SourceSpec`` (typed ``Any`` here so that
#: importing the schema does not import ``datasets``)
SourceEntry = Annotated[Any, BeforeValidator(_validate_source_entry), _SOURCE_MARK]


def _no_streams(entries: list[Any]) -> list[Any]:
    """Evaluation sets are map-style datasets: a stream entry (``webdataset``, ...) is an error."""
    errors = []
    for i, entry in enumerate(entries):
        if entry.is_stream:
            errors.append(InitErrorDetails(type=PydanticCustomError(
                "recipe_value", "is a stream; only `data.train` can be read as a stream: evaluate on a "
                "map-style source (a path, a benchmark name)"), loc=(i,), input=entry))
    _raise_errors(errors, "eval.sets")
    return entries



# -- dataset entries ------------------------------------------------------------------------------
def _source_spec_class() -> type:
    from finetune.data.sources import SourceSpec

    return SourceSpec


def source_spec_keys() -> tuple[str, ...]:
    """The keys of a dataset entry (``data.train``, each of ``eval.sets``): the fields of
    :class:`finetune.data.sources.SourceSpec`, in order."""
    return tuple(f.name for f in dataclasses.fields(_source_spec_class()))


def _available_sources() -> dict[str, str]:
    from finetune.data.sources import available_sources

    return available_sources()


def _source_takes_path(name: str) -> bool:
    from finetune.data import sources

    takes_path = getattr(sources, "source_takes_path", None)
    return True if takes_path is None else takes_path(name)


def _check_source_name(name: str, loc: tuple[Any, ...]) -> list[InitErrorDetails]:
    known = _available_sources()
    if name in known:
        return []
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    message = f"is {name!r}, not a registered data source: {hint}registered sources: {', '.join(sorted(known))}"
    return [InitErrorDetails(type=PydanticCustomError("recipe_value", message.replace("{", "{{").replace("}", "}}")),
                             loc=loc, input=name)]


def _source_entry(value: Any) -> Any:
    """A dataset entry: a name string (``docci`` or ``docci:goal``), a ``SourceSpec`` mapping or a
    ``SourceSpec``, returned as a typed :class:`finetune.data.sources.SourceSpec` (checked by its
    ``parse``: streams, ranges) that remembers the keys it was given, so that the resolved recipe writes
    the entry back as it was written (``SourceSpec.recipe_entry``)."""
    cls = _source_spec_class()
    if isinstance(value, cls):  # built in code: checked like the mapping it writes
        value = value.recipe_entry()
    if isinstance(value, str):
        if not value.strip():
            raise PydanticCustomError("recipe_value",
                                      "is an empty dataset name; write a name like `docci` or a mapping")
        out = parse_source_shorthand(value)
        _raise_errors(_check_source_name(out["name"], ()), "dataset entry")
        return _typed(cls, out)
    if not isinstance(value, Mapping):
        raise PydanticCustomError(
            "recipe_value", "expected a dataset name (e.g. `docci`, `docci:goal`) or a mapping with {keys}; "
            "got {got} ({kind})", {"keys": ", ".join(source_spec_keys()), "got": repr(value), "kind": _type_name(value)})
    probe = dict(value)
    if "name" not in probe:
        # an alias of `name` that the source module knows (a stream's `format`) counts as a name
        name = _spec_name(cls, value)
        if name is not None:
            probe["name"] = name
    spec = _build_options(cls, probe)
    out = {k: getattr(spec, k) for k in value}
    errors = _check_source_name(spec.name, ("name",) if "name" in value else ())
    if not errors and spec.path is not None and not _source_takes_path(spec.name):
        message = (f"is set, but the source {spec.name!r} takes no path (it makes its own data); "
                   f"remove the key")
        errors.append(InitErrorDetails(type=PydanticCustomError("recipe_key", message), loc=("path",),
                                       input=spec.path))
    _raise_errors(errors, "dataset entry")
    return _typed(cls, out)


def _typed(cls: Any, entry: dict[str, Any]) -> Any:
    """``entry`` (checked keys and values) as ``cls`` through its ``parse`` (the source module's own checks
    across keys: streams, ranges), remembering the keys given."""
    try:
        spec = cls.parse(dict(entry))
    except ValueError as exc:
        raise PydanticCustomError("recipe_value", "is not a valid dataset entry: {problem}",
                                  {"problem": str(exc)}) from None
    spec.given_keys = tuple(entry)
    return spec


def _spec_name(cls: Any, value: Mapping[str, Any]) -> str | None:
    """The source name that ``cls.parse`` reads from an entry without ``name``, else ``None``."""
    parse = getattr(cls, "parse", None)
    if not callable(parse):
        return None
    try:
        return parse(dict(value)).name
    except (ValueError, TypeError):
        return None


def parse_sources(value: Any, key: str = "eval.sets") -> list[Any]:
    """Validate a list of dataset entries as the recipe validates ``eval.sets`` (names,
    ``name:protocol`` shorthands or ``SourceSpec`` mappings; a single entry is a list of one) and
    return them as typed :class:`finetune.data.sources.SourceSpec` objects. Errors name ``key``.

    Raises:
        RecipeError: on unknown keys, wrong types, a missing ``name`` or an unregistered source.
    """
    path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
    tp = Annotated[list[SourceEntry], BeforeValidator(_validate_source_list)]
    try:
        return _adapter(tp).validate_python(value)
    except ValidationError as exc:
        raise _recipe_error(exc, _Origins(None, None), value, tp, path) from None


def parse_source_shorthand(text: str) -> dict[str, Any]:
    """``"docci"`` -> ``{"name": "docci"}``; ``"docci:goal"`` -> ``{"name": "docci", "protocol": "goal"}``."""
    name, sep, protocol = text.strip().partition(":")
    spec: dict[str, Any] = {"name": name.strip()}
    if sep and protocol.strip():
        spec["protocol"] = protocol.strip()
    return spec
