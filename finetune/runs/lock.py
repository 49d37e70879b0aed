"""One process writes into a run folder at a time: :class:`RunLock` holds an OS file lock (``filelock.FileLock`` on
``.xlipkit.lock``, released by the kernel when the process dies) and records its holder (``.xlipkit.owner.json``:
PID, host, command), so that a second run is refused naming that PID; :func:`lock_on_main_process` takes it on the
main process of a launch and tells every process the outcome.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune.files import _host, process_tag
from finetune.runs.errors import RunFolderBusy, RunFolderError
from finetune.runs.space import check_writable, describe_os_error

__all__ = ["LOCK_NAME", "OWNER_NAME", "RunLock", "lock_on_main_process"]

LOCK_NAME = ".xlipkit.lock"
OWNER_NAME = ".xlipkit.owner.json"


def _make_folder(folder: Path, what: str) -> Path | None:
    """``folder`` created with its missing parents; returns the topmost folder it created, or None."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunFolderError(f"{what} or one of its parents is a file; give a folder path") from None
    except OSError as exc:
        raise RunFolderError(f"{what} cannot be created ({describe_os_error(exc)}); choose a writable place, or "
                             "fix the permissions of its parent folder") from None
    return missing[-1] if missing else None


def _read_owner(folder: Path, wait_s: float = 2.0) -> dict[str, Any]:
    """The lock holder's record; the holder writes it just after it took the lock, so wait a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            record = json.loads((folder / OWNER_NAME).read_text(encoding="utf-8"))
            if isinstance(record, dict) and isinstance(record.get("pid"), int):
                return record
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return {}
        time.sleep(0.05)


class RunLock:
    """The exclusive lock of one run folder, held while a run (or an evaluation) writes into it.

    ``filelock.FileLock`` on ``FOLDER/.xlipkit.lock`` (``flock``: the kernel drops it when the process
    exits, even on ``kill -9``); the holder records its PID, host, command and start time in
    ``FOLDER/.xlipkit.owner.json``, so that a second process is refused naming it. Only one process of a
    multi-process launch takes it (the caller decides which). Usable as a context manager.

    Args:
        folder: the run folder (created with its parents when missing; removed again on release when it
            was created here and holds nothing else).
        what: how messages name the folder (``output.dir 'runs/x'``).
        command: what the owner record says the holder is doing.
    """

    def __init__(self, folder: str | os.PathLike, *, what: str | None = None, command: str = "") -> None:
        self.folder = Path(folder)
        self.what = what or f"run folder {str(self.folder)!r}"
        self.command = command
        self._lock: Any = None
        self._created: Path | None = None

    @property
    def held(self) -> bool:
        return self._lock is not None

    def acquire(self) -> RunLock:
        """Take the lock; returns ``self``.

        Raises:
            RunFolderBusy: another process holds it (the message names its PID, host and command).
            RunFolderError: the folder is a file, cannot be created or is not writable.
        """
        from filelock import FileLock, Timeout

        if self.held:
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise RunFolderError(f"{self.what} is a file; give a folder path")
        self._created = _make_folder(self.folder, self.what)
        try:
            check_writable(self.folder, self.what)
            lock = FileLock(str(self.folder / LOCK_NAME))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                raise self._busy() from None
            except OSError as exc:
                raise RunFolderError(f"{self.what}: cannot lock it ({describe_os_error(exc)})") from None
            self._lock = lock
            try:
                self._write_owner()
            except OSError as exc:
                self.release()
                raise RunFolderError(f"{self.what} is not writable ({describe_os_error(exc)})") from None
        except BaseException:
            if self._lock is None:
                self._remove_created()
            raise
        return self

    def _busy(self) -> RunFolderBusy:
        owner = _read_owner(self.folder)
        pid, host = owner.get("pid"), owner.get("host")
        if pid == os.getpid() and host == _host():
            return RunFolderBusy(
                f"{self.what} is already being written by this same process: a model.init_from or eval.compare_with "
                "recipe has the same output.dir as the run that needs it; give each its own output.dir", pid, host)
        if pid is None:
            holder = "another process (it has not recorded its PID yet)"
        else:
            doing = f", {owner['command']}" if owner.get("command") else ""
            since = f", since {owner['started']}" if owner.get("started") else ""
            holder = f"PID {pid} on {host}{doing}{since}"
        return RunFolderBusy(f"{self.what} is in use by another run: {holder}. Wait for it to finish (or stop it), "
                             "or choose another output.dir; two runs must never write into one folder", pid, host)

    def _write_owner(self) -> None:
        record = {"pid": os.getpid(), "host": _host(), "command": self.command,
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        fd, tmp = tempfile.mkstemp(prefix=f"{OWNER_NAME}.{process_tag()}.", suffix=".tmp", dir=self.folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(record, fh)
            os.replace(tmp, self.folder / OWNER_NAME)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def release(self) -> None:
        """Drop the lock (the owner record first); a folder this lock created and nothing else wrote into is
        removed. Safe to call twice."""
        if self._lock is None:
            return
        try:
            (self.folder / OWNER_NAME).unlink(missing_ok=True)
        except OSError:
            pass
        self._lock.release()
        self._lock = None
        self._remove_created()

    def _remove_created(self) -> None:
        created, self._created = self._created, None
        if created is None or not self.folder.is_dir():
            return
        try:
            if {p.name for p in self.folder.iterdir()} <= {LOCK_NAME}:
                (self.folder / LOCK_NAME).unlink(missing_ok=True)
                for folder in [self.folder, *self.folder.parents]:
                    folder.rmdir()  # only empty folders go
                    if folder == created:
                        break
        except OSError:
            pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_on_main_process(lock: RunLock | None, *checks: Any) -> RunLock | None:
    """Take ``lock`` (if any, after ``checks``: callables that raise :class:`RunFolderError`) on the main process
    of a launch (global rank 0, ``RANK``) only, the other ranks must not be refused; in a multi-process launch
    every process learns the outcome (accelerate's ``PartialState`` sets up the process group that the
    ``Accelerator`` built later uses).

    Returns:
        the held lock on the main process, None on the others.
    Raises:
        RunFolderError: on every process, when the main process was refused.
    """
    refused = None
    if int(os.environ.get("RANK") or 0) == 0:
        try:
            for check in checks:
                check()
            if lock is not None:
                lock.acquire()
        except RunFolderError as exc:
            refused = str(exc)
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        from accelerate import PartialState
        from accelerate.utils import broadcast_object_list, parse_flag_from_env

        PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # what Accelerator() would set up
        refused = broadcast_object_list([refused])[0]
    if refused:
        if lock is not None:
            lock.release()
        raise RunFolderError(refused)
    return lock if lock is not None and lock.held else None


