"""Recipes: the typed schema (pydantic v2) and :func:`load_recipe`.

A recipe is one YAML file (``recipes/*.yaml``) whose first comment line describes it, with the
sections ``model``, ``adapter``, ``data``, ``objective``, ``train``, ``eval``, ``output`` and
``hub`` (DESIGN 2-3). Each section is a pydantic dataclass (attribute access, ``vars()``,
``dataclasses.asdict`` / ``replace`` keep working); pydantic converts and checks the values, and
:mod:`finetune.config.errors` turns its errors into a :class:`RecipeError` whose message names the file
and line (or the command-line override), the key path, what was expected and, for an unknown key, the
closest valid one (``did you mean `train.lr`?``, also across sections). :func:`load_recipe` reads a file
with ``yaml.safe_load`` semantics (:mod:`finetune.config.io`) and applies overrides
(:mod:`finetune.config.overrides`); :func:`recipe_json_schema` (``python finetune/run.py --schema``) is the
JSON schema that editors use to complete and check recipes.

Dataset entries (``data.train`` and each of ``eval.sets``) are validated by :mod:`finetune.config.sources`.
The options of each objective term are validated by the class (a dataclass or a pydantic model) that the
term registered with :func:`finetune.config.terms.register_term_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

import finetune.plugins as plugins

from finetune.config.errors import (SECTION_TYPES, RecipeError, _NOT_FINITE, _Origins, _alias, _arms, _fields_of,
                                    _non_finite, _recipe_error, _suggest, _type_name)
from finetune.config.io import MAX_RECIPE_BYTES, _compose, _first_comment, _plain
from finetune.config.model_options import _OPTIONS_MARK, _moved_model_keys, _validate_model_options
from finetune.config.overrides import _parse_override, _set_path, check_override_sizes
from finetune.config.secrets import mask_secrets, override_secrets, secret_values
from finetune.config.terms import (_TERMS_MARK, _import_objectives, _import_user_modules, _term_options,
                                   registered_term_configs)
from finetune.config.sources import (SourceEntry, _default_eval_sets, _default_train_source, _no_streams,
                                     _validate_source_list)
from finetune.config.values import (STREAM_GROUPING, Bool, Float, Int, NonEmptyStr, Str, UnitInterval, _adapter,
                                    _betas, _doc, _float, _int, _positive_ints, _text_buckets, _yaml_word)

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
        known = plugins.MODEL_FAMILIES.names()
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
        "name_or_path is then not loaded (finetune.training.upstream)")] = None
    options: Annotated[Any, BeforeValidator(_validate_model_options), _OPTIONS_MARK, _doc(
        "the model family's own options, validated by the options class the family declares (vision_text: "
        "vision, text, projection_dim); null: its defaults")] = None

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
    extra_targets: Annotated[list[Str], _doc("more module names to adapt")] = dataclasses.field(default_factory=list)
    train_extra: Annotated[list[Str], _doc("trained as they are next to the adapter: positions, "
                                           "logit_scale, logit_bias or parameter name patterns")] = (
        dataclasses.field(default_factory=lambda: list(_DEFAULT_TRAIN_EXTRA)))


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
    read_timeout_s: Annotated[_float(gt=0.0, le=86_400.0), _doc(
        "the longest a read of a remote shard (s3://, https://, a pipe: command) may wait for data; then the run "
        "stops, naming the shard and why")] = 60.0


def _check_scorer(value: str) -> str:
    if value != "cosine":  # the built-in default: no need to import the scorers (and torch) for it
        known = plugins.SCORERS.names()
        _check_registered(value, known, "a registered scorer")
    return value


@_section(("eval",))
class EvalConfig:
    """Retrieval evaluation before and after training (``finetune.evaluation``)."""

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
        "a registered scorer (finetune.evaluation.scorers): cosine or one a method registers")] = "cosine"
    rerank_top_k: Annotated[_int(ge=1) | None, _doc("re-score the global-cosine top-k only; null: all")] = None
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
    compile: Annotated[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | Bool, _doc(
        "compile the towers' transformer blocks once with torch.compile (static shapes: the run's fixed batch shapes); "
        "true is mode default, reduce-overhead adds CUDA graphs")] = False
    attention: Annotated[Literal["auto", "torch", "flash", "efficient", "cudnn", "math"], _doc(
        "the attention backend of the training step: auto (CUDA: flash, then efficient for masked calls, then cudnn, "
        "then math; CPU: PyTorch's choice), torch (PyTorch's own choice), or one backend tried first")] = "auto"
    text_buckets: Annotated[list[Int] | None, AfterValidator(_text_buckets), _doc(
        "lengths a text pass is padded to, the smallest that holds its longest text (model.max_text_len added as the "
        "last); null: the multiples of 32 below model.max_text_len (with group_by_length: four per doubling, 8, 12, "
        "16, 20, 24, 28, 32, 40, ...)")] = None
    group_by_length: Annotated[Bool, _doc(
        "opt-in: batches of captions of similar token counts (map-style data.train only), so that a text pass padded "
        "to its bucket computes little padding. It changes which captions share a contrastive batch (each other's "
        "negatives): this toolkit's choice, not the papers', which draw batches uniformly")] = False
    length_group_batches: Annotated[_int(ge=1) | None, _doc(
        "with group_by_length: batches per megabatch, the examples sorted by length together; larger groups tighter "
        "and leaves less chance in which captions meet; null: transformers' default, 50 or a quarter of an "
        "epoch's batches, whichever is smaller")] = None
    process_group_timeout_s: Annotated[_int(ge=1, le=2_592_000), _doc(
        "seconds a process waits for the others at a collective or the rendezvous (a first download or preprocessing "
        "included) before the run fails; NCCL's default is 600; at most 30 days")] = 7200


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
    command-line ``key=value`` strings applied on top; ``trust_code`` is whether the user allowed the recipe to
    run the code it names (``load_recipe(..., trust_imports=)``). These four are not recipe keys.
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
    #: the user allowed this recipe's code on the command line (objective.import, pipe: commands); never from the file
    trust_code: SkipJsonSchema[bool] = dataclasses.field(default=False, metadata={"meta": True}, compare=False)


_SECTION_TYPES = (Recipe, ModelConfig, KPSConfig, AdapterConfig, DataConfig, EvalConfig, ObjectiveConfig,
                  TrainConfig, OutputConfig, HubConfig)
SECTION_TYPES[:] = _SECTION_TYPES  # the error messages walk the schema from the root


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
    hints = typing.get_type_hints(cls, include_extras=True)  # once: each call evaluates every annotation again
    for key, tp in (_fields_of(cls) or {}).items():
        section = next((a for a in _arms(tp) if a in _SECTION_TYPES), None)
        if key in data:
            if section is not None:
                out[key] = _merge_defaults(data[key], section)
        else:
            name = next(f.name for f in dataclasses.fields(cls) if f.name == key or _alias(hints[f.name]) == key)
            out[key] = _plain(getattr(defaults, name))
    return out


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
    if t.length_group_batches is not None and not t.group_by_length:
        raise origins.error_any([("train", "length_group_batches"), ("train", "group_by_length")],
                                f"`train.length_group_batches` ({t.length_group_batches}) only applies with "
                                "`train.group_by_length: true`; set that, or remove length_group_batches")
    if t.group_by_length and recipe.data.train.is_stream:
        raise origins.error_any([("train", "group_by_length"), ("data", "train")], STREAM_GROUPING)
    m = recipe.model
    if t.text_buckets and m.max_text_len is not None and t.text_buckets[-1] > m.max_text_len:
        raise origins.error_any([("train", "text_buckets"), ("model", "max_text_len")], f"`train.text_buckets` reaches "
                                f"{t.text_buckets[-1]}, above `model.max_text_len` ({m.max_text_len}); keep it below")
    if m.backend not in ("auto", m.family):
        raise origins.error_any([("model", "backend"), ("model", "family")],
                                f"`model.backend` ({m.backend}) and `model.family` ({m.family}) disagree; "
                                f"`backend` is the deprecated name of `family`: keep only `family`")
    if recipe.hub.push and not recipe.hub.repo_id:
        raise origins.error_any([("hub", "repo_id"), ("hub", "push")],
                                "`hub.push: true` needs `hub.repo_id` (`user/name`); set it "
                                "or set `hub.push: false`")


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = (), *,
                trust_imports: bool = False) -> Recipe:
    """Read, override and validate a recipe.

    Args:
        path: the YAML file.
        overrides: ``key.sub=value`` strings applied after the file; values are YAML scalars or
            flow collections (``train.lr=1e-5``, ``eval.sets=[docci,urban1k]``,
            ``train.max_steps=null``, ``eval.sets.0.size=128``) and are validated like file values.
        trust_imports: the user allowed the recipe's code (``--trust-recipe-code``; ``Recipe.trust_code``): import
            ``objective.import``, run ``pipe:`` shard commands. Off by default (a recipe may come from anyone): a module
            not imported yet and not part of xlipkit is then a :class:`RecipeError` naming the flag.

    Returns:
        the :class:`Recipe`, every section filled with its defaults where the file is silent.

    Raises:
        RecipeError: the file is missing, empty or not valid YAML, a key is unknown (the message
            suggests the closest valid key), a value has the wrong type or range (the message names
            the expected type), an objective term is not registered, a module of
            ``objective.import`` does not import (or may not: ``trust_imports``), a number is not
            finite (``.inf``, ``.nan``), the file or the overrides are too large (more than
            :data:`~finetune.config.io.MAX_RECIPE_BYTES` bytes, more than
            :data:`~finetune.config.io.MAX_RECIPE_VALUES` keys and values, more than
            :data:`~finetune.config.io.MAX_OVERRIDES` overrides), YAML aliases expand past a bound, or the
            sections disagree (``train.batch_size`` not divisible by ``train.accumulation_steps``, ...).
    """
    file = os.fspath(path)
    p = Path(file)
    if not p.is_file():
        hint = " (it is a folder; give the YAML file inside)" if p.is_dir() else ""
        raise RecipeError(f"recipe file not found: {file}{hint}; give the path of a YAML recipe "
                          f"(`finetune/run.py --list` shows the ones in recipes/)", file=file)
    size = p.stat().st_size
    if size > MAX_RECIPE_BYTES:  # refused before it is read: PyYAML reads about 10,000 keys a second
        raise RecipeError(f"{file}: the recipe is {size:,} bytes, more than the {MAX_RECIPE_BYTES:,} a recipe may "
                          "hold (the shipped ones hold about 5 kB); list long things in files the recipe names, or "
                          "write shard URLs as brace patterns (shards-{000000..000999}.tar)", file=file)
    check_override_sizes(overrides)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read the recipe {file}: {exc}", file=file) from None
    data, node = _compose(text, file)
    secrets = secret_values(data) + override_secrets(overrides)  # by key: masked in any error, whatever they are
    try:
        return _validated(data, node, text, file, overrides, trust_imports)
    except RecipeError as exc:
        if not secrets:
            raise
        raise RecipeError(mask_secrets(str(exc), secrets), file=exc.file, line=exc.line, key=exc.key) from None


def _validated(data: Any, node: Any, text: str, file: str, overrides: Sequence[str], trust_imports: bool) -> Recipe:
    """The :class:`Recipe` of a parsed recipe file and its overrides (:func:`load_recipe`)."""
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
    _moved_model_keys(tree, origins)
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
                               overrides=tuple(overrides), trust_code=trust_imports)


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
