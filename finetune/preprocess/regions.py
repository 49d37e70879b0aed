"""Regions for StructXLIP's local structure-centric loss (paper 3.2, eqs. 1-2; Supp. Mat. D.3).

The paper segments the *colour* image with SAM -- FastSAM in practice (D.3) -- into masks K_i,
takes the structure-centric regions R_i as the edge map cut to each mask, splits the filtered
caption T' into chunks at sentence delimiters, and pairs each chunk c_m with the K regions most
similar to it under the *pretrained* encoders (R_m^K; the paper names no K). All of this is fixed before
fine-tuning, so it is computed once per dataset and cached (:func:`compute_regions`): per example
the region boxes, whether the default regions were used, the chunks, and each chunk's top-K region
indices and cosine scores. Crops are not stored; the collate re-cuts them from the (cached) edge
map with :func:`crop_box`.

Settings the paper does not give, and the choices made here:

- Masks are kept when their area is within [0.01, 0.8] of the image (GOAL's LISM, whose pipeline
  StructXLIP's follows) and each region is the mask's bounding box (a box already kept is not
  kept twice: identical crops would only duplicate positives). FastSAM runs at 1024 px with
  conf 0.4 and NMS IoU 0.9 (FastSAM's training size and the settings of ultralytics' FastSAM
  example).
- Similarity is measured on the structure-centric views the loss aligns: the filtered chunk and
  the edge-map crop (``match_on="edges"``); ``match_on="image"`` uses colour crops, as GOAL's LISM.
- When no mask passes, the image gets the default regions -- its four quadrants and its centre --
  and ``region_fallback`` is set; the count is logged.

ultralytics lowers OpenCV's thread count when imported and sets torch's inside ``predict`` on a
CPU (DESIGN 8): every call into it here runs inside :func:`preserve_thread_settings`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import datasets
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from finetune.data.text import split_sentences
from finetune.extras import require_extra

from finetune.data.cache import cached_map
from .edges import EdgeConfig, edge_map

__all__ = [
    "Box",
    "FastSAMRegions",
    "RegionMatcher",
    "RegionProposals",
    "UltralyticsCheckpoint",
    "compute_regions",
    "crop_box",
    "default_regions",
    "load_ultralytics",
    "preserve_thread_settings",
    "region_features",
    "split_chunks",
    "topk_regions",
]

logger = logging.getLogger("xlipkit")

Box = tuple[float, float, float, float]
"""``(x1, y1, x2, y2)`` in pixels of the original image, ``x2 > x1``, ``y2 > y1``."""

FASTSAM_DOWNLOAD_HINT = (
    "download FastSAM-s.pt or FastSAM-x.pt from the ultralytics assets "
    "(https://github.com/ultralytics/assets/releases) and set `regions.checkpoint` to its path"
)


@contextlib.contextmanager
def preserve_thread_settings() -> Iterator[None]:
    """Restore torch's and OpenCV's thread counts on exit (ultralytics changes both, DESIGN 8)."""
    torch_threads = torch.get_num_threads()
    cv2_threads = cv2.getNumThreads()
    try:
        yield
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        if cv2.getNumThreads() != cv2_threads:
            cv2.setNumThreads(cv2_threads)


def default_regions(width: int, height: int) -> list[Box]:
    """The default regions of a ``width`` x ``height`` image: its four quadrants (top-left,
    top-right, bottom-left, bottom-right), then the centred box of half its width and height."""
    if width <= 0 or height <= 0:
        raise ValueError(f"default_regions needs a positive image size, got {width}x{height}.")
    w, h = float(width), float(height)
    return [
        (0.0, 0.0, w / 2, h / 2),
        (w / 2, 0.0, w, h / 2),
        (0.0, h / 2, w / 2, h),
        (w / 2, h / 2, w, h),
        (w / 4, h / 4, 3 * w / 4, 3 * h / 4),
    ]


def crop_box(image: Image.Image, box: Sequence[float]) -> Image.Image:
    """``image`` cut to ``box`` ``(x1, y1, x2, y2)``, widened to whole pixels and clipped to the image.

    Always at least 1 x 1 pixel, so that a degenerate box still yields an encodable crop.
    """
    if len(box) != 4:
        raise ValueError(f"a box is (x1, y1, x2, y2), got {tuple(box)!r}.")
    width, height = image.size
    x1 = min(max(int(math.floor(box[0])), 0), width - 1)
    y1 = min(max(int(math.floor(box[1])), 0), height - 1)
    x2 = max(min(int(math.ceil(box[2])), width), x1 + 1)
    y2 = max(min(int(math.ceil(box[3])), height), y1 + 1)
    return image.crop((x1, y1, x2, y2))


_CLAUSE_BREAK = re.compile(r";+(?=\s|$)")
_CHUNK_END = re.compile(r"[.;!?…]+$")


def split_chunks(text: str) -> list[str]:
    """Split a (filtered) caption into chunks at sentence delimiters (paper 3.2: periods or
    semicolons). Sentences come from :func:`finetune.data.text.split_sentences` (so "3.5 m",
    "Mr. Smith" and "e.g. Paris" stay whole, and line breaks end a chunk); each sentence is cut
    further at semicolons before whitespace, the delimiters at a chunk's end are dropped, and
    chunks without a word character are dropped.

    Example: ``"A cat sits; a dog runs. Nothing else."`` -> ``["A cat sits", "a dog runs",
    "Nothing else"]``.
    """
    chunks = []
    for sentence in split_sentences(text):
        for clause in _CLAUSE_BREAK.split(sentence):
            chunk = _CHUNK_END.sub("", clause.strip()).strip()
            if re.search(r"\w", chunk):
                chunks.append(chunk)
    return chunks


def topk_regions(chunk_embeds: Tensor, region_embeds: Tensor, k: int = 3) -> tuple[Tensor, Tensor]:
    """The ``k`` regions most similar to each chunk (paper 3.2: R_m^K), by cosine similarity.

    Args:
        chunk_embeds: ``(M, D)`` chunk embeddings (raw; normalised here).
        region_embeds: ``(R, D)`` region embeddings of the same image.
        k: regions per chunk; ``k' = min(k, R)`` are returned.

    Returns:
        ``indices`` ``(M, k')`` int64 into the regions, most similar first, and their cosine
        ``scores`` ``(M, k')`` float32.
    """
    if chunk_embeds.ndim != 2 or region_embeds.ndim != 2 or chunk_embeds.shape[1] != region_embeds.shape[1]:
        raise ValueError(
            f"topk_regions expects (M, D) chunks and (R, D) regions, got {tuple(chunk_embeds.shape)} "
            f"and {tuple(region_embeds.shape)}."
        )
    if k < 1:
        raise ValueError(f"regions.k must be >= 1, got {k}.")
    kk = min(k, region_embeds.shape[0])
    sims = F.normalize(chunk_embeds.float(), dim=-1) @ F.normalize(region_embeds.float(), dim=-1).T
    scores, indices = sims.topk(kk, dim=1)
    return indices, scores


@dataclass
class RegionProposals:
    """Regions of one image.

    Attributes:
        boxes: the regions, ``(x1, y1, x2, y2)`` in the image's pixels.
        fallback: True when no mask passed the filters and ``boxes`` are :func:`default_regions`.
    """

    boxes: list[Box]
    fallback: bool


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_ultralytics(checkpoint: Path, model_class: str, task_class: str, *, exact: bool, hint: str,
                     prefix: str = "") -> Any:
    """An ultralytics checkpoint through its model class (``"FastSAM"``, ``"YOLO"``), checked to hold a
    ``ultralytics.nn.tasks.<task_class>`` (``exact``: that very class, as a segmentation model is also a
    detection model). Offline by default (``YOLO_OFFLINE``). Errors start with ``prefix`` (the recipe key)
    and end with ``hint`` (where to get a checkpoint)."""
    require_extra("regions", f"{prefix}{str(checkpoint)!r} (an ultralytics checkpoint)".strip())
    os.environ.setdefault("YOLO_OFFLINE", "1")  # no update checks or analytics by default
    import ultralytics  # noqa: PLC0415 - heavy import, only when a checkpoint runs
    from ultralytics.nn import tasks  # noqa: PLC0415

    try:
        model = getattr(ultralytics, model_class)(str(checkpoint))
    except Exception as err:  # ultralytics raises many kinds for a file it cannot read
        raise ValueError(f"{prefix}could not load {str(checkpoint)!r} as an ultralytics checkpoint ({err}); "
                         f"{hint}") from err
    expected = getattr(tasks, task_class)
    if (type(model.model) is not expected) if exact else not isinstance(model.model, expected):
        kind = "detection" if task_class == "DetectionModel" else "segmentation"
        raise ValueError(f"{prefix}{str(checkpoint)!r} holds a {type(model.model).__name__}, not a {kind} model; "
                         f"{hint}")
    return model


class UltralyticsCheckpoint:
    """Shared by the proposers that run an ultralytics checkpoint (FastSAM here, YOLO in FLISM): the model is
    loaded lazily into ``_model`` and dropped when pickled (``datasets.map`` worker processes load their own),
    and the checkpoint is identified by content for cache keys."""

    checkpoint: Path
    _model: Any = None
    _sha256: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_model"] = None
        return state

    def checkpoint_sha256(self) -> str:
        """The checkpoint file's sha256 (computed once)."""
        if self._sha256 is None:
            self._sha256 = _file_sha256(self.checkpoint)
        return self._sha256


def _ultralytics_version() -> str:
    """ultralytics' ``major.minor`` for cache keys, from the package metadata (importing ultralytics here would
    drop OpenCV's threads)."""
    return ".".join(importlib.metadata.version("ultralytics").split(".")[:2])


class FastSAMRegions(UltralyticsCheckpoint):
    """FastSAM masks of the colour image -> region boxes (paper 3.2, D.3), through ultralytics.

    Args:
        checkpoint: path to a FastSAM checkpoint (``FastSAM-s.pt`` / ``FastSAM-x.pt``) or any
            ultralytics segmentation checkpoint.
        imgsz: inference size (pixels, long side).
        conf: minimum mask confidence.
        iou: NMS IoU threshold between masks.
        min_area, max_area: keep masks whose area is within this share of the image.
        max_regions: keep at most this many masks (most confident first); ``None`` keeps all.
        device: ultralytics device string (``"cpu"``, ``"0"``, ...); ``None`` lets it choose.
        batch_size: images per ``predict`` call.

    Calling it on a list of RGB images returns one :class:`RegionProposals` per image;
    ``images`` and ``fallbacks`` count what it has seen.

    Raises:
        FileNotFoundError: when ``checkpoint`` does not exist (ultralytics would try to download it).
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        imgsz: int = 1024,
        conf: float = 0.4,
        iou: float = 0.9,
        min_area: float = 0.01,
        max_area: float = 0.8,
        max_regions: int | None = None,
        device: str | None = None,
        batch_size: int = 8,
    ) -> None:
        path = Path(checkpoint)
        require_extra("regions", f"the FastSAM checkpoint {str(path)!r}")
        if not path.is_file():
            raise FileNotFoundError(
                f"FastSAM checkpoint {str(path)!r} not found: {FASTSAM_DOWNLOAD_HINT}."
            )
        if not 0 <= min_area <= max_area <= 1:
            raise ValueError(
                f"regions.min_area and regions.max_area must satisfy 0 <= min_area <= max_area <= 1, "
                f"got {min_area} and {max_area}."
            )
        if max_regions is not None and max_regions < 1:
            raise ValueError(f"regions.max_regions must be >= 1 or null, got {max_regions}.")
        self.checkpoint = path
        self.imgsz = imgsz
        self.conf = conf
        self.iou = iou
        self.min_area = min_area
        self.max_area = max_area
        self.max_regions = max_regions
        self.device = device
        self.batch_size = batch_size
        self.images = 0
        self.fallbacks = 0

    def params(self) -> dict[str, Any]:
        """Settings that determine the regions (the checkpoint by content), for cache keys."""
        return {
            "segmenter": "fastsam",
            "checkpoint_sha256": self.checkpoint_sha256(),
            "imgsz": self.imgsz,
            "conf": self.conf,
            "iou": self.iou,
            "min_area": self.min_area,
            "max_area": self.max_area,
            "max_regions": self.max_regions,
            "ultralytics": _ultralytics_version(),
        }

    def _load(self) -> Any:
        if self._model is None:
            self._model = load_ultralytics(self.checkpoint, "FastSAM", "SegmentationModel", exact=False,
                                           hint=f"regions need FastSAM: {FASTSAM_DOWNLOAD_HINT}.")
        return self._model

    def __call__(self, images: Sequence[Image.Image]) -> list[RegionProposals]:
        """Region boxes of each image (RGB ``PIL.Image``), default regions where no mask passes."""
        rgb = [im if im.mode == "RGB" else im.convert("RGB") for im in images]
        out: list[RegionProposals] = []
        with preserve_thread_settings():
            model = self._load()
            for i in range(0, len(rgb), self.batch_size):
                batch = rgb[i : i + self.batch_size]
                results = model.predict(
                    batch, imgsz=self.imgsz, conf=self.conf, iou=self.iou, device=self.device,
                    retina_masks=False, verbose=False,
                )
                out.extend(self._proposals(im, res) for im, res in zip(batch, results))
        self.images += len(out)
        self.fallbacks += sum(p.fallback for p in out)
        return out

    def _proposals(self, image: Image.Image, result: Any) -> RegionProposals:
        width, height = image.size
        boxes: list[Box] = []
        seen: set[Box] = set()
        if result.masks is not None and len(result.masks) > 0:
            masks = result.masks.data
            in_h, in_w = masks.shape[-2:]
            # Masks live on the letterboxed network input: scale their area back to the image.
            gain = min(in_h / height, in_w / width)
            ratios = (masks.flatten(1).float().sum(1) / (gain * gain * width * height)).clamp(max=1.0)
            xyxy = result.boxes.xyxy.float().cpu()
            order = result.boxes.conf.float().cpu().argsort(descending=True)
            for j in order.tolist():
                if not self.min_area <= float(ratios[j]) <= self.max_area:
                    continue
                x1, y1, x2, y2 = (float(v) for v in xyxy[j])
                x1, x2 = max(0.0, x1), min(float(width), x2)
                y1, y2 = max(0.0, y1), min(float(height), y2)
                box = (x1, y1, x2, y2)
                if x2 - x1 < 1 or y2 - y1 < 1 or box in seen:  # degenerate, or a duplicate crop
                    continue
                seen.add(box)
                boxes.append(box)
                if self.max_regions is not None and len(boxes) >= self.max_regions:
                    break
        if not boxes:
            return RegionProposals(default_regions(width, height), True)
        return RegionProposals(boxes, False)


def region_features() -> datasets.Features:
    """The ``datasets`` features of the columns :class:`RegionMatcher` adds."""
    return datasets.Features(
        {
            "region_boxes": datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
            "region_fallback": datasets.Value("bool"),
            "chunks": datasets.Sequence(datasets.Value("string")),
            "chunk_topk": datasets.Sequence(datasets.Sequence(datasets.Value("int32"))),
            "chunk_topk_scores": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
        }
    )


def _callable_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


def _encode_in_batches(encode: Callable[[list[Any]], Tensor], items: list[Any], batch_size: int) -> Tensor | None:
    if not items:
        return None
    with torch.no_grad():
        parts = [encode(items[i : i + batch_size]).detach().float().cpu() for i in range(0, len(items), batch_size)]
    return torch.cat(parts)


class RegionMatcher:
    """Batched ``datasets.map`` function: regions, chunks and each chunk's top-K regions.

    Args:
        segmenter: images -> :class:`RegionProposals` (e.g. :class:`FastSAMRegions`).
        encode_images: ``list[PIL.Image] -> (n, D)`` embeddings under the frozen pretrained model.
        encode_texts: ``list[str] -> (m, D)`` embeddings under the same model.
        model_id: names the model behind the encoders (hub id, revision, KPS length, ...); part
            of the cache key, so that another model gives other regions.
        k: regions per chunk, K (the paper gives no number; the structxlip term's ``compat`` sets it).
        chunker: caption -> chunks; default :func:`split_chunks`.
        edge_cfg: edge extractor used when the batch has no ``edges_column``.
        match_on: ``"edges"`` (edge-map crops, the structure-centric regions) or ``"image"``
            (colour crops, as GOAL's LISM).
        image_column, caption_column, edges_column: input columns; ``caption_column`` holds the
            filtered caption T'.
        encode_batch_size: crops / chunks per encoder call.

    ``fn(batch)`` returns, per example, ``region_boxes`` ``(R, 4)``, ``region_fallback``,
    ``chunks`` (M strings), ``chunk_topk`` ``(M, k')`` region indices and ``chunk_topk_scores``
    ``(M, k')`` cosine similarities, with ``k' = min(k, R)``.
    """

    def __init__(
        self,
        segmenter: Callable[[Sequence[Image.Image]], list[RegionProposals]],
        encode_images: Callable[[list[Image.Image]], Tensor],
        encode_texts: Callable[[list[str]], Tensor],
        *,
        model_id: str,
        k: int = 3,
        chunker: Callable[[str], list[str]] = split_chunks,
        edge_cfg: EdgeConfig | None = None,
        match_on: str = "edges",
        image_column: str = "image",
        caption_column: str = "filtered_caption",
        edges_column: str | None = "edges",
        encode_batch_size: int = 64,
    ) -> None:
        if k < 1:
            raise ValueError(f"regions.k must be >= 1, got {k}.")
        if match_on not in ("edges", "image"):
            raise ValueError(f"regions.match_on must be 'edges' or 'image', got {match_on!r}.")
        if not model_id:
            raise ValueError("RegionMatcher needs `model_id` (the frozen model's name) for its cache key.")
        self.segmenter = segmenter
        self.encode_images = encode_images
        self.encode_texts = encode_texts
        self.model_id = model_id
        self.k = k
        self.chunker = chunker
        self.edge_cfg = edge_cfg or EdgeConfig()
        self.match_on = match_on
        self.image_column = image_column
        self.caption_column = caption_column
        self.edges_column = edges_column
        self.encode_batch_size = encode_batch_size

    def params(self) -> dict[str, Any]:
        """Everything that determines the output, for :func:`finetune.data.cache.cached_map`."""
        seg_params = self.segmenter.params() if hasattr(self.segmenter, "params") else repr(self.segmenter)
        return {
            "segmenter": seg_params,
            "model_id": self.model_id,
            "k": self.k,
            "chunker": _callable_name(self.chunker),
            "edges": self.edge_cfg.params(),
            "match_on": self.match_on,
            "caption_column": self.caption_column,
        }

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for column in (self.image_column, self.caption_column):
            if column not in batch:
                raise KeyError(f"regions need the column {column!r}; the batch has {sorted(batch)}.")
        images = [im if im.mode == "RGB" else im.convert("RGB") for im in batch[self.image_column]]
        proposals = self.segmenter(images)
        if len(proposals) != len(images):
            raise ValueError(f"the segmenter returned {len(proposals)} results for {len(images)} images.")
        if self.match_on == "image":
            sources = images
        elif self.edges_column and self.edges_column in batch:
            sources = batch[self.edges_column]
        else:
            sources = [edge_map(im, self.edge_cfg) for im in images]
        crops = [crop_box(src, box) for src, p in zip(sources, proposals) for box in p.boxes]
        chunks = [self.chunker(caption or "") for caption in batch[self.caption_column]]
        region_emb = _encode_in_batches(self.encode_images, crops, self.encode_batch_size)
        chunk_emb = _encode_in_batches(self.encode_texts, [c for cs in chunks for c in cs], self.encode_batch_size)
        out: dict[str, list[Any]] = {name: [] for name in region_features()}
        r0 = c0 = 0
        for p, cs in zip(proposals, chunks):
            r1, c1 = r0 + len(p.boxes), c0 + len(cs)
            if cs:
                indices, scores = topk_regions(chunk_emb[c0:c1], region_emb[r0:r1], self.k)
                topk, topk_scores = indices.tolist(), scores.tolist()
            else:
                topk, topk_scores = [], []
            out["region_boxes"].append([list(b) for b in p.boxes])
            out["region_fallback"].append(p.fallback)
            out["chunks"].append(cs)
            out["chunk_topk"].append(topk)
            out["chunk_topk_scores"].append(topk_scores)
            r0, c0 = r1, c1
        return out


def compute_regions(
    dataset: datasets.Dataset,
    matcher: RegionMatcher,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    batch_size: int = 16,
    num_proc: int | None = None,
    code_version: str = "1",
) -> datasets.Dataset:
    """``dataset`` plus the :class:`RegionMatcher` columns, computed once and cached (paper D.3).

    Logs how many images fell back to the default regions.
    """
    out = cached_map(
        dataset,
        matcher,
        params=matcher.params(),
        name="regions",
        cache_dir=cache_dir,
        code_version=code_version,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        features=region_features(),
        desc="StructXLIP regions",
    )
    fallbacks = sum(out["region_fallback"])
    if fallbacks:
        logger.info("regions: %d of %d images had no mask in range and use the default regions", fallbacks, len(out))
    return out
