"""Weight files that cannot be read, named with what to do (issue 31 item 11).

A truncated, empty or foreign ``model.safetensors`` made every loader fail inside the library that read it (a
14-frame traceback ending in ``SafetensorError: Error while deserializing header: header too small``), naming
neither the file nor a fix. :func:`check_weight_files` looks at every ``*.safetensors`` of a model folder before a
loader reads it, and :func:`naming_damaged_weights` turns a ``SafetensorError`` raised anywhere below (a hub
snapshot, a file inside a family's own loader) into a :class:`DamagedWeightsError` that names the file. The header
itself is read by ``safetensors.safe_open`` (the library that wrote it); this module only says what its refusal
means.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DamagedWeightsError", "check_weight_files", "naming_damaged_weights", "quiet_shard_bar",
           "safetensors_problem"]

#: safetensors refuses headers larger than this (``MAX_HEADER_SIZE`` of the format)
_MAX_HEADER = 100_000_000
_LFS_POINTER = b"version https://git-lfs"


class DamagedWeightsError(OSError, ValueError):
    """A weight file that cannot be read: the message names the file, what is wrong with it and how to get a good
    copy. An ``OSError`` (a file that cannot be read, as a missing one) and a ``ValueError`` (bad input): every
    command reports it without a traceback, whichever of the two it catches."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot load the model weights {self.path}: {reason}. {_fix(Path(self.path))}")


def _fix(path: Path) -> str:
    """What to do about a damaged file at ``path``: fetch it again from the hub, or write it again."""
    parts = path.parts
    repo = next((p for p in parts if p.startswith("models--")), None)
    if repo is not None and "snapshots" in parts:
        repo_id = repo.removeprefix("models--").replace("--", "/")
        cache = Path(*parts[:parts.index(repo) + 1])
        return (f"The hub cache holds a damaged copy (an interrupted download?): delete {cache} and load {repo_id} "
                "again to download it afresh")
    return ("The file is damaged (an interrupted copy, download or save?): copy or download it again, or write it "
            "again (save_finetuned / save_pretrained, `xlipkit export`, or train the run again)")


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a readable safetensors file, or None when ``safetensors.safe_open`` reads its header.

    The common damages are told apart from the file's first bytes: empty, shorter than the 8-byte header length,
    a Git LFS pointer or an HTML page in place of the weights, a header length past the end of the file
    (truncated); anything else is safetensors' own message.
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(64)
    except OSError as error:
        return f"it cannot be read ({error.strerror or error})"
    if size == 0:
        return "the file is empty (0 bytes)"
    if head.startswith(_LFS_POINTER):
        return ("it is a Git LFS pointer, not the weights: fetch the file itself (`git lfs pull` in its repository, "
                "or download it from the hub)")
    if head.lstrip()[:15].lower().startswith((b"<!doctype html", b"<html")):
        return "it is an HTML page, not a safetensors file (an error page saved in place of the download?)"
    if size < 8:
        return f"the file is truncated: {size} bytes, fewer than the 8 that give a safetensors header's length"
    header = int.from_bytes(head[:8], "little")
    if header > min(_MAX_HEADER, size - 8):
        return (f"the file is truncated or is not a safetensors file: it says its header takes {header:,} bytes, "
                f"and the file holds {size:,}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # safetensors raises its own SafetensorError for every kind of bad header
        text = str(error).removeprefix("Error while deserializing header: ")
        if "not fully covered" in text:
            return (f"the file is truncated, or has bytes after its tensors ({size:,} bytes, not what its header "
                    f"describes; safetensors: {text})")
        return f"safetensors cannot read its header ({text})"
    return None


def check_weight_files(path: str | os.PathLike) -> None:
    """Check the safetensors weights of a model folder (its ``*.safetensors``, not recursively) or one file.

    Raises:
        DamagedWeightsError: the first damaged file, named, with why and what to do.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    for file in files:
        if file.suffix != ".safetensors":
            continue
        problem = safetensors_problem(file)
        if problem is not None:
            raise DamagedWeightsError(file, problem)


def _is_safetensor_error(error: BaseException) -> bool:
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        return False
    return isinstance(error, SafetensorError)


def _local_copy(name: str, revision: str | None) -> Path | None:
    """The folder ``name`` loads from: a local path, or the hub cache's snapshot of a hub id (no download)."""
    path = Path(name.removeprefix("local-dir:")).expanduser()
    if path.exists():
        return path
    repo = name.removeprefix("hf-hub:")
    if repo.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception:  # not cached, or not a hub id: nothing to look at
        return None


@contextlib.contextmanager
def naming_damaged_weights(name: str, revision: str | None = None) -> Iterator[None]:
    """Turn a ``SafetensorError`` raised while loading ``name`` (a folder, a file or a hub id) into a
    :class:`DamagedWeightsError` naming the damaged file (searched in the folder, or in the hub cache's snapshot
    of a hub id), or naming ``name`` when no file can be singled out."""
    try:
        yield
    except Exception as error:
        if not _is_safetensor_error(error):
            raise
        where = _local_copy(str(name), revision)
        files = [] if where is None else [where] if where.is_file() else sorted(where.rglob("*.safetensors"))
        for file in files:
            problem = safetensors_problem(file)
            if problem is not None:
                raise DamagedWeightsError(file, problem) from error
        raise DamagedWeightsError(name, f"a weight file cannot be read (safetensors: {error})") from error


@contextlib.contextmanager
def quiet_shard_bar() -> Iterator[None]:
    """transformers' progress bars off while a model folder is written: ``save_pretrained`` draws a "Writing model
    shards" bar even for one shard (a 0 % and a 100 % line in every run's log, once per saved model); the run logs
    what it saved. The user's setting (``HF_HUB_DISABLE_PROGRESS_BARS``, ``disable_progress_bar``) is restored."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
