"""Run folders are never silently overwritten, and a resume continues the run it claims to.

Before :func:`finetune.run.run` writes anything into ``output.dir`` it calls
:func:`check_run_folder`: a folder that holds a finished run (``metrics.json`` or ``final/``) or
the ``recipe.yaml`` of a different run is refused, unless ``output.overwrite: true`` (then
:func:`clear_previous_run` removes the old run's files first, so nothing of it mixes with the new
one) or ``train.resume`` continues the same run.

"The same run" means the same :func:`continuation_view` of the recipe: what decides the weights a
continued run reaches (model, adapter, objective, training data, batch, optimiser and schedule).
A checkpoint records it, and resuming with a different one is an error listing the differing keys
(:func:`differing_keys`) unless ``train.resume_ignore_changes: true``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "RunFolderError",
    "RECIPE_NAME",
    "continuation_view",
    "continuation_hash",
    "comparable_recipe",
    "recipe_hash",
    "differing_keys",
    "check_run_folder",
    "clear_previous_run",
    "clean_stale_temporaries",
]

RECIPE_NAME = "recipe.yaml"
#: what a run writes into its folder (removed by ``output.overwrite: true``)
RUN_OUTPUTS = ("final", "metrics.json", "report.md", "plots", "checkpoints", "logs", RECIPE_NAME)
#: train keys that do not change the weights a continued run reaches
_BOOKKEEPING_TRAIN_KEYS = frozenset({"resume", "resume_ignore_changes", "checkpoint_every", "keep_checkpoints",
                                     "log_every", "trackers"})


class RunFolderError(ValueError):
    """``output.dir`` holds a run that this recipe must not overwrite, or a resume that does not fit."""


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


def _comparable(recipe: dict[str, Any]) -> dict[str, Any]:
    """The whole recipe less what may change between a run and its rerun in the same folder."""
    out = json.loads(json.dumps(recipe, default=str))
    out.pop("output", None)
    (out.get("hub") or {}).pop("token", None)
    for key in ("resume", "resume_ignore_changes"):
        (out.get("train") or {}).pop(key, None)
    return out


def comparable_recipe(recipe: dict[str, Any]) -> dict[str, Any]:
    """The whole recipe (as ``recipe_to_dict`` gives it) less what may change between a run and its rerun in
    the same folder: ``output``, ``hub.token``, ``train.resume`` / ``resume_ignore_changes``."""
    return _comparable(recipe)


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
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise RunFolderError(f"{path} is not a readable recipe ({error}); choose another output.dir or set "
                             "output.overwrite: true to replace that folder's run") from error
    if not isinstance(data, dict):
        raise RunFolderError(f"{path} is not a recipe mapping; choose another output.dir or set output.overwrite: true")
    return data


def check_run_folder(out_dir: str | os.PathLike, recipe: dict[str, Any], *, overwrite: bool = False,
                     resume: str | None = None, ignore_changes: bool = False) -> str:
    """Decide whether a run may write into ``out_dir``; nothing is written.

    Args:
        out_dir: the recipe's ``output.dir``.
        recipe: the new run's recipe as ``recipe_to_dict`` gives it.
        overwrite: ``output.overwrite``.
        resume: ``train.resume`` (``latest`` or a checkpoint path), or None.
        ignore_changes: ``train.resume_ignore_changes``.
    Returns:
        ``"new"`` (no run there), ``"overwrite"`` (a run is there and will be replaced),
        ``"resume"`` (the same run continues) or ``"rerun"`` (an unfinished run of the same
        recipe starts again).
    Raises:
        RunFolderError: the folder is a file; it holds a finished run or another recipe's run (the
            message lists the differing keys and the ways out; it suggests ``train.resume: latest``
            only where a usable checkpoint exists); ``train.resume: latest`` into a finished run with
            no usable checkpoint (it would train again from step 0 over the finished run).
    """
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"output.dir {str(folder)!r} is a file; set output.dir to a folder")
    previous = read_run_recipe(folder) if folder.is_dir() else None
    finished = [n for n in ("metrics.json", "final") if (folder / n).exists()]
    has_checkpoints = (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir())
    if previous is None and not finished and not has_checkpoints:
        return "new"
    if overwrite:
        return "overwrite"
    ways_out = ("choose another output.dir, or set output.overwrite: true to replace it")
    resumable = _resumable_checkpoints(folder)
    if resume:
        if finished and resume == "latest" and not resumable:
            # nothing to continue from: `latest` would train from step 0 and replace the finished run
            raise RunFolderError(
                f"train.resume: latest: output.dir {str(folder)!r} holds a finished run ({', '.join(finished)}) "
                f"and no usable checkpoint to continue it from (train.checkpoint_every was 0, or the checkpoints "
                f"are gone), so resuming would train it again from step 0 over the finished run; {ways_out}")
        if previous is not None and continuation_hash(previous) != continuation_hash(recipe):
            changes = differing_keys(continuation_view(previous), continuation_view(recipe))
            if not ignore_changes:
                raise RunFolderError(
                    f"train.resume: {resume} would continue the run in {str(folder)!r} with a different recipe; "
                    f"differing keys: {'; '.join(changes)}. Resume with the run's own recipe ({folder / RECIPE_NAME}), "
                    f"set train.resume_ignore_changes: true to continue with these changes on purpose, or {ways_out}")
        return "resume"
    if finished:
        # suggest a resume only where it continues from a checkpoint (without one it would start again)
        resume_hint = f" (or train.resume: latest to continue it from {resumable[-1]})" if resumable else ""
        raise RunFolderError(
            f"output.dir {str(folder)!r} holds a finished run ({', '.join(finished)}); {ways_out}{resume_hint}")
    if previous is not None and _comparable(previous) != _comparable(recipe):
        changes = differing_keys(_comparable(previous), _comparable(recipe))
        raise RunFolderError(
            f"output.dir {str(folder)!r} holds another run (its recipe.yaml differs: {'; '.join(changes[:10])}"
            f"{' ...' if len(changes) > 10 else ''}); {ways_out}")
    return "rerun"


def _resumable_checkpoints(folder: Path) -> list[str]:
    """The ``checkpoints/step-N`` folders of ``folder`` that ``train.resume: latest`` could continue from
    (complete, :func:`finetune.resume.checkpoint_problem`), oldest first, as ``checkpoints/step-N``."""
    from finetune.resume import CHECKPOINT_PREFIX, checkpoint_problem  # finetune.resume imports this module

    ckpt = folder / "checkpoints"
    if not ckpt.is_dir():
        return []
    steps = sorted((p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                    and p.name[len(CHECKPOINT_PREFIX):].isdigit()), key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))
    return [f"checkpoints/{p.name}" for p in steps if checkpoint_problem(p) is None]


def clear_previous_run(out_dir: str | os.PathLike) -> list[str]:
    """Remove what a run wrote into ``out_dir`` (:data:`RUN_OUTPUTS`); other files stay.

    Returns:
        the names removed.
    """
    folder = Path(out_dir)
    removed = []
    for name in RUN_OUTPUTS:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            removed.append(name)
        elif path.exists() or path.is_symlink():
            path.unlink()
            removed.append(name)
    return removed


def clean_stale_temporaries(out_dir: str | os.PathLike) -> list[str]:
    """Remove the temporary folders and files a killed run left behind: ``.final.tmp-*`` /
    ``.final.old-*`` (an interrupted model save), ``.NAME.*.tmp`` (an interrupted atomic file
    write) and ``checkpoints/step-N.tmp`` (an interrupted checkpoint).

    Only call it while no other process writes into ``out_dir``.

    Returns:
        the paths removed, relative to ``out_dir``.
    """
    folder = Path(out_dir)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name
                                                                          or p.name.endswith(".tmp"))]
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir():
        stale += [p for p in checkpoints.iterdir() if p.name.endswith(".tmp")]
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return sorted(str(p.relative_to(folder)) for p in stale)


def check_eval_output(out: str | os.PathLike, model_dirs: list[str | os.PathLike]) -> Path:
    """Check the ``--out`` of ``python -m finetune.evaluate`` before anything runs.

    Refused: a folder; a path inside a model folder being evaluated (``final/config.json`` would
    destroy the model); an existing file that is not an earlier evaluation result (JSON with
    ``"sets"``).

    Returns:
        the path.
    Raises:
        RunFolderError: naming the path and what to give instead.
    """
    path = Path(out)
    if path.is_dir():
        raise RunFolderError(f"--out {str(path)!r} is a folder; give a file path such as {path / 'metrics_eval.json'}")
    resolved = path.resolve()
    for folder in model_dirs:
        folder = Path(folder)
        if folder.is_dir() and resolved.is_relative_to(folder.resolve()):
            raise RunFolderError(f"--out {str(path)!r} is inside the model folder {str(folder)!r}, whose files it could "
                                 "overwrite; write the results elsewhere (e.g. the run folder's metrics_eval.json)")
    if path.exists():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            previous = None
        if not (isinstance(previous, dict) and "sets" in previous):
            raise RunFolderError(f"--out {str(path)!r} exists and is not an earlier evaluation result; "
                                 "give a new file path (or remove that file)")
    return path
