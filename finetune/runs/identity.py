"""Which run a folder holds: the resolved recipe a run writes there (``recipe.yaml``, :func:`read_run_recipe`), and
when two recipes are the same run.

"The same run" has two strengths. A rerun into the folder of an unfinished run needs the same whole recipe less
what may change between a run and its rerun (:func:`comparable_recipe`, hashed by :func:`recipe_hash`:
``model.init_from`` reuses such a run). A resume needs the same :func:`continuation_view`: what decides the weights a
continued run reaches (model, adapter, objective, training data, batch, optimiser and schedule); a checkpoint
records it, and resuming with a different one is an error listing the differing keys (:func:`differing_keys`) unless
``train.resume_ignore_changes: true``. A key that a later xlipkit added to the schema is no change when the current
recipe holds its default (:func:`with_added_defaults`): an upgrade alone never refuses a resume.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from finetune.runs.errors import RunFolderError

__all__ = ["RECIPE_NAME", "comparable_recipe", "continuation_hash", "continuation_view", "differing_keys",
           "read_run_recipe", "recipe_hash", "with_added_defaults"]

RECIPE_NAME = "recipe.yaml"
#: train keys that do not change the weights a continued run reaches
_BOOKKEEPING_TRAIN_KEYS = frozenset({"resume", "resume_ignore_changes", "resume_ignore_rng", "checkpoint_every",
                                     "process_group_timeout_s",
                                     "keep_checkpoints", "log_every", "trackers"})


def continuation_view(recipe: dict[str, Any]) -> dict[str, Any]:
    """The part of a recipe (as ``recipe_to_dict`` gives it) that decides what a continued run
    computes: ``model``, ``adapter``, ``objective``, ``data.train`` and the ``train`` keys other
    than bookkeeping (resume, checkpointing, logging, trackers)."""
    train = {k: v for k, v in (recipe.get("train") or {}).items() if k not in _BOOKKEEPING_TRAIN_KEYS}
    return json.loads(json.dumps({
        "model": recipe.get("model"),
        "adapter": recipe.get("adapter"),
        "objective": recipe.get("objective"),
        "data": {"train": (recipe.get("data") or {}).get("train")},
        "train": train,
    }, default=str))


def continuation_hash(recipe: dict[str, Any]) -> str:
    """sha256 of :func:`continuation_view` (canonical JSON)."""
    text = json.dumps(continuation_view(recipe), sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def comparable_recipe(recipe: dict[str, Any]) -> dict[str, Any]:
    """The whole recipe (as ``recipe_to_dict`` gives it) less what may change between a run and its rerun in
    the same folder: ``output``, ``hub.token``, ``train.resume`` / ``resume_ignore_changes`` / ``resume_ignore_rng``."""
    out = json.loads(json.dumps(recipe, default=str))
    out.pop("output", None)
    (out.get("hub") or {}).pop("token", None)
    for key in ("resume", "resume_ignore_changes", "resume_ignore_rng"):
        (out.get("train") or {}).pop(key, None)
    return out


def recipe_hash(recipe: dict[str, Any]) -> str:
    """sha256 of :func:`comparable_recipe` (canonical JSON): a run folder whose ``recipe.yaml`` has the same
    hash was run with the same resolved recipe (``model.init_from`` reuses such a run)."""
    text = json.dumps(comparable_recipe(recipe), sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_run_recipe(out_dir: Path) -> dict[str, Any] | None:
    """The ``recipe.yaml`` of the run in ``out_dir`` as a dict, or None when there is none.

    Raises:
        RunFolderError: when the file exists but is not a YAML mapping.
    """
    path = out_dir / RECIPE_NAME
    if not path.is_file():
        return None
    from finetune.config import safe_load_yaml  # aliases bounded: a run folder may come from anyone

    try:
        data = safe_load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise RunFolderError(f"{path} is not a readable recipe ({error}); choose another output.dir or set "
                             "output.overwrite: true to replace that folder's run") from error
    if not isinstance(data, dict):
        raise RunFolderError(f"{path} is not a recipe mapping; choose another output.dir or set output.overwrite: true")
    return data


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


@functools.cache
def _schema_defaults() -> dict[str, Any]:
    """Every recipe key's default, flattened (``{"train.lr": 5e-06, ...}``), as :func:`recipe_to_dict` writes them."""
    from finetune.config import Recipe, recipe_to_dict

    return _flatten(json.loads(json.dumps(recipe_to_dict(Recipe()), default=str)))


def with_added_defaults(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``saved`` (a run's recipe or a checkpoint's continuation view, written by the xlipkit of that run)
    with each key it lacks filled in where ``current`` holds that key at today's default: a key added to the toolkit
    since (``train.text_buckets``, ``train.group_by_length``, ...) is then no difference. A key set away from its
    default, or one ``saved`` has, compares as it is."""
    defaults, out = _schema_defaults(), copy.deepcopy(saved)
    for key, value in _flatten(current).items():
        if key not in defaults or defaults[key] != value:
            continue
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf not in node:
            node[leaf] = copy.deepcopy(value)
    return out
