"""FLISM: Fast Local Image-Sentence Matching (FAST-GOAL paper III-A, eqs. 1-2; Tables VII, VIII).

For every image-caption pair, once per dataset and cached (:func:`compute_flism`, like StructXLIP's regions):

1. sentences: :func:`finetune.data.text.split_sentences` of the caption, ``{T_l,i}_{i=1..M}``;
2. local image candidates ``{I_l,i}_{i=1..N}``: detector boxes (YOLOS through transformers,
   :class:`YolosDetector`, the paper's; an ultralytics YOLO checkpoint, :class:`UltralyticsDetector`) followed by
   the default regions -- the four quadrants and the centre box whose corners are the quadrants' midpoints,
   (W/4, H/4)-(3W/4, 3H/4) (``default=False`` is Table VII's "YOLO only"). GOAL's LISM for comparison
   (:class:`SamMasks`): SAM masks covering 1-80 % of the image, their tight boxes as candidates. A
   dataset's own boxes (:class:`DatasetBoxes`, the synthetic scenes' ``objects[].box``) can stand in for the
   detector, with or without the dataset's sentence links;
3. crops (of the original image, through the model's own processor) and sentences are encoded in batches by
   the frozen model as loaded before training (:class:`finetune.models.frozen.FrozenEncoders`); every sentence is
   matched to its most similar crop by cosine similarity (eqs. 1-2, :func:`match_sentences`);
4. of these matched pairs the single most similar one per image is kept (the paper's default), or the top 3 with
   ``uniform`` or similarity-proportional (``weighted``) weights (Table VIII, :func:`select_pairs`).

Candidates must survive the model's own resize and centre crop, since TSL pools the global image's patch states
inside the kept box (eq. 9): with the model's ``image_transform_params`` (:class:`FLISMMatcher` ``geometry``) every
candidate is clipped to the part of the image the network sees (:func:`finetune.preprocess.geometry.visible_box`;
CLIP's 224 centre crop of a 1000 x 500 image keeps x 250-750), and a candidate with less than a pixel left there is
dropped; both are counted per image (``flism_candidates_clipped``, ``flism_candidates_dropped``) and in the report.
The crops that are encoded for matching are the clipped boxes.

Choices where the paper is silent (the README lists them): an image without any candidate (no detection and
``default=False``, or none left after clipping) gets the visible image as its one candidate (counted as
``whole_image``); when an image has
fewer matched sentences than the pairs asked for, its last pair is repeated (with weight 0) so that every image has the same
number of pairs (``flism_num_pairs`` keeps the real count); ``weighted`` weights are the pairs' similarities
(clamped at 0) divided by their sum, ``uniform`` weights are ``1 / m`` for the image's m real pairs.

``python -m finetune.preprocess.flism IMAGES_AND_CAPTIONS OUT`` writes the global-local pairs of a dataset as a
jsonl (image, caption, box, sentence, sentence index, similarity), resumable (:func:`main`), the GLIT100k-style
construction of the paper's two-stage FAST-GOAL (Table V).

ultralytics lowers OpenCV's thread count when imported and sets torch's inside ``predict`` on a CPU (DESIGN 8):
every call into it runs inside :func:`finetune.preprocess.regions.preserve_thread_settings`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from finetune.data.text import split_sentences

from .cache import cached_map
from .regions import (
    Box,
    UltralyticsCheckpoint,
    _encode_in_batches,
    _file_sha256,
    _ultralytics_version,
    crop_box,
    default_regions,
    load_ultralytics,
    preserve_thread_settings,
)

__all__ = [
    "DatasetBoxes",
    "FLISMMatcher",
    "SamMasks",
    "UltralyticsDetector",
    "YolosDetector",
    "build_proposer",
    "candidate_boxes",
    "clip_to_input",
    "compute_flism",
    "flism_features",
    "flism_stats",
    "main",
    "mask_box",
    "pairs_by_image",
    "write_pairs",
    "match_sentences",
    "render_flism_preview",
    "select_pairs",
]

logger = logging.getLogger("xlipkit")

#: bump when the matching code changes its output (part of every cache key)
CODE_VERSION = "2"
#: the keys of ``image_transform_params`` that decide where a box lands (part of the cache key)
_GEOMETRY_KEYS = ("mode", "size", "crop", "patch_size", "crop_offset", "max_num_patches")
#: the paper's detector (YOLOS-Base, 127.8M parameters)
PAPER_DETECTOR = "hustvl/yolos-base"
#: GOAL's LISM: the mask-generation pipeline's default SAM checkpoint
LISM_SAM = "facebook/sam-vit-huge"
#: score threshold when none is given: YOLOS' model-card example (0.9) and ultralytics' ``predict`` default (0.25)
DEFAULT_THRESHOLDS = {"yolos": 0.9, "ultralytics": 0.25}
DETECTOR_HINT = ("the detector is a transformers YOLOS folder or hub id (e.g. hustvl/yolos-base, the paper's) or an "
                 "ultralytics YOLO checkpoint file ending in .pt (e.g. yolov8x.pt from the ultralytics assets)")


# -- candidate generators -----------------------------------------------------------------------------
def _folder_id(name: str) -> str:
    """A cache id of a model folder (its weights' sha256) or of a hub id (the id itself)."""
    path = Path(name).expanduser()
    if path.is_dir():
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        digest = hashlib.sha256()
        for file in weights:
            digest.update(_file_sha256(file).encode())
        return digest.hexdigest()[:16]
    return name


def _clip_box(box: Sequence[float], width: int, height: int) -> Box | None:
    x1, y1 = max(0.0, float(box[0])), max(0.0, float(box[1]))
    x2, y2 = min(float(width), float(box[2])), min(float(height), float(box[3]))
    if x2 - x1 < 1 or y2 - y1 < 1:
        return None
    return (x1, y1, x2, y2)


def clip_to_input(box: Sequence[float], window: Sequence[float]) -> Box | None:
    """``box`` clipped to ``window`` (both ``(x1, y1, x2, y2)`` pixels of the original image, the window from
    :func:`finetune.preprocess.geometry.visible_box`), or None when less than a pixel of it is left on either
    axis: the candidate does not survive the model's resize and crop."""
    x1, y1 = max(float(window[0]), float(box[0])), max(float(window[1]), float(box[1]))
    x2, y2 = min(float(window[2]), float(box[2])), min(float(window[3]), float(box[3]))
    if x2 - x1 < 1 or y2 - y1 < 1:
        return None
    return (x1, y1, x2, y2)


def _best_boxes(boxes: Iterable[Sequence[float]], width: int, height: int, max_boxes: int | None) -> list[Box]:
    """``boxes`` (best first) clipped to the image, degenerate ones and repeats dropped, at most ``max_boxes``."""
    out: list[Box] = []
    for raw in boxes:
        box = _clip_box(raw, width, height)
        if box is not None and box not in out:
            out.append(box)
        if max_boxes is not None and len(out) >= max_boxes:
            break
    return out


def _class_filter(classes: Sequence[str | int] | None, id2label: dict[int, str], where: str) -> set[int] | None:
    """Class names or ids -> a set of ids; a name the detector does not know is an error listing a few."""
    if not classes:
        return None
    by_name = {str(v).lower(): int(k) for k, v in id2label.items()}
    ids = set()
    for c in classes:
        if isinstance(c, int) or (isinstance(c, str) and c.isdigit()):
            ids.add(int(c))
        elif c.lower() in by_name:
            ids.add(by_name[c.lower()])
        else:
            known = ", ".join(sorted(by_name)[:12])
            raise ValueError(f"{where}: the detector has no class {c!r}; its classes include {known} (give names or "
                             "ids)")
    return ids


class YolosDetector:
    """Object boxes from YOLOS through transformers (FAST-GOAL III-A; the paper's ``hustvl/yolos-base``).

    Loads ``YolosForObjectDetection`` and its image processor from ``checkpoint`` (a hub id or a
    ``save_pretrained`` folder) and keeps the detections scoring at least ``threshold`` (after the processor's
    ``post_process_object_detection``, boxes in original pixels), of the classes in ``classes`` (names or ids;
    None: all), at most ``max_boxes`` per image by score.

    Args:
        checkpoint: hub id or folder.
        threshold: detection score threshold (default 0.9, YOLOS' model-card example).
        classes: class filter.
        max_boxes: most boxes per image (None: all).
        device: torch device (default: CUDA when available).
        batch_size: images per forward pass.
    """

    kind = "yolos"

    def __init__(self, checkpoint: str, *, threshold: float | None = None, classes: Sequence[str | int] | None = None,
                 max_boxes: int | None = None, device: str | None = None, batch_size: int = 8) -> None:
        self.checkpoint = str(checkpoint)
        self.threshold = DEFAULT_THRESHOLDS["yolos"] if threshold is None else float(threshold)
        self.classes = list(classes) if classes else None
        self.max_boxes = max_boxes
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size
        self._model: Any = None
        self._processor: Any = None
        self._ids: set[int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_model"] = state["_processor"] = None
        return state

    def params(self) -> dict[str, Any]:
        """Cache-key parameters (the checkpoint by content when it is a folder)."""
        return {"detector": "yolos", "checkpoint": _folder_id(self.checkpoint), "threshold": self.threshold,
                "classes": self.classes, "max_boxes": self.max_boxes}

    def _load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoImageProcessor, YolosForObjectDetection

        try:
            self._model = YolosForObjectDetection.from_pretrained(self.checkpoint).to(self.device).eval()
            self._processor = AutoImageProcessor.from_pretrained(self.checkpoint)
        except (OSError, ValueError) as err:
            raise ValueError(f"regions.detector: could not load {self.checkpoint!r} as a YOLOS detector ({err}); "
                             f"{DETECTOR_HINT}") from err
        self._ids = _class_filter(self.classes, self._model.config.id2label, "regions.classes")

    @torch.no_grad()
    def __call__(self, images: Sequence[Image.Image]) -> list[list[Box]]:
        """Boxes ``(x1, y1, x2, y2)`` in original pixels for each RGB image, best score first."""
        self._load()
        out: list[list[Box]] = []
        for i in range(0, len(images), self.batch_size):
            batch = list(images[i: i + self.batch_size])
            inputs = self._processor(images=batch, return_tensors="pt").to(self.device)
            outputs = self._model(**inputs)
            sizes = [(im.height, im.width) for im in batch]
            results = self._processor.post_process_object_detection(outputs, threshold=self.threshold,
                                                                     target_sizes=sizes)
            for im, res in zip(batch, results):
                order = res["scores"].argsort(descending=True).tolist()
                kept = [j for j in order if self._ids is None or int(res["labels"][j]) in self._ids]
                out.append(_best_boxes((res["boxes"][j].tolist() for j in kept), im.width, im.height,
                                       self.max_boxes))
        return out


class UltralyticsDetector(UltralyticsCheckpoint):
    """Object boxes from an ultralytics YOLO checkpoint (``detector: yolov8x.pt``), an option to YOLOS.

    torch's and OpenCV's thread counts are restored after every call (DESIGN 8).

    Args:
        checkpoint: path of the ``.pt`` file.
        threshold: confidence threshold (default 0.25, ultralytics' own).
        classes: class filter (names or ids), max_boxes: most boxes per image, imgsz: inference size,
        device: ultralytics device string, batch_size: images per ``predict`` call.
    """

    kind = "ultralytics"

    def __init__(self, checkpoint: str | Path, *, threshold: float | None = None,
                 classes: Sequence[str | int] | None = None, max_boxes: int | None = None, imgsz: int = 640,
                 device: str | None = None, batch_size: int = 16) -> None:
        self.checkpoint = Path(checkpoint).expanduser()
        if not self.checkpoint.is_file():
            raise FileNotFoundError(f"regions.detector: {str(checkpoint)!r} not found; download it from the "
                                    "ultralytics assets (https://github.com/ultralytics/assets/releases) or "
                                    f"use a YOLOS model ({DETECTOR_HINT})")
        self.threshold = DEFAULT_THRESHOLDS["ultralytics"] if threshold is None else float(threshold)
        self.classes = list(classes) if classes else None
        self.max_boxes = max_boxes
        self.imgsz = imgsz
        self.device = device
        self.batch_size = batch_size
        self._ids: set[int] | None = None

    def params(self) -> dict[str, Any]:
        """Cache-key parameters (the checkpoint by content)."""
        return {"detector": "ultralytics", "checkpoint_sha256": self.checkpoint_sha256(), "threshold": self.threshold,
                "classes": self.classes, "max_boxes": self.max_boxes, "imgsz": self.imgsz,
                "ultralytics": _ultralytics_version()}

    def _load(self) -> Any:
        if self._model is None:
            model = load_ultralytics(self.checkpoint, "YOLO", "DetectionModel", exact=True, hint=DETECTOR_HINT,
                                     prefix="regions.detector: ")
            self._ids = _class_filter(self.classes, dict(model.names), "regions.classes")
            self._model = model
        return self._model

    def __call__(self, images: Sequence[Image.Image]) -> list[list[Box]]:
        """Boxes ``(x1, y1, x2, y2)`` in original pixels for each RGB image, best score first."""
        out: list[list[Box]] = []
        with preserve_thread_settings():
            model = self._load()
            for i in range(0, len(images), self.batch_size):
                batch = list(images[i: i + self.batch_size])
                results = model.predict(batch, imgsz=self.imgsz, conf=self.threshold, device=self.device,
                                        classes=sorted(self._ids) if self._ids is not None else None, verbose=False)
                for im, res in zip(batch, results):
                    xyxy = res.boxes.xyxy.float().cpu()
                    order = res.boxes.conf.float().cpu().argsort(descending=True).tolist()
                    out.append(_best_boxes((xyxy[j].tolist() for j in order), im.width, im.height, self.max_boxes))
        return out


def mask_box(mask: Tensor) -> Box | None:
    """The tight box of a boolean mask ``(H, W)``: ``(x_min, y_min, x_max + 1, y_max + 1)`` in pixel edges (GOAL's
    LISM crop ``[y_min:y_max+1, x_min:x_max+1]``), None for an empty mask."""
    ys, xs = torch.nonzero(mask, as_tuple=True)
    if not len(xs):
        return None
    return (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))


class SamMasks:
    """GOAL's LISM candidates (``regions.method: sam``): SAM automatic mask generation through transformers'
    ``mask-generation`` pipeline; masks covering ``min_area``-``max_area`` of the image (GOAL: 1-80 %), their
    tight boxes (:func:`mask_box`) as candidates, largest first, duplicates dropped.

    Args:
        checkpoint: SAM hub id or folder (GOAL: the pipeline's default, ``facebook/sam-vit-huge``).
        min_area, max_area: kept area share.
        points_per_side: the pipeline's ``points_per_crop`` (its default, 64, GOAL's).
        points_per_batch: points per forward pass (GOAL: 128).
        max_boxes: most boxes per image (None: all).
        pred_iou_thresh, stability_score_thresh: the pipeline's mask filters (its defaults, GOAL's).
        device: torch device.
    """

    kind = "sam"

    def __init__(self, checkpoint: str = LISM_SAM, *, min_area: float = 0.01, max_area: float = 0.8,
                 points_per_side: int = 64, points_per_batch: int = 128, max_boxes: int | None = None,
                 pred_iou_thresh: float = 0.88, stability_score_thresh: float = 0.95, device: str | None = None) -> None:
        if not 0 <= min_area <= max_area <= 1:
            raise ValueError(f"regions.min_area and regions.max_area must satisfy 0 <= min <= max <= 1, got "
                             f"{min_area} and {max_area}")
        self.checkpoint = str(checkpoint)
        self.min_area, self.max_area = float(min_area), float(max_area)
        self.points_per_side, self.points_per_batch = int(points_per_side), int(points_per_batch)
        self.max_boxes = max_boxes
        self.pred_iou_thresh, self.stability_score_thresh = float(pred_iou_thresh), float(stability_score_thresh)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._pipe: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pipe"] = None
        return state

    def params(self) -> dict[str, Any]:
        """Cache-key parameters."""
        return {"detector": "sam", "checkpoint": _folder_id(self.checkpoint), "min_area": self.min_area,
                "max_area": self.max_area, "points_per_side": self.points_per_side, "max_boxes": self.max_boxes,
                "pred_iou_thresh": self.pred_iou_thresh, "stability_score_thresh": self.stability_score_thresh}

    def _load(self) -> Any:
        if self._pipe is None:
            from transformers import pipeline

            try:
                self._pipe = pipeline("mask-generation", model=self.checkpoint, device=self.device)
            except (OSError, ValueError) as err:
                raise ValueError(f"regions.sam_checkpoint: could not load {self.checkpoint!r} as a SAM model "
                                 f"({err}); give a transformers SAM hub id or folder (GOAL: {LISM_SAM})") from err
        return self._pipe

    def boxes_of_masks(self, masks: Sequence[Tensor], width: int, height: int) -> list[Box]:
        """Tight boxes of the masks whose area share is in ``[min_area, max_area]``, largest mask first."""
        area = float(width * height)
        kept = []
        for m in masks:
            m = torch.as_tensor(m).bool()
            share = float(m.sum()) / area
            if self.min_area <= share <= self.max_area:
                box = mask_box(m)
                if box is not None:
                    kept.append((share, box))
        boxes: list[Box] = []
        for _, box in sorted(kept, key=lambda sb: -sb[0]):
            if box not in boxes:
                boxes.append(box)
            if self.max_boxes is not None and len(boxes) >= self.max_boxes:
                break
        return boxes

    def __call__(self, images: Sequence[Image.Image]) -> list[list[Box]]:
        """Candidate boxes of each RGB image."""
        pipe = self._load()
        out = []
        for im in images:
            result = pipe(im, points_per_crop=self.points_per_side, points_per_batch=self.points_per_batch,
                          pred_iou_thresh=self.pred_iou_thresh, stability_score_thresh=self.stability_score_thresh)
            out.append(self.boxes_of_masks(result["masks"], im.width, im.height))
        return out


class DatasetBoxes:
    """Candidates a dataset provides: each example's ``objects[].box`` (the synthetic scenes'), in pixels of the
    original image, so that FLISM runs without a detector. With ``links`` the dataset's ``objects[].sentence_index``
    fixes which sentence each box is paired with (:class:`FLISMMatcher`); without, the boxes are matched to
    sentences by the frozen model like detections."""

    kind = "dataset"

    def __init__(self, *, links: bool = True, column: str = "objects") -> None:
        self.links = links
        self.column = column

    def params(self) -> dict[str, Any]:
        """Cache-key parameters."""
        return {"detector": "dataset", "links": self.links, "column": self.column}

    def boxes(self, batch: dict[str, list[Any]], images: Sequence[Image.Image]) -> list[list[Box]]:
        """Each example's object boxes (clipped to the image)."""
        if self.column not in batch:
            raise KeyError(f"regions.method: dataset needs an {self.column!r} column with boxes (as the synthetic "
                           f"scenes have); the data has {sorted(batch)}: use regions.method: detector")
        out = []
        for objects, im in zip(batch[self.column], images):
            boxes = []
            for o in objects or []:  # kept in the objects' order (sentence links index them), even if degenerate
                b = [float(v) for v in o["box"]]
                boxes.append((max(0.0, b[0]), max(0.0, b[1]), min(float(im.width), b[2]), min(float(im.height), b[3])))
            out.append(boxes)
        return out


def build_proposer(method: str, *, detector: str | None = None, threshold: float | None = None,
                   classes: Sequence[str | int] | None = None, max_boxes: int | None = None, imgsz: int = 640,
                   sam_checkpoint: str = LISM_SAM, min_area: float = 0.01, max_area: float = 0.8,
                   points_per_side: int = 64, links: bool = True, device: str | None = None) -> Any:
    """The candidate generator of ``regions.method``: ``detector`` (YOLOS for a hub id or folder, ultralytics for
    a ``.pt`` file, None: no detector, the default regions only), ``sam`` (GOAL's LISM) or ``dataset``."""
    if method == "detector":
        if detector is None:
            return None
        if str(detector).endswith(".pt"):
            return UltralyticsDetector(detector, threshold=threshold, classes=classes, max_boxes=max_boxes,
                                       imgsz=imgsz, device=device)
        return YolosDetector(detector, threshold=threshold, classes=classes, max_boxes=max_boxes, device=device)
    if method == "sam":
        return SamMasks(sam_checkpoint, min_area=min_area, max_area=max_area, points_per_side=points_per_side,
                        max_boxes=max_boxes, device=device)
    if method == "dataset":
        return DatasetBoxes(links=links)
    raise ValueError(f"regions.method must be detector, sam or dataset, got {method!r}")


def candidate_boxes(width: int, height: int, found: Sequence[Box], *, default: bool = True
                    ) -> tuple[list[Box], list[str]]:
    """The candidates of one image: ``found`` (detector / SAM / dataset boxes) then, with ``default``, the four
    quadrants and the centre box (III-A); the whole image when there is none at all.

    Returns:
        ``(boxes, kinds)``: boxes ``(x1, y1, x2, y2)`` in pixels and, per box, ``"found"``, ``"default"`` or
        ``"whole_image"``.
    """
    boxes = [tuple(float(v) for v in b) for b in found]
    kinds = ["found"] * len(boxes)
    if default:
        for b in default_regions(width, height):
            boxes.append(b)
            kinds.append("default")
    if not boxes:
        boxes, kinds = [(0.0, 0.0, float(width), float(height))], ["whole_image"]
    return boxes, kinds  # type: ignore[return-value]


# -- matching ---------------------------------------------------------------------------------------
def match_sentences(sentence_embeds: Tensor, crop_embeds: Tensor) -> tuple[Tensor, Tensor]:
    """Every sentence's most similar crop (FAST-GOAL eqs. 1-2 and the max-similarity matching of III-A).

    Args:
        sentence_embeds: ``(M, D)`` t_l,i^cls of the image's sentences (raw; normalised here).
        crop_embeds: ``(N, D)`` v_l,i^cls of its candidate crops.

    Returns:
        ``(index (M,) int64, similarity (M,) float32)``: the best crop of each sentence and its cosine.
    """
    if sentence_embeds.ndim != 2 or crop_embeds.ndim != 2 or sentence_embeds.shape[1] != crop_embeds.shape[1]:
        raise ValueError(f"match_sentences expects (M, D) sentences and (N, D) crops, got "
                         f"{tuple(sentence_embeds.shape)} and {tuple(crop_embeds.shape)}")
    if not crop_embeds.shape[0]:
        raise ValueError("match_sentences: an image needs at least one candidate crop")
    sims = F.normalize(sentence_embeds.float(), dim=-1) @ F.normalize(crop_embeds.float(), dim=-1).T
    best, index = sims.max(dim=1)
    return index, best


@dataclass
class Pair:
    """One kept global-local pair: ``sentence`` index into ``split_sentences(caption)``, ``candidate`` index into
    the image's candidates, their cosine ``similarity`` and the pair's loss ``weight``."""

    sentence: int
    candidate: int
    similarity: float
    weight: float


def select_pairs(sentences: Sequence[int], candidates: Sequence[int], similarities: Sequence[float], *,
                 pairs: int = 1, weighting: str = "uniform") -> list[Pair]:
    """The kept pairs of one image from its matched (sentence, crop) pairs: the ``pairs`` most similar (paper:
    the single best; Table VIII: top 3), padded to exactly ``pairs`` by repeating the last one.

    Args:
        sentences, candidates, similarities: the matched pairs (one per sentence).
        pairs: how many to keep.
        weighting: ``uniform`` (each ``1 / m`` for the m real pairs) or ``weighted`` (similarity / sum of the
            kept similarities, negative similarities counted as 0; uniform when all are <= 0).

    Returns:
        ``pairs`` :class:`Pair` s, most similar first (the real ones, then repeats of the last with weight 0),
        or ``[]`` when there is no matched pair.
    """
    if pairs < 1:
        raise ValueError(f"regions.pairs must be >= 1, got {pairs}")
    if weighting not in ("uniform", "weighted"):
        raise ValueError(f"regions.weighting must be uniform or weighted, got {weighting!r}")
    order = sorted(range(len(sentences)), key=lambda i: (-similarities[i], sentences[i]))[:pairs]
    if not order:
        return []
    sims = [float(similarities[i]) for i in order]
    positive = [max(s, 0.0) for s in sims]
    if weighting == "weighted" and sum(positive) > 0:
        weights = [p / sum(positive) for p in positive]
    else:
        weights = [1.0 / len(order)] * len(order)
    kept = [Pair(int(sentences[i]), int(candidates[i]), s, w) for i, s, w in zip(order, sims, weights)]
    return kept + [Pair(kept[-1].sentence, kept[-1].candidate, kept[-1].similarity, 0.0)] * (pairs - len(kept))


def flism_features() -> datasets.Features:
    """The ``datasets`` features of the columns :class:`FLISMMatcher` adds (per image)."""
    floats = datasets.Sequence(datasets.Value("float32"))
    ints = datasets.Sequence(datasets.Value("int32"))
    return datasets.Features({
        "flism_candidates": datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
        "flism_candidate_kinds": datasets.Sequence(datasets.Value("string")),
        "flism_num_candidates": datasets.Value("int32"),
        "flism_candidates_clipped": datasets.Value("int32"),
        "flism_candidates_dropped": datasets.Value("int32"),
        "flism_sentences": datasets.Sequence(datasets.Value("string")),
        "flism_sentence_match": ints,
        "flism_sentence_similarity": floats,
        "flism_pair_sentence": ints,
        "flism_pair_candidate": ints,
        "flism_pair_box": datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
        "flism_pair_similarity": floats,
        "flism_pair_weight": floats,
        "flism_num_pairs": datasets.Value("int32"),
    })


def _linked(objects: list[dict[str, Any]] | None, sentences: list[str], dataset_sentences: list[str] | None
            ) -> list[tuple[int, int]]:
    """``(sentence index into sentences, object index)`` of each object whose ``sentence_index`` (into the
    dataset's own ``sentences`` when it has them, else into ``sentences``) names one of ``sentences``."""
    source = dataset_sentences if dataset_sentences is not None else sentences
    out = []
    for c, o in enumerate(objects or []):
        s = o.get("sentence_index")
        if s is None or not 0 <= int(s) < len(source) or source[int(s)] not in sentences:
            continue
        out.append((sentences.index(source[int(s)]), c))
    return out


class FLISMMatcher:
    """Batched ``datasets.map`` function: FLISM's candidates, sentence matches and kept pairs of each example.

    Args:
        proposer: ``images -> boxes per image`` (:class:`YolosDetector`, :class:`UltralyticsDetector`,
            :class:`SamMasks`), a :class:`DatasetBoxes`, or None (the default regions only).
        encode_images: ``list[PIL.Image] -> (n, D)`` under the frozen model as loaded (crops through its processor).
        encode_texts: ``list[str] -> (m, D)`` under the same model.
        model_id: names the frozen model (``finetune.models.frozen.model_fingerprint``), part of the cache key.
        default: add the four quadrants and the centre box (Table VII).
        pairs, weighting: kept pairs per image (:func:`select_pairs`).
        encode_batch_size: crops / sentences per encoder call.
        geometry: the training model's ``image_transform_params()``: candidates are clipped to the part of the
            image its input shows, and those with nothing left there are dropped (both counted); None: the
            whole image counts as seen.

    ``fn(batch)`` returns the columns of :func:`flism_features` per example: the candidates ``(N, 4)`` in original
    pixels (clipped to what the model sees) and their kinds, how many were clipped and dropped, the sentences,
    each sentence's best candidate and cosine (``-1`` / NaN for a sentence without one, e.g. unlinked under
    dataset links), and the kept pairs (sentence index, candidate index, box, similarity, weight).
    """

    def __init__(self, proposer: Any, encode_images: Callable[[list[Image.Image]], Tensor],
                 encode_texts: Callable[[list[str]], Tensor], *, model_id: str, default: bool = True, pairs: int = 1,
                 weighting: str = "uniform", encode_batch_size: int = 64,
                 geometry: dict[str, Any] | None = None) -> None:
        if not model_id:
            raise ValueError("FLISMMatcher needs `model_id` (the frozen model's fingerprint) for its cache key")
        select_pairs([], [], [], pairs=pairs, weighting=weighting)  # validates both
        self.proposer = proposer
        self.encode_images = encode_images
        self.encode_texts = encode_texts
        self.model_id = model_id
        self.default = default
        self.pairs = pairs
        self.weighting = weighting
        self.encode_batch_size = encode_batch_size
        self.geometry = dict(geometry) if geometry is not None else None
        self.linked = isinstance(proposer, DatasetBoxes) and proposer.links

    def params(self) -> dict[str, Any]:
        """Everything that determines the output, for :func:`finetune.preprocess.cache.cached_map`."""
        proposer = self.proposer.params() if self.proposer is not None else {"detector": None}
        geometry = {k: self.geometry.get(k) for k in _GEOMETRY_KEYS} if self.geometry is not None else None
        return {"proposer": proposer, "model_id": self.model_id, "default": self.default and not self.linked,
                "pairs": self.pairs, "weighting": self.weighting, "geometry": geometry}

    def window(self, image: Image.Image) -> Box:
        """The part of ``image`` the model's input shows (the whole image without a ``geometry``)."""
        if self.geometry is None:
            return (0.0, 0.0, float(image.width), float(image.height))
        from .geometry import visible_box

        return visible_box(image.width, image.height, self.geometry)

    def survivors(self, image: Image.Image, boxes: Sequence[Box], kinds: Sequence[str]
                  ) -> tuple[list[Box], list[str], dict[int, int], int, int]:
        """The candidates the model's input shows, clipped to it: ``(boxes, kinds, old index -> new index,
        clipped count, dropped count)``."""
        window = self.window(image)
        kept: list[Box] = []
        kept_kinds: list[str] = []
        index: dict[int, int] = {}
        clipped = dropped = 0
        for c, (box, kind) in enumerate(zip(boxes, kinds)):
            inside = clip_to_input(box, window)
            if inside is None:
                dropped += 1
                continue
            clipped += inside != tuple(float(v) for v in box)
            index[c] = len(kept)
            kept.append(inside)
            kept_kinds.append(kind)
        return kept, kept_kinds, index, clipped, dropped

    def propose(self, batch: dict[str, list[Any]], images: list[Image.Image]) -> list[list[Box]]:
        """The proposer's boxes of each image (none without a proposer)."""
        if self.proposer is None:
            return [[] for _ in images]
        if isinstance(self.proposer, DatasetBoxes):
            return self.proposer.boxes(batch, images)
        found = self.proposer(images)
        if len(found) != len(images):
            raise ValueError(f"the detector returned {len(found)} results for {len(images)} images")
        return found

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for column in ("image", "caption"):
            if column not in batch:
                raise KeyError(f"FLISM needs the column {column!r}; the batch has {sorted(batch)}")
        images = [im if im.mode == "RGB" else im.convert("RGB") for im in batch["image"]]
        found = self.propose(batch, images)
        raw = [candidate_boxes(im.width, im.height, f, default=self.default and not self.linked)
               for im, f in zip(images, found)]
        if self.linked:  # only the dataset's boxes: an image without objects has nothing to pair
            raw = [(b, k) if f else ([], []) for (b, k), f in zip(raw, found)]
        # only what survives the model's resize and crop: TSL pools the global image's patches inside the box
        cands, remaps, clipped, dropped = [], [], [], []
        for im, (boxes, kinds) in zip(images, raw):
            kept, kept_kinds, remap, n_clipped, n_dropped = self.survivors(im, boxes, kinds)
            if not kept and not self.linked:
                kept, kept_kinds = [self.window(im)], ["whole_image"]
            cands.append((kept, kept_kinds))
            remaps.append(remap)
            clipped.append(n_clipped)
            dropped.append(n_dropped)
        sentences = [split_sentences(c or "") for c in batch["caption"]]
        crops = [crop_box(im, box) for im, (boxes, _) in zip(images, cands) for box in boxes]
        crop_emb = _encode_in_batches(self.encode_images, crops, self.encode_batch_size)
        sent_emb = _encode_in_batches(self.encode_texts, [s for ss in sentences for s in ss], self.encode_batch_size)
        out: dict[str, list[Any]] = {name: [] for name in flism_features()}
        r0 = s0 = 0
        for i, ((boxes, kinds), sents) in enumerate(zip(cands, sentences)):
            r1, s1 = r0 + len(boxes), s0 + len(sents)
            match = [-1] * len(sents)
            sims = [math.nan] * len(sents)
            if sents and boxes:
                if self.linked:
                    dataset_sentences = batch["sentences"][i] if "sentences" in batch else None
                    for s, obj in _linked(batch["objects"][i], sents, dataset_sentences):
                        c = remaps[i].get(obj)
                        if c is None:  # the object's box is cut away by the model's crop
                            continue
                        cos = F.cosine_similarity(sent_emb[s0 + s], crop_emb[r0 + c], dim=0)
                        match[s], sims[s] = c, float(cos)
                else:
                    index, best = match_sentences(sent_emb[s0:s1], crop_emb[r0:r1])
                    match, sims = index.tolist(), best.tolist()
            matched = [s for s in range(len(sents)) if match[s] >= 0]
            kept = select_pairs(matched, [match[s] for s in matched], [sims[s] for s in matched],
                                pairs=self.pairs, weighting=self.weighting)
            out["flism_candidates"].append([list(b) for b in boxes])
            out["flism_candidate_kinds"].append(list(kinds))
            out["flism_num_candidates"].append(len(boxes))
            out["flism_candidates_clipped"].append(clipped[i])
            out["flism_candidates_dropped"].append(dropped[i])
            out["flism_sentences"].append(sents)
            out["flism_sentence_match"].append(match)
            out["flism_sentence_similarity"].append(sims)
            out["flism_pair_sentence"].append([p.sentence for p in kept])
            out["flism_pair_candidate"].append([p.candidate for p in kept])
            out["flism_pair_box"].append([list(boxes[p.candidate]) for p in kept])
            out["flism_pair_similarity"].append([p.similarity for p in kept])
            out["flism_pair_weight"].append([p.weight for p in kept])
            out["flism_num_pairs"].append(min(len(matched), self.pairs))
            r0, s0 = r1, s1
        return out


def compute_flism(dataset: datasets.Dataset, matcher: FLISMMatcher, *, cache_dir: str | os.PathLike[str] | None = None,
                  batch_size: int = 16, num_proc: int | None = None) -> datasets.Dataset:
    """``dataset`` plus the :class:`FLISMMatcher` columns, computed once and cached (keyed by the dataset, the
    detector, the frozen model and the options)."""
    return cached_map(dataset, matcher, params=matcher.params(), name="flism", cache_dir=cache_dir,
                      code_version=CODE_VERSION, batched=True, batch_size=batch_size, num_proc=num_proc,
                      features=flism_features(), desc="FAST-GOAL FLISM")


# -- statistics and preview -------------------------------------------------------------------------
def flism_stats(dataset: datasets.Dataset, *, bins: int = 10) -> dict[str, Any]:
    """Statistics of a FLISM-processed dataset for the run report: images, candidates per image, the share of
    found (detector / SAM / dataset) vs default boxes among the candidates and among the kept pairs' boxes,
    images without a found box, images with the whole image as their only candidate, images without a pair,
    candidates clipped to and dropped outside what the model's input shows, and a histogram of the kept pairs'
    similarities (``bins`` equal bins over [-1, 1])."""
    kinds = dataset["flism_candidate_kinds"]
    n = max(1, len(kinds))
    all_kinds = [k for ks in kinds for k in ks]
    kept_kinds = [ks[c] for ks, cs, m in zip(kinds, dataset["flism_pair_candidate"], dataset["flism_num_pairs"])
                  for c in cs[:m]]
    sims = [s for ss, m in zip(dataset["flism_pair_similarity"], dataset["flism_num_pairs"]) for s in ss[:m]]
    counts = [0] * bins
    for s in sims:
        counts[min(bins - 1, max(0, int((s + 1) / 2 * bins)))] += 1
    edges = [round(-1 + 2 * i / bins, 4) for i in range(bins + 1)]

    def share(values: list[str], kind: str) -> float:
        return sum(1 for v in values if v == kind) / max(1, len(values))

    return {
        "images": len(kinds),
        "candidates_per_image": len(all_kinds) / n,
        "found_share": share(all_kinds, "found"),
        "default_share": share(all_kinds, "default"),
        "kept_found_share": share(kept_kinds, "found"),
        "kept_default_share": share(kept_kinds, "default"),
        "images_without_found_boxes": sum(1 for ks in kinds if "found" not in ks),
        "whole_image_fallbacks": sum(1 for ks in kinds if ks == ["whole_image"]),
        "images_without_pairs": sum(1 for m in dataset["flism_num_pairs"] if m == 0),
        "candidates_clipped": sum(dataset["flism_candidates_clipped"]),
        "candidates_dropped": sum(dataset["flism_candidates_dropped"]),
        "images_with_dropped_candidates": sum(1 for d in dataset["flism_candidates_dropped"] if d),
        "sentences_per_image": sum(len(s) for s in dataset["flism_sentences"]) / n,
        "mean_similarity": sum(sims) / len(sims) if sims else None,
        "similarity_histogram": {"edges": edges, "counts": counts},
    }


def render_flism_preview(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "FLISM pairs") -> Path:
    """Draw each example (image with its candidate boxes dashed, found boxes in blue, defaults in grey, the kept
    pairs' boxes in red) beside its caption's kept sentence and similarity; written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt

    from finetune.data.images import read_image
    from finetune.preview import save_png_atomic

    rows = list(rows)
    fig, axes = plt.subplots(max(1, len(rows)), 2, figsize=(10, 2.6 * max(1, len(rows))), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 2.2]})
    for (ax_im, ax_text), row in zip(axes, rows):
        image = read_image(row["image"])
        ax_im.imshow(image)
        ax_im.axis("off")
        for box, kind in zip(row["flism_candidates"], row["flism_candidate_kinds"]):
            colour = "#4363d8" if kind == "found" else "#888888"
            ax_im.add_patch(patches.Rectangle((box[0], box[1]), box[2] - box[0], box[3] - box[1], fill=False,
                                              lw=0.8, ls="--", ec=colour))
        lines = [str(row.get("id", ""))]
        for j in range(int(row["flism_num_pairs"])):
            box = row["flism_pair_box"][j]
            ax_im.add_patch(patches.Rectangle((box[0], box[1]), box[2] - box[0], box[3] - box[1], fill=False,
                                              lw=2.0, ec="#e6194b"))
            sentence = row["flism_sentences"][row["flism_pair_sentence"][j]]
            lines.append(f"pair {j + 1} (cos {row['flism_pair_similarity'][j]:.3f}, weight "
                         f"{row['flism_pair_weight'][j]:.2f}): {sentence}")
        found = sum(1 for k in row["flism_candidate_kinds"] if k == "found")
        lines.append(f"{row['flism_num_candidates']} candidates ({found} found, dashed blue; defaults dashed grey); "
                     "kept box in red")
        import textwrap

        wrapped = [w for line in lines for w in (textwrap.wrap(line, 90) or [""])]
        ax_text.axis("off")
        ax_text.text(0, 1, "\n".join(wrapped), va="top", ha="left", fontsize=7.5, family="DejaVu Sans")
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return save_png_atomic(fig, path, dpi=110)


# -- pairs as a dataset (GLIT100k-style; FAST-GOAL†† two-stage training) -------------------------------
_TABLE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}


def _source_spec(value: str) -> dict[str, Any]:
    """IMAGES_AND_CAPTIONS -> a data source spec: a jsonl / csv / parquet file or folder, an image folder, or a
    registered source as a name (``synthetic``) or a YAML mapping (``{name: synthetic, size: 64}``)."""
    import yaml

    path = Path(value).expanduser()
    if path.is_file():
        name = _TABLE_SUFFIXES.get(path.suffix.lower())
        if name is None:
            raise ValueError(f"{value!r}: a file of image-caption pairs must be .jsonl, .json, .csv or .parquet")
        return {"name": name, "path": str(path)}
    if path.is_dir():
        found = {_TABLE_SUFFIXES[p.suffix.lower()] for p in path.iterdir() if p.suffix.lower() in _TABLE_SUFFIXES}
        if len(found) == 1 and not (path / "metadata.jsonl").is_file():
            return {"name": found.pop(), "path": str(path)}
        return {"name": "imagefolder", "path": str(path)}
    spec = yaml.safe_load(value) if value.lstrip().startswith("{") else value
    if isinstance(spec, str) and ("/" in spec or "." in Path(spec).name):
        raise FileNotFoundError(f"{value!r} does not exist (give a jsonl/csv/parquet file, an image folder, or a "
                                "registered data source such as synthetic)")
    return spec if isinstance(spec, dict) else {"name": spec}


def _done_ids(out: Path, done: Path) -> set[str]:
    """Ids finished by an earlier run, and ``out`` cut back to their lines (an interrupted run may have left a
    partial block of lines after its last finished image)."""
    if not done.is_file():
        if out.exists():
            out.unlink()
        return set()
    ids = {line.strip() for line in done.read_text(encoding="utf-8").splitlines() if line.strip()}
    if out.is_file():
        from finetune.report import write_text_atomic

        kept = []
        for line in out.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by the interruption
            if str(row.get("id")) in ids:
                kept.append(line)
        write_text_atomic(out, "".join(k + "\n" for k in kept))
    return ids


def _image_ref(example: dict[str, Any], image: Image.Image, images_dir: Path, out: Path) -> str:
    """The image as the pairs file names it: its own file when it has one, else a PNG written beside ``out``."""
    raw = example.get("image_raw")
    path = raw.get("path") if isinstance(raw, dict) else None
    if path and Path(path).is_file():
        return str(Path(path).resolve())
    images_dir.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(example["id"]))
    target = images_dir / f"{safe}.png"
    if not target.is_file():
        tmp = target.with_name(f".{target.name}.tmp")
        image.save(tmp, format="PNG")
        os.replace(tmp, target)
    return os.path.relpath(target, out.parent)


#: the per-pair columns of a pairs file (one line per kept pair); the rest is the image's own
PAIR_FILE_COLUMNS = ("box", "sentence", "sentence_index", "similarity", "weight", "candidates", "image_id")


def _image_key(row_id: str) -> str:
    """The image of a pairs-file line without an ``image_id`` column: its id without ``write_pairs``' ``#p``."""
    head, sep, tail = row_id.rpartition("#")
    return head if sep and tail.isdigit() else row_id


def pairs_by_image(dataset: datasets.Dataset, *, pairs: int = 1) -> tuple[datasets.Dataset, dict[str, Any]]:
    """One example per image from the lines of a pairs file (``write_pairs``), with the columns FLISM adds in a
    recipe (``flism_pair_box``, ``flism_pair_sentence``, ``flism_pair_similarity``, ``flism_pair_weight``,
    ``flism_num_pairs``), so that both routes train alike: an image meets its own pairs in one example, never
    itself as a negative of the global loss (FAST-GOAL eq. 12).

    Lines are grouped by ``image_id`` (else by the id without its ``#p`` suffix); an image keeps its ``pairs``
    most similar lines (the file's order without a ``similarity`` column), padded by repeating the last one with
    weight 0; the kept lines' ``weight`` column (the builder's ``--weighting``; uniform without one) is
    renormalised to sum to 1 over them, as :func:`select_pairs` does in a recipe.

    Returns:
        ``(dataset, info)``: the grouped dataset (``id`` is the image's, the other non-pair columns the first
        line's) and ``{"lines", "images", "most_pairs_per_image"}``.

    Raises:
        DataError: lines of one image with different captions, a ``box`` that is not 4 numbers or a
            ``sentence_index`` that is not an integer (naming the line's id).
    """
    from finetune.data.images import DataError

    n = len(dataset)
    ids = [str(i) for i in dataset["id"]]
    keys = [str(k) for k in dataset["image_id"]] if "image_id" in dataset.column_names else [_image_key(i) for i in ids]
    captions = dataset["caption"]
    boxes = dataset["box"]
    sentence = dataset["sentence_index"]
    sims = dataset["similarity"] if "similarity" in dataset.column_names else [None] * n
    weights = dataset["weight"] if "weight" in dataset.column_names else [None] * n
    groups: dict[str, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    first, columns = [], {name: [] for name in ("flism_pair_box", "flism_pair_sentence", "flism_pair_similarity",
                                                "flism_pair_weight", "flism_num_pairs")}
    for key, rows in groups.items():
        if len({captions[r] for r in rows}) > 1:
            raise DataError(f"pairs file: the lines {ids[rows[0]]!r} and {ids[rows[1]]!r} name the image {key!r} with "
                            "different captions; one image has one caption (write the file again with python -m "
                            "finetune.preprocess.flism)")
        for r in rows:
            box = boxes[r]
            if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
                raise DataError(f"pairs file: line {ids[r]!r} has box {box!r}; a box is 4 numbers (x1, y1, x2, y2) in "
                                "pixels of the original image")
            if not isinstance(sentence[r], int):
                raise DataError(f"pairs file: line {ids[r]!r} has sentence_index {sentence[r]!r}; it is the index of the "
                                "pair's sentence among split_sentences(caption)")
        ranked = all(sims[r] is not None for r in rows)
        kept = (sorted(rows, key=lambda r: -float(sims[r])) if ranked else list(rows))[:pairs]  # stable: file order
        raw = [float(weights[r]) if weights[r] is not None else 1.0 for r in kept]
        total = sum(max(w, 0.0) for w in raw)
        shares = [max(w, 0.0) / total for w in raw] if total > 0 else [1.0 / len(kept)] * len(kept)
        pad = pairs - len(kept)
        first.append(rows[0])
        kept_boxes = [[float(v) for v in boxes[r]] for r in kept]
        columns["flism_pair_box"].append(kept_boxes + [kept_boxes[-1]] * pad)
        columns["flism_pair_sentence"].append([int(sentence[r]) for r in kept] + [int(sentence[kept[-1]])] * pad)
        kept_sims = [float(sims[r]) if sims[r] is not None else math.nan for r in kept]
        columns["flism_pair_similarity"].append(kept_sims + [kept_sims[-1]] * pad)
        columns["flism_pair_weight"].append(shares + [0.0] * pad)
        columns["flism_num_pairs"].append(len(kept))
    base = dataset.select(first)
    base = base.remove_columns([c for c in (*PAIR_FILE_COLUMNS, "id") if c in base.column_names])
    features = flism_features()
    added = datasets.Dataset.from_dict({"id": list(groups), **columns}, features=datasets.Features(
        {"id": datasets.Value("string"), **{name: features[name] for name in columns}}))
    grouped = datasets.concatenate_datasets([base, added], axis=1)
    most = max((len(r) for r in groups.values()), default=0)
    info = {"lines": n, "images": len(groups), "most_pairs_per_image": most}
    return grouped, info


def write_pairs(source: dict[str, Any] | str, out: str | Path, model: Any, *, proposer: Any = None,
                default: bool = True, pairs: int = 1, weighting: str = "uniform", batch_size: int = 16,
                progress: bool = True, model_id: str | None = None) -> dict[str, int]:
    """Write the global-local pairs of a dataset as a jsonl that ``data.train`` reads (``{name: jsonl, path: out}``
    with ``objective.terms.fastgoal.regions.method: pairs``): one line per kept pair with ``id``, ``image_id``
    (the image's own id: training groups an image's pairs into one example by it), ``width`` and ``height`` of
    the image, ``image`` (its file, or a PNG in ``<out stem>_images/``), ``caption``, ``box`` (pixels of the
    original image, clipped to what ``model``'s input shows), ``sentence``, ``sentence_index`` (into
    ``split_sentences(caption)``), ``similarity``, ``weight`` (the pair's share of the image's TSL weight:
    ``1 / m`` for ``uniform``, similarity-proportional for ``weighted``) and ``candidates``; the id of each
    finished image is appended to ``<out>.done`` after its lines are flushed.
    Interrupted, a second call with the same ``out`` skips the images listed there (resume).

    Args:
        source: a data source spec (:func:`finetune.data.sources.load_source`).
        out: the jsonl to write.
        model: the DualEncoder that matches sentences to crops (frozen, eval mode).
        proposer, default, pairs, weighting: as :class:`FLISMMatcher`.
        batch_size: images per matching batch.
        progress: show a progress bar.

    Returns:
        ``{"images": processed now, "skipped": already done, "pairs": lines written now}``.
    """
    from tqdm.auto import tqdm

    from finetune.data.sources import load_source
    from finetune.models.frozen import FrozenEncoders, model_fingerprint

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done_file = out.with_name(out.name + ".done")
    done = _done_ids(out, done_file)
    data = load_source(source).dataset
    raw = data.cast_column("image", datasets.Image(decode=False))
    todo = [i for i, rid in enumerate(data["id"]) if str(rid) not in done]
    encoders = FrozenEncoders(model)
    model.eval()
    matcher = FLISMMatcher(proposer, encoders.images, encoders.texts, model_id=model_id or model_fingerprint(model),
                           default=default, pairs=pairs, weighting=weighting, geometry=model.image_transform_params())
    images_dir = out.with_name(out.stem + "_images")
    written = 0
    bar = tqdm(total=len(data), initial=len(data) - len(todo), desc="FLISM pairs", unit="image", disable=not progress)
    with out.open("a", encoding="utf-8") as fh, done_file.open("a", encoding="utf-8") as dh:
        for start in range(0, len(todo), batch_size):
            rows = todo[start: start + batch_size]
            batch = data.select(rows)[:]
            result = matcher(batch)
            lines, ids = [], []
            for j, index in enumerate(rows):
                example = {k: batch[k][j] for k in batch}
                example["image_raw"] = raw[index]["image"]
                ref = _image_ref(example, batch["image"][j], images_dir, out)
                for p in range(result["flism_num_pairs"][j]):
                    s = result["flism_pair_sentence"][j][p]
                    image = batch["image"][j]
                    lines.append(json.dumps({
                        "id": f"{example['id']}#{p}" if pairs > 1 else str(example["id"]),
                        "image_id": str(example["id"]), "width": image.width, "height": image.height,
                        "image": ref, "caption": example["caption"],
                        "box": [round(float(v), 2) for v in result["flism_pair_box"][j][p]],
                        "sentence": result["flism_sentences"][j][s], "sentence_index": int(s),
                        "similarity": round(float(result["flism_pair_similarity"][j][p]), 6),
                        "weight": round(float(result["flism_pair_weight"][j][p]), 6),
                        "candidates": int(result["flism_num_candidates"][j]),
                    }, ensure_ascii=False))
                ids.append(str(example["id"]))
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
            dh.write("".join(i + "\n" for i in ids))  # only after the lines are on disk
            dh.flush()
            os.fsync(dh.fileno())
            written += len(lines)
            bar.update(len(rows))
    bar.close()
    return {"images": len(todo), "skipped": len(data) - len(todo), "pairs": written}


def _parser(prog: str = "python -m finetune.preprocess.flism") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Write FLISM's global-local pairs (FAST-GOAL III-A) of a dataset as a jsonl that data.train "
                    "reads ({name: jsonl, path: OUT} with objective.terms.fastgoal.regions.method: pairs). "
                    "Resumable: run it again with the same OUT after an interruption.")
    p.add_argument("images_and_captions", metavar="IMAGES_AND_CAPTIONS",
                   help="a jsonl/csv/parquet file or folder, an image folder, or a data source (synthetic, "
                        "'{name: docci, split: train}')")
    p.add_argument("out", metavar="OUT", help="the jsonl to write (OUT.done lists the finished images)")
    p.add_argument("--model", default="openai/clip-vit-base-patch16",
                   help="the model that matches sentences to crops (hub id, folder or registry name)")
    p.add_argument("--max-text-len", type=int, default=248, help="text positions (248: Long-CLIP KPS)")
    p.add_argument("--method", choices=("detector", "sam", "dataset"), default="detector")
    p.add_argument("--detector", default=PAPER_DETECTOR,
                   help="YOLOS hub id / folder, or an ultralytics .pt file; 'none': default regions only")
    p.add_argument("--threshold", type=float, default=None, help="detection score threshold")
    p.add_argument("--classes", nargs="*", default=None, help="keep only these detector classes")
    p.add_argument("--max-boxes", type=int, default=None)
    p.add_argument("--imgsz", type=int, default=640, help="ultralytics inference size")
    p.add_argument("--sam-checkpoint", default=LISM_SAM)
    p.add_argument("--no-default", action="store_true", help="no quadrants and centre box (Table VII 'YOLO only')")
    p.add_argument("--no-links", action="store_true", help="--method dataset: match the boxes like detections")
    p.add_argument("--pairs", type=int, default=1, help="pairs per image (paper 1; Table VIII 3)")
    p.add_argument("--weighting", choices=("uniform", "weighted"), default="uniform")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=None)
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """``python -m finetune.preprocess.flism IMAGES_AND_CAPTIONS OUT``: see :func:`write_pairs`. Exit status 2
    with a message (no traceback) on bad input."""
    parser = _parser(prog) if prog else _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from finetune import load_model
    from finetune.data.sources import DataError

    try:
        source = _source_spec(args.images_and_captions)
        detector = None if str(args.detector).lower() in ("none", "null", "") else args.detector
        proposer = build_proposer(args.method, detector=detector, threshold=args.threshold, classes=args.classes,
                                  max_boxes=args.max_boxes, imgsz=args.imgsz, sam_checkpoint=args.sam_checkpoint,
                                  links=not args.no_links, device=args.device)
        if proposer is None and args.no_default:
            raise ValueError("--detector none with --no-default leaves no candidate region")
        model = load_model(args.model, max_text_len=args.max_text_len)
        if args.device:
            model.to(args.device)
        counts = write_pairs(source, args.out, model, proposer=proposer, default=not args.no_default,
                             pairs=args.pairs, weighting=args.weighting, batch_size=args.batch_size)
    except (DataError, ValueError, FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {counts['pairs']} pairs of {counts['images']} images to {args.out} ({counts['skipped']} images "
          "were done before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
