"""The ``fastgoal`` objective term: FAST-GOAL's local contrastive loss and Token Similarity-based Learning.

FAST-GOAL (Choi, Jang, Eom; paper III) trains on the global pair (image I_g, caption T_g) and one local pair
(I_l, T_l) per image found by FLISM (:mod:`finetune.preprocess.flism`):

    L_total = l_global L_global + l_local L_local + l_TSL L_TSL                            (eq. 11)

- ``L_global`` (eq. 12) is the recipe's base term (``objective.base: clip``), weight 1;
- ``local`` L_local (eq. 13): symmetric InfoNCE between the crop embeddings v_l^cls and the sentence embeddings
  t_l^cls, with the model's logit scale (as the GOAL code), weight 0.5 (V-A);
- ``tsl`` L_TSL (eq. 14, :func:`losses.tsl.tsl_loss`): the global image's patch states inside the pair's box,
  mean-pooled (eq. 9) and projected by psi_v (eq. 10), against v_l^cls, plus the caption's token states in the
  sentence's span, mean-pooled (eq. 7) and projected by psi_t (eq. 8), against t_l^cls; n x n cosine matrices
  against I (``tsl_form: matrix``, the paper) or the GOAL code's ``MSE(diag, 1)`` (``tsl_form: diagonal``);
  weight 1 (V-A). psi are the model's own final norm + projection (``heads: own``, as the GOAL code) or separate
  heads initialised from them and saved with the model (``heads: new``, :class:`losses.tsl.TSLHeads`).

Sentences that truncation to ``model.max_text_len`` cut have no span in the global caption: they leave the text
half of TSL (their pair stays in L_local and in the image half) and are counted (:meth:`FastGoalTerm.summary`).
Likewise a box that the model's resize and centre crop cut away entirely (a pairs file built with another model):
the collate function finds it on the CPU and, per ``data.on_error``, leaves it out of the image half of TSL and
counts it (``skip``) or stops naming the example (``raise``). The training step only applies the masks the
collate function built: no host read, no branch on device values.

The colour image and the caption are the base term's requests (``image``, ``text``) asked for again with states:
the objective encodes each once, with states, also when ``structxlip`` sits on the same model. Crops and
sentences are encoded beside them (``fastgoal_crop`` in the same image pass, ``fastgoal_sentence`` in the causal
text buckets).

With ``regions.pairs: 3`` (Table VIII) every image brings three pairs (padded by repeating its last one, the
repeats marked invalid); each pair's rows of the TSL errors are scaled by its weight share times the image's
pair count (``uniform``: all 1; ``weighted``: similarity-proportional); L_local treats every valid pair as one
row. A pairs file (``regions.method: pairs``) is grouped into one example per image with the weights of its
``weight`` column (:func:`finetune.preprocess.flism.pairs_by_image`), as FLISM in a recipe gives them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from finetune.extras import require_extra
from finetune.preprocess.frozen import FrozenEncoders, model_fingerprint
from losses import clip_loss

from .base import Batch, Features, ImageRequest, Term, TextRequest, scale_of
from .checks import at_least_one as _at_least_one
from .checks import non_negative as _non_negative
from .checks import unit as _unit
from .registry import Citation, register_term
from .tsl_heads import TSL_HEADS_NAME, attach_tsl_heads, tsl_sentence_spans

__all__ = ["FastGoalOptions", "FastGoalTerm", "FastGoalWeights", "FlismOptions", "build_fastgoal"]

logger = logging.getLogger("xlipkit")

TERM_NAME = "fastgoal"
#: columns of a pairs file written by ``python -m finetune.preprocess.flism`` (``regions.method: pairs``)
PAIR_COLUMNS = ("box", "sentence_index")


@dataclass
class FastGoalWeights:
    """lambda_local and lambda_TSL of eq. 11 (V-A: 0.5 and 1; lambda_global is the base term's weight, 1)."""

    local: float = field(default=0.5, metadata={"check": _non_negative})
    tsl: float = field(default=1.0, metadata={"check": _non_negative})


@dataclass
class FlismOptions:
    """FLISM (paper III-A): where the local pairs come from.

    Attributes:
        method: ``detector`` (FLISM: ``detector`` boxes + the default regions), ``sam`` (GOAL's LISM: SAM masks
            covering ``min_area``-``max_area`` of the image), ``dataset`` (the data's ``objects[].box``, e.g. the
            synthetic scenes; with ``links`` their ``sentence_index`` fixes the sentence) or ``pairs`` (the
            ``box`` / ``sentence_index`` columns of a pairs file from ``python -m finetune.preprocess.flism``).
        default: add the four quadrants and the centre box (III-A); false is Table VII's "YOLO only".
        detector: a transformers YOLOS hub id or folder (``hustvl/yolos-base``: the paper names YOLOS and its
            127.8M parameters, Table X; which checkpoint is ours) or an ultralytics ``.pt`` checkpoint
            (``yolov8x.pt``, needs the ``regions`` extra); null: the default regions only.
        threshold: detection score threshold (null: 0.9 for YOLOS, as its model card; 0.25 for ultralytics).
        classes: keep only these detector classes (names or ids); null: all.
        max_boxes: most detector / SAM boxes per image, by score (null: all).
        imgsz: ultralytics inference size.
        sam_checkpoint, min_area, max_area, points_per_side: ``method: sam`` (GOAL: the pipeline's default SAM,
            1-80 % of the image, 64 points per side).
        links: ``method: dataset``: pair each object's box with its own sentence (false: match like detections).
        pairs: pairs kept per image (paper: 1; Table VIII: 3).
        weighting: ``uniform`` or ``weighted`` (similarity-proportional) weights of the pairs (Table VIII), as
            FLISM computes them here; a pairs file carries its own (its ``weight`` column, the builder's
            ``--weighting``).
        batch_size: images per matching batch; encode_batch_size: crops / sentences per encoder call.
        device: where the detector runs (null: CUDA when available).
    """

    method: Literal["detector", "sam", "dataset", "pairs"] = "detector"
    default: bool = True
    detector: str | None = "hustvl/yolos-base"
    threshold: float | None = field(default=None, metadata={"check": _unit})
    classes: list[str | int] | None = None
    max_boxes: int | None = field(default=None, metadata={"check": _at_least_one})
    imgsz: int = field(default=640, metadata={"check": _at_least_one})
    sam_checkpoint: str = "facebook/sam-vit-huge"
    min_area: float = field(default=0.01, metadata={"check": _unit})
    max_area: float = field(default=0.8, metadata={"check": _unit})
    points_per_side: int = field(default=64, metadata={"check": _at_least_one})
    links: bool = True
    pairs: int = field(default=1, metadata={"check": _at_least_one})
    weighting: Literal["uniform", "weighted"] = "uniform"
    batch_size: int = field(default=16, metadata={"check": _at_least_one})
    encode_batch_size: int = field(default=64, metadata={"check": _at_least_one})
    device: str | None = None


@dataclass
class FastGoalOptions:
    """``objective.terms.fastgoal`` of a recipe.

    Attributes:
        weights: lambda_local, lambda_TSL (:class:`FastGoalWeights`, V-A: 0.5 / 1).
        tsl_form: ``matrix`` (eq. 14 as written: n x n cosine matrices against I, 1 / n of the weight on the
            pairs) or ``diagonal`` (the GOAL code's ``MSE(diag, 1)``, the form the paper's numbers most likely
            used: docs/methods/fastgoal.md).
        heads: psi_v / psi_t: ``own`` (the model's final norm + projection, as the GOAL code) or ``new``
            (separate heads initialised from them, trained and saved with the model; the paper calls psi "a
            learned projection function" and gives no initialisation).
        box_cover: which patches a box pools: ``overlap`` (every patch it touches) or ``centre`` (patches whose
            centre lies inside, as StructXLIP's pooled regions).
        regions: FLISM (:class:`FlismOptions`).
    """

    weights: FastGoalWeights = field(default_factory=FastGoalWeights)
    tsl_form: Literal["matrix", "diagonal"] = "matrix"
    heads: Literal["own", "new"] = "own"
    box_cover: Literal["overlap", "centre"] = "overlap"
    regions: FlismOptions = field(default_factory=FlismOptions)


def _stack_inputs(parts: dict[str, Tensor], batch: int, k: int) -> dict[str, Tensor]:
    """Processor outputs of ``batch * k`` crops -> ``(batch, k, ...)`` so that micro-batch splits slice them."""
    return {name: t.reshape(batch, k, *t.shape[1:]) for name, t in parts.items()}


def _flat(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


class FastGoalTerm(Term):
    """FAST-GOAL's L_local (eq. 13) and L_TSL (eq. 14) as an objective term on any CLIP-like base.

    ``loss`` returns the unweighted ``{"local": L_local, "tsl": L_TSL}``; :attr:`weights` (0.5 / 1) are applied
    by the ``Objective``. The base term provides L_global.

    Args:
        options: :class:`FastGoalOptions` (a recipe's ``objective.terms.fastgoal``).

    Raises:
        FileNotFoundError: an ultralytics ``regions.detector`` file that does not exist.
        ValueError: inconsistent region options.
    """

    name = TERM_NAME
    needs = frozenset({"flism"})
    produces = frozenset({"fg_id", "fg_caption", "fg_crops", "fg_sentences", "fg_sentence_index", "fg_boxes", "fg_size",
                          "fg_valid", "fg_weight", "fastgoal"})
    requests = frozenset({"image", "text", "fastgoal_crop", "fastgoal_sentence"})
    features = frozenset({"fastgoal_box", "fastgoal_span", "fastgoal_pair_valid", "fastgoal_box_valid",
                          "fastgoal_span_valid", "fastgoal_weight"})
    #: the recipe's ``data.on_error`` (the run sets it): a pair box the model's input does not show leaves TSL's
    #: image half and is counted (``skip``) or stops the run naming the example (``raise``)
    on_error: str = "skip"

    def __init__(self, options: FastGoalOptions | None = None) -> None:
        super().__init__()
        self.options = opts = options or FastGoalOptions()
        r = opts.regions
        if r.min_area > r.max_area:
            raise ValueError(f"objective.terms.fastgoal.regions: min_area ({r.min_area}) must not exceed max_area "
                             f"({r.max_area})")
        if r.method == "detector" and r.detector and str(r.detector).endswith(".pt"):
            require_extra("regions", "objective.terms.fastgoal.regions.detector (an ultralytics YOLO checkpoint)")
        if r.method == "detector" and r.detector and str(r.detector).endswith(".pt") \
                and not Path(r.detector).expanduser().is_file():
            raise FileNotFoundError(
                f"objective.terms.fastgoal.regions.detector: {r.detector!r} not found; download it from the "
                "ultralytics assets (https://github.com/ultralytics/assets/releases), use a YOLOS model (the paper's "
                "hustvl/yolos-base) or set it to null for the default regions only")
        if r.method == "detector" and not r.detector and not r.default:
            raise ValueError("objective.terms.fastgoal.regions: no detector and default: false leaves no candidate "
                             "region; set regions.detector or regions.default: true")
        self.weights: dict[str, float] = {"local": float(opts.weights.local), "tsl": float(opts.weights.tsl)}
        self.k = int(r.pairs)
        self.stats: dict[str, Any] = {}
        self.truncated_sentences = 0
        self.tsl_pairs = 0
        self.boxes_outside = 0

    # -- preprocessing (once per dataset, cached) ------------------------------------------------
    def proposer(self) -> Any:
        """The candidate generator of ``regions.method`` (:func:`finetune.preprocess.flism.build_proposer`)."""
        from finetune.preprocess.flism import build_proposer

        r = self.options.regions
        return build_proposer(r.method, detector=r.detector, threshold=r.threshold, classes=r.classes,
                              max_boxes=r.max_boxes, imgsz=r.imgsz, sam_checkpoint=r.sam_checkpoint,
                              min_area=r.min_area, max_area=r.max_area, points_per_side=r.points_per_side,
                              links=r.links, device=r.device)

    def attach_heads(self, model: Any) -> None:
        """``heads: new``: put :class:`losses.tsl.TSLHeads` into ``model.inference_modules`` (trained and saved
        with the model, :func:`~finetune.objectives.tsl_heads.attach_tsl_heads`); must run before the optimiser
        is built (``preprocess`` does)."""
        if self.options.heads == "new":
            attach_tsl_heads(model)

    def preprocess(self, dataset: Any, model: Any, *, cache_dir: str | None = None, log: Any = None) -> Any:
        """Add FLISM's pairs to ``dataset`` (paper III-A), computed once with the frozen model as loaded and cached
        (``finetune.data.cache``); fills :attr:`stats` (:func:`finetune.preprocess.flism.flism_stats`).

        ``regions.method: pairs`` reads the pairs of a file written by ``python -m finetune.preprocess.flism``
        instead, one example per image with the file's weights (:meth:`_read_pairs`).

        Raises:
            MissingCapabilityError: a model that does not describe its image transform (boxes cannot be mapped).
            DataError: (``data.on_error: raise``) pairs-file boxes outside what the model sees.

        Args:
            dataset: a ``datasets.Dataset`` with ``image`` and ``caption`` columns.
            model: the DualEncoder as loaded (before training).
            cache_dir: the recipe's ``data.cache_dir`` (steps go to ``<cache_dir>/preprocess``).
            log: a logger.
        """
        from finetune.preprocess.flism import FLISMMatcher, compute_flism, flism_stats

        log = log or logger
        self.attach_heads(model)
        for column in ("image", "caption"):
            if column not in dataset.column_names:
                raise ValueError(f"fastgoal preprocessing needs a {column!r} column; the dataset has "
                                 f"{dataset.column_names}")
        r = self.options.regions
        if r.method == "pairs":
            return self._read_pairs(dataset, model, log)
        if r.method == "detector" and not r.detector:
            log.warning("fastgoal: regions.detector is null, so the candidates are the default regions only (4 "
                        "quadrants + centre); set it to hustvl/yolos-base (the paper's) or an ultralytics .pt file")
        root = Path(cache_dir) / "preprocess" if cache_dir else None
        encoders = FrozenEncoders(model)
        was_training = model.training
        model.eval()
        try:
            matcher = FLISMMatcher(self.proposer(), encoders.images, encoders.texts, model_id=model_fingerprint(model),
                                   default=r.default, pairs=r.pairs, weighting=r.weighting,
                                   encode_batch_size=r.encode_batch_size, geometry=self._geometry(model)[0])
            columns = [c for c in ("image", "caption", "objects", "sentences") if c in dataset.column_names]
            pairs = compute_flism(dataset.select_columns(columns), matcher, cache_dir=root, batch_size=r.batch_size)
        finally:
            model.train(was_training)
        import datasets

        from finetune.preprocess.flism import flism_features

        names = list(flism_features())
        self.stats = {"flism": flism_stats(pairs)}
        s = self.stats["flism"]
        log.info("fastgoal FLISM: %d images, %.2f candidates per image (%.0f%% found, %.0f%% default), kept boxes "
                 "%.0f%% found; %d candidates clipped to and %d dropped outside the model's input; %d images without "
                 "a pair; mean similarity %s", s["images"], s["candidates_per_image"], 100 * s["found_share"],
                 100 * s["default_share"], 100 * s["kept_found_share"], s["candidates_clipped"],
                 s["candidates_dropped"], s["images_without_pairs"],
                 f"{s['mean_similarity']:.3f}" if s["mean_similarity"] is not None else "-")
        base = dataset.remove_columns([c for c in dataset.column_names if c in names])
        return datasets.concatenate_datasets([base, pairs.select_columns(names)], axis=1)

    def _read_pairs(self, dataset: Any, model: Any, log: Any) -> Any:
        """``regions.method: pairs``: the lines of a pairs file grouped into one example per image
        (:func:`finetune.preprocess.flism.pairs_by_image`); with the file's ``width`` / ``height`` columns,
        boxes that this model's input does not show are found here, before training (``data.on_error``)."""
        from finetune.preprocess.flism import pairs_by_image

        r = self.options.regions
        missing = [c for c in PAIR_COLUMNS if c not in dataset.column_names]
        if missing:
            raise ValueError(f"objective.terms.fastgoal.regions.method: pairs reads the columns {PAIR_COLUMNS} of "
                             f"a pairs file (python -m finetune.preprocess.flism IMAGES OUT); data.train has no "
                             f"{missing}: point data.train at such a file or use regions.method: detector")
        grouped, info = pairs_by_image(dataset, pairs=r.pairs)
        if info["most_pairs_per_image"] > r.pairs:
            log.warning("fastgoal: the pairs file holds up to %d pairs per image and regions.pairs keeps %d (the most "
                        "similar); set regions.pairs: %d to train on all of them (Table VIII)",
                        info["most_pairs_per_image"], r.pairs, info["most_pairs_per_image"])
        outside = self._pairs_outside(grouped, model) if {"width", "height"} <= set(grouped.column_names) else None
        if outside:
            shown = "; ".join(f"{i!r}: box {tuple(b)} of a {w}x{h} image" for i, b, w, h in outside[:3])
            message = (f"{len(outside)} pair boxes of the pairs file lie outside what {model.name_or_path!r} sees "
                       f"after its resize and centre crop (first: {shown}); the file was built with another model's "
                       f"geometry: build it again with --model {model.name_or_path}")
            if self.on_error == "raise":
                from finetune.data.images import DataError

                raise DataError(message + ", or set data.on_error: skip to leave such boxes out of TSL and count them")
            log.warning("fastgoal: %s; they leave TSL's image half (data.on_error: skip)", message)
        self.stats = {"flism": {"source": "pairs file", "images": info["images"], "lines": info["lines"],
                                "most_pairs_per_image": info["most_pairs_per_image"],
                                "pairs_outside_input": None if outside is None else len(outside)}}
        log.info("fastgoal: %d pairs of %d images from the pairs file (regions.pairs %d per image)", info["lines"],
                 info["images"], r.pairs)
        return grouped

    def _pairs_outside(self, grouped: Any, model: Any) -> list[tuple[str, list[float], int, int]]:
        """The kept pairs whose box ``model``'s input does not show: ``(image id, box, width, height)``."""
        params, n_patches = self._geometry(model)
        rows = grouped.select_columns(["id", "width", "height", "flism_pair_box", "flism_num_pairs"]).to_dict()
        out = []
        for i, w, h, boxes, m in zip(rows["id"], rows["width"], rows["height"], rows["flism_pair_box"],
                                     rows["flism_num_pairs"]):
            for box in boxes[:m]:
                if self._box_mask(box, (int(w), int(h)), params, n_patches) is None:
                    out.append((i, box, int(w), int(h)))
        return out

    def check_stream(self) -> None:
        """FLISM matches over the whole dataset with the frozen model before training: not on a stream."""
        raise ValueError("objective.terms.fastgoal: FLISM matches sentences to regions with the frozen model before "
                         "training, which a streamed data.train cannot do; write the pairs first (python -m "
                         "finetune.preprocess.flism IMAGES OUT) and train on that file (data.train: {name: jsonl, "
                         "path: OUT}, regions.method: pairs)")

    def shape_scan(self, dataset: Any, model: Any) -> Any:
        """Each example's pair sentences (the short texts, whose lengths plan the short passes), from the
        preprocessed columns, as :meth:`prepare` picks them."""
        from finetune.data.text import split_sentences

        from .shapes import SHORT, ShapeScan, dataset_columns

        cols = dataset_columns(dataset, ["caption", "flism_num_pairs", "flism_pair_sentence"])
        if cols is None:
            return None
        texts = []
        for caption, m, index in zip(cols["caption"], cols["flism_num_pairs"], cols["flism_pair_sentence"]):
            sentences = split_sentences(caption or "")
            picked = [0] * self.k if int(m) == 0 else [int(i) for i in index[: self.k]]  # as _pairs_of
            texts.append([sentences[i] for i in picked if 0 <= i < len(sentences)] or [""])
        return ShapeScan(texts={SHORT: texts})

    # -- data workers ----------------------------------------------------------------------------
    def _pairs_of(self, example: dict[str, Any]) -> tuple[list[list[float]], list[int], list[bool], list[float]]:
        """Boxes, sentence indices, validity and TSL weights of the example's ``k`` pairs."""
        k = self.k
        if "flism_pair_box" not in example:
            raise KeyError("the example has no FLISM pairs ('flism_pair_box'): run the objective's "
                           "preprocess(dataset, model) before batching")
        m = int(example["flism_num_pairs"])
        if m == 0:
            w, h = example["image"].size
            return [[0.0, 0.0, float(w), float(h)]] * k, [0] * k, [False] * k, [0.0] * k
        boxes = [list(map(float, b)) for b in example["flism_pair_box"][:k]]
        sentences = [int(s) for s in example["flism_pair_sentence"][:k]]
        # TSL weights: the pairs' weight shares times the image's pair count (uniform: all 1)
        weights = [float(w) * m for w in example["flism_pair_weight"][:k]]
        return boxes, sentences, [j < m for j in range(k)], weights

    def prepare(self, example: dict[str, Any]) -> dict[str, Any]:
        """Per example: the ``k`` pairs' crops (of the original image), sentences, sentence indices, boxes, the
        image size, which pairs are real and their TSL weights."""
        from finetune.data.text import split_sentences
        from finetune.preprocess.regions import crop_box

        image = example["image"]
        boxes, index, valid, weights = self._pairs_of(example)
        sentences = split_sentences(example["caption"] or "")
        texts = []
        for b, i in enumerate(index):
            if valid[b] and not 0 <= i < len(sentences):
                raise ValueError(f"example {example.get('id', '?')!r}: its FLISM pair names sentence {i}, but the "
                                 f"caption has {len(sentences)} sentences (split_sentences); the cached pairs do not "
                                 "belong to this caption: clear the preprocessing cache")
            texts.append(sentences[i] if 0 <= i < len(sentences) else "")
        return {"fg_crops": [crop_box(image, b) for b in boxes], "fg_sentences": texts, "fg_sentence_index": index,
                "fg_boxes": boxes, "fg_size": image.size, "fg_valid": valid, "fg_weight": weights,
                "fg_caption": example["caption"], "fg_id": str(example.get("id", "?"))}

    def _geometry(self, model: Any) -> tuple[dict[str, Any], int]:
        """``model``'s image transform (:meth:`DualEncoder.image_transform_params`) and its patch count ``N``
        (NaFlex: the padded count ``max_num_patches``)."""
        from finetune.preprocess.geometry import patch_count

        model.require("patch_geometry", "FAST-GOAL's TSL box pooling (eq. 9)")
        params = model.image_transform_params()
        n = int(params["max_num_patches"]) if params["mode"] == "naflex" else patch_count(params)
        return params, n

    def _box_mask(self, box: Any, size: tuple[int, int], params: dict[str, Any], n_patches: int) -> Tensor | None:
        """The ``(N,)`` patches a box in original pixels selects (appendix C), or None when it has no area or the
        model's resize and crop cut it away entirely."""
        from finetune.preprocess.geometry import box_patch_mask, naflex_grid

        x1, y1, x2, y2 = (float(v) for v in box)
        if not (x2 > x1 and y2 > y1):
            return None
        shape = naflex_grid(size[0], size[1], params) if params["mode"] == "naflex" else None
        return box_patch_mask((x1, y1, x2, y2), size, params, n_patches=n_patches, spatial_shape=shape,
                              cover=self.options.box_cover)

    def collate(self, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        """Batch the prepared fields into ``batch["fastgoal"]`` (tensors ``(B, k, ...)`` or ``(B, ...)``), on the
        CPU in the data workers, so that the training step only applies masks:

        - ``crop_inputs``: the ``B * k`` crops through ``model.preprocess_images``, as ``(B, k, ...)``;
        - ``sentence_input_ids`` / ``sentence_attention_mask``: ``(B, k, Ls)``, the sentences alone, Ls the
          longest of the batch (causal towers);
        - ``boxes`` ``(B, k, 4)`` in original pixels, ``image_size`` ``(B, 2)`` (width, height);
        - ``patch_masks`` ``(B, k, N)``: the patches of the global image each box selects (eq. 9, appendix C),
          through the model's resize and centre crop; ``box_valid`` ``(B, k)``: False for padded pairs and for
          boxes the crop cut away entirely (``data.on_error: skip``; ``raise`` stops here, naming the example);
        - ``spans`` ``(B, k, 2)`` and ``span_valid`` ``(B, k)``: each sentence's tokens in the caption's row of
          ``model.tokenize(captions)`` (:func:`~finetune.objectives.tsl_heads.tsl_sentence_spans`), invalid where
          truncation cut it;
        - ``pair_valid`` ``(B, k)`` (padded repeats and images without a pair: False), ``weight`` ``(B, k)``;
        - per example, as python ints (counted by :meth:`extra_features` without reading the device): ``pairs``,
          ``sentences_cut`` and ``boxes_outside``.

        Raises:
            DataError: ``data.on_error: raise`` and a box that the model's input does not show.
        """
        from .structxlip.batch import trim

        b, k = len(examples), self.k
        crops = [c for e in examples for c in e["fg_crops"]]
        crop_inputs = _stack_inputs(dict(model.preprocess_images(crops)), b, k)
        tok = model.tokenize([s for e in examples for s in e["fg_sentences"]])
        ids, mask = trim(tok.input_ids, tok.attention_mask, model)
        captions = [e["fg_caption"] for e in examples]
        pair_valid = torch.tensor([e["fg_valid"] for e in examples], dtype=torch.bool)
        spans = torch.zeros(b, k, 2, dtype=torch.long)
        span_valid = torch.zeros(b, k, dtype=torch.bool)
        truncated = torch.zeros(b, k, dtype=torch.bool)
        for j in range(k):
            index = [e["fg_sentence_index"][j] if e["fg_valid"][j] else None for e in examples]
            sel = tsl_sentence_spans(model, captions, index)
            spans[:, j] = sel.spans
            span_valid[:, j] = sel.valid
            truncated[:, j] = pair_valid[:, j] & ~sel.valid
        patch_masks, box_valid = self._patch_masks(examples, model, pair_valid)
        outside = pair_valid & ~box_valid
        return {"fastgoal": {
            "crop_inputs": crop_inputs,
            "sentence_input_ids": ids.reshape(b, k, -1),
            "sentence_attention_mask": mask.reshape(b, k, -1),
            "boxes": torch.tensor([e["fg_boxes"] for e in examples], dtype=torch.float64),
            "image_size": torch.tensor([list(e["fg_size"]) for e in examples], dtype=torch.long),
            "patch_masks": patch_masks,
            "box_valid": box_valid,
            "spans": spans,
            "span_valid": span_valid,
            "pair_valid": pair_valid,
            "weight": torch.tensor([e["fg_weight"] for e in examples], dtype=torch.float32),
            "pairs": pair_valid.sum(dim=1).tolist(),
            "sentences_cut": truncated.sum(dim=1).tolist(),
            "boxes_outside": outside.sum(dim=1).tolist(),
        }}

    def _patch_masks(self, examples: list[dict[str, Any]], model: Any, pair_valid: Tensor) -> tuple[Tensor, Tensor]:
        """``patch_masks`` ``(B, k, N)`` (each pair box's patches of the global image, eq. 9, appendix C) and
        ``box_valid`` ``(B, k)`` (False for padded pairs and boxes the model's crop cut away: ``data.on_error: skip``
        leaves them out of TSL's image half, ``raise`` stops naming the example)."""
        b, k = len(examples), self.k
        params, n_patches = self._geometry(model)
        patch_masks = torch.zeros(b, k, n_patches, dtype=torch.bool)
        box_valid = pair_valid.clone()
        for i, e in enumerate(examples):
            for j in range(k):
                if not e["fg_valid"][j]:
                    continue
                m = self._box_mask(e["fg_boxes"][j], tuple(e["fg_size"]), params, n_patches)
                if m is None:
                    if self.on_error == "raise":
                        from finetune.data.images import DataError
                        from finetune.preprocess.geometry import visible_box

                        w, h = e["fg_size"]
                        seen = ", ".join(f"{v:g}" for v in visible_box(w, h, params))
                        raise DataError(
                            f"training example id={e['fg_id']!r}: its FAST-GOAL pair box "
                            f"{tuple(round(float(v), 2) for v in e['fg_boxes'][j])} has no area inside what the "
                            f"model sees of its {w}x{h} image after the resize and centre crop ({seen}), so TSL has "
                            "no patch to pool (eq. 9). Build the pairs with this model (python -m "
                            "finetune.preprocess.flism ... --model <this model>), or set data.on_error: skip to leave "
                            "such boxes out of TSL and count them.")
                    box_valid[i, j] = False
                else:
                    patch_masks[i, j] = m
        return patch_masks, box_valid

    # -- model side ------------------------------------------------------------------------------
    def image_inputs(self, batch: Batch) -> dict[str, ImageRequest]:
        """``image`` (the global images, with patch states; merged with the base term's request: encoded once)
        and ``fastgoal_crop`` (the ``B * k`` crops, embeddings only)."""
        fg = batch["fastgoal"]
        return {"image": ImageRequest(batch["image_inputs"], states=True),
                "fastgoal_crop": ImageRequest({n: _flat(t) for n, t in fg["crop_inputs"].items()})}

    def text_inputs(self, batch: Batch) -> dict[str, TextRequest]:
        """``text`` (the captions, with token states; merged with the base term's request) and
        ``fastgoal_sentence`` (the ``B * k`` sentences alone, short texts: a pass of their own, at their bucket)."""
        fg = batch["fastgoal"]
        return {"text": TextRequest(batch["input_ids"], batch["attention_mask"], states=True),
                "fastgoal_sentence": TextRequest(_flat(fg["sentence_input_ids"]), _flat(fg["sentence_attention_mask"]),
                                                 short=True)}

    def _heads(self, model: Any) -> Any:
        if self.options.heads == "own":
            return model
        if TSL_HEADS_NAME not in model.inference_modules:
            raise RuntimeError("objective.terms.fastgoal.heads: new needs the TSL heads on the model: run the "
                               "objective's preprocess(dataset, model) (or FastGoalTerm.attach_heads(model)) before "
                               "building the optimiser")
        return model.inference_modules[TSL_HEADS_NAME]

    def extra_features(self, model: Any, batch: Batch, feats: Features) -> None:
        """The projected pooled states P_l (eqs. 9-10) and S_l (eqs. 7-8) of every pair, ``(B * k, D)``, with the
        pairs' validity and TSL weights. The global states are dropped from the features afterwards.

        Only masks built by :meth:`collate` are applied: nothing here reads a device value on the host."""
        from losses.tsl import pool_patch_states, pool_span_states

        fg = batch["fastgoal"]
        image_states = feats.pop("image_states")
        text_states = feats.pop("text_states")
        feats.pop("text_mask", None)
        device = image_states.device
        masks = fg["patch_masks"].to(device)
        if masks.shape[-1] != image_states.shape[1]:
            raise ValueError(f"fastgoal: the collated patch masks cover {masks.shape[-1]} patches but the image states "
                             f"hold {image_states.shape[1]}; the batch was collated for another model")
        pair_valid = fg["pair_valid"].to(device)
        box_valid = fg["box_valid"].to(device)
        span_valid = fg["span_valid"].to(device)
        heads = self._heads(model)
        pooled_image = pool_patch_states(image_states, masks, valid=box_valid, check=False)  # (B, k, W)
        pooled_text = pool_span_states(text_states, fg["spans"].to(device), valid=span_valid, check=False)
        feats["fastgoal_box"] = heads.project_image_states(_flat(pooled_image))
        feats["fastgoal_span"] = heads.project_text_states(_flat(pooled_text))
        feats["fastgoal_pair_valid"] = _flat(pair_valid)
        feats["fastgoal_box_valid"] = _flat(box_valid)
        feats["fastgoal_span_valid"] = _flat(span_valid)
        feats["fastgoal_weight"] = _flat(fg["weight"]).to(device)
        if torch.is_grad_enabled():  # once per trained batch: accumulation first encodes it without gradients
            self.tsl_pairs += sum(fg["pairs"])
            self.truncated_sentences += sum(fg["sentences_cut"])
            self.boxes_outside += sum(fg["boxes_outside"])

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        """The unweighted L_local (eq. 13) and L_TSL (eq. 14) from possibly merged features."""
        from losses.tsl import tsl_loss

        valid = feats["fastgoal_pair_valid"]
        out: dict[str, Tensor] = {}
        if self.weights["local"]:
            scale = scale_of(model.logit_scale, detach_params)
            out["local"] = clip_loss(feats["fastgoal_crop"], feats["fastgoal_sentence"], scale, valid=valid)
        if self.weights["tsl"]:
            # the pairs' weights (uniform: 1 for every real pair, so the plain eq. 14)
            out["tsl"] = tsl_loss(feats["fastgoal_box"], feats["fastgoal_crop"], feats["fastgoal_span"],
                                  feats["fastgoal_sentence"], form=self.options.tsl_form,
                                  box_valid=feats["fastgoal_box_valid"] & valid,
                                  span_valid=feats["fastgoal_span_valid"] & valid, weights=feats["fastgoal_weight"])
        return out

    # -- report ----------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """What a run's ``metrics.json`` records: options, weights, FLISM statistics, the pairs whose sentence
        truncation cut (dropped from TSL's text half) and those whose box the model's input does not show (dropped
        from TSL's image half), counted on this process over the trained batches."""
        return {"options": asdict(self.options), "weights": dict(self.weights), **self.stats,
                "tsl_pairs_seen": self.tsl_pairs, "tsl_sentences_cut_by_truncation": self.truncated_sentences,
                "tsl_boxes_outside_input": self.boxes_outside}

    def report_sections(self, run_dir: str | Path, dataset: Any, *, n: int = 6) -> list[str]:
        """The FLISM statistics and a preview of ``n`` training examples
        (:func:`~finetune.objectives.fastgoal_report.flism_report`)."""
        from .fastgoal_report import flism_report

        return flism_report(self, run_dir, dataset, n=n)

    def extra_repr(self) -> str:
        r = self.options.regions
        return (f"weights={self.weights}, tsl_form={self.options.tsl_form!r}, heads={self.options.heads!r}, "
                f"method={r.method!r}, default={r.default}, pairs={r.pairs}")


@register_term(TERM_NAME, FastGoalOptions, citation=Citation(
    "Choi, Jang and Eom, FAST-GOAL: Fast and Efficient Global-local Object Alignment Learning", tag="fast-goal"))
def build_fastgoal(options: FastGoalOptions | None) -> tuple[FastGoalTerm, dict[str, float]]:
    """Build the term of ``objective.terms.fastgoal`` and its weights (the Objective applies them)."""
    term = FastGoalTerm(options or FastGoalOptions())
    return term, term.weights
