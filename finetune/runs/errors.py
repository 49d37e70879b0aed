"""The errors of run folders, at the bottom of :mod:`finetune.runs`: every module of the package raises them, and a
caller catches :class:`RunFolderError` for all of them."""

from __future__ import annotations

__all__ = ["CheckpointError", "RunFolderBusy", "RunFolderError"]


class RunFolderError(ValueError):
    """``output.dir`` holds a run that this recipe must not overwrite, or a resume that does not fit."""


class RunFolderBusy(RunFolderError):
    """Another process holds the run folder's lock (:class:`finetune.runs.lock.RunLock`).

    Attributes:
        pid: the holder's PID (None when it has not recorded itself yet).
        host: the holder's host name, or None.
    """

    def __init__(self, message: str, pid: int | None = None, host: str | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.host = host


class CheckpointError(RunFolderError, FileNotFoundError):
    """``train.resume`` names no usable checkpoint: missing, incomplete or damaged (names the file)."""
