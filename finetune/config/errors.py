"""Recipe errors: :class:`RecipeError`, where a key came from (file and line, or the override), and
pydantic's validation errors turned into one message that names the key, what was expected and how to
fix it (the closest valid key for an unknown one: ``did you mean `train.lr`?``, also across sections and
for other tools' names of a key).

This module is the bottom of :mod:`finetune.config` but for :mod:`finetune.config.secrets`, which masks the secrets
in every message. The schema registers
its section classes in :data:`SECTION_TYPES` (the root :class:`~finetune.config.schema.Recipe` first); a
schema mark (dataset entries, objective terms, model options) that carries ``recipe_fields()``,
``describe`` and ``plural`` tells the messages the keys below it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from finetune.config.secrets import mask_override, mask_secrets, secret_key

#: the recipe's section classes, the root (``Recipe``) first; :mod:`finetune.config.schema` fills it
SECTION_TYPES: list[type] = []

#: a key's path in the recipe: ``("train", "lr")``, ``("eval", "sets", 0, "name")``
KeyPath = tuple[Any, ...]


class RecipeError(ValueError):
    """A recipe that cannot be used; the message says where (file, line or override), which key,
    what is wrong and how to fix it.

    Attributes:
        file: the recipe file, or ``None`` when the problem is not in a file.
        line: 1-based line in ``file``, or ``None``.
        key: the dotted key path (``train.lr``), or ``None``.
    """

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 key: str | None = None) -> None:
        super().__init__(mask_secrets(message))
        self.file = file
        self.line = line
        self.key = key


def refuse_recipe(message: str) -> int:
    """Print ``recipe error: MESSAGE`` on standard error and return 2, the exit status of a refused recipe: the one
    place where the commands and a run say that a recipe cannot be used (its message names the key to change)."""
    print(f"recipe error: {mask_secrets(message)}", file=sys.stderr, flush=True)
    return 2


def _raise_errors(errors: list[InitErrorDetails], title: str) -> None:
    if errors:
        raise ValidationError.from_exception_data(title, errors)


def _prefixed(exc: ValidationError, prefix: tuple[Any, ...]) -> list[InitErrorDetails]:
    out = []
    for e in exc.errors():
        ctx = e.get("ctx")
        if e["type"].startswith("recipe_"):
            kind: Any = PydanticCustomError(e["type"], e["msg"].replace("{", "{{").replace("}", "}}"))
        else:
            kind = e["type"]
        detail = InitErrorDetails(type=kind, loc=prefix + tuple(e["loc"]), input=e.get("input"))
        if ctx is not None and not e["type"].startswith("recipe_"):
            detail["ctx"] = ctx
        out.append(detail)
    return out


_NOT_FINITE = "must be a finite number (no .inf, -.inf or .nan anywhere in a recipe)"


def _non_finite(value: Any, loc: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], float]]:
    """``(key path, value)`` of every float that is infinite or NaN in ``value``: plain data (mappings,
    lists), dataclasses and pydantic models, at any depth."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [(loc, value)]
    if isinstance(value, BaseModel):
        items: Iterable[tuple[Any, Any]] = ((k, getattr(value, k)) for k in type(value).model_fields)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return []
    return [hit for k, v in items for hit in _non_finite(v, loc + (k,))]


def _finite_errors(value: Any) -> list[InitErrorDetails]:
    """A ``recipe_value`` error for each non-finite number in ``value`` (an options instance)."""
    return [InitErrorDetails(type=PydanticCustomError("recipe_value", f"{_NOT_FINITE}, got {bad!r}"), loc=loc,
                             input=bad) for loc, bad in _non_finite(value)]



def _dotted(path: KeyPath) -> str:
    return ".".join(str(p) for p in path)


class _Origins:
    """Maps key paths to their place in the recipe file (YAML node marks) or to the override
    that set them, so that errors can say where to look."""

    def __init__(self, file: str | None, node: yaml.Node | None, overrides: Sequence[tuple[KeyPath, str]] = ()):
        self.file = file
        self.key_lines: dict[KeyPath, int] = {}
        self.value_lines: dict[KeyPath, int] = {}
        self.overrides = list(overrides)
        if node is not None:
            self._walk(node, ())

    def _walk(self, node: yaml.Node, path: KeyPath) -> None:
        self.value_lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                self.key_lines[path + (key,)] = key_node.start_mark.line + 1
                self._walk(value_node, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.key_lines[path + (i,)] = item.start_mark.line + 1
                self._walk(item, path + (i,))

    def overridden(self, path: KeyPath) -> str | None:
        """The override text that set ``path`` (or a key above or below it), else ``None``."""
        for opath, text in reversed(self.overrides):
            n = min(len(opath), len(path))
            if tuple(str(p) for p in opath[:n]) == tuple(str(p) for p in path[:n]):
                return text
        return None

    def in_file(self, path: KeyPath) -> bool:
        return path in self.key_lines

    def error(self, path: KeyPath, message: str, *, key_error: bool = False, name_key: bool = True) -> RecipeError:
        """A :class:`RecipeError` for ``path`` that names the override or the file and line; the
        message follows the key (``name_key``) or stands alone."""
        dotted = _dotted(path)
        if name_key:
            message = f"`{dotted}` {message}"
        text = self.overridden(path)
        if text is not None:
            return RecipeError(f"command-line override `{mask_override(text)}`: {message}", key=dotted)
        line = None
        probe = path
        while probe and line is None:
            lines = self.key_lines if key_error else self.value_lines
            line = lines.get(probe) or self.key_lines.get(probe)
            probe = probe[:-1]
        if self.file is None:
            return RecipeError(message, key=dotted)
        where = f"{self.file}, line {line}" if line is not None else self.file
        return RecipeError(f"{where}: {message}", file=self.file, line=line, key=dotted)

    def error_any(self, paths: Sequence[KeyPath], message: str) -> RecipeError:
        """An error about several keys (the message names them), located at the first one an
        override set, else the first one the file sets, else the first."""
        for path in paths:
            if self.overridden(path):
                return self.error(path, message, name_key=False)
        for path in paths:
            if self.in_file(path):
                return self.error(path, message, name_key=False)
        return self.error(paths[0], message, name_key=False)


# -- pydantic errors -> RecipeError ---------------------------------------------------------------
def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _strip(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """``(type, metadata)`` of a possibly ``Annotated`` type."""
    meta: tuple[Any, ...] = ()
    while typing.get_origin(tp) is Annotated:
        args = typing.get_args(tp)
        tp, meta = args[0], meta + tuple(args[1:])
    return tp, meta


def _arms(tp: Any) -> list[Any]:
    """The non-null members of a (possibly optional or annotated) type, each stripped."""
    tp, _ = _strip(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [_strip(a)[0] for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _fields_of(tp: Any) -> dict[Any, Any] | None:
    """The recipe keys below a type and their types: a schema section, an options class, a
    dataset entry (``SourceSpec``) or ``objective.terms`` (the registered terms); else ``None``."""
    _, meta = _strip(tp)
    for m in meta:  # a schema mark (dataset entries, objective terms, model options) knows its own keys
        fields = getattr(m, "recipe_fields", None)
        if fields is not None:
            return fields()
    for arm in _arms(tp):
        if isinstance(arm, type) and issubclass(arm, BaseModel):
            return {(f.alias or name): f.annotation for name, f in arm.model_fields.items()}
        if dataclasses.is_dataclass(arm) and isinstance(arm, type):
            hints = typing.get_type_hints(arm, include_extras=True)
            out = {}
            for f in dataclasses.fields(arm):
                if f.metadata.get("meta"):
                    continue
                alias = _alias(hints[f.name])
                out[alias or f.name] = hints[f.name]
            return out
    return None


def _alias(tp: Any) -> str | None:
    for m in _strip(tp)[1]:
        alias = getattr(m, "alias", None)
        if isinstance(alias, str):
            return alias
    return None


def _child(tp: Any, part: Any) -> Any:
    fields = _fields_of(tp)
    if fields is not None:
        return fields.get(part, Any)
    for arm in _arms(tp):
        origin, args = typing.get_origin(arm), typing.get_args(arm)
        if origin is list and isinstance(part, int):
            return args[0] if args else Any
        if origin is tuple and isinstance(part, int):
            if args and args[-1] is Ellipsis:
                return args[0]
            return args[part] if part < len(args) else Any
        if origin is dict:
            return args[1] if args else Any
    return Any


def _describe(tp: Any) -> str:
    base, meta = _strip(tp)
    described = next((m.describe for m in meta if isinstance(getattr(m, "describe", None), str)), None)
    if described is not None:
        return described
    origin = typing.get_origin(base)
    args = typing.get_args(base)
    if base is type(None):
        return "null"
    if base is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if base is bool:
        return "true or false"
    if base is int:
        return "an integer"
    if base is float:
        return "a number (e.g. 1.0e-5)"
    if base is str:
        return "a string"
    if origin in (list, tuple) or base in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} values ({', '.join(_describe(a) for a in args)})"
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict or base is dict or _fields_of(base) is not None:
        return "a mapping"
    return getattr(base, "__name__", str(base))


def _plural(tp: Any) -> str:
    base, meta = _strip(tp)
    names = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}
    if base in names:
        return names[base]
    plural = next((m.plural for m in meta if isinstance(getattr(m, "plural", None), str)), None)
    if plural is not None:
        return plural
    if typing.get_origin(base) is dict or _fields_of(base) is not None:
        return "mappings"
    return f"values ({_describe(tp)})"


@functools.lru_cache(maxsize=1)
def _schema_paths() -> tuple[str, ...]:
    """Every key of the fixed schema (``train.lr``, ``model.kps.keep``), for suggestions across sections."""
    def walk(tp: Any, prefix: str) -> list[str]:
        out = []
        for key, sub in (_fields_of(tp) or {}).items():
            out.append(prefix + key)
            if any(a in SECTION_TYPES for a in _arms(sub)):
                out.extend(walk(sub, f"{prefix}{key}."))
        return out
    return tuple(walk(SECTION_TYPES[0], "") if SECTION_TYPES else ())


_TF = "transformers' TrainingArguments name"
_OC = "open_clip's training flag"
_GLOBAL_BATCH = ("; train.batch_size is the global batch of one optimiser step, over all processes and "
                 "train.accumulation_steps")
#: other tools' names for recipe keys (transformers' ``TrainingArguments``, open_clip's ``--flags``, peft's
#: ``LoraConfig``): ``{name: (recipe key, where the name comes from and how the meaning differs)}``
_FOREIGN_KEYS: dict[str, tuple[str, str]] = {
    "learning_rate": ("train.lr", _TF),
    "per_device_train_batch_size": ("train.batch_size", _TF + ", a batch per device" + _GLOBAL_BATCH),
    "train_batch_size": ("train.batch_size", _TF + _GLOBAL_BATCH),
    "per_device_eval_batch_size": ("eval.batch_size", _TF),
    "num_train_epochs": ("train.epochs", _TF),
    "warmup_ratio": ("train.warmup_steps", _TF + ", a fraction of the steps; xlipkit counts warm-up in steps"),
    "warmup": ("train.warmup_steps", _OC),
    "lr_scheduler_type": ("train.schedule", _TF + "; xlipkit has cosine and constant, both after a linear warm-up"),
    "lr_scheduler": ("train.schedule", _OC + "; xlipkit has cosine and constant, both after a linear warm-up"),
    "max_grad_norm": ("train.grad_clip", _TF),
    "grad_clip_norm": ("train.grad_clip", _OC),
    "gradient_accumulation_steps": ("train.accumulation_steps", _TF),
    "accum_freq": ("train.accumulation_steps", _OC),
    "adam_beta1": ("train.betas", _TF + "; train.betas is the pair [beta1, beta2]"),
    "adam_beta2": ("train.betas", _TF + "; train.betas is the pair [beta1, beta2]"),
    "beta1": ("train.betas", _OC + "; train.betas is the pair [beta1, beta2]"),
    "beta2": ("train.betas", _OC + "; train.betas is the pair [beta1, beta2]"),
    "adam_epsilon": ("train.eps", _TF),
    "wd": ("train.weight_decay", _OC),
    "save_steps": ("train.checkpoint_every", _TF),
    "save_total_limit": ("train.keep_checkpoints", _TF),
    "logging_steps": ("train.log_every", _TF),
    "resume_from_checkpoint": ("train.resume", _TF + "; `latest` or a checkpoint folder"),
    "report_to": ("train.trackers", _TF),
    "bf16": ("train.mixed_precision", _TF + "; write train.mixed_precision: bf16"),
    "fp16": ("train.mixed_precision", _TF + "; write train.mixed_precision: fp16"),
    "precision": ("train.mixed_precision", _OC + "; no, fp16 or bf16"),
    "output_dir": ("output.dir", _TF),
    "overwrite_output_dir": ("output.overwrite", _TF),
    "model_name_or_path": ("model.name_or_path", "the transformers examples' name"),
    "grad_checkpointing": ("model.gradient_checkpointing", _OC),
    "dataloader_num_workers": ("data.num_workers", _TF),
    "workers": ("data.num_workers", _OC),
    "lora_r": ("adapter.r", "peft's LoraConfig(r=...) as the transformers examples name it"),
    "lora_alpha": ("adapter.alpha", "peft's LoraConfig(lora_alpha=...)"),
    "lora_dropout": ("adapter.dropout", "peft's LoraConfig(lora_dropout=...)"),
}


def _suggest(key: str, valid: Iterable[str], prefix: KeyPath, across_sections: bool) -> str:
    valid = [str(v) for v in valid]
    foreign = _FOREIGN_KEYS.get(key.strip().lower().replace("-", "_")) if across_sections else None
    if foreign is not None:  # a section's key (not a term's or a dataset's option) named the way another tool does
        return f"did you mean `{foreign[0]}`? (`{key}` is {foreign[1]})"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{_dotted(prefix + (close[0],))}`?"
    if across_sections:
        elsewhere = [p for p in _schema_paths() if p.rsplit(".", 1)[-1] == key]
        if elsewhere:
            return f"did you mean `{elsewhere[0]}`? (`{key}` lives in another section)"
    return "valid keys here: " + ", ".join(f"`{k}`" for k in valid)


_KEY_ERRORS = ("extra_forbidden", "unexpected_keyword_argument", "recipe_key")
_MISSING = ("missing", "missing_argument", "missing_keyword_only_argument", "missing_positional_only_argument")


def _data_path(loc: Sequence[Any], data: Any) -> tuple[KeyPath, Any, bool]:
    """The part of a pydantic ``loc`` that indexes into the input ``data`` (dropping union-member
    tags), the value there, and whether the whole ``loc`` was found."""
    path: list[Any] = []
    node = data
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif dataclasses.is_dataclass(node) and not isinstance(node, type) and isinstance(part, str) \
                and hasattr(node, part):
            node = getattr(node, part)
        else:
            return tuple(path), node, False
        path.append(part)
    return tuple(path), node, True


def _type_at(root: Any, path: KeyPath) -> Any:
    tp = root
    for part in path:
        tp = _child(tp, part)
    return tp


def _recipe_error(exc: ValidationError, origins: _Origins, data: Any, root: Any, prefix: KeyPath = ()) -> RecipeError:
    """The first problem of a pydantic ``ValidationError`` as a :class:`RecipeError`: unknown keys
    first (as a reader fixes a recipe top down), then the rest in schema order. The value of a key that
    looks like a secret (``hub.tokn``) is not shown."""
    error = _recipe_error_shown(exc, origins, data, root, prefix)
    key = (error.key or "").rsplit(".", 1)[-1]
    if key and secret_key(key):
        _, value, _ = _data_path(_first_error(exc)["loc"], data)
        if isinstance(value, str) and len(value) >= 4:
            error = RecipeError(str(error).replace(repr(value), "***").replace(value, "***"), file=error.file,
                                line=error.line, key=error.key)
    return error


def _first_error(exc: ValidationError) -> Any:
    """The problem a reader fixes first: an unknown key, else the first in schema order."""
    return min(exc.errors(), key=lambda e: 0 if e["type"] in _KEY_ERRORS else 1)


def _recipe_error_shown(exc: ValidationError, origins: _Origins, data: Any, root: Any,
                        prefix: KeyPath = ()) -> RecipeError:
    e = _first_error(exc)
    path, value, found = _data_path(e["loc"], data)
    where = prefix + path
    kind = e["type"]
    tp = _type_at(root, path)
    if kind in _KEY_ERRORS:
        if not found:  # a key the walk could not enter (a shorthand string expanded by a validator)
            path = tuple(e["loc"])
            where = prefix + path
        if kind == "recipe_key":
            return origins.error(where, e["msg"], key_error=True)
        parent = _type_at(root, path[:-1])
        valid = _fields_of(parent) or {}
        across = any(a in SECTION_TYPES for a in _arms(parent))
        hint = _suggest(str(path[-1]), valid, prefix + path[:-1], across)
        return origins.error(where, f"is not a recipe key: {hint}", key_error=True)
    if kind.startswith("recipe_"):
        return origins.error(where if found else prefix + tuple(e["loc"]), e["msg"])
    if kind in ("too_short", "too_long") or (kind in _MISSING and any(
            typing.get_origin(a) is tuple for a in _arms(tp))):
        items = list(value) if isinstance(value, (list, tuple)) else []
        return origins.error(where, f"expected {_describe(tp)}, got {len(items)} values: {items!r}")
    if kind in _MISSING:
        missing = e["loc"][len(path)] if len(e["loc"]) > len(path) else None
        need = _describe(_child(tp, missing))
        return origins.error(where, f"is missing the required key `{missing}` ({need}); add it")
    if kind in ("value_error", "assertion_error"):
        return origins.error(where, str(e.get("ctx", {}).get("error", e["msg"])).removeprefix("Value error, "))
    if kind == "finite_number":
        return origins.error(where, f"{_NOT_FINITE}, got {value!r}")
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        bound = next(iter(e.get("ctx", {}).values()))
        shown = float(value) if float in _arms(tp) and isinstance(value, int) else value
        return origins.error(where, f"must be {bounds[kind]} {bound:g}, got {shown!r}")
    choices = [a for a in _arms(tp) if typing.get_origin(a) is Literal]
    if kind == "literal_error" and len(_arms(tp)) == 1 and choices and isinstance(value, str):
        args = typing.get_args(choices[0])
        close = difflib.get_close_matches(value, [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return origins.error(where, f"must be one of {', '.join(repr(a) for a in args)}, got {value!r}{hint}")
    if _fields_of(tp) is not None and not isinstance(value, Mapping) and value is not None:
        keys = ", ".join(str(k) for k in _fields_of(tp) or {})
        return origins.error(where, f"expected a mapping of {keys}, got {value!r} ({_type_name(value)})")
    return origins.error(where, f"expected {_describe(tp)}, got {value!r} ({_type_name(value)}); "
                                f"write {_describe(tp)} there")
