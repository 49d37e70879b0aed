"""Atomic writes: model folders (:func:`atomic_dir`: build in a temporary sibling folder, then ``os.replace``)
and PNG figures (:func:`save_png_atomic`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from finetune.run_folder import process_tag


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``path``; on success it replaces ``path``.

    A reader never sees a half-written folder: either the old content or the new one. On error
    the temporary folder is removed and ``path`` is left as it was.

    Raises:
        FileExistsError: when ``path`` exists and is a file.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is a file; give a folder path to save a model into")
    target.parent.mkdir(parents=True, exist_ok=True)
    # the writer's PID@HOST in the name: a cleanup removes it only once this process is gone
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{process_tag()}.", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    apply_umask(tmp)
    replace_dir(tmp, target)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(folder: str | os.PathLike) -> None:
    """Give ``folder`` and everything under it the permissions a plain ``open`` / ``mkdir`` would: 0666 /
    0777 less the user's umask (0644 / 0755 with the usual 022). ``mkdtemp`` makes 0700 folders and
    safetensors writes 0600 weight files whatever the umask; a run folder shared with a group or served
    to others must not depend on which library wrote a file."""
    mask = _umask()
    root = Path(folder)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def give_user_permissions(path: str | os.PathLike) -> None:
    """Give a file made by ``tempfile.mkstemp`` (0600) or a folder made by ``mkdtemp`` (0700) the
    permissions a plain ``open`` / ``mkdir`` would: 0666 / 0777 less the user's umask."""
    mode = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, mode & ~_umask())


def replace_dir(src: Path, target: Path) -> None:
    """Move the finished folder ``src`` to ``target``, replacing any old one, with ``os.replace``."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{process_tag()}.{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(src, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_png_atomic(fig: Any, path: str | Path, *, dpi: int = 110) -> Path:
    """Write the matplotlib figure ``fig`` to ``path`` as a PNG atomically (a temporary file beside it, then
    ``os.replace``; the user's usual permissions), creating the folder, and close the figure. Returns ``path``."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi)
        give_user_permissions(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path
