"""StructXLIP's recipe options (``objective.terms.structxlip``): weights, edge maps, the lexicon, regions and
the ``compat`` switch between the paper's settings and the public code's (:mod:`.term` says which is which)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from finetune.objectives.checks import at_least_one as _at_least_one
from finetune.objectives.checks import non_negative as _non_negative
from finetune.objectives.checks import positive as _positive
from finetune.objectives.checks import unit as _unit

__all__ = ["COMPAT_K", "EdgeOptions", "LexiconOptions", "RegionOptions", "StructXLIPOptions", "StructXLIPWeights"]

#: K of each ``compat`` when ``regions.k`` is null: the paper names none (3.2); 3 is the public ``train.py``'s
#: ``--chunk_top_k`` default, 2 what its ``scripts/finetune.sh`` passes
COMPAT_K = {"paper": 3, "official": 2}


def _count_or_all(value: Any) -> str | None:
    return None if value == "all" else _at_least_one(value)


# -- options (validated by the recipe schema) ---------------------------------------------------------
@dataclass
class StructXLIPWeights:
    """lambda_1-3 of eq. 4; ``null`` takes the ``compat`` default (paper 0.25 / 0.1 / 0.1, section 4;
    official 0.25 / 0.001 / 0.001). A weight of 0 switches its loss off (and, for ``local``, the
    region/chunk work with it)."""

    structure: float | None = field(default=None, metadata={"check": _non_negative})
    consistency: float | None = field(default=None, metadata={"check": _non_negative})
    local: float | None = field(default=None, metadata={"check": _non_negative})


@dataclass
class EdgeOptions:
    """The edge extractor E of paper 3.1 (``finetune.preprocess.edges.EdgeConfig``) and where it runs.

    ``on_the_fly: false`` computes the maps once and caches them (paper D.3); ``true`` computes them in the
    data workers each time an example is loaded (no disk, more CPU per step).
    """

    method: Literal["canny", "log"] = "canny"
    low: float = field(default=100.0, metadata={"check": _non_negative})
    high: float = field(default=200.0, metadata={"check": _non_negative})
    aperture: int = 3
    l2_gradient: bool = False
    blur: int = field(default=0, metadata={"check": _non_negative})
    invert: bool = False
    log_sigma: float = field(default=2.0, metadata={"check": _positive})
    log_threshold: float | None = field(default=None, metadata={"check": _non_negative})
    on_the_fly: bool = False


@dataclass
class LexiconOptions:
    """The lexicon filter F of paper 3.1 / B.2 (``finetune.preprocess.lexicon.LexiconFilter``).

    ``file`` replaces the Fig. 5 vocabulary, ``extra_terms`` extends it (``"term"`` or ``"term:category"``),
    ``min_content_words`` is the revert threshold, ``categories`` the categories removed. ``null`` takes the
    ``compat`` default: paper 1 (B.2 gives no number; 1 keeps B.2's own example "a blue and white pattern"
    -> "a pattern") and every category; official 2 and ``[colour]`` (the public code's ``min_content_tokens``
    and ``--remove_colors``).
    """

    file: str | None = None
    extra_terms: list[str] = field(default_factory=list)
    min_content_words: int | None = field(default=None, metadata={"check": _non_negative})
    categories: list[str] | None = None


@dataclass
class RegionOptions:
    """Regions of the local loss (paper 3.2, D.3).

    Attributes:
        source: ``segmenter`` (the paper: FastSAM masks, or the default regions, each chunk's top-K under the
            frozen model) or ``dataset`` (boxes and sentence-to-region links the dataset provides: columns
            ``sentences`` and ``objects[{box, sentence_index}]``, as the synthetic scenes have; a chunk's
            positives are the regions of its sentence, ``finetune.preprocess.region_links.DatasetRegionLinks``).
        checkpoint: FastSAM checkpoint (``FastSAM-s.pt`` / ``FastSAM-x.pt`` from the ultralytics assets);
            ``null`` gives every image the default regions (4 quadrants + centre), counted and logged.
        k: K, the positives of each chunk; ``null``: the ``compat`` value (:data:`COMPAT_K`). The paper gives
            no number (3.2); ``paper``: 3, our choice (the public ``train.py``'s ``--chunk_top_k`` default);
            ``official``: 2, the public ``scripts/finetune.sh``'s ``--chunk_top_k 2``.
        per_image: regions encoded per image and step (the ones most often among its chunks' top-K, then
            by score); ``null``: as many as K (the public code encodes each image's top-K crops); ``all``:
            every region that is a top-K of some chunk.
        encode: ``crop`` (the paper: each region's edge-map crop through the image tower) or ``pool`` (our
            extension: the edge map's patch states inside the box, mean-pooled and projected).
        min_area, max_area: FastSAM masks kept by area share of the image (GOAL's LISM: 0.01-0.8).
        imgsz, conf, iou, max_masks, device: FastSAM inference settings (ours: neither the paper nor the public
            code gives them).
        match_on: top-K measured on ``edges`` crops (the structure-centric regions) or ``image`` crops.
    """

    source: Literal["segmenter", "dataset"] = "segmenter"
    checkpoint: str | None = None
    k: int | None = field(default=None, metadata={"check": _at_least_one})
    per_image: int | Literal["all"] | None = field(default=None, metadata={"check": _count_or_all})
    encode: Literal["crop", "pool"] = "crop"
    min_area: float = field(default=0.01, metadata={"check": _unit})
    max_area: float = field(default=0.8, metadata={"check": _unit})
    imgsz: int = field(default=1024, metadata={"check": _at_least_one})
    conf: float = field(default=0.4, metadata={"check": _unit})
    iou: float = field(default=0.9, metadata={"check": _unit})
    max_masks: int | None = field(default=None, metadata={"check": _at_least_one})
    match_on: Literal["edges", "image"] = "edges"
    device: str | None = None


@dataclass
class StructXLIPOptions:
    """``objective.terms.structxlip`` of a recipe.

    Attributes:
        compat: ``paper`` (defaults of the paper) or ``official`` (the public code's choices, DESIGN 5).
        weights: lambda_1-3 (:class:`StructXLIPWeights`).
        local_temperature: gamma of eq. 1, fixed (D.2: 0.07). Official: the main scale is divided by it.
        structure_temperature: initial tau' of L_{I',T'} (paper mode; the paper gives no value: 0.07, CLIP's
            initial temperature, is ours; learnable, ours).
        structure_logit_scale_max: upper clamp of log(1 / tau') after each step (ours, as D.2 clamps the
            main scale at 3.5).
        edges, lexicon, regions: the preprocessing (:class:`EdgeOptions`, :class:`LexiconOptions`,
            :class:`RegionOptions`).
    """

    compat: Literal["paper", "official"] = "paper"
    weights: StructXLIPWeights = field(default_factory=StructXLIPWeights)
    local_temperature: float = field(default=0.07, metadata={"check": _positive})
    structure_temperature: float = field(default=0.07, metadata={"check": _positive})
    structure_logit_scale_max: float = 3.5
    edges: EdgeOptions = field(default_factory=EdgeOptions)
    lexicon: LexiconOptions = field(default_factory=LexiconOptions)
    regions: RegionOptions = field(default_factory=RegionOptions)


# -- the term ----------------------------------------------------------------------------------------
