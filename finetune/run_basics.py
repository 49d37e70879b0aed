"""What run folders, checkpoints, caches and the recipe writer share, below all of them in the import graph:
the run-folder error, the differing keys of two recipes, and the ``PID@HOST`` tags in temporary names.

:mod:`finetune.run_folder` re-exports every name (``from finetune.run_folder import process_tag`` keeps
working); :mod:`finetune.resume` and :mod:`finetune.config` import from here, so that neither imports
:mod:`finetune.run_folder`, which imports them.
"""

from __future__ import annotations

import json
import os
import re
import socket
from typing import Any

__all__ = ["RunFolderError", "differing_keys", "owner_alive", "process_tag", "tag_owner"]


class RunFolderError(ValueError):
    """``output.dir`` holds a run that this recipe must not overwrite, or a resume that does not fit."""


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: value}


def differing_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["train.lr: 0.001 -> 0.002", ...]``: the dotted keys whose values differ, sorted."""
    a, b = _flatten(old), _flatten(new)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            show = lambda v: "(unset)" if v is missing else json.dumps(v, default=str)  # noqa: E731
            out.append(f"{key}: {show(va)} -> {show(vb)}")
    return out


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
