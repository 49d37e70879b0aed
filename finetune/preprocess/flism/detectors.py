"""FLISM's candidate generators (FAST-GOAL III-A step 2): YOLOS through transformers (the paper's), an
ultralytics YOLO checkpoint, GOAL's LISM (SAM masks), a dataset's own boxes, and the default regions."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from finetune.extras import require_extra
from finetune.preprocess.regions import (
    Box,
    UltralyticsCheckpoint,
    _file_sha256,
    _ultralytics_version,
    default_regions,
    load_ultralytics,
    preserve_thread_settings,
)

__all__ = [
    "DatasetBoxes",
    "SamMasks",
    "UltralyticsDetector",
    "YolosDetector",
    "build_proposer",
    "candidate_boxes",
    "clip_to_input",
    "mask_box",
    "PAPER_DETECTOR",
    "LISM_SAM",
    "DEFAULT_THRESHOLDS",
    "DETECTOR_HINT",
]


#: the paper's detector (YOLOS-Base, 127.8M parameters)
PAPER_DETECTOR = "hustvl/yolos-base"
#: GOAL's LISM: the mask-generation pipeline's default SAM checkpoint
LISM_SAM = "facebook/sam-vit-huge"
#: score threshold when none is given: YOLOS' model-card example (0.9) and ultralytics' ``predict`` default (0.25)
DEFAULT_THRESHOLDS = {"yolos": 0.9, "ultralytics": 0.25}
DETECTOR_HINT = ("the detector is a transformers YOLOS folder or hub id (e.g. hustvl/yolos-base, the paper's) or an "
                 "ultralytics YOLO checkpoint file ending in .pt (e.g. yolov8x.pt from the ultralytics assets)")


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
        require_extra("regions", f"regions.detector: {str(checkpoint)!r} (an ultralytics YOLO checkpoint)")
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
