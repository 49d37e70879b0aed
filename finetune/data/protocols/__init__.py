"""Pinned evaluation protocols of the long-caption benchmarks (DESIGN 4, "Datasets").

A protocol names the exact image set a paper reports on (DOCCI test 5,000 or GOAL's 5,100, DCI all
7,805, ...). Each benchmark's loader selects the protocol's images from the official files, then:

- records the protocol's name, the number of images and ``ids_sha256`` (sha256 of the sorted ids,
  one per line) in ``LoadedSource.info``, so ``metrics.json`` says exactly what was evaluated;
- warns (does not fail) when the count differs from the protocol's published size, so a user with
  an incomplete copy sees it, while tiny test fixtures still load;
- where a pinned id list exists (a file ``<benchmark>-<protocol>.txt`` shipped in this folder, or
  the user's ``options.ids_file``), keeps only listed ids: any other id is an error or a counted
  skip, as the data layer's ``on_error`` says, and listed ids missing from the files are reported.

No id lists are shipped yet: the official lists could not be fetched where this toolkit was built,
so every protocol is derived from the official split files (see :data:`PROTOCOLS`). ``DCI goal``
has no such split file and needs the user's ``options.ids_file`` (GOAL's ``DCI_test.json``).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from finetune.data.images import DataError

PROTOCOL_DIR = Path(__file__).resolve().parent

#: Keys read, in this order, from the objects of a JSON ids file (GOAL's lists use ``filename``).
ID_KEYS = ("id", "example_id", "image_id", "filename", "image", "file_name")


@dataclass(frozen=True)
class Protocol:
    """One evaluation protocol of a benchmark.

    Attributes:
        benchmark: registry name of the benchmark (``docci``).
        name: protocol name, as in ``--protocol docci=goal`` or ``docci:goal``.
        expected: number of images the papers evaluate on.
        selection: how the images are selected from the official files.
        used_by: papers / code that report on it.
        captions_per_image: positives per image where fixed (5 for COCO and Flickr30k).
        needs_ids_file: the selection exists only as an id list the user must supply.
        folds: evaluated as this many consecutive blocks of images (dataset order), each against its
            own captions only, and Recall@K averaged over the blocks (COCO 1K: 5 folds of 1,000).
    """

    benchmark: str
    name: str
    expected: int
    selection: str
    used_by: str
    captions_per_image: int | None = None
    needs_ids_file: bool = False
    folds: int | None = None


#: Benchmark name -> its protocols, the default first.
PROTOCOLS: dict[str, tuple[Protocol, ...]] = {
    "docci": (
        Protocol("docci", "test", 5000, "records with split == 'test'", "FLAIR, F-CAST"),
        Protocol("docci", "goal", 5100, "split 'test' + 'qual_test' (GOAL's docci_test.json)",
                 "GOAL, StructXLIP"),
    ),
    "dci": (
        Protocol("dci", "all", 7805, "every image of splits.json (train + valid + test), "
                 "caption = short_caption + extra_caption", "LoTLIP, FLAIR"),
        Protocol("dci", "goal", 1999, "the images listed in GOAL's datasets/DCI_test.json",
                 "GOAL, StructXLIP", needs_ids_file=True),
    ),
    "urban1k": (
        Protocol("urban1k", "all", 1000, "every image/N.jpg with its caption/N.txt",
                 "Long-CLIP, FLAIR, GOAL"),
    ),
    "sharegpt4v": (
        Protocol("sharegpt4v", "1k", 1000, "the first 1,000 rows of "
                 "share-captioner_coco_lcs_sam_1246k_1107.json", "Long-CLIP"),
        Protocol("sharegpt4v", "10k", 10000, "the first 10,000 rows of the same file",
                 "LoTLIP, FLAIR"),
    ),
    "flickr30k": (
        Protocol("flickr30k", "test", 1000, "Karpathy split == 'test', 5 captions per image",
                 "FLAIR, CLIP_benchmark, FAST-GOAL", captions_per_image=5),
        Protocol("flickr30k", "full", 31783, "every image of results_20130124.token, "
                 "5 captions each", "Long-CLIP, TULIP", captions_per_image=5),
    ),
    "coco": (
        Protocol("coco", "val2017", 5000, "captions_val2017.json, the first 5 captions of each "
                 "image", "Long-CLIP, FLAIR", captions_per_image=5),
        Protocol("coco", "karpathy", 5000, "Karpathy dataset_coco.json split == 'test', "
                 "5 captions per image", "CLIP_benchmark, FAST-GOAL, VSE++, LAPS, GRM (5K)", captions_per_image=5),
        Protocol("coco", "karpathy_1k", 5000, "the karpathy test images as 5 folds of 1,000 images "
                 "(in id order), each with its own 5,000 captions; Recall@K averaged over the folds",
                 "VSE++, LAPS, GRM (COCO 1K)", captions_per_image=5, folds=5),
    ),
    "docci_fg": (
        Protocol("docci_fg", "test", 5000, "DOCCI test images, every sentence of the description "
                 "a positive caption (35,533 in FLAIR Tab. 6)", "FLAIR 4.3"),
    ),
}


def available_protocols(name: str) -> list[str]:
    """Protocol names of benchmark ``name``, the default first (``[]`` for non-benchmarks)."""
    return [protocol.name for protocol in PROTOCOLS.get(name, ())]


def get_protocol(benchmark: str, name: str | None = None) -> Protocol:
    """The protocol ``name`` of ``benchmark`` (its default when ``name`` is ``None``).

    Raises:
        DataError: unknown benchmark or protocol; the message lists the available ones.
    """
    if benchmark not in PROTOCOLS:
        raise DataError(
            f"{benchmark!r} has no evaluation protocols; benchmarks with protocols: "
            f"{', '.join(sorted(PROTOCOLS))}"
        )
    protocols = PROTOCOLS[benchmark]
    if name is None:
        return protocols[0]
    for protocol in protocols:
        if protocol.name == name:
            return protocol
    raise DataError(
        f"unknown protocol {name!r} for {benchmark}: choose one of "
        f"{', '.join(p.name for p in protocols)} (e.g. `protocol: {protocols[0].name}`)"
    )


def ids_sha256(ids: Iterable[str]) -> str:
    """sha256 of the sorted ids joined by newlines: the fingerprint of an evaluation set."""
    return hashlib.sha256("\n".join(sorted(ids)).encode("utf-8")).hexdigest()


def normalise_id(value: object) -> str:
    """An id as the loaders write it: a file name loses its folders and extension.

    ``"images/test_00012.jpg"`` -> ``"test_00012"``; ``139`` -> ``"139"``.
    """
    text = str(value).strip()
    if "/" in text or "." in Path(text).name:
        return Path(text).stem
    return text


def read_ids_file(path: str | Path) -> list[str]:
    """Read a pinned id list.

    Accepts a text file (one id per line, ``#`` comments and blank lines ignored), a JSON list of
    ids, or a JSON list of objects holding one of :data:`ID_KEYS` (GOAL's ``{"filename",
    "caption"}`` lists). Every id goes through :func:`normalise_id`.

    Raises:
        FileNotFoundError: no such file.
        DataError: the JSON is not a list of ids / objects with an id key.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"ids file {path} does not exist (set `options.ids_file` to a list "
                                "of ids, one per line, or a JSON list)")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() != ".json":
        lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
        return [normalise_id(line) for line in lines if line]
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"ids file {path} is not valid JSON: {error}") from error
    if isinstance(rows, dict):
        rows = rows.get("images", rows.get("ids"))
    if not isinstance(rows, list):
        raise DataError(f"ids file {path} must hold a JSON list of ids or of objects with one "
                         f"of the keys {', '.join(ID_KEYS)}")
    ids = []
    for position, row in enumerate(rows):
        if isinstance(row, dict):
            key = next((k for k in ID_KEYS if k in row), None)
            if key is None:
                raise DataError(f"ids file {path}, entry {position}: none of the keys "
                                 f"{', '.join(ID_KEYS)} (found {', '.join(map(str, row))})")
            row = row[key]
        ids.append(normalise_id(row))
    return ids


def pinned_ids(
    protocol: Protocol, ids_file: str | Path | None = None
) -> tuple[list[str], str] | None:
    """The pinned id list of ``protocol`` and where it came from, or ``None`` when there is none.

    The user's ``ids_file`` comes first, then a list shipped as ``<benchmark>-<protocol>.txt`` in
    this package.

    Raises:
        DataError: the protocol needs an ids file and none was given.
    """
    if ids_file is not None:
        return read_ids_file(ids_file), str(ids_file)
    shipped = PROTOCOL_DIR / f"{protocol.benchmark}-{protocol.name}.txt"
    if shipped.is_file():
        return read_ids_file(shipped), f"shipped {shipped.name}"
    if protocol.needs_ids_file:
        raise DataError(
            f"protocol {protocol.benchmark}:{protocol.name} ({protocol.expected} images) is only "
            f"defined by an id list that is not distributed with the data ({protocol.selection}): "
            f"set `options.ids_file` to that list (JSON or one id per line), or use protocol "
            f"{PROTOCOLS[protocol.benchmark][0].name!r}"
        )
    return None


def check_count(protocol: Protocol, n_images: int, *, stacklevel: int = 2) -> bool:
    """Warn when ``n_images`` differs from the protocol's published size; True when equal."""
    if n_images == protocol.expected:
        return True
    warnings.warn(
        f"{protocol.benchmark}:{protocol.name} has {n_images} images here, the papers evaluate on "
        f"{protocol.expected} ({protocol.selection}): results are not comparable to published "
        "numbers; check that the local copy is complete",
        stacklevel=stacklevel + 1,
    )
    return False
