"""Flickr30k (Karpathy splits and the full 31,783 images) as the data source ``flickr30k``."""

from __future__ import annotations

from collections import defaultdict

import datasets

from finetune.data.protocols import available_protocols, normalise_id
from finetune.data.sources import DataError, SourceSpec, register_source

from ._common import _find, _finish, _image_dir, _karpathy_rows, _local_root, _read_json, _Rows, _selection

__all__ = ["build_flickr30k", "FLICKR_TOKEN_FILE"]


FLICKR_TOKEN_FILE = "results_20130124.token"

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
