"""Recipes: the typed schema, YAML loading, ``key.sub=value`` overrides and validation errors.

A recipe is one YAML file (``recipes/*.yaml``) whose first comment line describes it, with the
sections ``model``, ``adapter``, ``data``, ``objective``, ``train``, ``eval``, ``output`` and
``hub`` (DESIGN 2-3). :func:`load_recipe` reads it with ``yaml.safe_load`` semantics, applies
command-line overrides and returns a :class:`Recipe` of nested dataclasses; every problem is a
:class:`RecipeError` whose message names the file and line (or the override), the key path and
how to fix it. :func:`dump_recipe` writes the resolved recipe into a run folder.

Dataset entries (``data.train`` and each of ``eval.sets``) stay plain mappings with the keys of
``finetune.data.sources.SourceSpec``; the string shorthand ``docci`` / ``docci:goal`` (name and
protocol) is expanded to a mapping. The options of each objective term are validated by the
dataclass that the term registered with :func:`register_term_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tempfile
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = [
    "AdapterConfig",
    "DataConfig",
    "EvalConfig",
    "HubConfig",
    "KPSConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OutputConfig",
    "Recipe",
    "RecipeError",
    "SOURCE_SPEC_KEYS",
    "TrainConfig",
    "dump_recipe",
    "list_recipes",
    "load_recipe",
    "parse_source_shorthand",
    "parse_sources",
    "recipe_to_dict",
    "register_term_config",
    "registered_term_configs",
]

#: The keys of a dataset entry (``finetune.data.sources.SourceSpec``).
SOURCE_SPEC_KEYS: tuple[str, ...] = (
    "name", "path", "split", "protocol", "size", "seed", "limit",
    "image_column", "caption_column", "id_column", "options",
)


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
        super().__init__(message)
        self.file = file
        self.line = line
        self.key = key


# -- field checks ---------------------------------------------------------------------------------
def _at_least(low: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is not None and value < low:
            return f"must be >= {low:g}, got {value!r}"
        return None
    return check


def _in_unit_interval(value: Any) -> str | None:
    if value is not None and not 0.0 <= value < 1.0:
        return f"must be in [0, 1), got {value!r}"
    return None


def _positive(value: Any) -> str | None:
    if value is not None and value <= 0:
        return f"must be > 0, got {value!r}"
    return None


def _betas(value: Any) -> str | None:
    if any(not 0.0 <= b < 1.0 for b in value):
        return f"both betas must be in [0, 1), got {list(value)!r}"
    return None


def _positive_ints(value: Any) -> str | None:
    if not value:
        return "must list at least one K, e.g. [1, 5, 10]"
    bad = [k for k in value if k < 1]
    return f"every K must be >= 1, got {bad!r}" if bad else None


def _non_empty(value: Any) -> str | None:
    return "must not be empty" if isinstance(value, str) and not value.strip() else None


def _check(fn: Callable[[Any], str | None]) -> dict[str, Any]:
    return {"check": fn}


# -- the schema -----------------------------------------------------------------------------------
@dataclass
class KPSConfig:
    """Long-CLIP knowledge-preserving stretching of the text positions (Long-CLIP 3.1; DESIGN 4).

    ``keep`` rows are copied, the rest interpolated by ``ratio`` (``None``: the smallest ratio that
    reaches ``model.max_text_len``); ``freeze_kept`` keeps the copied rows frozen in training.
    """

    keep: int = field(default=20, metadata=_check(_at_least(0)))
    ratio: int | None = field(default=None, metadata=_check(_at_least(1)))
    freeze_kept: bool = True


@dataclass
class ModelConfig:
    """Which model to load and how (``finetune.load_model``)."""

    name_or_path: str = field(default="small-clip", metadata=_check(_non_empty))
    #: the registered model family that loads it (``finetune.models.families``: ``hf``, ``open_clip``,
    #: ...); ``auto`` detects it from a saved folder's own files or the registry name
    family: str = field(default="auto", metadata=_check(_non_empty))
    #: deprecated alias of ``family`` (``auto`` defers to ``family``)
    backend: str = "auto"
    max_text_len: int | None = field(default=248, metadata=_check(_at_least(1)))
    kps: KPSConfig = field(default_factory=KPSConfig)
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass
class AdapterConfig:
    """Full fine-tuning or a peft LoRA / DoRA adapter (DESIGN 4, "Adapters")."""

    type: Literal["full", "lora", "dora"] = "full"
    r: int = field(default=16, metadata=_check(_at_least(1)))
    alpha: int = field(default=32, metadata=_check(_at_least(1)))
    dropout: float = field(default=0.05, metadata=_check(_in_unit_interval))
    targets: Literal["preset"] | list[str] = "preset"
    include_mlp: bool = True
    extra_targets: list[str] = field(default_factory=list)


def _default_train_source() -> dict[str, Any]:
    return {"name": "synthetic", "size": 2000, "seed": 0}


def _default_eval_sets() -> list[dict[str, Any]]:
    return [{"name": "synthetic", "split": "test", "size": 256, "seed": 1}]


@dataclass
class DataConfig:
    """The training data: a dataset entry (a ``SourceSpec`` mapping) and how to treat bad rows."""

    train: dict[str, Any] = field(default_factory=_default_train_source,
                                  metadata={"source": "one"})
    on_error: Literal["skip", "raise"] = "skip"
    num_workers: int = field(default=0, metadata=_check(_at_least(0)))
    cache_dir: str | None = None


@dataclass
class EvalConfig:
    """Retrieval evaluation before and after training (``finetune.evaluate``)."""

    sets: list[dict[str, Any]] = field(default_factory=_default_eval_sets,
                                       metadata={"source": "list"})
    batch_size: int = field(default=64, metadata=_check(_at_least(1)))
    ks: list[int] = field(default_factory=lambda: [1, 5, 10, 25, 50],
                          metadata=_check(_positive_ints))
    before: bool = True
    after: bool = True
    #: also evaluate the trained model with captions cut at its original length (77 for CLIP), to show
    #: what reading past it buys (only when KPS stretched the model)
    compare_base_length: bool = False
    #: a registered scorer (``finetune.scorers``): ``cosine`` (default) or one a method registers
    scorer: str = field(default="cosine", metadata=_check(_non_empty))
    #: re-score only the global-cosine top-k candidates with the scorer (FLAIR's inference); null: all
    rerank_top_k: int | None = field(default=None, metadata=_check(_at_least(1)))
    #: texts x images scored per block (bounds evaluation memory)
    block_size: int = field(default=1024, metadata=_check(_at_least(1)))


@dataclass
class ObjectiveConfig:
    """One base loss plus any number of weighted terms (DESIGN 3); ``terms`` maps a registered
    term name to its options dataclass (see :func:`register_term_config`).

    ``label_smoothing: null`` (the default) keeps the base term's own value: 0 for ``clip``, 0.1
    for ``longclip`` (Long-CLIP's training code); a number overrides it.
    """

    #: a registered term used as the base loss (``clip``, ``siglip``, ``longclip``, ...) or ``none``
    base: str = field(default="clip", metadata=_check(_non_empty))
    #: modules imported before the terms are validated, so that a user's own terms and scorers
    #: register (YAML key ``objective.import``)
    imports: list[str] = field(default_factory=list)
    label_smoothing: float | None = field(default=None, metadata=_check(_in_unit_interval))
    terms: dict[str, Any] = field(default_factory=dict, metadata={"terms": True})


@dataclass
class TrainConfig:
    """The Accelerate loop (DESIGN 6). Defaults are StructXLIP's (D.2): AdamW lr 5e-6, weight
    decay 0.05, cosine to 0, batch 16, 10 epochs."""

    lr: float = field(default=5.0e-6, metadata=_check(_positive))
    weight_decay: float = field(default=0.05, metadata=_check(_at_least(0)))
    betas: tuple[float, float] = field(default=(0.9, 0.98), metadata=_check(_betas))
    eps: float = field(default=1.0e-6, metadata=_check(_positive))
    batch_size: int = field(default=16, metadata=_check(_at_least(1)))
    epochs: int | None = field(default=10, metadata=_check(_at_least(1)))
    max_steps: int | None = field(default=None, metadata=_check(_at_least(1)))
    warmup_steps: int = field(default=0, metadata=_check(_at_least(0)))
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr: float = field(default=0.0, metadata=_check(_at_least(0)))
    logit_scale_max: float | None = None
    grad_clip: float | None = field(default=None, metadata=_check(_positive))
    accumulation_steps: int = field(default=1, metadata=_check(_at_least(1)))
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    checkpoint_every: int = field(default=0, metadata=_check(_at_least(0)))
    keep_checkpoints: int = field(default=2, metadata=_check(_at_least(1)))
    resume: str | None = None
    seed: int = 42
    log_every: int = field(default=10, metadata=_check(_at_least(1)))
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    on_nonfinite: Literal["raise", "skip"] = "raise"
    fused_optimizer: Literal["auto"] | bool = "auto"


@dataclass
class OutputConfig:
    """Where the run folder goes (recipe.yaml, metrics.json, report.md, plots/, final/, ...)."""

    dir: str = field(default="runs/quickstart", metadata=_check(_non_empty))


@dataclass
class HubConfig:
    """Optional push of the result to the Hugging Face hub. ``token`` is accepted but never
    written out (:func:`recipe_to_dict` drops it); prefer ``HF_TOKEN`` in the environment."""

    push: bool = False
    repo_id: str | None = None
    private: bool = True
    revision: str | None = None
    token: str | None = field(default=None, repr=False)


@dataclass
class Recipe:
    """A validated recipe: the eight sections, plus where it came from.

    ``description`` is the file's first comment line and ``source`` its path; ``overrides`` are the
    command-line ``key=value`` strings applied on top. These three are not recipe keys.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    description: str = field(default="", metadata={"meta": True})
    source: str | None = field(default=None, metadata={"meta": True}, compare=False)
    overrides: tuple[str, ...] = field(default=(), metadata={"meta": True}, compare=False)


_SECRET_KEYS = {("hub", "token")}
_SECTION_TYPES = (ModelConfig, KPSConfig, AdapterConfig, DataConfig, EvalConfig, ObjectiveConfig,
                  TrainConfig, OutputConfig, HubConfig)


# -- objective term registry ----------------------------------------------------------------------
_TERM_CONFIGS: dict[str, type] = {}


def register_term_config(name: str, cls: type) -> None:
    """Register the options dataclass of an objective term, so that ``objective.terms.<name>`` in
    a recipe is validated against (and built as) ``cls``.

    Registering the same class twice is a no-op; a different class under a taken name is an error.
    """
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise TypeError(f"register_term_config({name!r}, ...): expected a dataclass type, got {cls!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_term_config: the term name must be a non-empty string, got {name!r}")
    known = _TERM_CONFIGS.get(name)
    if known is not None and known is not cls:
        raise ValueError(
            f"objective term {name!r} is already registered with {known.__module__}.{known.__qualname__}; "
            f"pick another name for {cls.__module__}.{cls.__qualname__}"
        )
    _TERM_CONFIGS[name] = cls


def registered_term_configs() -> dict[str, type]:
    """The registered term names and their options dataclasses (importing ``finetune.objectives``
    first, so that the built-in terms are there)."""
    _import_objectives()
    return dict(_TERM_CONFIGS)


def _import_objectives() -> None:
    try:
        import finetune.objectives  # noqa: F401  (registers the built-in terms)
    except ImportError:
        pass


# -- where a key came from ------------------------------------------------------------------------
KeyPath = tuple[Any, ...]


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
            return RecipeError(f"command-line override `{text}`: {message}", key=dotted)
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


# -- type conversion and validation -------------------------------------------------------------
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number (e.g. 1.0e-5)"
    if tp is str:
        return "a string"
    if origin in (list, tuple) or tp in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} values ({', '.join(_describe(a) for a in args)})"
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _plural(tp: Any) -> str:
    names = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is dict or dataclasses.is_dataclass(tp):
        return "mappings"
    return f"values ({_describe(tp)})"


def _suggest(key: str, valid: Iterable[str], prefix: KeyPath, schema_paths: Iterable[str] = ()) -> str:
    valid = list(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{_dotted(prefix + (close[0],))}`?"
    elsewhere = [p for p in schema_paths if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"did you mean `{elsewhere[0]}`? (`{key}` lives in another section)"
    return "valid keys here: " + ", ".join(f"`{k}`" for k in valid)


def _schema_paths(cls: type, prefix: str = "") -> list[str]:
    paths = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("meta"):
            continue
        dotted = f"{prefix}{f.name}"
        paths.append(dotted)
        if dataclasses.is_dataclass(hints[f.name]):
            paths.extend(_schema_paths(hints[f.name], dotted + "."))
    return paths


class _Validator:
    """Converts a plain (YAML) value to the annotated type, raising :class:`RecipeError`s."""

    def __init__(self, origins: _Origins) -> None:
        self.origins = origins
        self.schema_paths = _schema_paths(Recipe)

    def fail(self, path: KeyPath, message: str, *, key_error: bool = False) -> RecipeError:
        return self.origins.error(path, message, key_error=key_error)

    def fail_any(self, paths: Sequence[KeyPath], message: str) -> RecipeError:
        """An error about several keys (the message names them), located at the first one an
        override set, else the first one the file sets, else the first."""
        for path in paths:
            if self.origins.overridden(path):
                return self.origins.error(path, message, name_key=False)
        for path in paths:
            if self.origins.in_file(path):
                return self.origins.error(path, message, name_key=False)
        return self.origins.error(paths[0], message, name_key=False)

    def wrong_type(self, path: KeyPath, tp: Any, value: Any) -> RecipeError:
        return self.fail(path, f"expected {_describe(tp)}, got {value!r} ({_type_name(value)}); "
                               f"write {_describe(tp)} there")

    def convert(self, value: Any, tp: Any, path: KeyPath) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any:
            return value
        if tp is type(None):
            if value is not None:
                raise self.wrong_type(path, tp, value)
            return None
        if origin in (typing.Union, types.UnionType):
            if value is None:
                if type(None) in args:
                    return None
                raise self.wrong_type(path, tp, value)
            arms = [a for a in args if a is not type(None)]
            for arm in arms:
                try:
                    return self.convert(value, arm, path)
                except RecipeError:
                    continue
            # one arm that is a container/dataclass of the right shape gives the most precise error
            for arm in arms:
                if _shape_matches(value, arm):
                    return self.convert(value, arm, path)
            raise self.wrong_type(path, tp, value)
        if origin is Literal:
            if isinstance(value, bool):
                # YAML 1.1 reads unquoted no/yes/off/on as booleans: `mixed_precision: no`
                for word in (("no", "off", "false") if not value else ("yes", "on", "true")):
                    if word in args:
                        return word
            elif value in args:
                return value
            if isinstance(value, str):
                close = difflib.get_close_matches(value, [str(a) for a in args], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise self.fail(path, f"must be one of {', '.join(repr(a) for a in args)}, got {value!r}{hint}")
            raise self.wrong_type(path, tp, value)
        if tp is bool:
            if not isinstance(value, bool):
                raise self.wrong_type(path, tp, value)
            return value
        if tp is int:
            if isinstance(value, bool):
                raise self.wrong_type(path, tp, value)
            if isinstance(value, int):
                return value
            if isinstance(value, str) and _NUMBER.match(value.strip()):
                value = float(value)
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise self.wrong_type(path, tp, value)
        if tp is float:
            if isinstance(value, bool):
                raise self.wrong_type(path, tp, value)
            if isinstance(value, (int, float)):
                return float(value)
            # YAML 1.1 reads `1e-5` (no dot) as a string; it is a number here
            if isinstance(value, str) and _NUMBER.match(value.strip()):
                return float(value)
            raise self.wrong_type(path, tp, value)
        if tp is str:
            if not isinstance(value, str):
                raise self.wrong_type(path, tp, value)
            return value
        if origin is list or tp is list:
            if not isinstance(value, (list, tuple)):
                raise self.wrong_type(path, tp, value)
            item = args[0] if args else Any
            return [self.convert(v, item, path + (i,)) for i, v in enumerate(value)]
        if origin is tuple:
            if not isinstance(value, (list, tuple)):
                raise self.wrong_type(path, tp, value)
            if args and args[-1] is Ellipsis:
                return tuple(self.convert(v, args[0], path + (i,)) for i, v in enumerate(value))
            if len(value) != len(args):
                raise self.fail(path, f"expected {_describe(tp)}, got {len(value)} values: {list(value)!r}")
            return tuple(self.convert(v, a, path + (i,)) for i, (v, a) in enumerate(zip(value, args)))
        if origin is dict or tp is dict:
            if not isinstance(value, Mapping):
                raise self.wrong_type(path, tp, value)
            kt, vt = args if args else (Any, Any)
            out = {}
            for k, v in value.items():
                if kt is str and not isinstance(k, str):
                    raise self.fail(path + (k,), f"has a key {k!r} that is not a string; quote it", key_error=True)
                out[k] = self.convert(v, vt, path + (k,))
            return out
        if dataclasses.is_dataclass(tp):
            return self.dataclass(value, tp, path)
        if isinstance(tp, type):
            if not isinstance(value, tp):
                raise self.wrong_type(path, tp, value)
            return value
        return value

    def dataclass(self, value: Any, cls: type, path: KeyPath) -> Any:
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise self.fail(path, f"expected a mapping of {', '.join(f.name for f in _schema_fields(cls))}, "
                                  f"got {value!r} ({_type_name(value)})")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in _schema_fields(cls)}
        for key in value:
            if key not in fields:
                where = path + (key,)
                raise self.fail(where, f"is not a recipe key: "
                                       f"{_suggest(str(key), fields, path, self.schema_paths if cls in _SECTION_TYPES else ())}",
                                key_error=True)
        kwargs = {}
        for name, f in fields.items():
            if name not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise self.fail(path, f"is missing the required key `{name}` ({_describe(hints[name])}); add it")
                continue
            sub = path + (name,)
            raw = value[name]
            if f.metadata.get("source") == "one":
                converted = self.source(raw, sub)
            elif f.metadata.get("source") == "list":
                if not isinstance(raw, (list, tuple)):
                    raw = [raw] if isinstance(raw, (str, Mapping)) else raw
                if not isinstance(raw, (list, tuple)):
                    raise self.fail(sub, f"expected a list of datasets (names like `docci` or mappings "
                                         f"with {', '.join(SOURCE_SPEC_KEYS)}), got {raw!r}")
                converted = [self.source(v, sub + (i,)) for i, v in enumerate(raw)]
            elif f.metadata.get("terms"):
                converted = self.terms(raw, sub)
            else:
                converted = self.convert(raw, hints[name], sub)
            check = f.metadata.get("check")
            if check is not None:
                problem = check(converted)
                if problem:
                    raise self.fail(sub, problem)
            kwargs[name] = converted
        return cls(**kwargs)

    def source(self, value: Any, path: KeyPath) -> dict[str, Any]:
        """A dataset entry: a name string (``docci`` or ``docci:goal``) or a ``SourceSpec`` mapping,
        returned as a plain mapping holding the keys given."""
        if isinstance(value, str):
            if not value.strip():
                raise self.fail(path, "is an empty dataset name; write a name like `docci` or a mapping")
            spec = parse_source_shorthand(value)
            self.check_source_name(spec["name"], path)
            return spec
        if not isinstance(value, Mapping):
            raise self.fail(path, f"expected a dataset name (e.g. `docci`, `docci:goal`) or a mapping with "
                                  f"{', '.join(SOURCE_SPEC_KEYS)}; got {value!r} ({_type_name(value)})")
        spec_cls = _source_spec_class()
        try:
            self.dataclass(value, spec_cls, path)  # checks names, types and required keys
        except (TypeError, ValueError) as exc:
            if isinstance(exc, RecipeError):
                raise
            raise self.fail(path, f"is not a valid dataset entry: {exc}") from None
        hints = typing.get_type_hints(spec_cls)
        spec = {k: self.convert(v, hints[k], path + (k,)) for k, v in value.items()}
        self.check_source_name(spec["name"], path + ("name",))
        return spec

    def check_source_name(self, name: str, path: KeyPath) -> None:
        known = _available_sources()
        if known is not None and name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise self.fail(path, f"is {name!r}, not a registered data source: {hint}"
                                  f"registered sources: {', '.join(sorted(known))}")

    def terms(self, value: Any, path: KeyPath) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(path, f"expected a mapping of term name -> options, got {value!r} ({_type_name(value)})")
        registry = registered_term_configs()
        out = {}
        for name, options in value.items():
            if name not in registry:
                known = ", ".join(f"`{n}`" for n in sorted(registry)) or "none (finetune.objectives registered no terms)"
                close = difflib.get_close_matches(str(name), list(registry), n=1)
                hint = f"did you mean `{close[0]}`? " if close else ""
                raise self.fail(path + (name,), f"is not a registered objective term: {hint}registered terms: {known}",
                                key_error=True)
            out[name] = self.dataclass(options, registry[name], path + (name,))
        return out


def _shape_matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (list, tuple) or tp in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return isinstance(value, Mapping)
    return False


def _schema_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("meta")]


@dataclass
class _SourceSpecKeys:
    """The keys of a dataset entry, used when ``finetune.data.sources`` is not importable."""

    name: str
    path: str | None = None
    split: str | None = None
    protocol: str | None = None
    size: int | None = None
    seed: int | None = None
    limit: int | None = None
    image_column: str | None = None
    caption_column: str | None = None
    id_column: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


def _source_spec_class() -> type:
    try:
        from finetune.data.sources import SourceSpec
    except ImportError:
        return _SourceSpecKeys
    return SourceSpec if dataclasses.is_dataclass(SourceSpec) else _SourceSpecKeys


def _available_sources() -> dict[str, str] | None:
    """The registered data sources, or None when ``finetune.data.sources`` is not importable."""
    try:
        from finetune.data.sources import available_sources
    except ImportError:
        return None
    return available_sources()


def parse_sources(value: Any, key: str = "eval.sets") -> list[dict[str, Any]]:
    """Validate a list of dataset entries as the recipe validates ``eval.sets`` (names,
    ``name:protocol`` shorthands or ``SourceSpec`` mappings; a single entry is a list of one) and
    return them as plain mappings. Errors name ``key``.

    Raises:
        RecipeError: on unknown keys, wrong types or a missing ``name``.
    """
    if isinstance(value, (str, Mapping)):
        value = [value]
    validator = _Validator(_Origins(None, None))
    path = tuple(key.split("."))
    if not isinstance(value, (list, tuple)):
        raise validator.fail(path, f"expected a list of datasets, got {value!r} ({_type_name(value)})")
    return [validator.source(v, path + (i,)) for i, v in enumerate(value)]


def parse_source_shorthand(text: str) -> dict[str, Any]:
    """``"docci"`` -> ``{"name": "docci"}``; ``"docci:goal"`` -> ``{"name": "docci", "protocol": "goal"}``."""
    name, sep, protocol = text.strip().partition(":")
    spec: dict[str, Any] = {"name": name.strip()}
    if sep and protocol.strip():
        spec["protocol"] = protocol.strip()
    return spec


def _cross_checks(recipe: Recipe, v: _Validator) -> None:
    t = recipe.train
    if t.batch_size % t.accumulation_steps:
        raise v.fail_any([("train", "batch_size"), ("train", "accumulation_steps")],
                         f"`train.batch_size` ({t.batch_size}) must be divisible by "
                         f"`train.accumulation_steps` ({t.accumulation_steps}), since each micro-batch "
                         f"holds batch_size / accumulation_steps samples")
    if t.epochs is None and t.max_steps is None:
        raise v.fail_any([("train", "epochs"), ("train", "max_steps")],
                         "`train.epochs` and `train.max_steps` are both null; set at least one of them")
    if t.min_lr > t.lr:
        raise v.fail_any([("train", "min_lr"), ("train", "lr")],
                         f"`train.min_lr` ({t.min_lr:g}) is above `train.lr` ({t.lr:g}); lower it")
    known_bases = {"none", "clip", "siglip", "longclip", *_TERM_CONFIGS}
    if recipe.objective.base not in known_bases:
        close = difflib.get_close_matches(recipe.objective.base, sorted(known_bases), n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        raise v.fail(("objective", "base"), f"is not a registered objective term: {hint}choose one of "
                                            f"{', '.join(f'`{b}`' for b in sorted(known_bases))}")
    if recipe.hub.push and not recipe.hub.repo_id:
        raise v.fail_any([("hub", "repo_id"), ("hub", "push")],
                         "`hub.push: true` needs `hub.repo_id` (`user/name`); set it "
                         "or set `hub.push: false`")


# -- loading --------------------------------------------------------------------------------------
def _import_user_modules(tree: dict[str, Any], v: _Validator) -> None:
    """``objective.import: [my_pkg.my_term]``: import the modules (they register terms, scorers or
    model families) before the rest is validated; the YAML key ``import`` is the field ``imports``."""
    import importlib

    objective = tree.get("objective")
    if not isinstance(objective, dict) or "import" not in objective:
        return
    modules = objective.pop("import")
    objective["imports"] = modules
    if modules is None:
        objective["imports"] = modules = []
    if isinstance(modules, str):
        objective["imports"] = modules = [modules]
    if not isinstance(modules, list) or not all(isinstance(m, str) and m.strip() for m in modules):
        raise v.fail(("objective", "import"), f"expected a list of module names (e.g. `[my_pkg.my_term]`), "
                                              f"got {modules!r}")
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name.strip())
        except ImportError as exc:
            raise v.fail(("objective", "import", i),
                         f"cannot import module {name!r} ({exc}); install it or put its folder on "
                         f"PYTHONPATH") from None


def _compose(text: str, file: str) -> tuple[Any, yaml.Node | None]:
    """Parse YAML once, keeping both the node tree (for line numbers) and the safe-loaded data."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}, None
        _reject_duplicates(node, file)
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        where = f"{file}, line {line}" if line else file
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"{where}: invalid YAML ({problem}); fix the syntax there "
                          f"(indentation, `key: value`, quotes)", file=file, line=line) from None
    finally:
        loader.dispose()
    return data, node


def _reject_duplicates(node: yaml.Node, file: str, path: KeyPath = ()) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = getattr(key_node, "value", None)
            line = key_node.start_mark.line + 1
            if key in seen:
                dotted = _dotted(path + (key,))
                raise RecipeError(f"{file}, line {line}: `{dotted}` is given twice (first on line {seen[key]}); "
                                  f"keep one", file=file, line=line, key=dotted)
            seen[key] = line
            _reject_duplicates(value_node, file, path + (key,))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _reject_duplicates(item, file, path + (i,))


def _parse_override(text: str) -> tuple[KeyPath, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"command-line override `{text}` is not `key.sub=value` "
                          f"(e.g. `train.lr=1e-5`, `eval.sets=[docci,urban1k]`)")
    parts = key.split(".")
    if any(not p for p in parts):
        raise RecipeError(f"command-line override `{text}`: `{key}` has an empty part; write dotted keys like `train.lr`",
                          key=key)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"command-line override `{text}`: the value is not valid YAML ({problem}); "
                          f"quote it, e.g. {key}='...'", key=key) from None
    return tuple(int(p) if p.isdigit() else p for p in parts), value


def _is_source_path(path: KeyPath) -> bool:
    keys = tuple(str(p) for p in path)
    return keys == ("data", "train") or (len(keys) == 3 and keys[:2] == ("eval", "sets"))


def _set_path(tree: dict[str, Any], path: KeyPath, value: Any, text: str) -> None:
    """Set ``tree[path] = value``, creating mappings on the way; integer parts index lists and a
    dataset shorthand string (``docci:goal``) on the way becomes its mapping."""
    node: Any = tree
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list) and isinstance(part, int):
            if part >= len(node):
                raise RecipeError(f"command-line override `{text}`: `{_dotted(path[:i])}` has {len(node)} "
                                  f"entries, there is no index {part}", key=_dotted(path))
            key: Any = part
        elif isinstance(node, dict):
            key = str(part)
        else:
            raise RecipeError(f"command-line override `{text}`: `{_dotted(path[:i])}` is {node!r}, not a mapping; "
                              f"set it whole instead (e.g. `{_dotted(path[:i])}={{...}}`)", key=_dotted(path))
        if last:
            node[key] = value
            return
        if isinstance(node, dict) and node.get(key) is None:
            node[key] = {}
        if isinstance(node[key], str) and _is_source_path(path[:i + 1]):
            node[key] = parse_source_shorthand(node[key])
        node = node[key]


def _merge_defaults(data: Any, cls: type) -> Any:
    """``data`` with the defaults of ``cls`` filled in, recursing only into nested schema
    dataclasses: dataset entries, term options and lists given in the file replace the default
    whole. Keys that are not in the schema are kept, so that validation reports them."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        return data
    hints = typing.get_type_hints(cls)
    defaults = cls()
    out = dict(data)
    for f in _schema_fields(cls):
        tp = hints[f.name]
        if f.name in data:
            if dataclasses.is_dataclass(tp):
                out[f.name] = _merge_defaults(data[f.name], tp)
        else:
            default = getattr(defaults, f.name)
            out[f.name] = _plain(dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default)
    return out


def _first_comment(text: str) -> str:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            return stripped.lstrip("#").strip()
    return ""


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe.

    Args:
        path: the YAML file.
        overrides: ``key.sub=value`` strings applied after the file; values are YAML scalars or
            flow collections (``train.lr=1e-5``, ``eval.sets=[docci,urban1k]``,
            ``train.max_steps=null``, ``eval.sets.0.size=128``) and are validated like file values.

    Returns:
        the :class:`Recipe`, every section filled with its defaults where the file is silent.

    Raises:
        RecipeError: the file is missing or not valid YAML, a key is unknown (the message suggests
            the closest valid key), a value has the wrong type or range (the message names the
            expected type), an objective term is not registered, or the sections disagree
            (``train.batch_size`` not divisible by ``train.accumulation_steps``, ...).
    """
    file = os.fspath(path)
    p = Path(file)
    if not p.is_file():
        hint = " (it is a folder; give the YAML file inside)" if p.is_dir() else ""
        raise RecipeError(f"recipe file not found: {file}{hint}; give the path of a YAML recipe "
                          f"(`finetune/run.py --list` shows the ones in recipes/)", file=file)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read the recipe {file}: {exc}", file=file) from None
    data, node = _compose(text, file)
    if not isinstance(data, Mapping):
        raise RecipeError(f"{file}: a recipe is a mapping of sections ({', '.join(f.name for f in _schema_fields(Recipe))}), "
                          f"got {_type_name(data)}", file=file)
    # overrides go on top of the file merged with the defaults, so that `data.train.size=64` edits
    # the default dataset entry and an override can repair a bad file value before validation
    tree = _merge_defaults(data, Recipe)
    parsed = [(_parse_override(o), o) for o in overrides]
    for (opath, value), text_ in parsed:
        _set_path(tree, opath, value, text_)
    validator = _Validator(_Origins(file, node, [(opath, text_) for (opath, _), text_ in parsed]))
    _import_user_modules(tree, validator)
    recipe = validator.dataclass(tree, Recipe, ())
    _cross_checks(recipe, validator)
    recipe.description = _first_comment(text)
    recipe.source = file
    recipe.overrides = tuple(overrides)
    return recipe


# -- writing --------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def recipe_to_dict(recipe: Recipe, *, keep_secrets: bool = False) -> dict[str, Any]:
    """The recipe as plain YAML-able data (sections only; tuples become lists).

    ``hub.token`` is dropped unless ``keep_secrets`` is true.
    """
    out = {}
    for f in _schema_fields(Recipe):
        section = dataclasses.asdict(getattr(recipe, f.name))
        if not keep_secrets:
            for sec, key in _SECRET_KEYS:
                if sec == f.name:
                    section.pop(key, None)
        if f.name == "objective":
            section = {("import" if k == "imports" else k): v for k, v in section.items()}
        out[f.name] = _plain(section)
    return out


def dump_recipe(recipe: Recipe, path: str | os.PathLike[str]) -> Path:
    """Write the resolved recipe as YAML, atomically (temp file + ``os.replace``).

    The first line is the recipe's description comment, so the file lists and loads like any
    recipe; ``hub.token`` is never written, and overrides that set it are left out of the header.
    Returns the path written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    header = [f"# {recipe.description or 'resolved recipe'}"]
    if recipe.source:
        header.append(f"# resolved from {recipe.source}")
    shown = [o for o in recipe.overrides if not o.strip().startswith("hub.token")]
    if shown:
        header.append("# overrides: " + " ".join(shown))
    body = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True, default_flow_style=None)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("\n".join(header) + "\n" + body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def list_recipes(folder: str | os.PathLike[str] = "recipes") -> list[tuple[str, str]]:
    """The recipes in ``folder`` as ``(name, description)`` pairs, sorted by name; the name is the
    file name without ``.yaml`` / ``.yml`` and the description its first comment line."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"recipe folder not found: {root}; run from the repository root "
                                f"or give the folder that holds the YAML recipes")
    out = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix in (".yaml", ".yml"):
            out.append((p.stem, _first_comment(p.read_text(encoding="utf-8"))))
    return out
