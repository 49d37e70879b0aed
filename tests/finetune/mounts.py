"""Small and read-only file systems for tests.

Root writes through permission bits, so a read-only folder is a read-only mount when the tests run as root
(as in the CI container), and a ``chmod a-w`` folder otherwise; a full disk is a small ``tmpfs``. Where
neither can be made, the test is skipped (and says why)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


class Folder:
    """A folder under test; :meth:`read_only` makes it (and what is in it) unwritable."""

    def __init__(self, path: Path, mounted: bool) -> None:
        self.path = path
        self.mounted = mounted
        self._chmodded: list[tuple[Path, int]] = []

    def read_only(self) -> None:
        if self.mounted:
            done = _mount("-o", "remount,ro", str(self.path))
            assert done.returncode == 0, done.stderr
            return
        for p in [self.path, *self.path.rglob("*")]:
            mode = stat.S_IMODE(p.stat().st_mode)
            self._chmodded.append((p, mode))
            p.chmod(mode & ~0o222)

    def restore(self) -> None:
        for p, mode in reversed(self._chmodded):
            p.chmod(mode)


@contextmanager
def tmpfs(path: Path, size: str = "64m") -> Iterator[Folder]:
    """A ``tmpfs`` of ``size`` mounted at ``path`` (as root), else a plain folder (``size`` is then not
    enforced: tests of a full disk need :func:`require_mount`)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount"):
        done = _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
        mounted = done.returncode == 0
    folder = Folder(path, mounted)
    try:
        yield folder
    finally:
        folder.restore()
        if mounted:
            if subprocess.run(["umount", str(path)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(path)], capture_output=True)


def require_read_only_possible(folder: Folder) -> None:
    if os.geteuid() == 0 and not folder.mounted:
        pytest.skip("running as root without permission to mount: a chmod'ed folder stays writable for root")


def require_mount(folder: Folder) -> None:
    if not folder.mounted:
        pytest.skip("cannot mount a tmpfs here (not root, or mounting is not permitted)")
