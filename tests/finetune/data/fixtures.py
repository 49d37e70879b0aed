"""Tiny benchmark fixtures in each benchmark's official on-disk format.

Each ``write_*_fixture(folder, ...)`` writes a handful of small JPEG images and captions laid out
exactly as the official release lays them out, and returns the folder to pass as ``path:`` in a
recipe or a :class:`~finetune.data.sources.SourceSpec`. Images are 16 x 16 solid colours, distinct
per example; captions are distinct, multi-sentence and deterministic, so tests can assert exact
values.

Import them from other tests with ``from tests.finetune.data.fixtures import write_docci_fixture``
(tests run from the repository root).

Layouts (see ``finetune/data/benchmarks/`` for what each loader reads):

- DOCCI: ``docci_descriptions.jsonlines`` (``example_id``, ``split``, ``image_file``,
  ``description``) and ``images/<image_file>``.
- DCI: ``densely_captioned_images/{splits.json, annotations/<name>.json, photos/<image>}``, each
  annotation with ``image``, ``short_caption``, ``extra_caption``, ``mask_data`` (optionally
  :data:`DCI_MASKS`).
- Urban-1k: ``image/<N>.jpg`` and ``caption/<N>.txt``.
- ShareGPT4V: ``share-captioner_coco_lcs_sam_1246k_1107.json`` (a list of ``{id, image,
  conversations: [{from: human, value}, {from: gpt, value}]}``) and images under ``coco/`` and
  ``sam/``.
- Flickr30k: Karpathy ``dataset_flickr30k.json`` and ``flickr30k-images/``; optionally the original
  ``results_20130124.token``.
- COCO: ``annotations/captions_val2017.json`` and ``val2017/`` (2017 val), Karpathy
  ``dataset_coco.json`` and ``val2014/``.
"""

from __future__ import annotations

import json
import tarfile
import zipfile
from pathlib import Path

from PIL import Image

DOCCI_SPLITS = ("train", "test", "qual_dev", "qual_test")
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black", "grey", "pink")


def _write_image(path: Path, index: int, size: tuple[int, int] = (16, 16)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    colour = ((37 * index) % 256, (91 * index + 40) % 256, (151 * index + 80) % 256)
    Image.new("RGB", size, colour).save(path, format="JPEG")


def long_caption(tag: str, index: int) -> str:
    """The deterministic three-sentence caption of example ``index`` of benchmark ``tag``."""
    colour = COLOURS[index % len(COLOURS)]
    return (
        f"A {colour} {tag} scene number {index}. "
        f"There are {index + 2} small objects near the centre. "
        f"The background of image {index} is plain."
    )


def write_docci_fixture(
    folder: str | Path, n_train: int, n_test: int, *, n_qual_dev: int = 0, n_qual_test: int = 0
) -> Path:
    """Write a DOCCI release: ``docci_descriptions.jsonlines`` + ``images/``.

    Example ids follow the release (``train_00000``, ``test_00000``, ``qual_test_00000``...), one
    image ``<example_id>.jpg`` each, descriptions from :func:`long_caption` (``"docci"``, running
    index over all splits in the order train, test, qual_dev, qual_test).

    Returns:
        ``folder``, ready to be passed as ``path:``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    counts = dict(zip(DOCCI_SPLITS, (n_train, n_test, n_qual_dev, n_qual_test)))
    lines, index = [], 0
    for split in DOCCI_SPLITS:
        for k in range(counts[split]):
            example_id = f"{split}_{k:05d}"
            image_file = f"{example_id}.jpg"
            _write_image(folder / "images" / image_file, index)
            record = {
                "example_id": example_id,
                "split": split,
                "image_file": image_file,
                "description": long_caption("docci", index),
            }
            lines.append(json.dumps(record))
            index += 1
    (folder / "docci_descriptions.jsonlines").write_text("\n".join(lines) + "\n")
    return folder


#: The masks ``write_dci_fixture(..., masks=True)`` gives every image (``mask_data`` in DCI's
#: format, keys deliberately out of ``idx`` order): a fine mask with a two-sentence caption, a
#: low-quality one (its label only), an unusable one (left out) and one smaller than DCI's
#: 224 x 224 (left out unless ``mask_min_size`` allows it). Bounds are pixels of a 400 x 300 image.
DCI_MASKS: dict[str, dict] = {
    "3": {"idx": 3, "bounds": {"topLeft": {"x": 100, "y": 100}, "bottomRight": {"x": 150, "y": 140}},
          "area": 1500, "label": "Small cup", "caption": "It is white.", "mask_quality": 0,
          "parent": 0, "requirements": [], "outer_mask": ""},
    "0": {"idx": 0, "bounds": {"topLeft": {"x": 10, "y": 20}, "bottomRight": {"x": 310, "y": 280}},
          "area": 60000, "label": "A wooden table", "caption": "Its legs are thin. It holds a cup.",
          "mask_quality": 0, "parent": -1, "requirements": [3], "outer_mask": ""},
    "2": {"idx": 2, "bounds": {"topLeft": {"x": 0, "y": 0}, "bottomRight": {"x": 400, "y": 300}},
          "area": 90000, "label": "Blurry thing", "caption": "Hard to tell.", "mask_quality": 2,
          "parent": -1, "requirements": [], "outer_mask": ""},
    "1": {"idx": 1, "bounds": {"topLeft": {"x": 150, "y": 50}, "bottomRight": {"x": 400, "y": 290}},
          "area": 40000, "label": "Chair", "caption": "", "mask_quality": 1,
          "parent": -1, "requirements": [], "outer_mask": ""},
}


def write_dci_fixture(
    folder: str | Path, n_train: int, n_valid: int, n_test: int, *, masks: bool = False
) -> Path:
    """Write a DCI release under ``folder/densely_captioned_images``.

    Image ``sa_<1000+i>.jpg`` has annotation ``sa_<1000+i>.json`` with ``short_caption`` ``"Short
    caption i."`` and ``extra_caption`` :func:`long_caption` (``"dci"``, i); ``splits.json`` lists
    the annotation files per split (train, valid, test). ``mask_data`` is empty, or, with
    ``masks``, :data:`DCI_MASKS` (the images are then 400 x 300, the size the bounds refer to).

    Returns:
        ``folder`` (the parent of ``densely_captioned_images``).
    """
    folder = Path(folder)
    root = folder / "densely_captioned_images"
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[str]] = {"train": [], "valid": [], "test": []}
    index = 0
    for split, count in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        for _ in range(count):
            stem = f"sa_{1000 + index}"
            _write_image(root / "photos" / f"{stem}.jpg", index, (400, 300) if masks else (16, 16))
            annotation = {
                "image": f"{stem}.jpg",
                "short_caption": f"Short caption {index}.",
                "extra_caption": long_caption("dci", index),
                "mask_data": DCI_MASKS if masks else {},
                "mask_keys": list(DCI_MASKS) if masks else [],
            }
            (root / "annotations" / f"{stem}.json").write_text(json.dumps(annotation))
            splits[split].append(f"{stem}.json")
            index += 1
    (root / "splits.json").write_text(json.dumps(splits))
    return folder


def write_urban1k_fixture(folder: str | Path, n: int) -> Path:
    """Write Urban-1k: ``image/<N>.jpg`` and ``caption/<N>.txt`` for N = 1..n.

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    (folder / "caption").mkdir(parents=True, exist_ok=True)
    for number in range(1, n + 1):
        _write_image(folder / "image" / f"{number}.jpg", number)
        (folder / "caption" / f"{number}.txt").write_text(long_caption("urban", number) + "\n")
    return folder


SHAREGPT4V_JSON = "share-captioner_coco_lcs_sam_1246k_1107.json"


def write_sharegpt4v_fixture(folder: str | Path, n: int) -> Path:
    """Write ShareGPT4V's ``share-captioner_coco_lcs_sam_1246k_1107.json`` and its images.

    Even rows are COCO images (``coco/train2017/<12 digits>.jpg``), odd rows SAM images
    (``sam/images/sa_<i>.jpg``); the second conversation turn (``gpt``) is :func:`long_caption`
    (``"sharegpt4v"``, i) with a line break after its first sentence, as real captions have.

    Returns:
        ``folder`` (the image root; the JSON sits in it).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(n):
        if index % 2 == 0:
            row_id = f"{index:012d}"
            image = f"coco/train2017/{row_id}.jpg"
        else:
            row_id = f"sa_{index}"
            image = f"sam/images/{row_id}.jpg"
        _write_image(folder / image, index)
        caption = long_caption("sharegpt4v", index).replace(". ", ".\n", 1)
        rows.append(
            {
                "id": row_id,
                "image": image,
                "conversations": [
                    {"from": "human", "value": "What do you see happening in this image?\n<image>"},
                    {"from": "gpt", "value": caption},
                ],
            }
        )
    (folder / SHAREGPT4V_JSON).write_text(json.dumps(rows))
    return folder


def five_captions(tag: str, index: int) -> list[str]:
    """The five short captions of image ``index`` in the Flickr30k / COCO fixtures."""
    return [f"{tag} image {index}, caption {k}." for k in range(5)]


def _karpathy_entry(index: int, filename: str, split: str, tag: str, **extra) -> dict:
    sentences = [
        {"raw": raw, "tokens": raw.rstrip(".").replace(",", "").split(), "imgid": index,
         "sentid": 5 * index + k}
        for k, raw in enumerate(five_captions(tag, index))
    ]
    return {"filename": filename, "imgid": index, "split": split, "sentences": sentences,
            "sentids": [5 * index + k for k in range(5)], **extra}


def write_flickr30k_fixture(
    folder: str | Path, n_train: int, n_val: int, n_test: int, *, token_file: bool = False
) -> Path:
    """Write Karpathy's ``dataset_flickr30k.json`` and ``flickr30k-images/<id>.jpg``.

    Image i is ``<1000000+i>.jpg`` with :func:`five_captions` (``"flickr"``, i). With
    ``token_file``, also the original ``results_20130124.token`` (``<file>#k<TAB>caption``) over
    all images, which the ``full`` protocol reads.

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    images, tokens, index = [], [], 0
    for split, count in (("train", n_train), ("val", n_val), ("test", n_test)):
        for _ in range(count):
            filename = f"{1000000 + index}.jpg"
            _write_image(folder / "flickr30k-images" / filename, index)
            images.append(_karpathy_entry(index, filename, split, "flickr"))
            captions = five_captions("flickr", index)
            tokens += [f"{filename}#{k}\t{raw}" for k, raw in enumerate(captions)]
            index += 1
    karpathy_json = {"images": images, "dataset": "flickr30k"}
    (folder / "dataset_flickr30k.json").write_text(json.dumps(karpathy_json))
    if token_file:
        (folder / "results_20130124.token").write_text("\n".join(tokens) + "\n")
    return folder


def write_coco_fixture(
    folder: str | Path, n_val2017: int, *, karpathy: tuple[int, int, int] = (0, 0, 0),
    extra_captions: int = 1,
) -> Path:
    """Write COCO: 2017 val captions + images, and optionally Karpathy's ``dataset_coco.json``.

    2017 val: ``annotations/captions_val2017.json`` (``images``: ``id``, ``file_name``;
    ``annotations``: ``image_id``, ``id``, ``caption``) and ``val2017/<12 digits>.jpg``; image i has
    id ``100+i`` and :func:`five_captions` (``"coco"``, i) followed by ``extra_captions`` more
    (``"coco image i, extra caption k."``), as some COCO images have six or seven.
    Karpathy: ``karpathy=(n_train, n_val, n_test)`` entries with ``filepath`` ``val2014`` and
    ``filename`` ``COCO_val2014_<12 digits>.jpg``, captions :func:`five_captions`
    (``"karpathy"``, i).

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    (folder / "annotations").mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for index in range(n_val2017):
        image_id = 100 + index
        file_name = f"{image_id:012d}.jpg"
        _write_image(folder / "val2017" / file_name, index)
        images.append({"id": image_id, "file_name": file_name, "height": 16, "width": 16})
        captions = five_captions("coco", index) + [
            f"coco image {index}, extra caption {k}." for k in range(extra_captions)
        ]
        for caption in captions:
            annotation_id = len(annotations) + 1
            annotations.append({"image_id": image_id, "id": annotation_id, "caption": caption})
    # COCO does not group annotations by image: interleave them to test that the loader does.
    annotations = annotations[::2] + annotations[1::2]
    captions_json = {"info": {}, "licenses": [], "images": images, "annotations": annotations}
    (folder / "annotations" / "captions_val2017.json").write_text(json.dumps(captions_json))
    entries, index = [], 0
    for split, count in zip(("train", "val", "test"), karpathy):
        for _ in range(count):
            cocoid = 500000 + index
            filename = f"COCO_val2014_{cocoid:012d}.jpg"
            _write_image(folder / "val2014" / filename, index)
            entry = _karpathy_entry(index, filename, split, "karpathy", filepath="val2014")
            entries.append({**entry, "cocoid": cocoid})
            index += 1
    if entries:
        karpathy_json = {"images": entries, "dataset": "coco"}
        (folder / "dataset_coco.json").write_text(json.dumps(karpathy_json))
    return folder


def make_archive(folder: str | Path, archive: str | Path) -> Path:
    """Pack ``folder``'s content into ``archive`` (``.tar.gz`` or ``.zip``), paths relative to it.

    Returns:
        ``archive``.
    """
    folder, archive = Path(folder), Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive, "w") as zipped:
            for path in files:
                zipped.write(path, path.relative_to(folder).as_posix())
    else:
        with tarfile.open(archive, "w:gz") as tarred:
            for path in files:
                tarred.add(path, arcname=path.relative_to(folder).as_posix())
    return archive
