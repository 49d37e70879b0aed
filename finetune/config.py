"""Recipes: the typed schema (pydantic v2), YAML loading, ``key.sub=value`` overrides and errors.

A recipe is one YAML file (``recipes/*.yaml``) whose first comment line describes it, with the
sections ``model``, ``adapter``, ``data``, ``objective``, ``train``, ``eval``, ``output`` and
``hub`` (DESIGN 2-3). Each section is a pydantic dataclass (attribute access, ``vars()``,
``dataclasses.asdict`` / ``replace`` keep working); pydantic converts and checks the values, and
this module turns its errors into a :class:`RecipeError` whose message names the file and line (or
the command-line override), the key path, what was expected and, for an unknown key, the closest
valid one (``did you mean `train.lr`?``, also across sections). :func:`load_recipe` reads a file
with ``yaml.safe_load`` semantics and applies overrides; :func:`dump_recipe` writes the resolved
recipe into a run folder; :func:`recipe_json_schema` (``python finetune/run.py --schema``) is the
JSON schema that editors use to complete and check recipes.

Dataset entries (``data.train`` and each of ``eval.sets``) stay plain mappings, validated against
``finetune.data.sources.SourceSpec`` (the keys come from that dataclass); the string shorthand
``docci`` / ``docci:goal`` (name and protocol) is expanded to a mapping. The options of each
objective term are validated by the class (a dataclass or a pydantic model) that the term
registered with :func:`register_term_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import math
import os
import re
import tempfile
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr
from pydantic import Strict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import InitErrorDetails, PydanticCustomError

import finetune.plugins as plugins

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
    "recipe_json_schema",
    "recipe_to_dict",
    "register_term_config",
    "registered_term_configs",
]


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


# -- secrets in messages -------------------------------------------------------------------------
#: what a hub token (or any similar access token) looks like
_TOKEN_VALUE = re.compile(r"\b(hf_)[A-Za-z0-9]{10,}")
_SECRET_WORDS = ("token", "secret", "password", "passwd", "apikey", "api_key", "credential", "auth")


def secret_key(key: Any) -> bool:
    """Whether a recipe key looks like it holds a secret: it contains ``token``, ``secret``, ``password``,
    ... or is a near miss of one (``tokn``, ``tocken``), as a mistyped ``hub.token`` is."""
    word = str(key).lower()
    if any(w in word for w in _SECRET_WORDS):
        return True
    return bool(difflib.get_close_matches(word, ["token", "secret", "password"], n=1, cutoff=0.75))


def mask_secrets(text: str) -> str:
    """``text`` with every value that looks like a hub token (``hf_...``) replaced by ``***``."""
    return _TOKEN_VALUE.sub(lambda m: m.group(1) + "***", text)


def _mask_override(text: str) -> str:
    """A ``key=value`` override as messages show it: the value hidden when the key looks like a secret."""
    key, sep, value = text.partition("=")
    if sep and value.strip() and secret_key(key.strip().rsplit(".", 1)[-1]):
        return f"{key}=***"
    return mask_secrets(text)


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


# -- schema markers: dataset entries and objective terms ------------------------------------------
class _SourceEntry:
    """Marks a dataset entry (``SourceSpec`` mapping or shorthand); gives its JSON schema."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        spec = _json_schema_of(_source_spec_class(), handler)
        return {"anyOf": [{"type": "string", "description": "a registered source name, or `name:protocol`"},
                          spec]}


class _TermOptions:
    """Marks ``objective.terms``; its JSON schema lists the registered terms and their options."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        props = {name: {"anyOf": [_json_schema_of(cls, handler), {"type": "null"}]}
                 for name, cls in sorted(registered_term_configs().items())}
        return {"type": "object", "properties": props, "additionalProperties": False,
                "description": "registered objective term -> its options (null: the defaults)"}


_SOURCE_MARK = _SourceEntry()
_TERMS_MARK = _TermOptions()


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


# -- the sections ---------------------------------------------------------------------------------
_SECTION_CONFIG = ConfigDict(extra="forbid", populate_by_name=True)


def _section(path: tuple[str, ...]) -> Callable[[type], type]:
    """Make ``cls`` a pydantic dataclass of the recipe schema at ``path`` (``("model", "kps")``).

    Built in code (``TrainConfig(lr=0)``, ``dataclasses.replace``), a bad value raises a
    :class:`RecipeError` that names the recipe key, as in a file."""

    def wrap(cls: type) -> type:
        out = pydantic_dataclass(cls, config=_SECTION_CONFIG)
        validated_init = out.__init__

        @functools.wraps(validated_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                validated_init(self, *args, **kwargs)
            except ValidationError as exc:
                data = dict(zip([f.name for f in dataclasses.fields(out)], args)) | kwargs
                raise _recipe_error(exc, _Origins(None, None), data, out, path) from None

        out.__init__ = __init__
        return out

    return wrap


@_section(("model", "kps"))
class KPSConfig:
    """Long-CLIP knowledge-preserving stretching of the text positions (Long-CLIP 3.1; DESIGN 4).

    ``keep`` rows are copied, the rest interpolated by ``ratio`` (``None``: the smallest ratio that
    reaches ``model.max_text_len``); ``freeze_kept`` keeps the copied rows frozen in training.
    """

    keep: Annotated[_int(ge=0), _doc("position rows copied as they are (Long-CLIP: 20)")] = 20
    ratio: Annotated[_int(ge=1) | None, _doc("interpolation ratio; null: the smallest that "
                                                   "reaches model.max_text_len")] = None
    freeze_kept: Annotated[Bool, _doc("keep the copied rows frozen in training")] = True


def _check_family(value: str) -> str:
    if value != "auto":
        known = _registry_names("finetune.models.families",
                                ("model_family_names", "available_model_families"))
        _check_registered(value, known, "a registered model family", extra=("auto",))
    return value


@_section(("model",))
class ModelConfig:
    """Which model to load and how (``finetune.load_model``)."""

    name_or_path: Annotated[NonEmptyStr, _doc(
        "a hub id, a local folder or a registry config with random weights (random:small-clip, "
        "random:tiny-clip, ...)")] = "random:small-clip"
    family: Annotated[NonEmptyStr, AfterValidator(_check_family),
                      _doc("the registered model family that loads it (hf, open_clip, ...); auto "
                           "detects it from a saved folder's files or the registry name")] = "auto"
    backend: Annotated[NonEmptyStr, AfterValidator(_check_family),
                       _doc("deprecated alias of `family` (auto defers to `family`)")] = "auto"
    max_text_len: Annotated[_int(ge=1) | None, _doc("text length after KPS (Long-CLIP: 248); "
                                                          "null keeps the model's own")] = 248
    kps: Annotated[KPSConfig, _doc("Long-CLIP KPS settings")] = dataclasses.field(default_factory=KPSConfig)
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    gradient_checkpointing: Bool = False
    trust_remote_code: Annotated[Bool, _doc("let transformers run the model repository's code")] = False
    init_from: Annotated[Str | None, _doc(
        "start from another run's final/: a recipe YAML (its run is reused when its output.dir holds a "
        "finished run of the same resolved recipe, else trained first) or a run folder with final/; "
        "name_or_path is then not loaded (finetune.prerequisites)")] = None
    vision: Annotated[NonEmptyStr | None, _doc(
        "family vision_text: the image tower (a ViT or Swin hub id or folder) of a new dual encoder; "
        "with model.text, name_or_path is not read")] = None
    text: Annotated[NonEmptyStr | None, _doc(
        "family vision_text: the text tower (a BERT hub id or folder, with its tokenizer)")] = None
    projection_dim: Annotated[_int(ge=1) | None, _doc(
        "family vision_text: the joint dimension of the new projections (GRM: 512); null: 512")] = None

    def __post_init__(self) -> None:
        if self.backend != "auto" and self.family == "auto":
            self.family = self.backend


#: parameters trained next to an adapter by default (``finetune.models.adapters.EXTRA_SYMBOLS``)
_DEFAULT_TRAIN_EXTRA = ("positions", "logit_scale", "logit_bias")


@_section(("adapter",))
class AdapterConfig:
    """How to fine-tune: ``full`` (every parameter), ``lora`` or ``dora`` (peft; DESIGN 4,
    "Adapters"). The one adapter settings class: the recipe's ``adapter`` section and
    ``finetune.models.adapters.apply_adapter`` both take it.

    Attributes:
        type: ``"full"``, ``"lora"`` or ``"dora"``.
        r: LoRA rank.
        alpha: LoRA ``alpha`` (the update is scaled by ``alpha / r``).
        dropout: dropout on the LoRA branch input.
        targets: ``"preset"`` (the backend's attention + MLP linears) or a list of module names
            (peft's suffix matching).
        include_mlp: with the preset, also adapt the MLP linears.
        extra_targets: more module names to adapt (e.g. ``"text_projection"``).
        train_extra: parameters trained as they are next to the adapter: ``"positions"`` (the
            text positional table, when KPS stretched it), ``"logit_scale"``, ``"logit_bias"``, or
            names / shell patterns of the backend model's parameters (``"text_model.final_layer_norm.*"``).
    """

    type: Annotated[Literal["full", "lora", "dora"], _doc("full fine-tuning or a peft adapter")] = "full"
    r: Annotated[_int(ge=1), _doc("LoRA rank")] = 16
    alpha: Annotated[_int(ge=1), _doc("LoRA alpha (the update is scaled by alpha / r)")] = 32
    dropout: Annotated[UnitInterval, _doc("dropout on the LoRA branch input")] = 0.05
    targets: Annotated[Literal["preset"] | list[Str],
                       _doc("preset (the backend's attention + MLP linears) or module names")] = "preset"
    include_mlp: Annotated[Bool, _doc("with the preset, also adapt the MLP linears")] = True
    extra_targets: Annotated[list[Str], _doc("more module names to adapt")] = dataclasses.field(
        default_factory=list)
    train_extra: Annotated[list[Str], _doc("trained as they are next to the adapter: positions, "
                                           "logit_scale, logit_bias or parameter name patterns")] = (
        dataclasses.field(default_factory=lambda: list(_DEFAULT_TRAIN_EXTRA)))


def _default_train_source() -> dict[str, Any]:
    return {"name": "synthetic", "size": 2000, "seed": 0}


def _default_eval_sets() -> list[dict[str, Any]]:
    return [{"name": "synthetic", "split": "test", "size": 256, "seed": 1}]


def _validate_source_entry(value: Any) -> dict[str, Any]:
    return _source_entry(value)


def _validate_source_list(value: Any) -> Any:
    if isinstance(value, (str, Mapping)):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise PydanticCustomError(
            "recipe_value", "expected a list of datasets (names like `docci` or mappings with {keys}), got {got}",
            {"keys": ", ".join(_source_keys()), "got": repr(value)})
    return value


SourceEntry = Annotated[dict[str, Any], BeforeValidator(_validate_source_entry), _SOURCE_MARK]


def _no_streams(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evaluation sets are map-style datasets: a stream entry (``webdataset``, ...) is an error."""
    parse = getattr(_source_spec_class(), "parse", None)
    if parse is None:
        return entries
    errors = []
    for i, entry in enumerate(entries):
        if getattr(parse(dict(entry)), "is_stream", False):
            errors.append(InitErrorDetails(type=PydanticCustomError(
                "recipe_value", "is a stream; only `data.train` can be read as a stream: evaluate on a "
                "map-style source (a path, a benchmark name)"), loc=(i,), input=entry))
    _raise_errors(errors, "eval.sets")
    return entries


@_section(("data",))
class DataConfig:
    """The training data: a dataset entry (a ``SourceSpec`` mapping) and how to treat bad rows."""

    train: Annotated[SourceEntry, _doc("the training set: a source name, `name:protocol` or a "
                                       "mapping of SourceSpec keys")] = dataclasses.field(
        default_factory=_default_train_source)
    on_error: Annotated[Literal["skip", "raise"], _doc("bad rows: count and skip them, or stop")] = "skip"
    num_workers: Annotated[_int(ge=0), _doc("data-loader worker processes")] = 0
    cache_dir: Annotated[Str | None, _doc("where downloaded / preprocessed data is cached")] = None
    max_image_pixels: Annotated[_int(ge=1), _doc(
        "the largest image accepted, in pixels (width x height); larger ones follow `data.on_error` "
        "(PIL's decompression-bomb limit by default)")] = 89_478_485
    validate: Annotated[Literal["header", "full"], _doc(
        "how images are checked before training: `header` (fast: format, size, JPEG end marker) or "
        "`full` (decode every image once)")] = "header"


def _check_scorer(value: str) -> str:
    if value != "cosine":  # the built-in default: no need to import the scorers (and torch) for it
        known = _registry_names("finetune.scorers", ("available_scorers", "scorer_names"))
        _check_registered(value, known, "a registered scorer")
    return value


@_section(("eval",))
class EvalConfig:
    """Retrieval evaluation before and after training (``finetune.evaluate``)."""

    sets: Annotated[list[SourceEntry], BeforeValidator(_validate_source_list), AfterValidator(_no_streams),
                    _doc("the evaluation sets (dataset entries)")] = dataclasses.field(
        default_factory=_default_eval_sets)
    batch_size: _int(ge=1) = 64
    ks: Annotated[list[Int], AfterValidator(_positive_ints), _doc("the K of Recall@K")] = dataclasses.field(
        default_factory=lambda: [1, 5, 10, 25, 50])
    before: Annotated[Bool, _doc("evaluate the model before training")] = True
    after: Annotated[Bool, _doc("evaluate the model after training")] = True
    compare_base_length: Annotated[Bool, _doc(
        "also evaluate the trained model with captions cut at its original length (77 for CLIP), to "
        "show what reading past it buys (only when KPS stretched the model)")] = False
    scorer: Annotated[NonEmptyStr, AfterValidator(_check_scorer), _doc(
        "a registered scorer (finetune.scorers): cosine or one a method registers")] = "cosine"
    rerank_top_k: Annotated[_int(ge=1) | None, _doc(
        "re-score only the global-cosine top-k candidates with the scorer; null: all")] = None
    block_size: Annotated[_int(ge=1), _doc("texts x images scored per block (bounds memory)")] = 1024
    compare_with: Annotated[list[NonEmptyStr], _doc(
        "recipes (or finished run folders) whose Recall@K the report sets beside this run's; a recipe's "
        "run is reused when current, else trained first, like model.init_from")] = dataclasses.field(
        default_factory=list)
    seed_spread: Annotated[_float(ge=0.0) | None, _doc(
        "how many points of Recall@1 this recipe's result moves between seeds (the range you measured over "
        "train.seed); the report's verdict says whether the gap to eval.compare_with exceeds it. null: not "
        "measured, the verdict says the gap cannot be judged")] = None


def _validate_terms(value: Any) -> dict[str, Any]:
    return _term_options(value)


def _check_base(value: str) -> str:
    known = {"none", "clip", "siglip", "longclip", *plugins.TERM_OPTIONS.snapshot()}
    if value not in known:
        known |= set(registered_term_configs())
    if value not in known:
        close = difflib.get_close_matches(value, sorted(known), n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        raise PydanticCustomError("recipe_value", "is not a registered objective term: {hint}choose one of {known}",
                                  {"hint": hint, "known": ", ".join(f"`{b}`" for b in sorted(known))})
    return value


@_section(("objective",))
class ObjectiveConfig:
    """One base loss plus any number of weighted terms (DESIGN 3); ``terms`` maps a registered
    term name to its options (the class given to :func:`register_term_config`).

    ``label_smoothing: null`` (the default) keeps the base term's own value: 0 for ``clip``, 0.1
    for ``longclip`` (Long-CLIP's training code); a number overrides it.
    """

    base: Annotated[NonEmptyStr, AfterValidator(_check_base), _doc(
        "a registered term used as the base loss (clip, siglip, longclip, ...) or none")] = "clip"
    #: YAML key ``objective.import``
    imports: Annotated[list[NonEmptyStr], Field(alias="import"), _doc(
        "modules imported before the terms are validated, so that your own terms, scorers and "
        "model families register")] = dataclasses.field(default_factory=list)
    label_smoothing: Annotated[UnitInterval | None, _doc(
        "null keeps the base term's own (0 clip, 0.1 longclip)")] = None
    terms: Annotated[dict[str, Any], BeforeValidator(_validate_terms), _TERMS_MARK] = dataclasses.field(
        default_factory=dict)


@_section(("train",))
class TrainConfig:
    """The Accelerate loop (DESIGN 6). Defaults are StructXLIP's (D.2): AdamW lr 5e-6, weight
    decay 0.05, cosine to 0, batch 16, 10 epochs."""

    lr: Annotated[_float(gt=0.0), _doc("peak learning rate (AdamW)")] = 5.0e-6
    weight_decay: _float(ge=0.0) = 0.05
    betas: Annotated[tuple[Float, Float], AfterValidator(_betas), _doc("AdamW betas")] = (0.9, 0.98)
    eps: _float(gt=0.0) = 1.0e-6
    batch_size: Annotated[_int(ge=1), _doc("global batch size (all processes)")] = 16
    epochs: _int(ge=1) | None = 10
    max_steps: Annotated[_int(ge=1) | None, _doc("stop after this many optimizer steps")] = None
    warmup_steps: _int(ge=0) = 0
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr: _float(ge=0.0) = 0.0
    logit_scale_max: Annotated[Float | None, _doc("clamp of the log logit scale after each step")] = None
    grad_clip: _float(gt=0.0) | None = None
    accumulation_steps: _int(ge=1) = 1
    mixed_precision: Annotated[Literal["no", "fp16", "bf16"], BeforeValidator(_yaml_word)] = "no"
    checkpoint_every: Annotated[_int(ge=0), _doc("steps between checkpoints; 0: none")] = 0
    keep_checkpoints: _int(ge=1) = 2
    resume: Annotated[Str | None, _doc("a checkpoint folder, or `latest`")] = None
    resume_ignore_changes: Annotated[Bool, _doc(
        "resume even where the recipe differs from the checkpoint's in what matters for continuation "
        "(the differences are logged)")] = False
    resume_ignore_rng: Annotated[Bool, _doc(
        "resume from a checkpoint whose RNG state (random_states_<rank>.pkl) is missing or damaged, with a fresh "
        "one seeded from train.seed and the step (the run then differs from an uninterrupted one)")] = False
    seed: Int = 42
    log_every: Annotated[_int(ge=1), _doc(
        "steps between loss-history entries and tracker logs; an entry holds each term's mean over those steps")] = 10
    trackers: list[Str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    on_nonfinite: Literal["raise", "skip"] = "raise"
    fused_optimizer: Literal["auto"] | Bool = "auto"
    compile: Annotated[Bool, _doc(
        "compile the towers' transformer blocks with torch.compile (captions padded to a few fixed lengths)")] = False


@_section(("output",))
class OutputConfig:
    """Where the run folder goes (recipe.yaml, metrics.json, report.md, plots/, final/, ...)."""

    dir: Annotated[NonEmptyStr, _doc("the run folder")] = "runs/quickstart"
    overwrite: Annotated[Bool, _doc(
        "replace a folder that holds a finished or different run (default: refuse it)")] = False


@_section(("hub",))
class HubConfig:
    """Optional push of the result to the Hugging Face hub. ``token`` is accepted but never
    written out (:func:`recipe_to_dict` drops it); prefer ``HF_TOKEN`` in the environment."""

    push: Bool = False
    repo_id: Annotated[Str | None, _doc("user/name")] = None
    private: Bool = True
    revision: Str | None = None
    token: Annotated[Str | None, _doc("prefer HF_TOKEN in the environment; never written out")] = (
        dataclasses.field(default=None, repr=False))


@_section(())
class Recipe:
    """A validated recipe: the eight sections, plus where it came from.

    ``description`` is the file's first comment line and ``source`` its path; ``overrides`` are the
    command-line ``key=value`` strings applied on top. These three are not recipe keys.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    adapter: AdapterConfig = dataclasses.field(default_factory=AdapterConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    hub: HubConfig = dataclasses.field(default_factory=HubConfig)
    description: SkipJsonSchema[Str] = dataclasses.field(default="", metadata={"meta": True})
    source: SkipJsonSchema[Str | None] = dataclasses.field(default=None, metadata={"meta": True}, compare=False)
    overrides: SkipJsonSchema[tuple[Str, ...]] = dataclasses.field(default=(), metadata={"meta": True},
                                                                   compare=False)


_SECRET_KEYS = {("hub", "token")}
_SECTION_TYPES = (Recipe, ModelConfig, KPSConfig, AdapterConfig, DataConfig, EvalConfig, ObjectiveConfig,
                  TrainConfig, OutputConfig, HubConfig)


# -- registries of other modules ------------------------------------------------------------------
def _registry_names(module: str, functions: Sequence[str]) -> list[str] | None:
    """The names a registry module lists (its first function of ``functions`` that exists), or
    ``None`` when the module or function is not there (then any name is accepted)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            return None
        raise
    for name in functions:
        fn = getattr(mod, name, None)
        if callable(fn):
            return sorted(fn())
    return None


def _check_registered(value: str, known: Iterable[str] | None, what: str, extra: Sequence[str] = ()) -> None:
    if known is None:
        return
    known = [*extra, *known]
    if value not in known:
        close = difflib.get_close_matches(value, known, n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        raise PydanticCustomError("recipe_value", "is {value}, not {what}: {hint}choose one of {known}",
                                  {"value": repr(value), "what": what, "hint": hint,
                                   "known": ", ".join(f"`{k}`" for k in known)})


# -- objective term registry ----------------------------------------------------------------------
# The options classes live in the ground floor, finetune.plugins.TERM_OPTIONS (read at call time, so a test may
# swap it); this module never imports finetune.objectives: the registry's first lookup discovers the terms.
def _is_options_class(cls: Any) -> bool:
    return isinstance(cls, type) and (dataclasses.is_dataclass(cls) or issubclass(cls, BaseModel))


def register_term_config(name: str, cls: type) -> None:
    """Register the options class of an objective term (a dataclass, stdlib or pydantic, or a
    pydantic model), so that ``objective.terms.<name>`` in a recipe is validated against and built
    as ``cls``. Unknown keys are rejected with the closest valid one; a dataclass field's
    ``metadata={"check": fn}`` (``fn(value) -> message or None``) is a range check.

    Registering the same class twice is a no-op; a different class under a taken name is an error.
    (:func:`finetune.objectives.register_term` registers a term's options here itself.)
    """
    if not _is_options_class(cls):
        raise TypeError(f"register_term_config({name!r}, ...): expected a dataclass or a pydantic model "
                        f"type, got {cls!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_term_config: the term name must be a non-empty string, got {name!r}")
    known = plugins.TERM_OPTIONS.peek(name)
    if known is not None and known is not cls:
        raise ValueError(
            f"objective term {name!r} is already registered with {known.__module__}.{known.__qualname__}; "
            f"pick another name for {cls.__module__}.{cls.__qualname__}"
        )
    plugins.TERM_OPTIONS.add(name, cls)


def registered_term_configs() -> dict[str, type]:
    """The registered term names and their options classes (the built-in terms discovered first)."""
    _import_objectives()
    return plugins.TERM_OPTIONS.snapshot()


def _import_objectives() -> None:
    """Discover the registered terms (the first lookup of ``finetune.plugins.TERM_OPTIONS`` imports the
    term modules); without their dependencies (torch), only the terms registered so far are known."""
    try:
        plugins.TERM_OPTIONS.discover()
    except ImportError:
        pass


@functools.lru_cache(maxsize=None)
def _adapter(cls: Any) -> TypeAdapter:
    return TypeAdapter(cls)


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


def _term_options(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PydanticCustomError("recipe_value", "expected a mapping of term name -> options, got {got} ({kind})",
                                  {"got": repr(value), "kind": _type_name(value)})
    registry = registered_term_configs()
    out, errors = {}, []
    for name, options in value.items():
        if name not in registry:
            known = ", ".join(f"`{n}`" for n in sorted(registry)) or "none (finetune.objectives registered no terms)"
            close = difflib.get_close_matches(str(name), list(registry), n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            message = f"is not a registered objective term: {hint}registered terms: {known}"
            errors.append(InitErrorDetails(type=PydanticCustomError("recipe_key", message.replace("{", "{{")),
                                           loc=(name,), input=options))
            continue
        try:
            out[name] = _build_options(registry[name], options)
        except ValidationError as exc:
            errors.extend(_prefixed(exc, (name,)))
    _raise_errors(errors, "objective.terms")
    return out


# -- dataset entries ------------------------------------------------------------------------------
def _source_spec_class() -> type:
    from finetune.data.sources import SourceSpec

    return SourceSpec


def _source_keys() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(_source_spec_class()))


def __getattr__(name: str) -> Any:
    if name == "SOURCE_SPEC_KEYS":
        #: the keys of a dataset entry, from ``finetune.data.sources.SourceSpec``
        return _source_keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _source_entry(value: Any) -> dict[str, Any]:
    """A dataset entry: a name string (``docci`` or ``docci:goal``) or a ``SourceSpec`` mapping,
    returned as a plain mapping holding the keys given (values converted to their types)."""
    if isinstance(value, str):
        if not value.strip():
            raise PydanticCustomError("recipe_value",
                                      "is an empty dataset name; write a name like `docci` or a mapping")
        spec = parse_source_shorthand(value)
        _raise_errors(_check_source_name(spec["name"], ()), "dataset entry")
        return spec
    if not isinstance(value, Mapping):
        raise PydanticCustomError(
            "recipe_value", "expected a dataset name (e.g. `docci`, `docci:goal`) or a mapping with {keys}; "
            "got {got} ({kind})", {"keys": ", ".join(_source_keys()), "got": repr(value), "kind": _type_name(value)})
    cls = _source_spec_class()
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
    parse = getattr(cls, "parse", None)
    if callable(parse):  # the source module's own checks across keys (streams, ranges, ...)
        try:
            parse(dict(out))
        except ValueError as exc:
            raise PydanticCustomError("recipe_value", "is not a valid dataset entry: {problem}",
                                      {"problem": str(exc)}) from None
    return out


def _spec_name(cls: Any, value: Mapping[str, Any]) -> str | None:
    """The source name that ``cls.parse`` reads from an entry without ``name``, else ``None``."""
    parse = getattr(cls, "parse", None)
    if not callable(parse):
        return None
    try:
        return parse(dict(value)).name
    except (ValueError, TypeError):
        return None


def parse_sources(value: Any, key: str = "eval.sets") -> list[dict[str, Any]]:
    """Validate a list of dataset entries as the recipe validates ``eval.sets`` (names,
    ``name:protocol`` shorthands or ``SourceSpec`` mappings; a single entry is a list of one) and
    return them as plain mappings. Errors name ``key``.

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
            return RecipeError(f"command-line override `{_mask_override(text)}`: {message}", key=dotted)
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
    if any(m is _SOURCE_MARK for m in meta):
        return _fields_of(_source_spec_class())
    if any(m is _TERMS_MARK for m in meta):
        return plugins.TERM_OPTIONS.snapshot()
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
    if any(m is _SOURCE_MARK for m in meta):
        return "a dataset name or a mapping"
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
    if any(m is _SOURCE_MARK for m in meta):
        return "datasets"
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
            if any(a in _SECTION_TYPES for a in _arms(sub)):
                out.extend(walk(sub, f"{prefix}{key}."))
        return out
    return tuple(walk(Recipe, ""))


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
        across = any(a in _SECTION_TYPES for a in _arms(parent))
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


# -- loading --------------------------------------------------------------------------------------
#: the packages of xlipkit itself: importing them runs no code from a recipe's folder
_OWN_PACKAGES = ("finetune", "losses")


def _import_user_modules(tree: dict[str, Any], origins: _Origins, trust: bool = True) -> None:
    """``objective.import: [my_pkg.my_term]``: import the modules (they register terms, scorers or
    model families) before the rest is validated. Untrusted (``trust=False``), only modules already
    imported or of xlipkit itself are."""
    objective = tree.get("objective")
    if not isinstance(objective, dict) or "import" not in objective:
        return
    modules = objective["import"]
    if modules is None:
        objective["import"] = modules = []
    if isinstance(modules, str):
        objective["import"] = modules = [modules]
    if not isinstance(modules, list) or not all(isinstance(m, str) and m.strip() for m in modules):
        raise origins.error(("objective", "import"), f"expected a list of module names (e.g. `[my_pkg.my_term]`), "
                                                     f"got {modules!r}")
    import sys

    for i, name in enumerate(modules):
        if not trust and name.strip() not in sys.modules and name.strip().split(".")[0] not in _OWN_PACKAGES:
            raise origins.error(("objective", "import", i),
                                f"would import the module {name.strip()!r}, which runs its code; this recipe is not "
                                f"trusted to do that (it comes from a folder, not from you)")
        try:
            importlib.import_module(name.strip())
        except ImportError as exc:
            raise origins.error(("objective", "import", i),
                                f"cannot import module {name!r} ({exc}); install it or put its folder on "
                                f"PYTHONPATH") from None


#: the most values a YAML document may hold once its aliases are expanded (a recipe holds hundreds)
MAX_YAML_VALUES = 100_000


class YAMLAliasError(yaml.YAMLError):
    """YAML aliases that expand past :data:`MAX_YAML_VALUES` values (a "billion laughs" document) or
    refer to themselves."""

    def __init__(self, problem: str, line: int | None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = yaml.Mark("", 0, line - 1, 0, None, None) if line else None


class BoundedSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that notes where aliases are used, so that :func:`check_aliases` can bound
    what they expand to before anything walks or copies the document."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.alias_lines: list[int] = []

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.alias_lines.append(self.peek_event().start_mark.line + 1)
        return super().compose_node(parent, index)


def check_aliases(node: yaml.Node, alias_lines: Sequence[int], limit: int = MAX_YAML_VALUES) -> None:
    """Count the values of the composed document ``node`` as its aliases expand them, in time linear in
    the distinct nodes (each node's expanded size is computed once).

    Raises:
        YAMLAliasError: more than ``limit`` values, or an alias inside the node it refers to.
    """
    if not alias_lines:
        return
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    open_: set[int] = set()
    while stack:
        current, done = stack.pop()
        key = id(current)
        children = ([n for pair in current.value for n in pair] if isinstance(current, yaml.MappingNode)
                    else list(current.value) if isinstance(current, yaml.SequenceNode) else [])
        if done:
            open_.discard(key)
            sizes[key] = min(limit + 1, 1 + sum(sizes[id(c)] for c in children))
            continue
        if key in sizes:
            continue
        if key in open_:
            raise YAMLAliasError("a YAML alias refers to the value that contains it (a recursive document); "
                                 "write the value out", alias_lines[0])
        open_.add(key)
        stack.append((current, True))
        for child in children:
            if id(child) in open_:
                raise YAMLAliasError("a YAML alias refers to the value that contains it (a recursive document); "
                                     "write the value out", alias_lines[0])
            if id(child) not in sizes:
                stack.append((child, False))
    if sizes[id(node)] > limit:
        raise YAMLAliasError(f"YAML aliases (`*name`, first on line {alias_lines[0]}) expand to more than "
                             f"{limit:,} values, far more than any recipe holds (an alias bomb?); write the values "
                             "out or use fewer aliases", alias_lines[0])


def safe_load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` with aliases bounded (:func:`check_aliases`) before the data is built.

    Raises:
        yaml.YAMLError: invalid YAML, or a :class:`YAMLAliasError`.
    """
    loader = BoundedSafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_aliases(node, loader.alias_lines)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _compose(text: str, file: str) -> tuple[Any, yaml.Node | None]:
    """Parse YAML once, keeping both the node tree (for line numbers) and the safe-loaded data; aliases
    are bounded (:func:`check_aliases`) before anything walks or builds the document."""
    loader = BoundedSafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        check_aliases(node, loader.alias_lines)
        _reject_duplicates(node, file)
        data = loader.construct_document(node)
    except RecursionError:
        raise RecipeError(f"{file}: the YAML is nested too deeply to read; a recipe has a few levels of sections",
                          file=file) from None
    except YAMLAliasError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
        raise RecipeError(f"{file}{f', line {line}' if line else ''}: {exc.problem}", file=file, line=line) from None
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
        raise RecipeError(f"command-line override `{_mask_override(text)}` is not `key.sub=value` "
                          f"(e.g. `train.lr=1e-5`, `eval.sets=[docci,urban1k]`)")
    parts = key.split(".")
    if any(not p for p in parts):
        raise RecipeError(f"command-line override `{_mask_override(text)}`: `{key}` has an empty part; write dotted "
                          "keys like `train.lr`",
                          key=key)
    try:
        value = safe_load_yaml(raw) if raw.strip() else None
    except YAMLAliasError as exc:
        raise RecipeError(f"command-line override `{_mask_override(text)}`: {exc.problem}",
                          key=key) from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"command-line override `{_mask_override(text)}`: the value is not valid YAML ({problem}); "
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
                raise RecipeError(f"command-line override `{_mask_override(text)}`: `{_dotted(path[:i])}` has "
                                  f"{len(node)} "
                                  f"entries, there is no index {part}", key=_dotted(path))
            key: Any = part
        elif isinstance(node, dict):
            key = str(part)
        else:
            raise RecipeError(f"command-line override `{_mask_override(text)}`: `{_dotted(path[:i])}` is {node!r}, "
                              "not a mapping; "
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
    """``data`` with the defaults of ``cls`` filled in (under their YAML keys), recursing only
    into nested sections: dataset entries, term options and lists given in the file replace the
    default whole. Keys that are not in the schema are kept, so that validation reports them."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        return data
    defaults = cls()
    out = dict(data)
    for key, tp in (_fields_of(cls) or {}).items():
        section = next((a for a in _arms(tp) if a in _SECTION_TYPES), None)
        if key in data:
            if section is not None:
                out[key] = _merge_defaults(data[key], section)
        else:
            name = next(f.name for f in dataclasses.fields(cls) if f.name == key or _alias(
                typing.get_type_hints(cls, include_extras=True)[f.name]) == key)
            out[key] = _plain(getattr(defaults, name))
    return out


def _first_comment(text: str) -> str:
    """The recipe's description: its first comment line, skipping an editor modeline
    (``# yaml-language-server: $schema=...``)."""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment = stripped.lstrip("#").strip()
            if not comment.startswith("yaml-language-server:"):
                return comment
    return ""


def _cross_checks(recipe: Recipe, origins: _Origins) -> None:
    t = recipe.train
    if t.batch_size % t.accumulation_steps:
        raise origins.error_any([("train", "batch_size"), ("train", "accumulation_steps")],
                                f"`train.batch_size` ({t.batch_size}) must be divisible by "
                                f"`train.accumulation_steps` ({t.accumulation_steps}), since each micro-batch "
                                f"holds batch_size / accumulation_steps samples")
    if t.epochs is None and t.max_steps is None:
        raise origins.error_any([("train", "epochs"), ("train", "max_steps")],
                                "`train.epochs` and `train.max_steps` are both null; set at least one of them")
    if t.min_lr > t.lr:
        raise origins.error_any([("train", "min_lr"), ("train", "lr")],
                                f"`train.min_lr` ({t.min_lr:g}) is above `train.lr` ({t.lr:g}); lower it")
    m = recipe.model
    if m.backend not in ("auto", m.family):
        raise origins.error_any([("model", "backend"), ("model", "family")],
                                f"`model.backend` ({m.backend}) and `model.family` ({m.family}) disagree; "
                                f"`backend` is the deprecated name of `family`: keep only `family`")
    towers = [k for k in ("vision", "text", "projection_dim") if getattr(m, k, None) is not None]
    if towers and m.family != "vision_text":
        raise origins.error_any([("model", k) for k in towers] + [("model", "family")],
                                f"`model.{towers[0]}` builds a dual encoder from two towers, which only "
                                f"`model.family: vision_text` does (it is {m.family!r}); set the family or drop "
                                f"{', '.join(f'`model.{k}`' for k in towers)}")
    if towers and (m.vision is None) != (m.text is None):
        given, missing = ("vision", "text") if m.vision is not None else ("text", "vision")
        raise origins.error_any([("model", given), ("model", missing)],
                                f"`model.{given}` is set but `model.{missing}` is not: a vision_text model is "
                                f"built from both towers; set `model.{missing}` too")
    if m.projection_dim is not None and m.vision is None:
        raise origins.error_any([("model", "projection_dim")],
                                "`model.projection_dim` sizes the projections of a model built from "
                                "`model.vision` and `model.text`; a saved model keeps its own: drop it or set both towers")
    if recipe.hub.push and not recipe.hub.repo_id:
        raise origins.error_any([("hub", "repo_id"), ("hub", "push")],
                                "`hub.push: true` needs `hub.repo_id` (`user/name`); set it "
                                "or set `hub.push: false`")


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = (), *,
                trust_imports: bool = True) -> Recipe:
    """Read, override and validate a recipe.

    Args:
        path: the YAML file.
        overrides: ``key.sub=value`` strings applied after the file; values are YAML scalars or
            flow collections (``train.lr=1e-5``, ``eval.sets=[docci,urban1k]``,
            ``train.max_steps=null``, ``eval.sets.0.size=128``) and are validated like file values.
        trust_imports: import the modules of ``objective.import`` (running their code). False for a
            recipe from a folder that is not the user's own (``python -m finetune.evaluate RUN``): then a
            module that is not imported yet and not part of xlipkit is a :class:`RecipeError`.

    Returns:
        the :class:`Recipe`, every section filled with its defaults where the file is silent.

    Raises:
        RecipeError: the file is missing, empty or not valid YAML, a key is unknown (the message
            suggests the closest valid key), a value has the wrong type or range (the message names
            the expected type), an objective term is not registered, a module of
            ``objective.import`` does not import (or may not: ``trust_imports``), a number is not
            finite (``.inf``, ``.nan``), YAML aliases expand past a bound, or the sections disagree
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
    sections = [f.name for f in dataclasses.fields(Recipe) if not f.metadata.get("meta")]
    if data is None:
        raise RecipeError(f"{file}: the recipe is empty; write at least one section ({', '.join(sections)}), "
                          f"e.g. start from recipes/quickstart.yaml", file=file)
    if not isinstance(data, Mapping):
        raise RecipeError(f"{file}: a recipe is a mapping of sections ({', '.join(sections)}), "
                          f"got {_type_name(data)}", file=file)
    # overrides go on top of the file merged with the defaults, so that `data.train.size=64` edits
    # the default dataset entry and an override can repair a bad file value before validation
    tree = _merge_defaults(data, Recipe)
    parsed = [(_parse_override(o), o) for o in overrides]
    for (opath, value), text_ in parsed:
        _set_path(tree, opath, value, text_)
    origins = _Origins(file, node, [(opath, text_) for (opath, _), text_ in parsed])
    for key in tree:
        if key not in sections:
            raise origins.error((key,), f"is not a recipe key: {_suggest(str(key), sections, (), True)}",
                                key_error=True)
    bad = _non_finite(tree)  # anywhere, also in dataset options and term options: before any code runs
    if bad:
        raise origins.error(bad[0][0], f"{_NOT_FINITE}, got {bad[0][1]!r}")
    _import_user_modules(tree, origins, trust_imports)
    try:
        recipe = _adapter(Recipe).validate_python(tree)
    except ValidationError as exc:
        raise _recipe_error(exc, origins, tree, Recipe) from None
    _cross_checks(recipe, origins)
    return dataclasses.replace(recipe, description=_first_comment(text), source=file,
                               overrides=tuple(overrides))


def recipe_json_schema() -> dict[str, Any]:
    """The JSON schema of a recipe (draft 2020-12), for editors: the sections and their keys with
    types, defaults, ranges and descriptions, the dataset-entry keys (``SourceSpec``) and the
    options of every registered objective term under ``objective.terms``.

    Point the YAML language server at it with a first line
    ``# yaml-language-server: $schema=recipe.schema.json`` (after
    ``python finetune/run.py --schema > recipe.schema.json``).
    """
    _import_objectives()
    schema = _adapter(Recipe).json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "xlipkit recipe"
    return schema


# -- writing --------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Plain YAML-able data: sections and options classes become mappings (under their YAML
    keys), tuples lists."""
    if isinstance(value, BaseModel):
        return _plain(value.model_dump(by_alias=True))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = typing.get_type_hints(type(value), include_extras=True)
        return {(_alias(hints.get(f.name)) or f.name): _plain(getattr(value, f.name))
                for f in dataclasses.fields(value) if not f.metadata.get("meta")}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def recipe_to_dict(recipe: Recipe, *, keep_secrets: bool = False) -> dict[str, Any]:
    """The recipe as plain YAML-able data (sections only, under their YAML keys; tuples become
    lists).

    ``hub.token`` is dropped unless ``keep_secrets`` is true.
    """
    out = _plain(recipe)
    if not keep_secrets:
        for sec, key in _SECRET_KEYS:
            out[sec].pop(key, None)
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
    from finetune.run_basics import process_tag

    # the writer's PID@HOST in the name: another run's cleanup leaves it alone while this process lives
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{process_tag()}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("\n".join(header) + "\n" + body)
            fh.flush()
            os.fsync(fh.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600: give the file the user's usual permissions
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
