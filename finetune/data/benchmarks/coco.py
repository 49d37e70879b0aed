"""MS-COCO captions (2017 files and Karpathy's splits) as the data source ``coco``."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import datasets

from finetune.data.download import fetch_archive
from finetune.data.protocols import available_protocols
from finetune.data.sources import DataError, SourceSpec, register_source

from ._common import (
    KARPATHY_SPLITS,
    OFFICIAL_FILES,
    _cache,
    _find,
    _finish,
    _image_dir,
    _karpathy_rows,
    _local_root,
    _read_json,
    _Rows,
    _selection,
)

__all__ = ["build_coco"]


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
