"""One-off, per-dataset preprocessing cached on disk and keyed by its parameters (DESIGN 2-3).

:func:`cached_map` runs a ``datasets.Dataset.map`` function once per (dataset, step, parameters,
code version) and reuses the result afterwards: StructXLIP's edge maps, filtered captions and
regions are computed once before fine-tuning (paper D.3) and every later run starts at once.

Layout: ``<cache_dir>/<name>-<key>/`` holds the computed columns only (``data*.arrow``, one file
per process of ``num_proc``) and ``meta.json`` (name, parameters, code version, dataset
fingerprint, rows). The input columns are not copied: the cached columns are joined back to the
input dataset column-wise. A step is written into a temporary folder next to it and moved into
place with ``os.replace``, so an interrupted or failing step never leaves a partial cache behind.

``meta.json`` also records the size and sha256 of every arrow file at write time; a cache is checked
against them before it is reused, and a damaged one (truncated, bit-flipped, unreadable, or written by
an older version without that record) is rebuilt with a warning naming it. A temporary folder carries
its writer's ``PID@HOST`` (:func:`finetune.files.process_tag`): those of processes that are gone
(killed during a write) are removed, those of live ones never.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import datasets

from finetune.files import owner_alive, process_tag, tag_owner

__all__ = ["cache_key", "cached_map", "clean_stale_temporaries", "default_cache_dir", "file_fingerprints",
           "verify_cache"]

logger = logging.getLogger("xlipkit")


def default_cache_dir() -> Path:
    """``$XLIPKIT_CACHE/preprocess``, by default ``~/.cache/xlipkit/preprocess``."""
    root = os.environ.get("XLIPKIT_CACHE") or Path.home() / ".cache" / "xlipkit"
    return Path(root) / "preprocess"


def _fingerprint(dataset: datasets.Dataset) -> str:
    fingerprint = getattr(dataset, "_fingerprint", None)
    if not fingerprint:
        raise ValueError("the dataset has no fingerprint; pass a datasets.Dataset (not an IterableDataset).")
    return fingerprint


def cache_key(dataset: datasets.Dataset, *, name: str, params: Mapping[str, Any], code_version: str) -> str:
    """A stable 16-hex-digit key of (dataset fingerprint, step name, parameters, code version).

    ``params`` is serialised as sorted JSON (values that JSON cannot hold are written with
    ``str``), so equal parameters give equal keys across processes and runs.
    """
    payload = json.dumps(
        {"dataset": _fingerprint(dataset), "name": name, "params": params, "code_version": code_version},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _validate_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise ValueError(
            f"cache step name {name!r} must be non-empty and use only letters, digits, '-', '_' and '.'."
        )


def _data_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("data*.arrow"))


def _load(folder: Path) -> datasets.Dataset:
    files = _data_files(folder)
    if not files:
        raise FileNotFoundError(f"cache folder {str(folder)!r} holds no data*.arrow file.")
    parts = [datasets.Dataset.from_file(str(f)) for f in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_fingerprints(folder: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """``{file name: {"size", "sha256"}}`` of a cache folder's arrow files (what ``meta.json`` records)."""
    return {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)} for f in _data_files(Path(folder))}


def verify_cache(folder: str | os.PathLike[str], meta: Mapping[str, Any] | None = None) -> str | None:
    """Why the cache in ``folder`` cannot be trusted, or None when its arrow files are those written: the
    same names, sizes (a truncated file) and sha256 (a flipped bit) as ``meta.json`` records."""
    folder = Path(folder)
    meta = _read_meta(folder) if meta is None else meta
    recorded = (meta or {}).get("files")
    if not isinstance(recorded, dict) or not recorded:
        return "meta.json records no fingerprint of its files (an older xlipkit wrote it)"
    present = {f.name: f for f in _data_files(folder)}
    if set(present) != set(recorded):
        missing = sorted(set(recorded) - set(present)) or sorted(set(present) - set(recorded))
        return f"its arrow files differ from those written ({', '.join(missing)})"
    for name, expected in sorted(recorded.items()):
        size = present[name].stat().st_size
        if size != expected.get("size"):
            return f"{name} has {size} bytes, {expected.get('size')} were written (truncated?)"
    for name, expected in sorted(recorded.items()):
        if _sha256(present[name]) != expected.get("sha256"):
            return f"{name} does not match its sha256 (damaged on disk)"
    return None


def clean_stale_temporaries(root: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary folders (``.NAME-KEY.tmp-PID@HOST.*``, and ``.old-`` ones) that processes which
    are gone left in the cache folder ``root`` (a kill during a cache write); those of live processes, and
    of other hosts, stay. Returns the names removed."""
    root = Path(root)
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for path in entries:
        if not path.name.startswith(".") or (".tmp-" not in path.name and ".old-" not in path.name):
            continue
        owner = tag_owner(path.name)
        if owner is None or owner_alive(*owner):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    if removed:
        logger.info("removed %d temporary cache folders of processes that are gone from %s: %s", len(removed), root,
                    ", ".join(sorted(removed)))
    return sorted(removed)


def _discard(folder: Path) -> None:
    """Remove a cache folder: renamed aside first, so that no reader ever sees it half deleted."""
    aside = folder.parent / f".{folder.name}.old-{process_tag()}.{uuid.uuid4().hex[:8]}"
    try:
        os.replace(folder, aside)
    except OSError:
        aside = folder
    shutil.rmtree(aside, ignore_errors=True)


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def cached_map(
    dataset: datasets.Dataset,
    fn: Callable[..., dict[str, Any]],
    *,
    params: Mapping[str, Any],
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    code_version: str = "1",
    **map_options: Any,
) -> datasets.Dataset:
    """``dataset`` plus the columns ``fn`` computes, computed once and cached on disk.

    Args:
        dataset: the input ``datasets.Dataset``; its fingerprint is part of the key.
        fn: a ``Dataset.map`` function returning only the *new* columns (a column that already
            exists in ``dataset`` is replaced by the new one).
        params: every setting that changes ``fn``'s output; a change gives a new key.
        name: the step's name (``edges``, ``lexicon``, ``regions``, ...), used in the folder name.
        cache_dir: where caches live; default :func:`default_cache_dir`.
        code_version: bump it when ``fn``'s code changes its output.
        map_options: ``batched`` (default False), ``batch_size`` (100), ``num_proc``, ``features``, ``desc``:
            passed to ``Dataset.map``.

    Returns:
        A dataset with ``dataset``'s columns followed by the computed ones. A dataset with an
        indices mapping (after ``select``/``shuffle``) is flattened to join them.

    In multi-process training run it on the main process first (``accelerator.main_process_first()``)
    so that the other ranks reuse the cache instead of computing it again.
    """
    _validate_name(name)
    unknown = sorted(set(map_options) - set(_MAP_DEFAULTS))
    if unknown:
        raise TypeError(f"cached_map: unknown option(s) {', '.join(unknown)}; the Dataset.map options it passes on "
                        f"are {', '.join(_MAP_DEFAULTS)}")
    key = cache_key(dataset, name=name, params=params, code_version=code_version)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    clean_stale_temporaries(root)
    folder = root / f"{name}-{key}"
    meta = _read_meta(folder)
    computed = None
    if meta is not None and meta.get("num_rows") == len(dataset):
        problem = verify_cache(folder, meta)
        if problem is None:
            try:
                computed = _load(folder)
            except Exception as error:  # pyarrow's errors are OSError / ArrowInvalid / ValueError subclasses
                problem = f"it does not load ({type(error).__name__}: {error})"
            else:
                if len(computed) != len(dataset):
                    problem, computed = f"it holds {len(computed)} rows, not {len(dataset)}", None
        if problem is None:
            logger.info("reusing cached %s (%s) from %s", name, key, folder)
        else:
            logger.warning("the cached %s in %s is damaged (%s): rebuilding it", name, folder, problem)
            computed = None
    if computed is None:
        if folder.exists():
            if meta is None or meta.get("num_rows") != len(dataset):
                logger.warning("discarding incomplete cache %s", folder)
            _discard(folder)
        logger.info("computing %s (%s) for %d examples into %s", name, key, len(dataset), folder)
        step = {"name": name, "key": key, "params": params, "code_version": code_version}
        computed = _compute(dataset, fn, folder, step, {**_MAP_DEFAULTS, **map_options})
    overlap = [c for c in computed.column_names if c in dataset.column_names]
    base = dataset.remove_columns(overlap) if overlap else dataset
    return datasets.concatenate_datasets([base, computed], axis=1)


#: the ``Dataset.map`` options :func:`cached_map` passes on, and their defaults
_MAP_DEFAULTS: dict[str, Any] = {"batched": False, "batch_size": 100, "num_proc": None, "features": None, "desc": None}


def _compute(dataset: datasets.Dataset, fn: Callable[..., dict[str, Any]], folder: Path, step: Mapping[str, Any],
             map_options: Mapping[str, Any]) -> datasets.Dataset:
    """Run the map into a temporary folder beside ``folder`` and rename it into place; ``step``: the ``name``,
    ``key``, ``params`` and ``code_version`` recorded in its ``meta.json``."""
    name, key = step["name"], step["key"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    # the writer's PID@HOST in the name: once this process is gone (killed mid-write), a later call removes it
    tmp = folder.parent / f".{folder.name}.tmp-{process_tag()}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        result = dataset.map(
            fn,
            batched=map_options["batched"],
            batch_size=map_options["batch_size"],
            num_proc=map_options["num_proc"],
            remove_columns=dataset.column_names,
            cache_file_name=str(tmp / "data.arrow"),
            load_from_cache_file=False,
            new_fingerprint=key,
            features=map_options["features"],
            desc=map_options["desc"] or f"computing {name}",
        )
        meta = {
            "name": name,
            "key": key,
            "params": json.loads(json.dumps(dict(step["params"]), default=str)),
            "code_version": step["code_version"],
            "dataset_fingerprint": _fingerprint(dataset),
            "num_rows": len(result),
            "columns": result.column_names,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        del result
        meta["files"] = file_fingerprints(tmp)  # checked before every reuse
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.replace(tmp, folder)
        except OSError:
            # Another process finished the same step first: keep its result, drop ours.
            if _read_meta(folder) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _load(folder)
