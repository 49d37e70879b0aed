"""Room for what a run writes: the bytes a folder holds (:func:`folder_bytes`), what a run will hold on disk at its
peak (:func:`estimate_run_bytes`), a size as people read it (:func:`size_text`), and the checks that stop a run or an
evaluation before it starts when its folder cannot take what it writes: not writable (:func:`check_writable`), or
not enough free space (:func:`check_free_space`)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from finetune.files import process_tag
from finetune.runs.errors import RunFolderError

__all__ = ["check_free_space", "check_writable", "describe_os_error", "estimate_run_bytes", "folder_bytes",
           "size_text"]


def folder_bytes(path: str | os.PathLike) -> int:
    """The bytes of the files under ``path`` (0 when it does not exist)."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    total = 0
    for p in root.rglob("*") if root.is_dir() else ():
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def estimate_run_bytes(*, model_bytes: int, trainable_bytes: int, trainable_numel: int, full: bool,
                       checkpoints_written: int, keep: int) -> dict[str, int]:
    """What a run will hold on disk at its peak, in bytes.

    ``final`` is the whole model for full fine-tuning, else the trained parameters (adapter and extras);
    ``checkpoint`` is one ``accelerator.save_state``: every model weight plus AdamW's two float32 moments
    per trained parameter. A new checkpoint is written before the oldest goes, so training holds up to
    ``keep + 1`` of them, and the final save ``keep`` of them beside ``final/``; ``checkpoints`` is the
    larger count held, and ``total`` the peak plus 5 % and 16 MiB for logs, plots and metrics.

    Args:
        model_bytes: the bytes of every parameter and buffer of the model (and objective heads).
        trainable_bytes, trainable_numel: those of the trained parameters.
        full: full fine-tuning (``final/`` holds the whole model) or an adapter.
        checkpoints_written: how many checkpoints the run writes (0 without ``train.checkpoint_every``).
        keep: ``train.keep_checkpoints``.
    """
    final = model_bytes if full else trainable_bytes
    checkpoint = model_bytes + 8 * trainable_numel
    during = min(keep + 1, checkpoints_written)
    at_end = min(keep, checkpoints_written)
    peak = max(during * checkpoint, at_end * checkpoint + final)
    return {"final": final, "checkpoint": checkpoint, "checkpoints": during,
            "total": peak + peak // 20 + 16 * 2**20}


def size_text(n: float) -> str:
    """``n`` bytes as people read them: ``512 bytes``, ``1.5 KiB``, ... ``2.0 TiB`` (binary units, TiB the largest)."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_RUN_ADVICE = "free some space, choose another output.dir, or keep fewer checkpoints (train.keep_checkpoints)"


def check_free_space(folder: str | os.PathLike, need: int, *, what: str, detail: str = "",
                     reclaimed: int = 0, advice: str = _RUN_ADVICE) -> None:
    """Stop before a run or an evaluation starts when ``folder``'s file system lacks ``need`` bytes.

    Args:
        folder: an existing folder on the file system written to.
        need: the bytes that will be written.
        what: how the message names the folder.
        detail: what ``need`` is made of, for the message.
        reclaimed: bytes already there that the run replaces (an earlier ``final/``, checkpoints).
        advice: what the message suggests.
    Raises:
        RunFolderError: saying how much is needed and how much is free.
    """
    free = shutil.disk_usage(folder).free
    if free + reclaimed < need:
        made_of = f" ({detail})" if detail else ""
        raise RunFolderError(f"{what} has {size_text(free)} free, but about {size_text(need - reclaimed)} will be "
                             f"written there{made_of}; {advice}")


def describe_os_error(exc: OSError) -> str:
    """Why a write failed, in words: a read-only file system, permission denied, a full disk, or the OS's own."""
    if exc.errno == errno.EROFS:
        return "it is on a read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.ENOSPC:
        return "the disk is full"
    return exc.strerror or str(exc)


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Create and remove a small file in ``folder`` (an existing folder): the one test of writability that
    a read-only mount, permissions, ACLs and a full disk all answer.

    Raises:
        RunFolderError: naming ``what`` (e.g. ``output.dir 'runs/x'``) and why.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=f".xlipkit-probe.{process_tag()}.", suffix=".tmp", dir=folder)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise RunFolderError(f"{what} is not writable ({describe_os_error(exc)}); choose a writable folder, or "
                             "fix its permissions") from None
