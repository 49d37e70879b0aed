"""DOCCI (Onoe et al. 2024) and DOCCI-FG (FLAIR 4.3) as data sources: ``docci`` and ``docci_fg``."""

from __future__ import annotations

import re
from pathlib import Path

import datasets

from finetune.data.download import fetch, fetch_archive
from finetune.data.protocols import Protocol, available_protocols
from finetune.data.sources import DataError, SourceSpec, register_source
from finetune.data.text import split_sentences

from ._common import OFFICIAL_FILES, _cache, _find, _finish, _jsonlines, _local_root, _missing_keys, _Rows, _selection

__all__ = ["build_docci", "build_docci_fg", "DOCCI_SPLITS"]


DOCCI_SPLITS = ("train", "test", "qual_dev", "qual_test")

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
