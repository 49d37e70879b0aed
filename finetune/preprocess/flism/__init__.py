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
   the frozen model as loaded before training (:class:`finetune.preprocess.frozen.FrozenEncoders`); every sentence is
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

``xlipkit pairs IMAGES_AND_CAPTIONS OUT`` (:mod:`finetune.cli.pairs`; ``python -m finetune.preprocess.flism``) writes
the global-local pairs of a dataset as a jsonl (image, caption, box, sentence, sentence index, similarity),
resumable (:func:`write_pairs`), the GLIT100k-style construction of the paper's two-stage FAST-GOAL (Table V).

ultralytics lowers OpenCV's thread count when imported and sets torch's inside ``predict`` on a CPU (DESIGN 8):
every call into it runs inside :func:`finetune.preprocess.regions.preserve_thread_settings`.

The package, by stage: ``detectors`` (the candidate generators and the default regions), ``matcher``
(:class:`FLISMMatcher`, :func:`compute_flism`, eqs. 1-2 and the pair selection), ``stats`` (the report's
numbers), ``preview`` (the picture of the kept pairs) and ``pairs`` (the pairs file: :func:`write_pairs`,
:func:`pairs_by_image`); the command line is :mod:`finetune.cli.pairs`.
"""

from __future__ import annotations

from .detectors import (
    DEFAULT_THRESHOLDS,
    DETECTOR_HINT,
    LISM_SAM,
    PAPER_DETECTOR,
    DatasetBoxes,
    SamMasks,
    UltralyticsDetector,
    YolosDetector,
    build_proposer,
    candidate_boxes,
    clip_to_input,
    mask_box,
)
from .matcher import CODE_VERSION, FLISMMatcher, Pair, compute_flism, flism_features, match_sentences, select_pairs
from .pairs import PAIR_FILE_COLUMNS, pairs_by_image, write_pairs
from .preview import render_flism_preview
from .stats import flism_stats

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
    "mask_box",
    "pairs_by_image",
    "write_pairs",
    "match_sentences",
    "render_flism_preview",
    "select_pairs",
    "CODE_VERSION",
    "DEFAULT_THRESHOLDS",
    "DETECTOR_HINT",
    "LISM_SAM",
    "PAIR_FILE_COLUMNS",
    "PAPER_DETECTOR",
    "Pair",
]
