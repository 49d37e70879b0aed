"""Shared helpers of the benchmark builders (:mod:`finetune.data.benchmarks`): the row collector, protocol
selection and pinned ids, local roots and archive layouts, JSON readers, Karpathy-format rows, the official
download locations, and :func:`protocol_record`.

A module whose name starts with ``_`` is skipped by the registries' discovery rule (``finetune.plugins``):
nothing is registered here, each benchmark registers in its own module.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets

from finetune.data.protocols import PROTOCOLS, Protocol, check_count, get_protocol, normalise_id, pinned_ids
from finetune.data.sources import DataError, LoadedSource, SourceSpec, source_cache_dir

logger = logging.getLogger("finetune.data.benchmarks")

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

KARPATHY_SPLITS = ("train", "restval", "val", "test")
_FEATURES = {
    "id": datasets.Value("string"),
    "image": datasets.Value("string"),
    "caption": datasets.Value("string"),
}


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


# --------------------------------------------------------------------------- Karpathy format (Flickr30k, COCO)


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
