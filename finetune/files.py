"""The ground floor of files (beside :mod:`finetune.plugins`; imports nothing of the toolkit): atomic writes of
folders (:func:`atomic_dir`: built in a temporary sibling folder, then ``os.replace``), text and JSON
(:func:`write_text_atomic`, :func:`write_json_atomic`) and PNG figures (:func:`save_png_atomic`); the user's usual
permissions on what temporary files and folders are made with (:func:`apply_umask`); and the ``PID@HOST`` tags in
the names of temporary files (:func:`process_tag`), so that a cleanup can tell a live writer's files from a killed
one's (:func:`tag_owner`, :func:`owner_alive`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["apply_umask", "atomic_dir", "give_user_permissions", "owner_alive", "process_tag", "replace_dir",
           "save_png_atomic", "tag_owner", "write_json_atomic", "write_text_atomic"]


# -- temporary names that say who writes them ---------------------------------------------------------
_TAG = re.compile(r"(?<![0-9])([0-9]+)@([A-Za-z0-9-]+)\.")
#: the cache folders of older versions: ``.NAME-KEY.tmp-PID-HEX8``
_LEGACY_PID = re.compile(r"\.tmp-([0-9]+)-[0-9a-f]{8}$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "localhost"


def process_tag() -> str:
    """``PID@HOST``: what this process puts in the names of the temporary files and folders it writes
    (followed by a ``.``), so that a cleanup can tell a live writer's files from a killed one's."""
    return f"{os.getpid()}@{_host()}"


def tag_owner(name: str) -> tuple[int, str] | None:
    """``(pid, host)`` of the process whose :func:`process_tag` is in ``name`` (or an older cache folder's
    ``.tmp-PID-HEX8``, taken as this host's); None for an untagged name."""
    match = _TAG.search(name)
    if match:
        return int(match.group(1)), match.group(2)
    match = _LEGACY_PID.search(name)
    if match:
        return int(match.group(1)), _host()
    return None


def owner_alive(pid: int, host: str) -> bool:
    """Whether the process ``pid`` on ``host`` may still run: True for another host (this one cannot
    tell) and for this process; else whether a process with that PID exists here."""
    if host != _host() or pid == os.getpid() or os.name == "nt":  # Windows: os.kill(pid, 0) would kill it
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


# -- atomic writes -----------------------------------------------------------------------------------------------


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
    """Move the finished folder ``src`` to ``target``, replacing any old one, with ``os.replace``. A symbolic link at
    ``target`` is replaced itself (what it points to is left as it is), and leaves nothing behind."""
    old = None
    if target.exists() or target.is_symlink():
        old = target.parent / f".{target.name}.old-{process_tag()}.{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(src, target)
    if old is not None:
        if old.is_symlink():
            old.unlink()
        else:
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


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` through a temp file and ``os.replace``; tensors and numpy
    arrays become lists, objects with a ``__dict__`` that dict, anything else JSON cannot hold its ``str``."""
    write_text_atomic(path, json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__dict__"):
        return obj.__dict__
    return str(obj)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the writer's PID@HOST in the name: another run's cleanup leaves it alone while this process lives
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{process_tag()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600: give the file the user's usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
