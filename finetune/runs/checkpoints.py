"""The reading side of checkpoints: what a checkpoint folder holds, which folders are checkpoints
(:func:`list_checkpoints`, the one listing), and whether one is complete and intact (:func:`checkpoint_problem`).
:mod:`finetune.training.checkpoint` writes them; :mod:`finetune.runs.resume` picks the one ``train.resume`` names.

A checkpoint folder ``checkpoints/step-N`` holds accelerate's state (``model.safetensors``,
``optimizer.bin``, ``scheduler.bin``, ``random_states_<rank>.pkl``, ...), each process's stream position
(``stream_state_<rank>.json``, streamed data, :func:`read_stream_states`), the stream's shard index
(:data:`STREAM_INDEX`) and ``train_state.json``, which records the step, the loss history, the recipe's continuation
view and a manifest of the other files: the size and sha256 of each (:func:`file_manifest`).
:func:`checkpoint_problem` checks a folder against its manifest, so that a missing, truncated or bit-flipped file is
named before the model loads, instead of resuming silently from damaged weights or surfacing as an unrelated message
deep in ``load_state``.

The RNG state matters as much as the weights: without it a resumed run draws other dropout masks and
augmentations and stops being bit-identical to an uninterrupted one, which accelerate only reports at
INFO level. A missing, damaged or unreadable ``random_states_<rank>.pkl`` of a process of this launch is
therefore a problem of the checkpoint, unless ``train.resume_ignore_rng: true`` (then the run goes on with
a fresh RNG state seeded from ``train.seed`` and the step, and says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["CHECKPOINT_PREFIX", "STATE_NAME", "STREAM_INDEX", "checkpoint_problem", "checkpoint_step", "file_digest",
           "file_manifest", "list_checkpoints", "read_stream_index", "read_stream_states", "rng_problem",
           "rng_state_name", "stream_state_file"]

log = logging.getLogger("xlipkit")

CHECKPOINT_PREFIX = "step-"
STATE_NAME = "train_state.json"
#: the stream's shard index (sample counts) in a checkpoint: a resume reads it instead of counting again
STREAM_INDEX = "stream_index.json"
_WEIGHT_PATTERNS = ("model*.safetensors", "pytorch_model*.bin", "model*.bin")
#: bytes read at a time when hashing a checkpoint file
HASH_CHUNK = 8 * 2**20
#: files hashed at once (hashlib releases the GIL on large updates, so the big files hash in parallel)
HASH_THREADS = 4


def rng_state_name(rank: int) -> str:
    """The file accelerate writes process ``rank``'s RNG states to (``random_states_<rank>.pkl``)."""
    return f"random_states_{rank}.pkl"


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (hex), read in chunks of :data:`HASH_CHUNK` into one reused buffer."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def _digests(paths: list[Path]) -> list[str]:
    if len(paths) <= 1:
        return [file_digest(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(paths))) as pool:
        return list(pool.map(file_digest, paths))


def file_manifest(folder: str | os.PathLike, *, hashes: bool = True) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes": size, "sha256": hex}}`` of every file under ``folder`` (``train_state.json``
    aside); ``hashes=False`` leaves the sha256 out. Hashing reads every byte once (sha256 runs at about
    2 GB/s per core with the CPU's SHA extensions, and the files hash in parallel)."""
    root = Path(folder)
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != STATE_NAME]
    digests = _digests(files) if hashes else [None] * len(files)
    out = {}
    for path, digest in zip(files, digests):
        entry: dict[str, Any] = {"bytes": path.stat().st_size}
        if digest is not None:
            entry["sha256"] = digest
        out[path.relative_to(root).as_posix()] = entry
    return out


def _safetensors_problem(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # safetensors raises its own SafetensorError on a bad header
        return f"{path.name} is corrupt ({type(error).__name__}: {error})"
    return None


def _read_state(root: Path) -> tuple[dict | None, str | None]:
    state_file = root / STATE_NAME
    if not state_file.is_file():
        return None, f"{STATE_NAME} is missing (the save was interrupted?)"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return None, f"{STATE_NAME} is corrupt ({error})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return None, f"{STATE_NAME} is corrupt (no step)"
    return state, None


def _entry(value: Any) -> tuple[int | None, str | None]:
    """``(bytes, sha256)`` of a manifest entry; checkpoints written before hashes recorded the size alone."""
    if isinstance(value, dict):
        return value.get("bytes"), value.get("sha256")
    return (value if isinstance(value, int) else None), None


def _is_rng_state(name: str) -> bool:
    return name.startswith("random_states_") and name.endswith(".pkl") and "/" not in name


def rng_problem(folder: str | os.PathLike, rank: int, *, hashes: bool = True) -> str | None:
    """What keeps process ``rank``'s RNG state in ``folder`` from being restored, or None: the file is missing,
    differs from the manifest (size, sha256) or does not load as accelerate's RNG states (read with
    ``weights_only``, as accelerate reads it)."""
    from accelerate.utils import load

    root = Path(folder)
    name = rng_state_name(rank)
    path = root / name
    if not path.is_file():
        return (f"{name} is missing: the RNG state of process {rank} was not saved (a checkpoint of a launch "
                "with fewer processes?)")
    state, _ = _read_state(root)
    manifest = (state or {}).get("files") or {}
    if name in manifest:
        size, digest = _entry(manifest[name])
        if size is not None and path.stat().st_size != size:
            return f"{name} is damaged ({path.stat().st_size} bytes, {size} when saved)"
        if hashes and digest and file_digest(path) != digest:
            return f"{name} is damaged (its sha256 differs from the one recorded when it was saved)"
    try:
        states = load(path)
    except Exception as error:  # a damaged pickle raises many types
        return f"{name} is unreadable ({type(error).__name__}: {error})"
    if not isinstance(states, dict) or "torch_manual_seed" not in states:
        return f"{name} is unreadable (not accelerate's RNG states)"
    return None


def checkpoint_problem(folder: str | os.PathLike, *, hashes: bool = True, world_size: int = 1,
                       ignore_rng: bool = False) -> str | None:
    """What is wrong with a checkpoint folder, naming the file, or None when it is complete and intact.

    Checks that ``train_state.json`` exists and parses, that every file of its manifest exists with the
    recorded size and (``hashes``) sha256, that every ``.safetensors`` header parses (a checkpoint from before
    manifests needs model weights), and that the RNG state of each of the ``world_size`` processes that will
    resume from it is intact and loads (:func:`rng_problem`).

    Args:
        folder: a ``checkpoints/step-N`` folder.
        hashes: verify the sha256 of every file (reads every byte; False checks names and sizes only).
        world_size: processes of the launch that resumes (each restores ``random_states_<rank>.pkl``; a process of a
            requeue on more processes than the checkpoint's, which has none, starts a fresh RNG state).
        ignore_rng: ``train.resume_ignore_rng``: a missing or damaged RNG state is logged, not a problem.
    """
    root = Path(folder)
    state, problem = _read_state(root)
    if problem:
        return problem
    manifest = state.get("files")
    if isinstance(manifest, dict) and manifest:
        to_hash = []
        for name, value in manifest.items():
            if _is_rng_state(name):
                continue  # checked below, for the processes that resume
            size, digest = _entry(value)
            path = root / name
            if not path.is_file():
                return f"{name} is missing"
            if size is not None and path.stat().st_size != size:
                return f"{name} is damaged ({path.stat().st_size} bytes, {size} when saved)"
            if hashes and digest:
                to_hash.append((name, path, digest))
        for (name, _, digest), got in zip(to_hash, _digests([p for _, p, _ in to_hash])):
            if got != digest:
                return (f"{name} is damaged (its sha256 differs from the one recorded when it was saved: its bytes "
                        "changed since)")
    elif not any(root.glob(pattern) for pattern in _WEIGHT_PATTERNS):
        return "the model weights (model.safetensors) are missing"
    for path in sorted(root.rglob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return problem
    saved_ranks = sum(1 for name in (manifest or {}) if _is_rng_state(name)) if isinstance(manifest, dict) else 0
    for rank in range(world_size):
        if saved_ranks and rank >= saved_ranks:  # a requeue on more processes: this one starts a fresh RNG state
            continue
        problem = rng_problem(root, rank, hashes=hashes)
        if problem and not ignore_rng:
            return (f"{problem}; without it the resumed run would not repeat an uninterrupted one (set "
                    "train.resume_ignore_rng: true to resume with a fresh RNG state)")
        if problem:
            log.warning("train.resume_ignore_rng: %s: %s; the resumed run draws from a fresh RNG state seeded from "
                        "train.seed and the step (it will not repeat an uninterrupted run exactly)", root.name, problem)
    return None


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder ``step-N``: ``N``."""
    return int(folder.name[len(CHECKPOINT_PREFIX):])


def list_checkpoints(ckpt_dir: str | os.PathLike, *, complete: bool = True) -> list[Path]:
    """The checkpoint folders ``step-N`` of a run's ``checkpoints/`` folder, oldest first; the temporary folders of
    an interrupted save (``step-N.<PID@HOST>.tmp``) are never listed.

    Args:
        ckpt_dir: the run's ``checkpoints/`` folder (none yet: an empty list).
        complete: only those with a ``train_state.json`` (written last, before the rename); False lists every
            ``step-N`` folder, so that a resume can name what is wrong with a damaged one.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir()
             if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX):].isdigit()
             and (not complete or (p / STATE_NAME).is_file())]
    return sorted(found, key=checkpoint_step)


def stream_state_file(folder: Path, rank: int) -> Path:
    """Where process ``rank`` keeps its stream position in a checkpoint folder."""
    return folder / f"stream_state_{rank}.json"


def read_stream_states(folder: Path) -> list[dict[str, Any]]:
    """Every process's stream position in a checkpoint folder (``stream_state_<rank>.json``, rank order).

    Raises:
        FileNotFoundError: none, or a gap in the ranks (naming the folder).
    """
    files = sorted(folder.glob("stream_state_*.json"), key=lambda p: int(p.stem.rpartition("_")[2]))
    if not files or [int(p.stem.rpartition("_")[2]) for p in files] != list(range(len(files))):
        raise FileNotFoundError(
            f"train.resume: {folder} has no complete set of stream positions (stream_state_<rank>.json): it was saved "
            "from map-style data; resume with the data.train it was saved with")
    return [json.loads(p.read_text()) for p in files]


def read_stream_index(folder: Path) -> dict[str, Any] | None:
    """The shard index a checkpoint saved (:data:`STREAM_INDEX`), or None."""
    path = folder / STREAM_INDEX
    return json.loads(path.read_text()) if path.is_file() else None
