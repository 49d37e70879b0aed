"""The ``fcast`` objective term: F-CAST's two-level sigmoid losses (F-CAST section 3.3, appendix C).

Use with ``objective.base: none`` and an ``fcast`` model (``model.family: fcast``). Per example, in the
data workers, the caption is split into sentences (:func:`finetune.data.text.split_sentences`), cut into
N random chunks of 1-3 sentences (:func:`~finetune.data.text.random_chunks`, appendix C) and completed
to K sub-captions with FLAIR's sampler (:func:`~finetune.data.text.sample_subcaptions`, K - N more of
1-3 sentences): the first N are the long caption's chunks (3.3, "Training batch construction"). The
model's :meth:`~finetune.models.families.fcast.FCastModel.preprocess_images` puts superpixels next to the pixels;
for map-style data :meth:`FCastTerm.preprocess` points it at an on-disk cache so every image's
superpixels are computed once; a stream whose shards hold precomputed superpixels (``xlipkit superpixels``)
reads them back (:meth:`FCastTerm.stream_map`) and computes none.

Per batch: the CAST encoder gives ``v_fine`` and ``v_coarse``, stage 1 encodes all K sub-captions, the
adapter and stage 2 turn the first N into ``t_long``; the loss is
:func:`losses.fcast_loss` (``fcast/part`` + ``fcast/whole``) with the model's part-level and whole-level
scales and biases. The two levels are added unweighted as the paper writes; their reductions are the
implementation's (L_part as FLAIR's public code, L_whole as SigLIP), which puts them at about 8 : 1 at
initialisation (:mod:`losses.fcast`). After every optimiser step both log scales are clamped to
``[0, ln 100]`` (``logit_scale_max``): FLAIR's public code does this; F-CAST's text does not mention a clamp
(it says it builds on FLAIR's code).

The part level's negatives are keyed by (``seed``, step) as FLAIR's (:class:`~finetune.objectives.flair.DrawCounter`
saves the step count in the run's checkpoints): each process draws only its own rows, and a resumed run
draws what the uninterrupted one would.

The run report draws, for a few training images, the superpixels and each stage's segments (F-CAST
Fig. 6) and the part-level attention of a few sub-captions over the 64 segments (Fig. 7).
"""

from __future__ import annotations

import logging
import math
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from losses import fcast_loss, flair_draw_seed

from .base import TEXT_PLAN, Batch, Features, Term, scale_of, term_plan
from .flair import DrawCounter
from .registry import Citation, register_term

TERM_NAME = "fcast"
#: the text kind of the sub-captions, which the term encodes itself (the chunk encoder): planned like the requests
CHUNK_KIND = f"{TERM_NAME}/chunks"
#: the CAST encoder's segment tokens per image under planned shapes: the superpixels' target count times this,
#: rounded up to a multiple of SEGMENT_ALIGN (SLIC gives about its target, sometimes a little more)
SEGMENT_MARGIN = 1.25
SEGMENT_ALIGN = 16

log = logging.getLogger("xlipkit")


def _positive(value: Any) -> str | None:
    return None if value >= 1 else f"must be >= 1, got {value!r}"


def _distributed(value: Any) -> str | None:
    return None if value in ("global", "ring") else f"must be 'global' or 'ring', got {value!r}"


@dataclass
class FCastOptions:
    """``objective.terms.fcast``.

    Attributes:
        k: sub-captions per image K (8, F-CAST 4.1), the first ``n_chunks`` of them the random chunks.
        n_chunks: chunks N per caption (4); must equal the model's.
        max_sentences: most sentences in a chunk or sub-caption (3, appendix C).
        distributed: ``global`` (the paper's global batch) or ``ring`` (FLAIR's public code), for the
            part level.
        logit_scale_max: clamp of both log scales after every step (FLAIR's public code: ln 100; F-CAST's text
            names none); null: no clamp.
        cache_superpixels: cache map-style data's superpixels under ``data.cache_dir``.
        seed: seed of the chunking and sub-caption draws (with the epoch and the example id) and of the part
            level's negatives (with the step).
        report_images: images drawn in the report (F-CAST Figs. 6-7); 0: none.
        caption_fields: example fields holding an image's captions (strings, or lists of sentences such as
            DreamLIP's re-captioned shards); null: the example's ``caption``. The K - N extra sub-captions
            are drawn from all their sentences ("sampled from multiple captions", 3.3).
        long_fields: which of ``caption_fields`` are long captions; the N chunks come from one of them drawn
            at random per example (3.3: "derived from a single long caption"); null: all of them.
        superpixels: overrides of the model's superpixel settings (``method``: slic | seeds | sfcn,
            ``n_segments``, ``compactness``, ``checkpoint``: the SFCN weights), applied when the term first
            sees the model (preprocessing, or the first streamed example) and saved with it, since
            inference needs the same superpixels; null: the model's own (``slic`` for registry models).
    """

    k: int = field(default=8, metadata={"check": _positive})
    n_chunks: int = field(default=4, metadata={"check": _positive})
    max_sentences: int = field(default=3, metadata={"check": _positive})
    distributed: str = field(default="global", metadata={"check": _distributed})
    logit_scale_max: float | None = math.log(100.0)
    cache_superpixels: bool = True
    seed: int = 0
    report_images: int = 4
    caption_fields: list[str] | None = None
    long_fields: list[str] | None = None
    superpixels: dict[str, Any] | None = None


class FCastTerm(Term):
    """F-CAST's ``L_part + L_whole`` (see the module docstring)."""

    name = TERM_NAME
    contrastive = True
    produces = frozenset({"fcast_subcaptions", "fcast_sub_ids", "fcast_sub_mask"})
    features = frozenset({"fcast_fine", "fcast_coarse", "fcast_sub", "fcast_long"})
    uses_logit_bias = True

    def __init__(self, options: FCastOptions) -> None:
        super().__init__()
        unknown = set(options.long_fields or ()) - set(options.caption_fields or ())
        if unknown:
            raise ValueError(f"objective.terms.fcast.long_fields {sorted(unknown)} must be among caption_fields "
                             f"{options.caption_fields}")
        if options.k < options.n_chunks:
            raise ValueError(f"objective.terms.fcast.k ({options.k}) must be at least n_chunks ({options.n_chunks}): "
                             f"the first N sub-captions are the caption's chunks")
        self.options = options
        self.epoch = 0
        self.draws = DrawCounter()
        #: (micro-)batches whose superpixels had more segments than the planned capacity (each ran at a new shape)
        self.over_capacity = 0
        if options.superpixels is not None:
            from finetune.preprocess.superpixels import SuperpixelSettings

            try:
                SuperpixelSettings(**{"n_segments": 196, **options.superpixels})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"objective.terms.fcast.superpixels: {exc}") from exc

    # -- the model the term works with (kept out of the module tree) ------------------------------
    def _attach(self, model: Any) -> Any:
        from finetune.models.families.fcast import FCastModel

        if not isinstance(model, FCastModel):
            raise ValueError(f"objective.terms.fcast needs an F-CAST model (model.family: fcast, e.g. "
                             f"model.name_or_path: fcast-tiny), got {type(model).__name__} "
                             f"({getattr(model, 'backend', '?')!r})")
        if model.n_chunks != self.options.n_chunks:
            raise ValueError(f"objective.terms.fcast.n_chunks ({self.options.n_chunks}) differs from the model's "
                             f"N = {model.n_chunks}; set them equal")
        if self.options.superpixels is not None and self.__dict__.get("_model") is not model:
            from dataclasses import asdict

            from finetune.preprocess.superpixels import settings_from

            settings = settings_from({**asdict(model.superpixels), **self.options.superpixels})
            model.superpixels = settings
            model.config.superpixels = asdict(settings)
        self.__dict__["_model"] = model
        return model

    # -- data ---------------------------------------------------------------------------------------
    def prepare_model(self, model: Any) -> None:
        """Check that the model is an F-CAST model and apply ``superpixels`` to it, on either data path."""
        self._attach(model)

    def preprocess(self, dataset: Any, model: Any, *, cache_dir: str | None = None, log: Any = None) -> Any:
        """Point the model's superpixels at an on-disk cache (map-style data: each image once)."""
        self._attach(model)
        if self.options.cache_superpixels:
            from finetune.data.cache import default_cache_dir

            root = Path(cache_dir) / "preprocess" if cache_dir else default_cache_dir()
            model.superpixel_cache_dir = str(root / "superpixels")
            if log is not None:
                log.info("fcast: superpixels (%s, %d segments) cached in %s", model.superpixels.method,
                         model.superpixels.n_segments, model.superpixel_cache_dir)
        return dataset

    def example_fields(self) -> dict[str, str]:
        """``caption_fields``: what a stream must pass through (``data.train.options.fields``)."""
        return {name: "objective.terms.fcast.caption_fields" for name in self.options.caption_fields or ()}

    def stream_map(self, example: dict[str, Any], model: Any) -> dict[str, Any]:
        """Streams: a sample's precomputed superpixels (``KEY.superpixels.png``, written by ``xlipkit superpixels``)
        decoded and checked against the model's settings, as ``superpixels``, which the model's
        ``preprocess_images`` then uses instead of computing them; without the entry nothing is added (they are
        computed with the pixels, uncached; the model got its settings in :meth:`prepare_model`).

        Raises:
            DataError: an entry made with other settings than the model's (naming both, the sample and the fix).
        """
        from finetune.data.collate import PRECOMPUTED_SUPERPIXELS
        from finetune.data.streams import SUPERPIXELS_FIELD

        entry = example.get(SUPERPIXELS_FIELD)
        if entry is None:
            return {}
        from finetune.preprocess.superpixels import decode_entry, settings_stamp

        key = (model.superpixels, model.image_size)
        stamps = self.__dict__.setdefault("_stamps", {})
        if key not in stamps:
            stamps[key] = settings_stamp(model.superpixels, model.image_size)
        where = f"sample {example.get('id')!r}" + (f" of {example['url']}" if example.get("url") else "")
        return {PRECOMPUTED_SUPERPIXELS: decode_entry(entry, stamps[key], where=where)}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def subcaptions(self, caption: str, key: str, captions: dict[str, list[str]] | None = None) -> list[str]:
        """The K sub-captions of one example: N random chunks of one long caption (appendix C), then K - N
        FLAIR samples (1-3 sentences) from all its captions' sentences.

        Args:
            caption: the example's caption (used when ``captions`` is None).
            key: what seeds the draws with the term's seed and the epoch (the example id).
            captions: ``{field: sentences}`` of ``caption_fields``.
        """
        from finetune.data.text import random_chunks, sample_subcaptions, split_sentences

        o = self.options
        rng = random.Random(zlib.crc32(f"{o.seed}:{self.epoch}:{key}".encode()))
        if captions is None:
            pool = long = split_sentences(caption) or [caption.strip() or "."]
        else:
            longs = [captions[f] for f in (o.long_fields or list(captions)) if captions.get(f)]
            pool = [s for sentences in captions.values() for s in sentences]
            if not longs or not pool:
                raise ValueError(f"objective.terms.fcast: example {key!r} has no sentence in its long_fields "
                                 f"{o.long_fields or list(captions)}")
            long = rng.choice(longs)
        chunks = [" ".join(c) for c in random_chunks(long, o.n_chunks, rng, max_per_chunk=o.max_sentences)]
        extra = sample_subcaptions(pool, o.k - o.n_chunks, 1, o.max_sentences, rng) if o.k > o.n_chunks else []
        return chunks + extra

    def prepare(self, example: dict[str, Any]) -> dict[str, Any]:
        from finetune.data.text import split_sentences

        key = str(example.get("id", example["caption"][:64]))
        captions = None
        if self.options.caption_fields:
            captions = {}
            for name in self.options.caption_fields:
                if name not in example:
                    raise ValueError(f"objective.terms.fcast.caption_fields: example {key!r} has no field {name!r} "
                                     f"(fields: {', '.join(sorted(example))}); a stream must pass it through "
                                     f"(data.train.options.fields), or set caption_fields: null")
                value = example[name]
                if isinstance(value, str):
                    captions[name] = split_sentences(value)
                else:
                    captions[name] = [str(v).strip() for v in (value or []) if str(v).strip()]
        return {"fcast_subcaptions": self.subcaptions(example["caption"], key, captions)}

    def collate(self, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        texts = [s for e in examples for s in e["fcast_subcaptions"]]
        tok = model.tokenize_chunks(texts)
        b, k = len(examples), self.options.k
        return {"fcast_sub_ids": tok.input_ids.reshape(b, k, -1), "fcast_sub_mask": tok.attention_mask.reshape(b, k, -1)}

    # -- model --------------------------------------------------------------------------------------
    def shape_scan(self, dataset: Any, model: Any) -> Any:
        """What the run plans before training: the segment tokens per image of the CAST encoder's first stage
        (:data:`SEGMENT_MARGIN` over the superpixels' target count, rounded up to :data:`SEGMENT_ALIGN`; the
        superpixels are computed in the data workers, so their count is not known before; a batch with more segments
        takes the next multiple of :data:`SEGMENT_ALIGN`, a new shape, warned once and counted in
        :meth:`summary`), and the sub-captions' kind (:data:`CHUNK_KIND`), drawn every epoch: every bucket length
        of the chunk encoder's 77 is planned for it."""
        from .shapes import ShapeScan

        return ShapeScan(open_kinds=frozenset({CHUNK_KIND}),
                         capacities={f"{TERM_NAME}/segments": self.segment_capacity(model)})

    def segment_capacity(self, model: Any) -> int:
        """The segment tokens per image planned for the CAST encoder's first stage: the superpixels' target count
        times :data:`SEGMENT_MARGIN`, rounded up to :data:`SEGMENT_ALIGN`."""
        from .shapes import round_up

        target = int(self._attach(model).superpixels.n_segments)
        return round_up(math.ceil(target * SEGMENT_MARGIN), SEGMENT_ALIGN)

    def text_masks(self, batch: Batch) -> dict[str, Tensor]:
        """The sub-captions' mask ``(B * K, 77)``: the batch's text plan gives the chunk encoder's columns (the
        smallest planned bucket length that holds the longest sub-caption)."""
        mask = batch.get("fcast_sub_mask")
        return {} if mask is None else {CHUNK_KIND: mask.reshape(-1, mask.shape[-1])}

    def plan(self, model: Any, batch: Batch) -> dict[str, int] | None:
        """The segment count the step would otherwise read from the device, counted on the CPU where the batch is
        collated (``CastEncoder.segment_count``): under the run's planned shapes (:attr:`Term.shapes`) the planned
        capacity (invalid segments are masked in every attention and pooling), or, for a batch with more segments,
        the next multiple of :data:`SEGMENT_ALIGN` (``over_capacity``: the step warns once and counts it); else this
        batch's count. ``capacity``: the planned capacity (:meth:`segment_capacity` without planned shapes), the
        tokens GraphPool's dropout is drawn at, so that the segments' padding does not decide the noise."""
        inputs = batch.get("image_inputs") or {}
        if inputs.get("superpixels") is None or "fcast_sub_mask" not in batch:
            return None
        from .shapes import round_up

        count = model.segment_count(inputs["pixel_values"], inputs["superpixels"])
        cap = self.shapes.capacity(f"{TERM_NAME}/segments") if self.shapes is not None else None
        if cap is None:
            return {"segments": count, "capacity": self.segment_capacity(model)}
        if count > cap:
            return {"segments": round_up(count, SEGMENT_ALIGN), "capacity": cap, "over_capacity": count}
        return {"segments": cap, "capacity": cap}

    def extra_features(self, model: Any, batch: Batch, feats: Features) -> None:
        self._attach(model)
        inputs = batch["image_inputs"]
        plan = term_plan(batch, self.name) or {}  # None: a batch collated without a plan counts on the device
        text_plan = batch.get(TEXT_PLAN)
        warmup = bool(getattr(text_plan, "warmup", False))
        if plan.get("over_capacity") and not warmup:
            self._note_over_capacity(plan)
        hier = model.encode_image_hierarchy(inputs["pixel_values"], inputs.get("superpixels"),
                                            n_segments=plan.get("segments"), noise_tokens=plan.get("capacity"))
        ids, mask = batch["fcast_sub_ids"], batch["fcast_sub_mask"]
        b, k, length = ids.shape
        columns = getattr(text_plan, "lengths", {}).get(CHUNK_KIND)
        sub = model.encode_subcaptions(ids.reshape(b * k, length), mask.reshape(b * k, length),
                                       longest=columns).reshape(b, k, -1)
        feats["fcast_fine"] = hier.fine
        feats["fcast_coarse"] = hier.coarse
        feats["fcast_sub"] = sub
        feats["fcast_long"] = model.encode_long(sub[:, : self.options.n_chunks])

    def _note_over_capacity(self, plan: dict[str, int]) -> None:
        """Count a (micro-)batch over the planned segment capacity (in ``metrics.json``, :meth:`summary`), and warn
        the first time."""
        self.over_capacity += 1
        if self.over_capacity == 1:
            log.warning("fcast: %d superpixel segments in a batch, more than the %d planned per image: such batches "
                        "run at a new shape (here %d segment tokens); counted in metrics.json (terms.fcast."
                        "over_capacity_batches). Fewer segments (objective.terms.fcast.superpixels.n_segments) or a "
                        "SLIC compactness that keeps its target avoids them", plan["over_capacity"], plan["capacity"],
                        plan["segments"])

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        heads = model.model
        out = fcast_loss(
            feats["fcast_sub"], feats["fcast_fine"], feats["fcast_coarse"], feats["fcast_long"], heads.part_pool,
            scale_of(heads.part_logit_scale, detach_params),
            heads.part_logit_bias.detach() if detach_params else heads.part_logit_bias,
            scale_of(heads.logit_scale, detach_params),
            heads.logit_bias.detach() if detach_params else heads.logit_bias,
            seed=self.draw_seed(), distributed=self.options.distributed,
        )
        return {"part": out["part"], "whole": out["whole"]}

    def draw_seed(self) -> int:
        """The key of this step's part-level negatives: (``seed``, steps so far), as FLAIR's term."""
        return flair_draw_seed(self.options.seed, self.draws.value)

    def after_optimizer_step(self) -> None:
        """Clamp both log scales to ``[0, logit_scale_max]``; the next step draws new negatives."""
        self.draws.advance()
        model = self.__dict__.get("_model")
        if model is None or self.options.logit_scale_max is None:
            return
        with torch.no_grad():
            for p in (model.model.logit_scale, model.model.part_logit_scale):
                p.clamp_(0.0, self.options.logit_scale_max)

    # -- report -------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        model = self.__dict__.get("_model")
        info: dict[str, Any] = {"k": self.options.k, "n_chunks": self.options.n_chunks,
                                "distributed": self.options.distributed, "over_capacity_batches": self.over_capacity}
        if model is not None:
            info.update(superpixels=model.superpixels.method, n_segments=model.superpixels.n_segments,
                        part_scale=float(model.model.part_logit_scale.detach().exp()),
                        whole_scale=float(model.model.logit_scale.detach().exp()),
                        part_bias=float(model.model.part_logit_bias.detach()),
                        whole_bias=float(model.model.logit_bias.detach()))
        return info

    def report_sections(self, run_dir: str | Path, dataset: Any) -> list[str]:
        """The part-to-whole hierarchy (Fig. 6) and part-level attention (Fig. 7) of a few training images,
        drawn with the trained model into ``plots/fcast_hierarchy.png`` and ``plots/fcast_attention.png``."""
        model = self.__dict__.get("_model")
        n = min(self.options.report_images, len(dataset)) if model is not None else 0
        if not n:
            return []
        from finetune.data.images import read_image
        from finetune.objectives._fcast_plots import draw_attention, draw_hierarchy

        examples = [dataset[i] for i in range(n)]
        images = [read_image(e["image"]) for e in examples]
        captions = [e["caption"] for e in examples]
        plots = Path(run_dir) / "plots"
        draw_hierarchy(model, images, plots / "fcast_hierarchy.png")
        draw_attention(model, images, captions, plots / "fcast_attention.png")
        return ["\n".join([
            "## F-CAST part-to-whole hierarchy", "",
            f"Superpixels ({model.superpixels.method}) and the segments after each graph pooling of the trained "
            f"CAST encoder (F-CAST Fig. 6): every pixel coloured by the segment it belongs to at that level.", "",
            "![F-CAST hierarchy: superpixels and each stage's segments](plots/fcast_hierarchy.png)", "",
            "Part-level attention of the first sub-captions (balanced chunks) over the stage-2 segments "
            "(F-CAST Fig. 7); the weight left on the empty slot is in each title.", "",
            "![F-CAST part-level attention of sub-captions](plots/fcast_attention.png)",
        ])]


@register_term(TERM_NAME, FCastOptions, citation=Citation(
    "Aligning Forest and Trees in Images and Long Captions for Cross-Domain Grounding (F-CAST)", tag="f-cast"))
def build_fcast(options: FCastOptions | None) -> tuple[FCastTerm, float]:
    """``objective.terms.fcast``: :class:`FCastTerm`, weight 1 for ``part`` and ``whole`` (L = L_part + L_whole)."""
    return FCastTerm(options or FCastOptions()), 1.0
