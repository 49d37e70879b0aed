"""Resume checks what it resumes: the checkpoint exists, every file is there with the bytes it was saved
with, the RNG state of every process can be restored, and it was written by the same run
(:func:`finetune.run_folder.continuation_view`).

A checkpoint folder ``checkpoints/step-N`` holds accelerate's state (``model.safetensors``,
``optimizer.bin``, ``scheduler.bin``, ``random_states_<rank>.pkl``, ...), each process's stream position
(``stream_state_<rank>.json``, streamed data) and ``train_state.json``, which records the step, the loss
history, the recipe's continuation view and a manifest of the other files: the size and sha256 of each
(:func:`file_manifest`). :func:`checkpoint_problem` checks a folder against its manifest, so that a missing,
truncated or bit-flipped file is named before the model loads, instead of resuming silently from damaged
weights or surfacing as an unrelated message deep in ``load_state``. ``train.resume: latest`` falls back
to the newest checkpoint that passes (saying which it skipped and why); a checkpoint named by its path must
pass.

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

from finetune.run_basics import RunFolderError

__all__ = ["CheckpointError", "CHECKPOINT_PREFIX", "STATE_NAME", "file_digest", "file_manifest",
           "checkpoint_problem", "rng_problem", "rng_state_name", "find_checkpoint"]

log = logging.getLogger("xlipkit")

CHECKPOINT_PREFIX = "step-"
STATE_NAME = "train_state.json"
_WEIGHT_PATTERNS = ("model*.safetensors", "pytorch_model*.bin", "model*.bin")
#: bytes read at a time when hashing a checkpoint file
HASH_CHUNK = 8 * 2**20
#: files hashed at once (hashlib releases the GIL on large updates, so the big files hash in parallel)
HASH_THREADS = 4


class CheckpointError(RunFolderError, FileNotFoundError):
    """``train.resume`` names no usable checkpoint: missing, incomplete or damaged (names the file)."""


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


def _steps(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir()
             if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def find_checkpoint(resume: str | None, ckpt_dir: str | os.PathLike, *, world_size: int = 1,
                    ignore_rng: bool = False) -> Path | None:
    """The checkpoint ``train.resume`` names, checked with :func:`checkpoint_problem` (every file's sha256).

    Args:
        resume: None (no resume), ``latest`` (the newest intact ``step-N`` in ``ckpt_dir``; a newer one that
            is incomplete or damaged is skipped with a warning that names the file and why) or a checkpoint
            folder.
        ckpt_dir: the run's ``checkpoints/`` folder.
        world_size: processes of this launch (each needs its RNG state).
        ignore_rng: ``train.resume_ignore_rng``.
    Returns:
        the folder, or None (no resume, or ``latest`` with no checkpoint yet: logged).
    Raises:
        CheckpointError: a path that is not an intact checkpoint, or ``latest`` when every checkpoint is
            unusable (naming the file of each).
    """
    if not resume:
        return None
    ckpt_dir = Path(ckpt_dir)
    check = dict(world_size=world_size, ignore_rng=ignore_rng)
    if resume == "latest":
        candidates = _steps(ckpt_dir)
        if not candidates:
            log.info("train.resume: latest: no checkpoint in %s yet; training starts at step 0", ckpt_dir)
            return None
        problems = []
        for path in reversed(candidates):
            problem = checkpoint_problem(path, **check)
            if problem is None:
                for skipped, why in problems:
                    log.warning("train.resume: latest: skipped %s: %s; resuming from %s", skipped, why, path.name)
                return path
            problems.append((path.name, problem))
        raise CheckpointError(
            f"train.resume: latest: no usable checkpoint in {ckpt_dir}: "
            + "; ".join(f"{name}: {why}" for name, why in problems)
            + ". Remove the damaged checkpoints, or unset train.resume to start again")
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"train.resume: {resume} is not a checkpoint folder (it does not exist); use `latest` or a folder "
            f"like {ckpt_dir / (CHECKPOINT_PREFIX + '100')}")
    problem = checkpoint_problem(path, **check)
    if problem is not None:
        hint = "" if (path / STATE_NAME).exists() or not _steps(path) else "; its step-N folders are checkpoints"
        raise CheckpointError(f"train.resume: {resume} is not a checkpoint folder ({problem}){hint}")
    return path


def check_continuation(saved: dict[str, Any] | None, current: dict[str, Any] | None, checkpoint: Path, *,
                       ignore_changes: bool = False) -> None:
    """Compare the continuation view a checkpoint was saved with to the current recipe's.

    Raises:
        RunFolderError: listing the differing keys, unless ``ignore_changes`` (then logged).
    """
    from finetune.run_basics import differing_keys

    if saved is None or current is None or saved == current:
        return
    changes = differing_keys(saved, current)
    if not ignore_changes:
        raise RunFolderError(
            f"train.resume: {checkpoint} was saved by a run with a different recipe; differing keys: "
            f"{'; '.join(changes)}. Resume with that run's recipe, or set train.resume_ignore_changes: true "
            "to continue with these changes on purpose")
    log.warning("train.resume_ignore_changes: continuing %s with changed keys: %s", checkpoint, "; ".join(changes))
