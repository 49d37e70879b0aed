"""StructXLIP (Ruan et al.): the ``structxlip`` objective term, one folder (DESIGN 2).

- :mod:`~finetune.objectives.structxlip.term`: the term (:class:`StructXLIPTerm`, its options, the
  registration ``structxlip``);
- :mod:`~finetune.objectives.structxlip.data`: chunks, region selection and the preprocessing map functions;
- :mod:`~finetune.objectives.structxlip.preview`: the preview picture (``python -m finetune.preview``, the
  run report).

``from finetune.objectives.structxlip import X`` keeps working for every name of the former single module.
"""

from finetune.objectives.structxlip.data import (
    CODE_VERSION,
    LEXICON_COLUMNS,
    DefaultRegionSegmenter,
    official_chunks,
    select_regions,
)
from finetune.objectives.structxlip.term import (
    LOSS_KEYS,
    TERM_NAME,
    EdgeOptions,
    LexiconOptions,
    RegionOptions,
    StructXLIPOptions,
    StructXLIPTerm,
    StructXLIPWeights,
    build_structxlip,
)

__all__ = [
    "CODE_VERSION",
    "DefaultRegionSegmenter",
    "EdgeOptions",
    "LEXICON_COLUMNS",
    "LOSS_KEYS",
    "LexiconOptions",
    "RegionOptions",
    "StructXLIPOptions",
    "StructXLIPTerm",
    "StructXLIPWeights",
    "TERM_NAME",
    "build_structxlip",
    "official_chunks",
    "select_regions",
]
