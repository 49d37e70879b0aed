"""What run folders and checkpoints share, below both in the import graph: the run-folder error and the differing
keys of two recipes. :mod:`finetune.resume` imports from here, so that it need not import
:mod:`finetune.run_folder`, which imports it. (The ``PID@HOST`` tags of temporary names are in
:mod:`finetune.files`.)
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["RunFolderError", "differing_keys"]


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
