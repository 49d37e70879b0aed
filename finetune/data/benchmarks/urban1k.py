"""Urban-1k (Long-CLIP) as the data source ``urban1k``."""

from __future__ import annotations

import datasets

from finetune.data.download import fetch_archive
from finetune.data.images import broken_link_reason
from finetune.data.protocols import available_protocols, get_protocol
from finetune.data.sources import DataError, SourceSpec, register_source

from ._common import OFFICIAL_FILES, _cache, _find, _finish, _local_root, _Rows

__all__ = ["build_urban1k"]


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
        link_problem = broken_link_reason(text_file)
        if link_problem is not None:  # skipped and counted, like a missing image
            rows.problem(text_file.stem, f"caption file {text_file}: {link_problem}")
            continue
        caption = text_file.read_text(encoding="utf-8", errors="replace").strip()
        rows.add(text_file.stem, images / f"{text_file.stem}.jpg", caption)
    if not rows.n_examples:
        raise DataError(
            f"urban1k: no caption/*.txt files in {str(captions.parent)!r}; {_URBAN_HOW}"
        )
    return _finish(rows, spec, protocol)
