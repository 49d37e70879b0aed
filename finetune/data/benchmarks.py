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
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from finetune.data.download import fetch, fetch_archive
from finetune.data.protocols import (
    PROTOCOLS,
    Protocol,
    available_protocols,
    check_count,
    get_protocol,
    normalise_id,
    pinned_ids,
)
from finetune.data.sources import (
    DataError,
    LoadedSource,
    SourceSpec,
    register_source,
    source_cache_dir,
)
from finetune.data.text import sentence_offsets, split_sentences

__all__ = [
    "available_protocols",
    "protocol_record",
    "OFFICIAL_FILES",
    "build_docci",
    "build_docci_fg",
    "build_dci",
    "build_urban1k",
    "build_sharegpt4v",
    "build_flickr30k",
    "build_coco",
]

logger = logging.getLogger(__name__)

#: Official download locations and their sha256 (``None``: no published checksum; the file's
#: digest is then recorded and printed, not verified; see ``finetune.data.download.fetch``).
OFFICIAL_FILES: dict[str, tuple[str, str | None]] = {
    "docci_descriptions": (
        "https://storage.googleapis.com/docci/data/docci_descriptions.jsonlines", None),
    "docci_images": ("https://storage.googleapis.com/docci/data/docci_images.tar.gz", None),
    "urban1k": ("hf://datasets/BeichenZhang/Urban1k/Urban1k.zip", None),
    "coco_val2017_images": ("http://images.cocodataset.org/zips/val2017.zip", None),
    "coco_annotations_2017": (
        "http://images.cocodataset.org/annotations/annotations_trainval2017.zip", None),
}

DOCCI_SPLITS = ("train", "test", "qual_dev", "qual_test")
DCI_SPLITS = ("train", "valid", "test")
KARPATHY_SPLITS = ("train", "restval", "val", "test")
SHAREGPT4V_JSON = "share-captioner_coco_lcs_sam_1246k_1107.json"
SHAREGPT4V_HOLDOUT = 1000  # Long-CLIP trains on rows [1000:] and tests on the first 1,000
FLICKR_TOKEN_FILE = "results_20130124.token"
_FEATURES = {
    "id": datasets.Value("string"),
    "image": datasets.Value("string"),
    "caption": datasets.Value("string"),
}


# --------------------------------------------------------------------------- shared helpers


class _Rows:
    """Columns under construction; problem records become rows the data layer skips or raises on.

    Fixed columns ``id``, ``image``, ``caption`` (and ``captions`` with ``multi``); a loader may
    declare extra per-row list columns with their ``datasets`` feature (``extra``, e.g. DCI's
    ``sentences`` and ``objects``), given to every :meth:`add` and empty on problem rows.
    """

    def __init__(self, multi: bool = False, extra: dict[str, datasets.List] | None = None) -> None:
        self.multi = multi
        self.ids: list[str] = []
        self.images: list[str | None] = []
        self.captions: list[str] = []
        self.caption_lists: list[list[str]] = []
        self.is_problem: list[bool] = []
        self.extra_features: dict[str, datasets.List] = dict(extra or {})
        self.extra_columns: dict[str, list[list]] = {name: [] for name in self.extra_features}

    def add(
        self,
        id_: str,
        image: Path | None,
        caption: str,
        captions: list[str] | None = None,
        extra: dict[str, list] | None = None,
    ) -> None:
        extra = extra or {}
        if set(extra) != set(self.extra_features):
            raise ValueError(f"_Rows.add: extra columns {sorted(extra)} given, "
                             f"{sorted(self.extra_features)} declared")
        self.ids.append(str(id_))
        self.images.append(str(image) if image is not None else None)
        self.captions.append(caption)
        self.is_problem.append(False)
        if self.multi:
            self.caption_lists.append(list(captions if captions is not None else [caption]))
        for name, values in self.extra_columns.items():
            values.append(list(extra[name]))

    def problem(self, where: str, what: str) -> None:
        """A record that cannot become an example: an id naming it, no image, no caption (and
        empty extra columns).

        Not logged one by one: ``load_source`` reports the skipped count and the first ids.
        """
        logger.debug("%s: %s", where, what)
        self.add(f"{where} ({what})", None, "", [], {name: [] for name in self.extra_features})
        self.is_problem[-1] = True

    @property
    def n_examples(self) -> int:
        """Rows that are real examples (not problem records)."""
        return self.is_problem.count(False)

    def example_ids(self) -> list[str]:
        return [id_ for id_, bad in zip(self.ids, self.is_problem) if not bad]

    def keep_examples(self, wanted: set[str]) -> None:
        """Keep the examples whose normalised id is in ``wanted``, and every problem record."""
        keep = [i for i, (id_, bad) in enumerate(zip(self.ids, self.is_problem))
                if bad or normalise_id(id_) in wanted]
        for name in ("ids", "images", "captions", "is_problem"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        if self.multi:
            self.caption_lists = [self.caption_lists[i] for i in keep]
        for name, values in self.extra_columns.items():
            self.extra_columns[name] = [values[i] for i in keep]

    def to_dataset(self) -> datasets.Dataset:
        order = sorted(range(len(self.ids)), key=self.ids.__getitem__)
        columns: dict[str, list] = {
            "id": [self.ids[i] for i in order],
            "image": [self.images[i] for i in order],
            "caption": [self.captions[i] for i in order],
        }
        features = dict(_FEATURES)
        if self.multi:
            columns["captions"] = [self.caption_lists[i] for i in order]
            features["captions"] = datasets.List(datasets.Value("string"))
        for name, values in self.extra_columns.items():
            columns[name] = [values[i] for i in order]
            features[name] = self.extra_features[name]
        return datasets.Dataset.from_dict(columns, features=datasets.Features(features))


def _selection(spec: SourceSpec, benchmark: str) -> Protocol | None:
    """The protocol that applies, or ``None`` when ``split:`` asks for a plain official split."""
    if spec.split is None:
        return get_protocol(benchmark, spec.protocol)
    default = PROTOCOLS[benchmark][0].name
    if spec.protocol not in (None, default):
        raise DataError(
            f"data source {benchmark!r}: both split {spec.split!r} and protocol "
            f"{spec.protocol!r} are set; a protocol selects its own images: drop one of them"
        )
    return None


def _finish(rows: _Rows, spec: SourceSpec, protocol: Protocol | None) -> datasets.Dataset:
    """Apply a pinned id list, check the protocol's size, and build the sorted dataset."""
    if protocol is not None:
        pinned = pinned_ids(protocol, spec.options.get("ids_file"))
        if pinned is not None:
            listed, source = pinned
            wanted = set(listed)
            found = {normalise_id(id_) for id_ in rows.example_ids()}
            rows.keep_examples(wanted)
            missing = sorted(wanted - found)
            if missing:
                warnings.warn(
                    f"{protocol.benchmark}:{protocol.name}: {len(missing)} of {len(wanted)} ids "
                    f"listed in {source} are not in the files (first: {', '.join(missing[:5])})",
                    stacklevel=4,  # the caller of load_source
                )
            for id_ in missing:
                rows.problem(id_, f"listed in {source} but absent from the files")
            check_count(protocol, len(wanted), stacklevel=4)
        else:
            check_count(protocol, rows.n_examples, stacklevel=4)
    return rows.to_dataset()


def _cache() -> Path | None:
    cache_dir = source_cache_dir()
    return Path(cache_dir) / "xlipkit" if cache_dir is not None else None


def _local_root(spec: SourceSpec, benchmark: str, how_to_get: str) -> Path:
    if not spec.path:
        raise DataError(
            f"data source {benchmark!r} needs `path:` (the folder of its official files): "
            f"{how_to_get}"
        )
    root = Path(spec.path).expanduser()
    if not root.exists():
        raise DataError(
            f"data source {benchmark!r}: path {str(root)!r} does not exist; {how_to_get}"
        )
    return root


def _subfolders(folder: Path) -> Iterator[Path]:
    return (child for child in sorted(folder.iterdir()) if child.is_dir())


def _find(root: Path, relative: str, benchmark: str, how_to_get: str) -> Path:
    """``root/relative``, or the same under one or two wrapping folders (as archives unpack)."""
    if (root / relative).exists():
        return root / relative
    if root.is_dir():
        for child in _subfolders(root):
            if (child / relative).exists():
                return child / relative
        for child in _subfolders(root):
            for grandchild in _subfolders(child):
                if (grandchild / relative).exists():
                    return grandchild / relative
    raise DataError(f"data source {benchmark!r}: no {relative} in {str(root)!r}; {how_to_get}")


def _read_json(path: Path, benchmark: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise DataError(
            f"data source {benchmark!r}: {path} is not valid JSON ({error}); the file is damaged "
            "or incomplete: download it again"
        ) from error


def _jsonlines(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """``(line number, record, None)`` per line, or ``(line number, None, problem)``."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                yield number, None, f"not valid JSON: {error}"
                continue
            if not isinstance(record, dict):
                yield number, None, "not a JSON object"
                continue
            yield number, record, None


def _missing_keys(record: dict, keys: tuple[str, ...]) -> str | None:
    absent = [key for key in keys if not isinstance(record.get(key), str)]
    return f"no {', '.join(absent)} (strings)" if absent else None


def protocol_record(loaded: LoadedSource) -> dict:
    """What a run's ``metrics.json`` records about an evaluation set.

    Returns:
        ``{"set", "protocol", "protocol_expected", "selection", "used_by", "num_images",
        "ids_sha256", "complete"}``; for a plain split (``split:`` given) or a non-benchmark
        source, ``protocol`` and the protocol fields are ``None``. ``ids_sha256`` is the sha256
        of the sorted ids of the images kept after validation, newline-joined.
    """
    protocol = None
    if loaded.split is None and loaded.name in PROTOCOLS and loaded.protocol is not None:
        protocol = get_protocol(loaded.name, loaded.protocol)
    n_images = len(loaded.dataset)
    return {
        "set": loaded.name,
        "protocol": protocol.name if protocol else None,
        "protocol_expected": protocol.expected if protocol else None,
        "selection": protocol.selection if protocol else loaded.split,
        "used_by": protocol.used_by if protocol else None,
        "num_images": n_images,
        "ids_sha256": loaded.info.get("ids_sha256"),
        "complete": protocol.expected == n_images if protocol else None,
    }


# --------------------------------------------------------------------------- DOCCI

_DOCCI_HOW = (
    "download docci_descriptions.jsonlines and docci_images.tar.gz from "
    "https://storage.googleapis.com/docci/data/ (see https://google.github.io/docci), unpack the "
    "images next to the file (images/<image_file>) and set path to that folder, or leave path "
    "unset to download them into the datasets cache"
)


def _docci_files(spec: SourceSpec) -> tuple[Path, Path]:
    """(``docci_descriptions.jsonlines``, the ``images/`` folder), local or downloaded."""
    if spec.path:
        root = _local_root(spec, spec.name, _DOCCI_HOW)
        if root.is_file():
            descriptions = root
        else:
            descriptions = _find(root, "docci_descriptions.jsonlines", spec.name, _DOCCI_HOW)
        images = spec.options.get("images_dir") or descriptions.parent / "images"
        return descriptions, Path(images).expanduser()
    url, sha = OFFICIAL_FILES["docci_descriptions"]
    descriptions = fetch(url, sha, cache_dir=_cache(), desc="DOCCI descriptions")
    url, sha = OFFICIAL_FILES["docci_images"]
    unpacked = fetch_archive(url, sha, cache_dir=_cache(), desc="DOCCI images")
    images = unpacked / "images"  # the archive's top folder
    return descriptions, images if images.is_dir() else unpacked


def _read_docci(spec: SourceSpec, splits: set[str], rows: _Rows, sentences: str | None) -> None:
    """Add the records of the wanted ``splits`` to ``rows``; unreadable lines as problems.

    With ``sentences`` (a splitter name), ``captions`` holds the description's sentences.
    """
    descriptions, images = _docci_files(spec)
    for number, record, problem in _jsonlines(descriptions):
        where = f"{descriptions.name} line {number}"
        if record is not None:
            problem = _missing_keys(record, ("example_id", "split", "image_file", "description"))
        if problem:
            rows.problem(where, problem)
        elif record["split"] in splits:
            description = record["description"]
            captions = _fg_sentences(description, sentences) if sentences else None
            rows.add(record["example_id"], images / record["image_file"], description, captions)


def _docci_splits(protocol: Protocol | None, spec: SourceSpec) -> set[str]:
    if protocol is None:
        return {spec.split}
    return {"test", "qual_test"} if protocol.name == "goal" else {"test"}


@register_source(
    "docci",
    description="DOCCI (Onoe et al. 2024): 15k images with long human descriptions; "
    "protocols test 5,000 / goal 5,100",
    protocols=tuple(available_protocols("docci")),
    splits=DOCCI_SPLITS,
)
def build_docci(spec: SourceSpec) -> datasets.Dataset:
    """DOCCI from ``docci_descriptions.jsonlines`` (``example_id``, ``split``, ``image_file``,
    ``description``) and ``images/``: one long description per image.

    Splits train 9,647 / test 5,000 / qual_dev 100 / qual_test 100. Protocols: ``test`` (split
    test, FLAIR and F-CAST) and ``goal`` (test + qual_test = 5,100, GOAL's ``docci_test.json``,
    used by GOAL and StructXLIP). ``options.images_dir`` overrides ``<path>/images``.
    """
    protocol = _selection(spec, "docci")
    rows = _Rows()
    _read_docci(spec, _docci_splits(protocol, spec), rows, sentences=None)
    return _finish(rows, spec, protocol)


_FLAIR_SPLIT = re.compile(r"\n|</s>|[.]")


def _fg_sentences(description: str, splitter: str) -> list[str]:
    if splitter == "flair":
        return [piece.strip() for piece in _FLAIR_SPLIT.split(description) if piece.strip()]
    return split_sentences(description)


@register_source(
    "docci_fg",
    description="DOCCI-FG (FLAIR 4.3): DOCCI test images, each sentence of the description a "
    "positive caption",
    protocols=tuple(available_protocols("docci_fg")),
    splits=DOCCI_SPLITS,
)
def build_docci_fg(spec: SourceSpec) -> datasets.Dataset:
    """DOCCI-FG, FLAIR's fine-grained retrieval set (FLAIR section 4.3, Tab. 6).

    The DOCCI test descriptions split into sentences: ``captions`` holds every sentence of an
    image (7.1 per image on average in FLAIR), each a positive for retrieval; ``caption`` is the
    full description. Sentences come from ``finetune.data.text.split_sentences`` (the paper's
    "individual sentences"); ``options.splitter: flair`` splits as FLAIR's public code does
    (``re.split(r'\\n|</s>|[.]')``, which also cuts "3.5" and "e.g.").
    """
    splitter = spec.options.get("splitter", "sentences")
    if splitter not in ("sentences", "flair"):
        raise DataError(
            f"docci_fg: options.splitter must be 'sentences' or 'flair', got {splitter!r}"
        )
    protocol = _selection(spec, "docci_fg")
    rows = _Rows(multi=True)
    _read_docci(spec, _docci_splits(protocol, spec), rows, sentences=splitter)
    return _finish(rows, spec, protocol)


# --------------------------------------------------------------------------- DCI

_DCI_HOW = (
    "DCI is not downloadable without accepting the SA-1B licence: get dci.tar.gz from "
    "https://github.com/facebookresearch/DCI and the SA-1B images it names (photos/), then set "
    "path to the folder holding densely_captioned_images/"
)


_DCI_MODES = ("short+extra", "short", "extra", "complete")
_DCI_MASK_MIN_SIZE = 224  # DCI's get_formatted_description_min_size(min_height=224, min_width=224)
_DCI_MASKS_INTRO = "The following can also be seen in the image:"


def _dci_caption(annotation: dict, mode: str) -> str:
    short = annotation.get("short_caption") or ""
    extra = annotation.get("extra_caption") or ""
    if mode == "short":
        return short.strip()
    if mode == "extra":
        return extra.strip()
    return " ".join(part.strip() for part in (short, extra) if part.strip())


class _DciMaskError(ValueError):
    """A mask of ``mask_data`` that cannot be read; the annotation becomes a problem record."""


@dataclass(frozen=True)
class _DciMask:
    """One entry of DCI's ``mask_data`` (``MaskDataEntry`` in DCI's ``dense_image.py``)."""

    key: str
    idx: int
    box: tuple[int, int, int, int]  # x1, y1, x2, y2 from bounds.topLeft / bounds.bottomRight
    quality: int  # 0 fine, 1 low quality, 2 unusable
    label: str
    caption: str

    @property
    def width(self) -> int:
        return self.box[2] - self.box[0]

    @property
    def height(self) -> int:
        return self.box[3] - self.box[1]

    def line(self) -> str | None:
        """The mask's line of the complete description (DCI ``_extract_caption``): ``"label:
        caption"`` for quality 0, the label for quality 1, ``None`` (left out) for quality 2."""
        if self.quality == 2:
            return None
        if self.quality == 1:
            return self.label
        return f"{self.label}: {self.caption}"


def _pixel(value: Any) -> int | None:
    """An integral pixel coordinate as an int, or ``None`` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        return None
    return int(value)


def _dci_mask(key: str, entry: Any) -> _DciMask:
    """Read one ``mask_data`` entry; :class:`_DciMaskError` names the key and the bad field."""
    where = f"mask_data[{key!r}]"
    if not isinstance(entry, dict):
        raise _DciMaskError(f"{where} is not a JSON object")
    bounds = entry.get("bounds")
    corners = [bounds.get(corner) if isinstance(bounds, dict) else None
               for corner in ("topLeft", "bottomRight")]
    box = [_pixel(c.get(axis)) if isinstance(c, dict) else None
           for c in corners for axis in ("x", "y")]
    if any(v is None for v in box):
        raise _DciMaskError(f"{where}: bounds must be {{topLeft: {{x, y}}, bottomRight: {{x, y}}}} "
                            f"in integer pixels, got {bounds!r}")
    idx, quality = entry.get("idx"), entry.get("mask_quality")
    if isinstance(idx, bool) or not isinstance(idx, int):
        raise _DciMaskError(f"{where}: idx must be an integer, got {idx!r}")
    if quality not in (0, 1, 2) or isinstance(quality, bool):
        raise _DciMaskError(f"{where}: mask_quality must be 0, 1 or 2, got {quality!r}")
    label, caption = entry.get("label"), entry.get("caption")
    if (quality < 2 and not isinstance(label, str)) or (quality == 0 and not isinstance(caption, str)):
        raise _DciMaskError(f"{where}: label (mask_quality 0 and 1) and caption (mask_quality 0) "
                            f"must be strings, got {type(label).__name__} and {type(caption).__name__}")
    x1, y1, x2, y2 = box
    return _DciMask(str(key), idx, (x1, y1, x2, y2), quality,
                    label if quality < 2 else "", caption if quality == 0 else "")


def _dci_masks(annotation: dict) -> list[_DciMask]:
    """Every mask of ``mask_data``, ordered by ``idx`` (DCI keeps the dict's order; its keys are
    the ``idx`` values, so the order is the same, and deterministic here)."""
    mask_data = annotation.get("mask_data")
    if not isinstance(mask_data, dict):
        raise _DciMaskError("mask_data must be a JSON object (mask key -> mask), "
                            f"got {type(mask_data).__name__}")
    return sorted((_dci_mask(key, entry) for key, entry in mask_data.items()), key=lambda m: (m.idx, m.key))


def _dci_complete(annotation: dict, min_size: int) -> tuple[str, list[str], list[dict]]:
    r"""DCI's complete description (``get_formatted_description_min_size(min_size, min_size)`` in
    DCI's ``dense_image.py``) with its sentences and one object per mask line.

    The caption is ``f"{short}\n{extra}"``, then, when any mask line remains, ``"\nThe following
    can also be seen in the image:\n"`` and the mask lines joined by ``"\n"``. Masks whose bounds
    are narrower or lower than ``min_size`` are left out (0 keeps every mask), and so are quality-2
    masks. Each mask line gives ``{"box": [x1, y1, x2, y2], "sentence_index": the first sentence of
    the line, "label"}``; a line without a sentence (an empty label) gives no object.

    Raises:
        _DciMaskError: a mask without readable bounds, idx, quality or label, or a kept mask whose
            box has no area.
    """
    head = f"{annotation.get('short_caption') or ''}\n{annotation.get('extra_caption') or ''}"
    lines: list[tuple[_DciMask, str]] = []
    for mask in _dci_masks(annotation):
        line = mask.line()
        if line is None or (min_size > 0 and (mask.width < min_size or mask.height < min_size)):
            continue
        if mask.width <= 0 or mask.height <= 0:
            raise _DciMaskError(f"mask_data[{mask.key!r}]: bounds {list(mask.box)} have no area "
                                "(bottomRight must be right of and below topLeft)")
        lines.append((mask, line))
    if not lines:
        return head, split_sentences(head), []
    caption = f"{head}\n{_DCI_MASKS_INTRO}\n"
    spans = []
    for k, (_, line) in enumerate(lines):
        caption += "\n" if k else ""
        spans.append((len(caption), len(caption) + len(line)))
        caption += line
    offsets = sentence_offsets(caption)
    objects = []
    for (mask, _), (begin, end) in zip(lines, spans):
        first = next((i for i, (start, _) in enumerate(offsets) if begin <= start < end), None)
        if first is not None:
            objects.append({"box": list(mask.box), "sentence_index": first, "label": mask.label})
    return caption, [caption[start:end] for start, end in offsets], objects


def _dci_features() -> dict[str, datasets.List]:
    """The extra columns of ``caption: complete`` (the objects schema of
    ``finetune.data.synthetic``, with DCI's label instead of shape/colour/size)."""
    return {
        "sentences": datasets.List(datasets.Value("string")),
        "objects": datasets.List({
            "box": datasets.List(datasets.Value("int32"), length=4),
            "sentence_index": datasets.Value("int32"),
            "label": datasets.Value("string"),
        }),
    }


def _dci_mask_min_size(spec: SourceSpec, mode: str) -> int:
    """``options.mask_min_size``: DCI's 224 unless set; only ``caption: complete`` reads masks."""
    if "mask_min_size" not in spec.options:
        return _DCI_MASK_MIN_SIZE
    size = spec.options["mask_min_size"]
    if mode != "complete":
        raise DataError(f"dci: options.mask_min_size applies to caption: complete only (caption is "
                        f"{mode!r}): set caption: complete or remove mask_min_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise DataError(f"dci: options.mask_min_size must be an integer >= 0 (pixels, both sides of "
                        f"a mask's bounds; 0 keeps every mask), got {size!r}")
    return size


@register_source(
    "dci",
    description="DCI (Urbanek et al. 2024): 7,805 SA-1B images with dense human captions; "
    "protocols all 7,805 (short + extra) / goal 1,999",
    protocols=tuple(available_protocols("dci")),
    splits=DCI_SPLITS,
)
def build_dci(spec: SourceSpec) -> datasets.Dataset:
    """DCI from ``densely_captioned_images/``: ``splits.json`` (split -> annotation files),
    ``annotations/<file>.json`` (``image``, ``short_caption``, ``extra_caption``) and ``photos/``.

    Protocol ``all`` (default): every image of every split, 7,805, caption = short_caption + " " +
    extra_caption (LoTLIP, FLAIR). ``goal``: GOAL's 1,999 test images, whose list is not part of
    DCI: give it as ``options.ids_file`` (GOAL's ``DCI_test.json`` or one id per line). Ids are
    image file stems (``sa_1234``). ``options.caption``: ``short+extra`` (default), ``short``,
    ``extra`` or ``complete``.

    ``complete``: DCI's complete description (:func:`_dci_complete`: short and extra caption, then
    one line per mask, "label: caption"), and the columns ``sentences`` and ``objects`` (each mask
    line's box and first sentence), the ground-truth regions of StructXLIP's
    ``regions.source: dataset``. ``options.mask_min_size`` (default 224, DCI's; 0 keeps every
    mask) leaves out masks whose bounds are smaller. An unreadable mask makes the annotation a
    problem record naming the file and the mask key.
    """
    mode = spec.options.get("caption", "short+extra")
    if mode not in _DCI_MODES:
        raise DataError(f"dci: options.caption must be one of {', '.join(_DCI_MODES)}, got {mode!r}")
    min_size = _dci_mask_min_size(spec, mode)
    protocol = _selection(spec, "dci")
    root = _find(_local_root(spec, "dci", _DCI_HOW), "splits.json", "dci", _DCI_HOW).parent
    splits = _read_json(root / "splits.json", "dci")
    if not isinstance(splits, dict):
        raise DataError(f"dci: {root / 'splits.json'} must map split names to annotation files")
    if protocol is None:
        if spec.split not in splits:
            raise DataError(f"dci: {root / 'splits.json'} has no split {spec.split!r} "
                            f"(it has {', '.join(splits)})")
        files = list(splits[spec.split])
    else:
        if protocol.name == "goal":
            pinned_ids(protocol, spec.options.get("ids_file"))  # fail before reading 7,805 files
        files = [name for split in splits.values() for name in split]
    rows = _Rows(extra=_dci_features() if mode == "complete" else None)
    for name in files:
        path = root / "annotations" / name
        if not path.is_file():
            rows.problem(f"annotations/{name}", "listed in splits.json but missing")
            continue
        try:
            annotation = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            rows.problem(f"annotations/{name}", f"not valid JSON: {error}")
            continue
        absent = _missing_keys(annotation, ("image", "short_caption")) if isinstance(
            annotation, dict) else "not a JSON object"
        if absent:
            rows.problem(f"annotations/{name}", absent)
            continue
        image = annotation["image"]
        if mode != "complete":
            rows.add(normalise_id(image), root / "photos" / image, _dci_caption(annotation, mode))
            continue
        try:
            caption, sentences, objects = _dci_complete(annotation, min_size)
        except _DciMaskError as error:
            rows.problem(f"annotations/{name}", str(error))
            continue
        rows.add(normalise_id(image), root / "photos" / image, caption,
                 extra={"sentences": sentences, "objects": objects})
    return _finish(rows, spec, protocol)


# --------------------------------------------------------------------------- Urban-1k

_URBAN_HOW = (
    "download Urban1k.zip from the hub dataset BeichenZhang/Urban1k and set path to the folder "
    "holding image/ and caption/, or leave path unset to download it into the datasets cache"
)


@register_source(
    "urban1k",
    description="Urban-1k (Long-CLIP): 1,000 urban images with long captions",
    protocols=tuple(available_protocols("urban1k")),
    splits=("test",),
)
def build_urban1k(spec: SourceSpec) -> datasets.Dataset:
    """Urban-1k from ``image/<N>.jpg`` + ``caption/<N>.txt`` (Long-CLIP's ``eval/retrieval``).

    One protocol, ``all``: every caption file with its image, 1,000 pairs; the caption is the
    text file's content, stripped. Without ``path`` the zip is fetched from the hub dataset
    ``BeichenZhang/Urban1k`` (file name ``Urban1k.zip``, not verified offline) into the cache.
    """
    protocol = get_protocol("urban1k", spec.protocol)  # its one split is the whole set
    if spec.path:
        root = _local_root(spec, "urban1k", _URBAN_HOW)
    else:
        url, sha = OFFICIAL_FILES["urban1k"]
        root = fetch_archive(url, sha, cache_dir=_cache(), desc="Urban-1k")
    captions = _find(root, "caption", "urban1k", _URBAN_HOW)
    images = captions.parent / "image"
    rows = _Rows()
    for text_file in sorted(captions.glob("*.txt")):
        caption = text_file.read_text(encoding="utf-8", errors="replace").strip()
        rows.add(text_file.stem, images / f"{text_file.stem}.jpg", caption)
    if not rows.n_examples:
        raise DataError(
            f"urban1k: no caption/*.txt files in {str(captions.parent)!r}; {_URBAN_HOW}"
        )
    return _finish(rows, spec, protocol)


# --------------------------------------------------------------------------- ShareGPT4V

_SHAREGPT4V_HOW = (
    f"get {SHAREGPT4V_JSON} from the hub dataset Lin-Chen/ShareGPT4V and its images (COCO, SAM "
    "from SA-1B, LLaVA sets) under one folder as the JSON's `image` paths expect, and set path to "
    "that folder (options.json_file if the JSON lives elsewhere)"
)


def _sharegpt4v_caption(row: Any) -> tuple[str, str, str] | str:
    """(id, image, caption) of a row, or a problem string."""
    if not isinstance(row, dict):
        return "not a JSON object"
    conversations = row.get("conversations")
    if not isinstance(row.get("image"), str) or row.get("id") is None:
        return "no id / image"
    if not (isinstance(conversations, list) and len(conversations) >= 2
            and isinstance(conversations[1], dict)
            and isinstance(conversations[1].get("value"), str)):
        return "no second conversation turn with a value"
    # Long-CLIP's loader flattens the caption's line breaks.
    return str(row["id"]), row["image"], conversations[1]["value"].replace("\n", " ").strip()


@register_source(
    "sharegpt4v",
    description="ShareGPT4V (Chen et al. 2024) share-captioner 1.2M captions; "
    "protocols first 1k / 10k rows",
    protocols=tuple(available_protocols("sharegpt4v")),
    splits=("train", "test"),
)
def build_sharegpt4v(spec: SourceSpec) -> datasets.Dataset:
    """ShareGPT4V from ``share-captioner_coco_lcs_sam_1246k_1107.json``: a list of ``{id, image,
    conversations}``; the caption is the second turn (the model's answer), line breaks flattened.

    Protocols: ``1k`` = the first 1,000 rows (Long-CLIP, its issues #8 / #60), ``10k`` = the
    first 10,000 (LoTLIP, FLAIR). ``split: train`` is every row after the first
    ``options.holdout`` (default 1,000, Long-CLIP's; use 10000 when evaluating on ``10k``),
    ``split: test`` the first ``holdout`` rows. Images are ``options.image_root`` (default: the
    JSON's folder) / ``image``.
    """
    protocol = _selection(spec, "sharegpt4v")
    root = _local_root(spec, "sharegpt4v", _SHAREGPT4V_HOW)
    default_json = root if root.is_file() else root / SHAREGPT4V_JSON
    json_file = Path(spec.options.get("json_file", default_json)).expanduser()
    if not json_file.is_file():
        raise DataError(f"sharegpt4v: no {json_file}; {_SHAREGPT4V_HOW}")
    default_images = root if root.is_dir() else json_file.parent
    image_root = Path(spec.options.get("image_root", default_images)).expanduser()
    data = _read_json(json_file, "sharegpt4v")
    if not isinstance(data, list):
        raise DataError(f"sharegpt4v: {json_file} must hold a JSON list of rows")
    holdout = int(spec.options.get("holdout", SHAREGPT4V_HOLDOUT))
    if protocol is not None:
        selected = data[: protocol.expected]
        offset = 0
    elif spec.split == "test":
        selected, offset = data[:holdout], 0
    else:
        selected, offset = data[holdout:], holdout
    rows = _Rows()
    for position, row in enumerate(selected, start=offset):
        item = _sharegpt4v_caption(row)
        if isinstance(item, str):
            rows.problem(f"{json_file.name} row {position}", item)
            continue
        row_id, image, caption = item
        rows.add(row_id, image_root / image, caption)
    return _finish(rows, spec, protocol)


# --------------------------------------------------------------------------- Flickr30k, COCO


def _karpathy_rows(
    entries: list, splits: set[str] | None, image_root: Path, n_captions: int | None, name: str
) -> _Rows:
    """Rows of a Karpathy ``dataset_*.json``: ``images[*]`` with ``filename``, ``split``,
    ``sentences[*].raw`` and, for COCO, ``filepath`` and ``cocoid``."""
    rows = _Rows(multi=True)
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("filename"), str):
            rows.problem(f"{name} images[{position}]", "no filename")
            continue
        if splits is not None and entry.get("split") not in splits:
            continue
        sentences = [s for s in entry.get("sentences", []) if isinstance(s, dict)]
        captions = [c for c in (str(s.get("raw", "")).strip() for s in sentences) if c]
        captions = captions[:n_captions]
        folder = image_root / entry["filepath"] if entry.get("filepath") else image_root
        id_ = str(entry["cocoid"]) if "cocoid" in entry else normalise_id(entry["filename"])
        rows.add(id_, folder / entry["filename"], captions[0] if captions else "", captions)
    return rows


def _image_dir(root: Path, spec: SourceSpec, names: tuple[str, ...]) -> Path:
    if spec.options.get("image_dir"):
        return Path(spec.options["image_dir"]).expanduser()
    return next((root / n for n in names if (root / n).is_dir()), root)


_FLICKR_HOW = (
    "Flickr30k images are given on request (https://shannon.cs.illinois.edu/DenotationGraph/): "
    "put flickr30k-images/, Karpathy's dataset_flickr30k.json (caption_datasets.zip) and, for the "
    "full protocol, results_20130124.token in one folder and set path to it"
)


@register_source(
    "flickr30k",
    description="Flickr30k: 5 captions per image; protocols Karpathy test 1k / full 31,783",
    protocols=tuple(available_protocols("flickr30k")),
    splits=("train", "val", "test"),
)
def build_flickr30k(spec: SourceSpec) -> datasets.Dataset:
    """Flickr30k from Karpathy's ``dataset_flickr30k.json`` and ``flickr30k-images/``.

    ``captions`` holds an image's five captions (all positives), ``caption`` the first. Protocol
    ``test`` (default): Karpathy ``split == "test"``, 1,000 images. ``full``: every image of the
    original ``results_20130124.token`` (``<file>#<k><TAB><caption>``), 31,783 images, as
    Long-CLIP and TULIP evaluate; without that file, every image of the Karpathy JSON (31,014:
    the count warning says so). ``options.image_dir`` overrides the image folder.
    """
    protocol = _selection(spec, "flickr30k")
    root = _local_root(spec, "flickr30k", _FLICKR_HOW)
    images = _image_dir(root, spec, ("flickr30k-images", "images"))
    token_file = root / FLICKR_TOKEN_FILE
    if protocol is not None and protocol.name == "full" and token_file.is_file():
        grouped: dict[str, list[str]] = defaultdict(list)
        for number, line in enumerate(token_file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            key, tab, caption = line.partition("\t")
            if not tab:
                raise DataError(f"flickr30k: {token_file} line {number} has no tab between the "
                                "image#k key and the caption")
            grouped[key.rsplit("#", 1)[0]].append(caption.strip())
        rows = _Rows(multi=True)
        for filename, captions in grouped.items():
            captions = captions[: protocol.captions_per_image]
            rows.add(normalise_id(filename), images / filename, captions[0], captions)
        return _finish(rows, spec, protocol)
    karpathy = _find(root, "dataset_flickr30k.json", "flickr30k", _FLICKR_HOW)
    data = _read_json(karpathy, "flickr30k")
    entries = data.get("images") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise DataError(f"flickr30k: {karpathy} has no 'images' list (Karpathy format)")
    if protocol is None:
        splits: set[str] | None = {spec.split}
    else:
        splits = None if protocol.name == "full" else {"test"}
    n_captions = protocol.captions_per_image if protocol else None
    rows = _karpathy_rows(entries, splits, images, n_captions, karpathy.name)
    return _finish(rows, spec, protocol)


_COCO_HOW = (
    "get val2017.zip and annotations_trainval2017.zip from https://cocodataset.org (or leave path "
    "unset to download them), and for the karpathy protocol Karpathy's dataset_coco.json with "
    "the val2014/ images; set path to the folder holding them"
)


def _coco_2017(spec: SourceSpec, split: str) -> tuple[Path, Path]:
    """(``captions_<split>.json``, image folder), local or (val2017) downloaded."""
    if spec.path:
        root = _local_root(spec, "coco", _COCO_HOW)
        annotations = _find(root, f"annotations/captions_{split}.json", "coco", _COCO_HOW)
        return annotations, _image_dir(root, spec, (split,))
    if split != "val2017":
        raise DataError(f"coco: split {split!r} is not downloaded automatically; {_COCO_HOW}")
    url, sha = OFFICIAL_FILES["coco_annotations_2017"]
    annotations = fetch_archive(url, sha, cache_dir=_cache(), desc="COCO annotations")
    url, sha = OFFICIAL_FILES["coco_val2017_images"]
    images = fetch_archive(url, sha, cache_dir=_cache(), desc="COCO val2017")
    return annotations / "annotations" / f"captions_{split}.json", images / "val2017"


def _coco_2017_rows(annotations_file: Path, images: Path, n_captions: int | None) -> _Rows:
    data = _read_json(annotations_file, "coco")
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) or not isinstance(
        data.get("annotations"), list
    ):
        raise DataError(f"coco: {annotations_file} needs 'images' and 'annotations' lists")
    by_image: dict[Any, list[str]] = defaultdict(list)
    for annotation in data["annotations"]:  # file order, as pycocotools keeps it
        if isinstance(annotation, dict) and isinstance(annotation.get("caption"), str):
            by_image[annotation.get("image_id")].append(annotation["caption"].strip())
    rows = _Rows(multi=True)
    for position, image in enumerate(data["images"]):
        if not isinstance(image, dict) or "id" not in image or "file_name" not in image:
            rows.problem(f"{annotations_file.name} images[{position}]", "no id / file_name")
            continue
        captions = by_image.get(image["id"], [])[:n_captions]
        rows.add(str(image["id"]), images / image["file_name"], captions[0] if captions else "",
                 captions)
    return rows


@register_source(
    "coco",
    description="MS-COCO captions: 5 per image; protocols 2017 val 5k / Karpathy 5k test / Karpathy 1k x 5 folds",
    protocols=tuple(available_protocols("coco")),
    splits=KARPATHY_SPLITS + ("train2017", "val2017"),
)
def build_coco(spec: SourceSpec) -> datasets.Dataset:
    """COCO captions from the 2017 annotation files or Karpathy's ``dataset_coco.json``.

    Protocol ``val2017`` (default, Long-CLIP and FLAIR): ``annotations/captions_val2017.json``
    and ``val2017/``, 5,000 images with their first 5 captions in file order (as Long-CLIP's
    ``captions[0:5]``). ``karpathy``: ``dataset_coco.json`` ``split == "test"``, 5,000 images,
    paths ``<filepath>/<filename>``, ids ``cocoid``. ``karpathy_1k``: the same 5,000 images, which
    evaluation scores as 5 folds of 1,000 (``Protocol.folds``; VSE++, LAPS and GRM's "COCO 1K"). Splits ``train2017`` / ``val2017`` read
    the 2017 files (all captions), ``train`` / ``restval`` / ``val`` / ``test`` Karpathy's.
    ``options.image_dir`` overrides the image folder of the 2017 files.
    """
    protocol = _selection(spec, "coco")
    if protocol is None:
        split = spec.split
    else:
        split = "val2017" if protocol.name == "val2017" else "test"
    n_captions = protocol.captions_per_image if protocol else None
    if split in ("train2017", "val2017"):
        annotations, images = _coco_2017(spec, split)
        rows = _coco_2017_rows(annotations, images, n_captions)
    else:
        root = _local_root(spec, "coco", _COCO_HOW)
        karpathy = _find(root, "dataset_coco.json", "coco", _COCO_HOW)
        data = _read_json(karpathy, "coco")
        entries = data.get("images") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise DataError(f"coco: {karpathy} has no 'images' list (Karpathy format)")
        rows = _karpathy_rows(entries, {split}, karpathy.parent, n_captions, karpathy.name)
    return _finish(rows, spec, protocol)
