"""Edge maps I' = E(I): StructXLIP's structure-centric view of an image (paper 3.1, "Visual extraction").

StructXLIP is edge-extractor agnostic; its main results use Canny and its ablation (Table 4)
finds Canny and LoG the best. Canny runs on the grayscale image (``cv2.cvtColor`` RGB2GRAY, then
``cv2.Canny``); LoG is a Gaussian blur, a Laplacian and its zero crossings (Marr-Hildreth). The
result is a binary map (the paper: "binary 0, 1 values instead of RGB triplets") returned as an
RGB ``PIL.Image`` with three identical uint8 channels (0 / 255), which is what every image
processor accepts -- the same form the public code feeds (``convert("L").convert("RGB")``).

Neither the paper nor the public code gives thresholds (the code's preprocessing is not released),
so the defaults are OpenCV's documented example and the ControlNet Canny annotator's: low 100,
high 200, aperture 3, L1 gradient, no blur; edges are white on black (Canny's output). The LoG
defaults are MATLAB ``edge(I, "log")``'s: sigma 2 and a threshold of 0.75 x the mean absolute
LoG response.

Edge maps are computed once per dataset and cached (``finetune.data.cache``) or, with
``edges.on_the_fly``, in the data workers through :func:`edge_example_fn`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any

import cv2
import numpy as np
from PIL import Image

__all__ = [
    "CV2_THREADS_AT_IMPORT",
    "EdgeConfig",
    "edge_array",
    "edge_example_fn",
    "edge_map",
    "edge_maps",
    "restore_cv2_threads",
]

# Importing ultralytics calls cv2.setNumThreads(0) (DESIGN 8); if it came first, OpenCV's own
# default (-1) is what it overrode.
CV2_THREADS_AT_IMPORT: int = -1 if "ultralytics" in sys.modules else cv2.getNumThreads()
"""OpenCV's thread count before ultralytics could change it (-1: OpenCV's default)."""


def restore_cv2_threads() -> None:
    """Give OpenCV back the threads ultralytics took when it was imported (DESIGN 8).

    Acts only when ultralytics is loaded and OpenCV runs on fewer threads than before, so a
    thread count set on purpose elsewhere (e.g. 1 in data workers) without ultralytics stays.
    """
    if "ultralytics" not in sys.modules:
        return
    target = CV2_THREADS_AT_IMPORT
    current = cv2.getNumThreads()
    if target < 0:
        if current <= 1:
            cv2.setNumThreads(-1)
    elif current < target:
        cv2.setNumThreads(target)

_METHODS = ("canny", "log")


@dataclass(frozen=True)
class EdgeConfig:
    """Parameters of the edge extractor (recipe section ``edges``).

    Attributes:
        method: ``"canny"`` (the paper's main choice) or ``"log"`` (Laplacian of Gaussian).
        low: Canny's lower hysteresis threshold (gradient magnitude, 8-bit image).
        high: Canny's upper hysteresis threshold; ``low <= high``.
        aperture: Sobel aperture of Canny: 3, 5 or 7.
        l2_gradient: Canny with the L2 gradient norm instead of L1.
        blur: Gaussian pre-blur kernel size (odd, pixels) applied before Canny; 0 = none.
        invert: black edges on white instead of white on black.
        log_sigma: standard deviation of the LoG's Gaussian (pixels).
        log_threshold: minimum LoG swing across a zero crossing to count as an edge; ``None``
            = 0.75 x the mean absolute LoG response of the image (MATLAB's default).
    """

    method: str = "canny"
    low: float = 100.0
    high: float = 200.0
    aperture: int = 3
    l2_gradient: bool = False
    blur: int = 0
    invert: bool = False
    log_sigma: float = 2.0
    log_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"edges.method must be one of {list(_METHODS)}, got {self.method!r}.")
        if not 0 <= self.low <= self.high:
            raise ValueError(
                f"edges.low and edges.high must satisfy 0 <= low <= high, got low={self.low}, high={self.high}."
            )
        if self.aperture not in (3, 5, 7):
            raise ValueError(f"edges.aperture must be 3, 5 or 7 (Sobel kernel size), got {self.aperture!r}.")
        if self.blur < 0 or (self.blur and self.blur % 2 == 0):
            raise ValueError(f"edges.blur must be 0 (none) or an odd kernel size, got {self.blur!r}.")
        if self.log_sigma <= 0:
            raise ValueError(f"edges.log_sigma must be > 0, got {self.log_sigma!r}.")
        if self.log_threshold is not None and self.log_threshold < 0:
            raise ValueError(f"edges.log_threshold must be >= 0 or null, got {self.log_threshold!r}.")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, *, ignore: Sequence[str] = ("on_the_fly",)) -> EdgeConfig:
        """Build from a recipe's ``edges`` section; unknown keys raise a ValueError naming them.

        Keys in ``ignore`` (settings of the pipeline, not of the extractor) are skipped.
        """
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known - set(ignore))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in `edges`; valid keys: {sorted(known | set(ignore))}.")
        return cls(**{k: v for k, v in values.items() if k in known})

    def params(self) -> dict[str, Any]:
        """The parameters as a plain dict (for cache keys and run reports)."""
        return asdict(self)


def _gray(image: Image.Image | np.ndarray) -> np.ndarray:
    """``(H, W)`` uint8 grayscale of an RGB/RGBA/L image (cv2's RGB2GRAY weights)."""
    if isinstance(image, Image.Image):
        if image.mode == "L":
            return np.asarray(image)
        if image.mode not in ("RGB", "RGBA"):
            image = image.convert("RGB")
        array = np.asarray(image)
    elif isinstance(image, np.ndarray):
        array = image
    else:
        raise TypeError(f"edge_map expects a PIL.Image or a numpy array, got {type(image).__name__}.")
    if array.dtype != np.uint8:
        raise ValueError(
            f"edge_map expects uint8 pixels, got an array of {array.dtype}; convert with .astype(np.uint8)."
        )
    if array.ndim == 2:
        return array
    if array.ndim == 3 and array.shape[2] == 3:
        return cv2.cvtColor(array, cv2.COLOR_RGB2GRAY)
    if array.ndim == 3 and array.shape[2] == 4:
        return cv2.cvtColor(array, cv2.COLOR_RGBA2GRAY)
    if array.ndim == 3 and array.shape[2] == 1:
        return array[:, :, 0]
    raise ValueError(f"edge_map expects an (H, W), (H, W, 3) or (H, W, 4) image, got shape {array.shape}.")


def _log_edges(gray: np.ndarray, cfg: EdgeConfig) -> np.ndarray:
    """Zero crossings of the Laplacian of Gaussian with a minimum swing (Marr-Hildreth)."""
    smooth = cv2.GaussianBlur(gray.astype(np.float32), (0, 0), cfg.log_sigma)
    log = cv2.Laplacian(smooth, cv2.CV_32F, ksize=1)
    kernel = np.ones((3, 3), np.uint8)
    low = cv2.erode(log, kernel)
    high = cv2.dilate(log, kernel)
    threshold = 0.75 * float(np.abs(log).mean()) if cfg.log_threshold is None else cfg.log_threshold
    # A pixel is on the edge when it is positive with a negative neighbour (one side of each
    # crossing, so lines stay one pixel wide) and the response swings by more than the threshold.
    edges = (log > 0) & (low < 0) & ((high - low) > threshold)
    return edges.astype(np.uint8) * 255


def edge_array(image: Image.Image | np.ndarray, cfg: EdgeConfig | None = None) -> np.ndarray:
    """The edge map as an ``(H, W)`` uint8 array of 0 / 255 (255 = edge unless ``cfg.invert``).

    Args:
        image: RGB (or RGBA, or gray) ``PIL.Image`` or uint8 array ``(H, W[, C])``, RGB order.
        cfg: extractor parameters; default :class:`EdgeConfig()` (Canny 100/200).
    """
    cfg = cfg or EdgeConfig()
    gray = _gray(image)
    if cfg.method == "canny":
        if cfg.blur:
            gray = cv2.GaussianBlur(gray, (cfg.blur, cfg.blur), 0)
        edges = cv2.Canny(gray, cfg.low, cfg.high, apertureSize=cfg.aperture, L2gradient=cfg.l2_gradient)
    else:
        edges = _log_edges(gray, cfg)
    if cfg.invert:
        edges = cv2.bitwise_not(edges)
    return edges


def edge_map(image: Image.Image | np.ndarray, cfg: EdgeConfig | None = None) -> Image.Image:
    """StructXLIP's edge map I' of ``image`` (paper 3.1) as an RGB image, ``(H, W)`` like the input.

    The three channels are identical copies of :func:`edge_array` (uint8, 0 / 255).
    """
    return Image.fromarray(cv2.cvtColor(edge_array(image, cfg), cv2.COLOR_GRAY2RGB))


def edge_maps(
    images: Sequence[Image.Image | np.ndarray], cfg: EdgeConfig | None = None, *, num_threads: int = 1
) -> list[Image.Image]:
    """:func:`edge_map` of each image; with ``num_threads > 1`` in a thread pool.

    OpenCV already parallelises ``cvtColor``/``Canny`` inside one call and the PIL conversions
    hold the GIL, so the pool pays off only with many idle cores and OpenCV set to one thread
    (``bench/preprocess_throughput.py`` measures both); hence the default of 1. OpenCV's threads
    are first restored if ultralytics took them (:func:`restore_cv2_threads`).
    """
    cfg = cfg or EdgeConfig()
    restore_cv2_threads()
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}.")
    if num_threads == 1 or len(images) < 2:
        return [edge_map(im, cfg) for im in images]
    with ThreadPoolExecutor(max_workers=min(num_threads, len(images))) as pool:
        return list(pool.map(lambda im: edge_map(im, cfg), images))


def edge_example_fn(
    cfg: EdgeConfig | None = None, *, image_column: str = "image", output_column: str = "edges"
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function for ``datasets.Dataset.map(batched=True)`` or a collate: adds the edge maps.

    The returned ``fn(batch)`` takes a batch dict with ``batch[image_column]`` a list of images and
    returns ``{output_column: [edge_map(image), ...]}`` (RGB PIL images, same sizes).

    Raises:
        KeyError: naming ``image_column`` when the batch lacks it.
    """
    cfg = cfg or EdgeConfig()

    def fn(batch: dict[str, Any]) -> dict[str, Any]:
        if image_column not in batch:
            raise KeyError(
                f"edge maps need the column {image_column!r}; the batch has {sorted(batch)}."
            )
        return {output_column: edge_maps(batch[image_column], cfg)}

    return fn
