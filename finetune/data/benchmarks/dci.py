"""DCI (Urbanek et al. 2024, Densely Captioned Images) as the data source ``dci``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import datasets

from finetune.data.protocols import available_protocols, normalise_id, pinned_ids
from finetune.data.sources import DataError, SourceSpec, register_source
from finetune.data.text import sentence_offsets, split_sentences

from ._common import _find, _finish, _local_root, _missing_keys, _read_json, _Rows, _selection

__all__ = ["build_dci", "DCI_SPLITS"]


DCI_SPLITS = ("train", "valid", "test")

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
