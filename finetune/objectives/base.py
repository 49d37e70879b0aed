"""Objectives: an optional base term plus any number of weighted added terms (DESIGN 3, DESIGN 4 Seams).

A :class:`Term` is a small ``nn.Module`` that

1. declares what it needs and produces (``needs``, ``produces``, ``requests``, ``features``), so that the
   :class:`Objective` checks when it is built that no two terms write the same batch field or feature key;
2. produces its batch fields: ``preprocess`` (once per dataset, cached; for streamed data its per-example
   form ``stream_map``), ``prepare`` (per example, in the data workers) and ``collate`` (per batch);
3. asks the :class:`Objective` for the images and texts it wants encoded (``image_inputs`` /
   ``text_inputs``): the objective runs ONE image-tower pass over every image request of the batch
   (StructXLIP's colour images and edge maps together) and one text-tower pass per text kind over every text
   request (:mod:`finetune.objectives.encoders`); under the run's planned shapes
   (:mod:`finetune.objectives.shapes`) that is at most two text passes (captions, short texts), each padded to
   one of a few planned bucket lengths. Requests of several terms under one feature key (``image``, ``text``)
   are encoded once, with states if any asks;
4. turns the encoded features into unweighted loss values (``loss``), logged as ``term/value`` (``term``
   alone when the value has the term's name, :func:`loss_name`).

Features are a flat ``dict[str, Tensor]`` so that the gradient-accumulation scheme of DESIGN 6 can cache
them per micro-batch and concatenate them: every tensor is concatenated along dim 0, and keys ending in
``_owner`` (the sample index a row belongs to) are offset by the number of samples before them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from .encoders import TextPlan, encode_images, encode_texts, plan_lengths, request_kind, right_padded
from .shapes import BatchShapes, ShapeScan

Features = dict[str, Tensor]
Batch = dict[str, Any]

#: key of the 0-dim tensor holding the number of samples a feature dict was encoded from
N_SAMPLES = "n_samples"
#: batch key of the :class:`~finetune.objectives.encoders.TextPlan` the collator adds (host-side metadata, see
#: :meth:`Objective.plan`)
TEXT_PLAN = "_text_plan"
#: batch key of the terms' host plans, ``{term name: plan}`` (:meth:`Term.plan`, :func:`term_plan`)
TERM_PLANS = "_term_plans"
#: names no term may take: the total, and what the trainer logs beside the losses
RESERVED_NAMES = frozenset({"loss", "lr", "logit_scale", "step", "none"})
#: batch fields the collator fills before the terms' ``collate`` (``finetune.data.collate.Collator``)
CORE_BATCH_FIELDS = frozenset({"ids", "image_inputs", "input_ids", "attention_mask", "truncated"})
#: feature keys the encoders write besides the requested ones (``image_grid``) and the sample count
CORE_FEATURES = frozenset({N_SAMPLES, "image_grid"})


class TermCollisionError(ValueError):
    """Two terms of one objective write the same batch field or feature key, or ask for one feature key with
    different inputs."""


def loss_name(term: str, value: str) -> str:
    """The logged name of a term's loss value: ``term/value`` (``structxlip/local``), or ``term`` alone when
    the value has the term's own name (``clip``)."""
    return term if value == term else f"{term}/{value}"


@dataclass
class ImageRequest:
    """Images a term wants encoded: the keyword inputs of ``DualEncoder.encode_image``.

    Attributes:
        inputs: ``{"pixel_values": (n, 3, H, W), ...}`` (NaFlex adds ``pixel_attention_mask`` and
            ``spatial_shapes``).
        states: whether the term needs patch states (``ImageFeatures.states``) too.
    """

    inputs: dict[str, Tensor]
    states: bool = False

    @property
    def count(self) -> int:
        return int(self.inputs["pixel_values"].shape[0])


@dataclass
class TextRequest:
    """Token ids a term wants encoded.

    Attributes:
        input_ids: ``(n, L)``.
        attention_mask: ``(n, L)``.
        states: whether token states are needed too.
        short: the rows are short texts (sentences, chunks): they go through the tower in a pass of their own (the
            :data:`~finetune.objectives.shapes.SHORT` kind), padded to the bucket of the longest short text, not
            to the captions'.
    """

    input_ids: Tensor
    attention_mask: Tensor
    states: bool = False
    short: bool = False


class Term(nn.Module):
    """One loss term of an objective (a base or an added term). Subclasses set ``name`` and the declarations
    below and override what they use.

    ``loss`` returns unweighted scalar values; the objective applies the recipe's weights. A term with
    learnable parameters of its own (a temperature, a head) holds them as submodules/parameters: they are
    trained, checkpointed and synchronised with the model.

    The declarations let the :class:`Objective` find collisions between terms when it is built; what a term
    actually writes is checked again while it runs (:class:`TermCollisionError` names both terms).
    """

    #: the registered name; prefixes the logged loss names (set by ``build_term``)
    name: str = ""
    #: fields the term adds to the data beyond ``image`` and ``caption`` (its ``preprocess`` columns, its
    #: prepared fields): what the data pipeline computes for it
    needs: frozenset[str] = frozenset()
    #: fields ``prepare`` returns and batch fields ``collate`` returns; no two terms may share one
    produces: frozenset[str] = frozenset()
    #: feature keys the term asks the encoders for (``image_inputs`` / ``text_inputs``); several terms may ask
    #: for one key (``image``, ``text``) when they give the same inputs
    requests: frozenset[str] = frozenset()
    #: feature keys ``extra_features`` adds; no other term may write or request them
    features: frozenset[str] = frozenset()
    #: model parameters this term's loss reads directly (e.g. "logit_scale"); see ``detach_params``
    uses_logit_bias: bool = False
    #: the run's planned shapes (:meth:`Objective.set_shapes`), whose capacities ``collate`` pads rows to; None: each
    #: batch its own
    shapes: BatchShapes | None = None
    #: the loss contrasts each example with the other examples of its batch (in-batch negatives, over every
    #: process): a batch of one example has none, and its loss is exactly 0 (InfoNCE) or holds no negative pair
    contrastive: bool = False

    def prepare_model(self, model: Any) -> None:
        """Add what the term needs to ``model`` (a head in ``model.inference_modules``, a model option), once,
        before training on either data path (map-style or stream). The run calls it after the adapter and
        before it counts parameters and builds the optimiser, so anything added here is trained and saved."""

    def preprocess(self, dataset: Any, model: Any, *, cache_dir: str | None = None, log: Any = None) -> Any:
        """Add this term's cached per-example fields to ``dataset`` (runs once, before training)."""
        return dataset

    def training_examples(self, dataset: Any, count: int) -> int:
        """How many training examples ``count`` examples of ``dataset`` become after :meth:`preprocess` (a term
        that turns one row into several says so), known before the model loads so that a training set smaller
        than one batch is a recipe error then."""
        return count

    def stream_map(self, example: dict[str, Any], model: Any) -> dict[str, Any]:
        """The per-example form of :meth:`preprocess`, for streamed data (``finetune.data.streams``): the
        fields ``preprocess`` would add to this example (no cache, no whole-dataset pass).

        The default adds nothing, which is right for a term that does not override ``preprocess``; a term
        that does must override this too, or :meth:`check_stream` stops the run before it starts.
        """
        return {}

    def example_fields(self) -> dict[str, str]:
        """Raw example fields the term reads besides ``id``, ``image`` and ``caption``, each with the recipe key
        that names it (``{"raw_caption": "objective.terms.flair.caption_fields"}``): a stream must pass them
        through (``data.train.options.fields``), which :func:`finetune.training.preflight.check_stream_recipe` checks
        before anything runs. The default reads none."""
        return {}

    def check_stream(self) -> None:
        """Raise ``ValueError`` naming the recipe option that makes this term streamable when it cannot
        run on streamed examples (called before training on a stream)."""
        if type(self).preprocess is not Term.preprocess and type(self).stream_map is Term.stream_map:
            raise ValueError(
                f"objective term {self.name or type(self).__name__!r} preprocesses whole datasets and has no "
                "per-example path (stream_map), so it cannot train on a stream: use a map-style data.train"
            )

    def prepare(self, example: dict[str, Any]) -> dict[str, Any]:
        """Per-example work in the data workers; returns the fields ``collate`` reads."""
        return {}

    def collate(self, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        """Stack the prepared fields of a batch into tensors."""
        return {}

    def image_inputs(self, batch: Batch) -> dict[str, ImageRequest]:
        """Images to encode, by feature key (embeds land in ``feats[key]``)."""
        return {}

    def text_inputs(self, batch: Batch) -> dict[str, TextRequest]:
        """Texts to encode, by feature key."""
        return {}

    def shape_scan(self, dataset: Any, model: Any) -> ShapeScan | None:
        """What the run's planned shapes (:func:`~finetune.objectives.shapes.plan_shapes`) need from this term,
        before training: the texts its requests will tokenise over ``dataset`` (the preprocessed map-style training
        set, or None for a stream), per example and kind, beyond the captions (which are scanned for every run), the
        kinds whose texts are drawn during training, and the most rows per sample of its requests whose count varies.
        None (the default): its requests are the captions, with fixed rows."""
        return None

    def text_masks(self, batch: Batch) -> dict[str, Tensor]:
        """``{kind: (n, L) attention mask}`` of the texts this term encodes itself, outside :meth:`text_inputs`
        (F-CAST's chunks through its own encoder): the batch's :class:`~finetune.objectives.encoders.TextPlan` plans
        their length like the requests' (:meth:`Objective.plan`); the term reads it from ``batch[TEXT_PLAN]``. The
        default: none."""
        return {}

    def plan(self, model: Any, batch: Batch) -> Any:
        """Host values the step needs from a collated (micro-)batch: sizes and counts as Python numbers, computed
        where the batch is collated, on the CPU (:class:`~finetune.objectives.planning.PlannedCollate`, in the
        data-loader workers), so that the step does not read them back from the device. The step finds them with
        :func:`term_plan`; a batch collated without a plan (a direct call) has none, and the term then computes
        them itself. None (the default): nothing to plan."""
        return None

    def extra_features(self, model: Any, batch: Batch, feats: Features) -> None:
        """Add non-embedding features (owners, masks, pooled states) after the encoders ran."""

    def summary(self) -> dict[str, Any]:
        """What the run's ``metrics.json`` records about the term (options, preprocessing statistics)."""
        return {}

    def report_sections(self, run_dir: Any, dataset: Any) -> list[str]:
        """Markdown sections the term adds to ``report.md`` (e.g. statistics, a preview image)."""
        return []

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next examples are drawn for (per-epoch weight schedules, per-epoch draws); called through
        :meth:`Objective.set_epoch` by the training loop and where a batch is collated."""

    def after_optimizer_step(self) -> None:
        """After every optimiser step (clamps of the term's own parameters); called through
        :meth:`Objective.after_step` by the training loop."""

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        """Unweighted loss values from (possibly merged) features.

        Args:
            detach_params: use detached copies of parameters the loss reads directly (logit scale,
                temperatures). The accumulation scheme sets it on all but the last micro-batch so those
                parameters receive their gradient exactly once.
        """
        raise NotImplementedError(f"term {type(self).__name__} must implement loss()")


def term_plan(batch: Batch, name: str) -> Any:
    """The plan term ``name`` made for ``batch`` where it was collated (:meth:`Term.plan`), or None."""
    return (batch.get(TERM_PLANS) or {}).get(name)


def host_tensor(values: list, device: torch.device | str, dtype: torch.dtype = torch.long) -> Tensor:
    """A tensor of host values (Python numbers: counts, owners) on ``device`` without waiting for the device:
    made on the CPU and, for an accelerator, pinned and copied with ``non_blocking`` (a copy from pageable
    memory would wait for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def scale_of(param: Tensor, detach: bool) -> Tensor:
    """``exp(param)``: the multiplier of a log-parameterised logit scale, optionally detached."""
    return (param.detach() if detach else param).exp()


@dataclass
class WeightedTerm:
    term: Term
    weight: float = 1.0


def _same_tensor(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return a == b
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


def _same_image_inputs(a: ImageRequest, b: ImageRequest) -> bool:
    return a.inputs.keys() == b.inputs.keys() and all(_same_tensor(a.inputs[k], b.inputs[k]) for k in a.inputs)


def _same_text_inputs(a: TextRequest, b: TextRequest) -> bool:
    return _same_tensor(a.input_ids, b.input_ids) and _same_tensor(a.attention_mask, b.attention_mask)


class Objective(nn.Module):
    """An optional base term plus weighted added terms: ``loss = w_base * base + sum_k w_k * term_k``.

    ``forward`` is not used; the :class:`~finetune.training.step.TrainModule` calls ``encode`` and ``loss`` so
    that everything runs inside the prepared (DDP/FSDP) module's forward.

    Args:
        base: the base term, or ``None`` (``objective.base: none``): the objective is then the weighted sum
            of ``terms``.
        terms: ``(term, weights)`` pairs; ``weights`` is a float for every value of the term or
            ``{value name: weight}`` (missing names weigh 1, weight 0 logs the value without training on it).
        base_weights: the base's weights (1 for clip, siglip and longclip).

    Raises:
        ValueError: no term at all, a term without a name or with a reserved one, two terms with one name.
        TermCollisionError: two terms declaring the same produced batch field, or one term's extra feature
            key among another's requests or features.
    """

    def __init__(
        self,
        base: Term | None,
        terms: list[tuple[Term, dict[str, float] | float]] | None = None,
        *,
        base_weights: dict[str, float] | float = 1.0,
    ) -> None:
        super().__init__()
        self.base = base
        self.base_weights = base_weights
        self.terms = nn.ModuleList([t for t, _ in terms or []])
        self.term_weights: list[dict[str, float] | float] = [w for _, w in terms or []]
        if base is None and not self.terms:
            raise ValueError("objective: nothing to optimise: no base term (objective.base: none) and no added "
                             "terms; set objective.base (e.g. clip) or add a term under objective.terms")
        check_declarations(self.all_terms)
        #: the run's planned shapes (:meth:`set_shapes`); None: every batch keeps its own
        self.shapes: BatchShapes | None = None

    @property
    def all_terms(self) -> list[Term]:
        """The base (when there is one) and the added terms, in order."""
        return ([self.base] if self.base is not None else []) + list(self.terms)

    @property
    def weighted_terms(self) -> list[tuple[Term, dict[str, float] | float]]:
        """``(term, weights)`` of every term, the base first."""
        out = [(self.base, self.base_weights)] if self.base is not None else []
        return out + list(zip(self.terms, self.term_weights))

    @property
    def needs(self) -> frozenset[str]:
        out: set[str] = set()
        for t in self.all_terms:
            out |= set(t.needs)
        return frozenset(out)

    @property
    def prepares_examples(self) -> bool:
        """Whether some term works on the examples in the data workers (:meth:`Term.prepare`), so that the collator
        hands them PIL images."""
        return any(type(t).prepare is not Term.prepare for t in self.all_terms)

    def set_shapes(self, shapes: BatchShapes | None) -> None:
        """Set the shapes batches are padded to (:func:`~finetune.objectives.shapes.plan_shapes`): the terms'
        ``collate`` pads per-sample rows to its capacities, :meth:`plan` chooses each text pass's length among its
        planned lengths and :meth:`encode` pads texts to it. Call it before the data-loader workers start (they copy
        the terms)."""
        self.shapes = shapes
        for t in self.all_terms:
            t.shapes = shapes

    def set_epoch(self, epoch: int) -> None:
        """Every term's :meth:`Term.set_epoch`: the training loop calls it as a batch of a new epoch arrives, and the
        collate function of the data-loader workers (:class:`~finetune.objectives.planning.PlannedCollate`) for the
        workers' copies of the terms."""
        for t in self.all_terms:
            t.set_epoch(epoch)

    def after_step(self) -> None:
        """Every term's :meth:`Term.after_optimizer_step`, after each optimiser step of the training loop."""
        for t in self.all_terms:
            t.after_optimizer_step()

    # -- data side --------------------------------------------------------------------------------
    def prepare_model(self, model: Any) -> None:
        """Every term's :meth:`Term.prepare_model`, in term order."""
        for t in self.all_terms:
            t.prepare_model(model)

    def preprocess(self, dataset: Any, model: Any, *, cache_dir: str | None = None, log: Any = None) -> Any:
        for t in self.all_terms:
            dataset = t.preprocess(dataset, model, cache_dir=cache_dir, log=log)
        return dataset

    def training_examples(self, dataset: Any) -> int:
        """The training examples ``dataset`` becomes after every term's :meth:`Term.preprocess`
        (:meth:`Term.training_examples`, in term order)."""
        count = len(dataset)
        for t in self.all_terms:
            count = t.training_examples(dataset, count)
        return count

    def stream_map(self, example: dict[str, Any], model: Any) -> dict[str, Any]:
        """Every term's :meth:`Term.stream_map` on one streamed example, in term order (a term sees the
        fields the terms before it added); returns the added fields."""
        out: dict[str, Any] = {}
        for t in self.all_terms:
            out.update(t.stream_map({**example, **out}, model))
        return out

    def check_stream(self) -> None:
        """:meth:`Term.check_stream` of every term (``ValueError`` naming the option to change)."""
        for t in self.all_terms:
            t.check_stream()

    def check_batch(self, batch_size: int, accumulation_steps: int = 1) -> None:
        """Refuse a batch that a contrastive term (:attr:`Term.contrastive`) cannot learn from: each loss sees
        ``batch_size // accumulation_steps`` examples (gathered over the processes), and one example has no
        negative: InfoNCE of a batch of one is exactly 0 at every step.

        Raises:
            ValueError: naming ``train.batch_size`` (and ``train.accumulation_steps``) and the terms.
        """
        terms = [t.name for t in self.all_terms if t.contrastive]
        per_loss = batch_size // max(1, accumulation_steps)
        if not terms or per_loss >= 2:
            return
        split = f" / train.accumulation_steps={accumulation_steps}" if accumulation_steps > 1 else ""
        raise ValueError(
            f"train.batch_size={batch_size}{split} gives each loss {per_loss} example(s): the contrastive term(s) "
            f"{', '.join(terms)} contrast every example with the others of its batch, so a batch of one trains on "
            f"a loss of exactly 0 (no negative pair). Set train.batch_size to at least {2 * max(1, accumulation_steps)}"
            " (tens to thousands is usual)")

    def prepare(self, example: dict[str, Any]) -> dict[str, Any]:
        """Every term's ``prepare`` fields in one dict; two terms returning one field is an error."""
        out: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for t in self.all_terms:
            for key, value in t.prepare(example).items():
                if key in owner:
                    raise _collision(owner[key], t.name, "example field", key, "prepare")
                owner[key] = t.name
                out[key] = value
        return out

    def collate(self, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        """Every term's ``collate`` fields in one dict; a field of two terms, or one of the collator's own
        (:data:`CORE_BATCH_FIELDS`), is an error."""
        out: dict[str, Any] = {}
        owner: dict[str, str] = {key: "the collator" for key in CORE_BATCH_FIELDS}
        for t in self.all_terms:
            for key, value in t.collate(examples, model).items():
                if key in owner:
                    raise _collision(owner[key], t.name, "batch field", key, "collate")
                owner[key] = t.name
                out[key] = value
        return out

    # -- model side -------------------------------------------------------------------------------
    def requests(self, batch: Batch) -> tuple[dict[str, ImageRequest], dict[str, TextRequest], dict[str, set[str]]]:
        """Every term's image and text requests, one per feature key: requests of several terms under one
        key are merged (states if any asks) when their inputs are the same tensors (or equal ones).

        Returns:
            ``(image requests, text requests, owners)``; ``owners[key]`` are the names of the terms that
            asked for ``key``.

        Raises:
            TermCollisionError: two terms ask for one key with different inputs, or one asks for it as an
                image and another as a text.
        """
        image_reqs: dict[str, ImageRequest] = {}
        text_reqs: dict[str, TextRequest] = {}
        owners: dict[str, set[str]] = {}
        for t in self.all_terms:
            sides = (("image", t.image_inputs(batch), image_reqs, text_reqs, _same_image_inputs, "images"),
                     ("text", t.text_inputs(batch), text_reqs, image_reqs, _same_text_inputs, "token ids"))
            for kind, asked, mine, theirs, same, what in sides:
                for key, req in asked.items():
                    if key in theirs:
                        other = "text" if kind == "image" else "image"
                        raise _collision(_first(owners[key]), t.name, "feature key", key, f"{kind}_inputs",
                                         detail=f"one asks for it as {'an' if other == 'image' else 'a'} {other}, "
                                                f"the other as {'an' if kind == 'image' else 'a'} {kind}")
                    first = mine.get(key)
                    if first is None:
                        mine[key] = req
                    elif not same(first, req):
                        raise _collision(_first(owners[key]), t.name, "feature key", key, f"{kind}_inputs",
                                         detail=f"with different {what}")
                    elif req.states and not first.states:
                        mine[key] = replace(first, states=True)
                    owners.setdefault(key, set()).add(t.name)
        return image_reqs, text_reqs, owners

    def encode(self, model: Any, batch: Batch) -> Features:
        """Run the encoders once for every term's requests and return the merged feature dict.

        All image requests go through ONE ``encode_image`` call (concatenated along the batch); text requests
        through one pass per text kind (:func:`~finetune.objectives.encoders.encode_texts`: at most two under
        :attr:`shapes`, at the lengths the batch's plan chose). A key asked for by several terms is encoded once
        (:meth:`requests`).
        """
        image_reqs, text_reqs, owners = self.requests(batch)
        feats: Features = {N_SAMPLES: torch.tensor(len(batch["input_ids"]))}
        feats.update(encode_images(model, image_reqs))
        feats.update(encode_texts(model, text_reqs, batch.get(TEXT_PLAN), self.shapes))
        # states and masks of a request belong to the terms that asked for it
        for key in list(owners):
            for suffix in ("_states", "_mask"):
                if key + suffix in feats:
                    owners.setdefault(key + suffix, set()).update(owners[key])
        for key in CORE_FEATURES:
            owners.setdefault(key, {"the encoders"})
        for t in self.all_terms:
            before = {k: id(v) for k, v in feats.items()}
            t.extra_features(model, batch, feats)
            for key, value in feats.items():
                if before.get(key) == id(value):
                    continue
                prev = owners.setdefault(key, set())
                if prev and t.name not in prev:
                    raise _collision(_first(prev), t.name, "feature key", key, "extra_features")
                prev.add(t.name)
        return feats

    def plan(self, model: Any, batch: Batch) -> TextPlan:
        """The :class:`~finetune.objectives.encoders.TextPlan` of ``batch`` (collated on the CPU), decided where the
        batch is collated so that the step reads no mask from the device: whether its text requests are right-padded,
        the length of each text kind's pass (under :attr:`shapes` the smallest planned bucket that holds its longest
        row, else that row's length; the kinds of the terms' own texts, :meth:`Term.text_masks`, too) and the real
        and computed text tokens."""
        _, text_reqs, _ = self.requests(batch)
        padded = right_padded([r.attention_mask for r in text_reqs.values()])
        masks: dict[str, list[Tensor]] = {}
        for req in text_reqs.values():
            masks.setdefault(request_kind(req), []).append(req.attention_mask)
        for t in self.all_terms:
            for kind, mask in t.text_masks(batch).items():
                masks.setdefault(kind, []).append(mask)
        return replace(plan_lengths(self.shapes, masks), right_padded=padded)

    def term_plans(self, model: Any, batch: Batch) -> dict[str, Any] | None:
        """``{term name: plan}`` of the terms that plan ``batch`` (:meth:`Term.plan`, on the CPU), or None when none
        does."""
        plans = {}
        for t in self.all_terms:
            p = t.plan(model, batch)
            if p is not None:
                plans[t.name] = p
        return plans or None

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        """Weighted total and every unweighted value: ``{"<term>" or "<term>/<value>": value, ..., "loss": total}``
        (:func:`loss_name`), the base first."""
        total: Tensor | int = 0
        out: dict[str, Tensor] = {}
        for term, weight in self.weighted_terms:
            for key, value in term.loss(model, feats, detach_params=detach_params).items():
                name = loss_name(term.name, key)
                if name in out:
                    raise TermCollisionError(f"objective: the loss name {name!r} is logged twice; term "
                                             f"{term.name!r} must not return a value named like another term")
                w = weight.get(key, 1.0) if isinstance(weight, dict) else weight
                if w:
                    total = total + (value if w == 1 else w * value)
                out[name] = value
        if not isinstance(total, Tensor):
            raise ValueError("objective: every loss value has weight 0 (or no term returned one); give at "
                             "least one value a non-zero weight")
        out["loss"] = total
        return out


def _first(names: set[str]) -> str:
    return sorted(names)[0]


def _collision(first: str, second: str, what: str, key: str, where: str, detail: str = "") -> TermCollisionError:
    detail = f" {detail}" if detail else ""
    if first == "the collator" or first == "the encoders":
        return TermCollisionError(f"objective: term {second!r} writes the {what} {key!r} in {where}, which "
                                  f"{first} fills; rename it in {second!r}")
    return TermCollisionError(f"objective: terms {first!r} and {second!r} both write the {what} {key!r} "
                              f"(in {where}){detail}; rename it in one of them")


def check_declarations(terms: list[Term]) -> None:
    """Check the terms of one objective against each other from their declarations (cheap, before any
    batch): names set, not reserved and distinct; no batch field ``produces``d by two terms or by the
    collator; no extra feature key of one term among another's ``requests`` or ``features``.

    Raises:
        ValueError: a missing, reserved or repeated name.
        TermCollisionError: naming the two terms and the field.
    """
    seen: dict[str, Term] = {}
    for t in terms:
        if not t.name or "/" in t.name or t.name in RESERVED_NAMES:
            raise ValueError(f"objective: term {type(t).__name__} has the name {t.name!r}; a term needs a name "
                             f"without '/', other than {', '.join(sorted(RESERVED_NAMES))} (set by register_term)")
        if t.name in seen:
            raise ValueError(f"objective: the term {t.name!r} appears twice (objective.base and objective.terms?); "
                             f"its losses would be logged under one name; keep one")
        seen[t.name] = t
    produced: dict[str, str] = {key: "the collator" for key in CORE_BATCH_FIELDS}
    for t in terms:
        for key in sorted(t.produces):
            if key in produced:
                raise _collision(produced[key], t.name, "batch field", key, "prepare/collate")
            produced[key] = t.name
    for j, later in enumerate(terms):
        for key in sorted(later.features & CORE_FEATURES):
            raise _collision("the encoders", later.name, "feature key", key, "extra_features")
        for earlier in terms[:j]:
            shared = (earlier.features & (later.requests | later.features)) | (later.features & earlier.requests)
            for key in sorted(shared):
                raise _collision(earlier.name, later.name, "feature key", key, "extra_features")


@dataclass
class TermSpec:
    """What a recipe's ``objective.terms.<name>`` resolves to: the term and its loss weights."""

    term: Term
    weights: dict[str, float] | float = field(default=1.0)
