"""The long-caption benchmarks as data sources, read from their official files (DESIGN 4).

Registered names: ``docci``, ``docci_fg``, ``dci``, ``urban1k``, ``sharegpt4v``, ``flickr30k``,
``coco``. Each builder reads the benchmark's release as it is distributed (the hub loading
scripts ``google/docci``, ``nlphuji/*`` no longer load with ``datasets`` >= 4) from ``path:``, or,
for DOCCI, Urban-1k and COCO 2017 val, downloads it into the datasets cache when no path is given.

Selection: ``split:`` picks an official split (``{name: docci, split: train}``); otherwise the
benchmark's evaluation protocol is used (``protocol:``, default first, see
:data:`finetune.data.protocols.PROTOCOLS`). Rows come out sorted by id, so the data layer's
``info["ids_sha256"]`` is the sha256 of the sorted ids: the protocol's fingerprint. A protocol
whose image count differs from the published one warns; a pinned id list (``options.ids_file``)
keeps only its ids, and listed ids missing from the files are reported to the data layer.

Records that cannot be read (an invalid JSON line, an annotation without its fields, a pinned id
with no record) are passed on as rows with an empty caption whose id names the problem, so that
``load_source`` counts them as skipped (``on_error: skip``) or stops on the first with a
``DataError`` naming it (``on_error: raise``). Missing or corrupt images are caught there too.

One module per benchmark, each registering its builder when imported: ``docci`` (``docci`` and
``docci_fg``, which read the same files), ``dci``, ``urban1k``, ``sharegpt4v``, ``flickr30k``, ``coco``; the
helpers they share (rows, protocol selection, file layouts, Karpathy-format rows, the official download
locations) are in ``_common`` (skipped by the registries' discovery rule, it registers nothing).
Importing this package registers every benchmark.
"""

from __future__ import annotations

from finetune.data.protocols import available_protocols

from ._common import KARPATHY_SPLITS, OFFICIAL_FILES, protocol_record

# in the order the builders were registered before the split
from .docci import DOCCI_SPLITS, build_docci, build_docci_fg
from .dci import DCI_SPLITS, build_dci
from .urban1k import build_urban1k
from .sharegpt4v import SHAREGPT4V_HOLDOUT, SHAREGPT4V_JSON, build_sharegpt4v
from .flickr30k import FLICKR_TOKEN_FILE, build_flickr30k
from .coco import _COCO_HOW, build_coco
from .dci import _DCI_HOW
from .docci import _DOCCI_HOW
from .flickr30k import _FLICKR_HOW
from .sharegpt4v import _SHAREGPT4V_HOW
from .urban1k import _URBAN_HOW

#: how to get each benchmark's files (the advice its own errors end with), for checks made before loading
HOW_TO_GET: dict[str, str] = {"docci": _DOCCI_HOW, "docci_fg": _DOCCI_HOW, "dci": _DCI_HOW, "urban1k": _URBAN_HOW,
                              "sharegpt4v": _SHAREGPT4V_HOW, "flickr30k": _FLICKR_HOW, "coco": _COCO_HOW}

__all__ = [
    "available_protocols",
    "protocol_record",
    "OFFICIAL_FILES",
    "HOW_TO_GET",
    "build_docci",
    "build_docci_fg",
    "build_dci",
    "build_urban1k",
    "build_sharegpt4v",
    "build_flickr30k",
    "build_coco",
    "DOCCI_SPLITS",
    "DCI_SPLITS",
    "KARPATHY_SPLITS",
    "SHAREGPT4V_JSON",
    "SHAREGPT4V_HOLDOUT",
    "FLICKR_TOKEN_FILE",
]
