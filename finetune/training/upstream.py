"""The upstream runs of a recipe, the runs it builds on: ``model.init_from`` (the starting model) and
``eval.compare_with`` (runs set beside this one in the report). Before a run, :func:`upstream_needs` says whether
each can be used (for :func:`finetune.training.preflight.preflight`); the run itself reuses or trains them
(:func:`ensure_all`).

A reference is a recipe YAML or a run folder. A recipe's run lives in its ``output.dir``; it is *current*
when that folder holds a finished run (``metrics.json`` and ``final/``) whose ``recipe.yaml`` has the same
:func:`finetune.runs.identity.recipe_hash` as the recipe now (and, when that recipe has an ``init_from`` of
its own, was trained from the same start: :func:`chain_hash` recorded in its ``metrics.json``). A current
run is reused; otherwise it is trained first, into its ``output.dir`` (a stale run there is replaced), by
the same launcher and in the same processes as the run that needs it: every process of a multi-process
launch calls :func:`ensure` with the same arguments, decides the same way from the same files, and trains
the prerequisite together with the others (one DDP run), then all of them load its ``final/``. A run
folder is used as it is (it must hold ``final/``).

Relative paths are read from the current directory, as ``output.dir`` is. An upstream recipe may run the code it
names (``objective.import``) only when the recipe that names it may (``Recipe.trust_code``, the user's
``--trust-recipe-code``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate.state import AcceleratorState, GradientState

from finetune.config import RecipeError, load_recipe, recipe_to_dict
from finetune.runs.errors import RunFolderError
from finetune.runs.identity import RECIPE_NAME, comparable_recipe, differing_keys, read_run_recipe, recipe_hash
from finetune.training.assets import Need, weights_need

log = logging.getLogger("xlipkit")

__all__ = ["PrerequisiteError", "Prerequisite", "Prerequisites", "chain_hash", "ensure", "ensure_all", "find_current",
           "reference_hash", "upstream_needs"]


class PrerequisiteError(ValueError):
    """A ``model.init_from`` / ``eval.compare_with`` reference that cannot be used: missing, a folder
    without ``final/``, a cycle, or a prerequisite run that failed."""


@dataclass
class Prerequisite:
    """A run this one builds on.

    Attributes:
        key: the recipe key that names it (``model.init_from``, ``eval.compare_with[0]``).
        ref: the reference as written.
        run_dir: its run folder.
        hash: :func:`reference_hash` of the reference (what a run built on it records).
        status: ``reused`` (a current run was found), ``trained`` (trained now) or ``folder`` (a run folder
            given directly).
    """

    key: str
    ref: str
    run_dir: Path
    hash: str
    status: str

    @property
    def final(self) -> Path:
        """The run's ``final/`` model folder."""
        return self.run_dir / "final"

    def metrics(self) -> dict[str, Any]:
        """The run's ``metrics.json`` (empty when it has none)."""
        path = self.run_dir / "metrics.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def record(self) -> dict[str, Any]:
        """What ``metrics.json`` of the run built on it records."""
        return {"ref": self.ref, "run_dir": str(self.run_dir), "hash": self.hash, "status": self.status}


def _load(ref: str, key: str, trust: bool = False) -> Any:
    try:
        return load_recipe(ref, trust_imports=trust)
    except RecipeError as exc:
        raise PrerequisiteError(f"{key}: {ref} is not a valid recipe: {exc}") from exc


def _check_exists(ref: str, key: str) -> Path:
    path = Path(ref).expanduser()
    if not path.exists():
        raise PrerequisiteError(
            f"{key}: {ref!r} not found (relative paths are read from the current directory, {Path.cwd()}); give a "
            "recipe YAML or a run folder that holds final/")
    if path.is_dir() and not (path / "final").is_dir():
        raise PrerequisiteError(
            f"{key}: the run folder {ref!r} has no final/ (not a finished run); train it first, or give its "
            "recipe YAML so that it is trained when needed")
    return path


def _folder_hash(final: Path) -> str:
    """A run folder given directly: its ``final/`` files' names, sizes and modification times."""
    digest = hashlib.sha256()
    for path in sorted(p for p in final.rglob("*") if p.is_file()):
        st = path.stat()
        digest.update(f"{path.relative_to(final)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def reference_hash(ref: str, key: str, chain: tuple[str, ...] = (), *, trust: bool = False) -> str:
    """What decides the run ``ref`` names: for a recipe, :func:`chain_hash` of it; for a run folder, its
    ``final/`` files (names, sizes, modification times). ``trust``: the recipe may import what it names.

    Raises:
        PrerequisiteError: a missing reference, a folder without ``final/``, a cycle.
    """
    path = _check_exists(ref, key)
    if path.is_dir():
        return _folder_hash(path / "final")
    resolved = str(path.resolve())
    if resolved in chain:
        cycle = " -> ".join([*chain[chain.index(resolved):], resolved])
        raise PrerequisiteError(f"{key}: a cycle of model.init_from: {cycle}; a recipe cannot start from itself")
    return chain_hash(_load(ref, key, trust), (*chain, resolved))


def chain_hash(recipe: Any, chain: tuple[str, ...] = ()) -> str:
    """sha256 of the recipe's :func:`finetune.runs.identity.recipe_hash` and, when it has a ``model.init_from``,
    the :func:`reference_hash` of that start (recursively): equal hashes train the same weights.

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        chain: resolved paths of the recipes that lead here (for cycle errors).
    """
    if recipe.source and not chain:
        chain = (str(Path(recipe.source).resolve()),)
    parts = [recipe_hash(recipe_to_dict(recipe))]
    init = getattr(recipe.model, "init_from", None)
    if init:
        parts.append(reference_hash(init, "model.init_from", chain, trust=recipe.trust_code))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _with_current_defaults(run_dir: Path, previous: dict[str, Any]) -> dict[str, Any]:
    """``run_dir``'s recipe resolved by today's schema, so that keys added to the toolkit since that run
    (at their defaults) do not count as changes; the recipe as written when it no longer validates."""
    try:
        return recipe_to_dict(load_recipe(run_dir / RECIPE_NAME))
    except (RecipeError, OSError, ValueError):
        return previous


def _current(run_dir: Path, recipe: Any, expected_init: str | None) -> tuple[bool, str]:
    """Whether ``run_dir`` holds a finished run of ``recipe`` trained from ``expected_init``; and why not."""
    if not (run_dir / "final").is_dir() or not (run_dir / "metrics.json").is_file():
        return False, f"{run_dir} holds no finished run"
    try:
        previous = read_run_recipe(run_dir)
    except RunFolderError as exc:
        return False, str(exc)
    if previous is None:
        return False, f"{run_dir} has no recipe.yaml"
    previous = _with_current_defaults(run_dir, previous)
    now = recipe_to_dict(recipe)
    if recipe_hash(previous) != recipe_hash(now):
        changes = differing_keys(comparable_recipe(previous), comparable_recipe(now))
        return False, f"its recipe changed ({'; '.join(changes[:6])}{' ...' if len(changes) > 6 else ''})"
    try:
        recorded = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8")).get("init_from")
    except (OSError, ValueError):
        recorded = None
    if (recorded or {}).get("hash") != expected_init:
        return False, "its starting model (model.init_from) changed"
    return True, ""


def find_current(ref: str, key: str, *, trust: bool = False) -> Prerequisite | None:
    """The run ``ref`` names when it exists and is current (what :func:`ensure` would reuse), else None; never
    trains. For commands that only look (``xlipkit preview``). ``trust``: the recipe may import what it names.

    Raises:
        PrerequisiteError: a missing reference, a folder without ``final/``, a cycle.
    """
    path = _check_exists(ref, key)
    if path.is_dir():
        return Prerequisite(key, ref, path, _folder_hash(path / "final"), "folder")
    this_hash = reference_hash(ref, key, trust=trust)
    recipe = _load(ref, key, trust)
    init = getattr(recipe.model, "init_from", None)
    expected_init = reference_hash(init, "model.init_from", (str(path.resolve()),), trust=trust) if init else None
    current, _ = _current(Path(recipe.output.dir), recipe, expected_init)
    return Prerequisite(key, ref, Path(recipe.output.dir), this_hash, "reused") if current else None


def ensure(ref: str, key: str, run_fn: Callable[..., int], chain: tuple[str, ...] = (), *,
           trust: bool = False) -> Prerequisite:
    """Make sure the run ``ref`` names exists and is current; train it (``run_fn(recipe, chain=...)``, the
    same :func:`finetune.training.recipe.run_recipe` as the caller's) when it is not.

    Args:
        ref: a recipe YAML or a run folder with ``final/``.
        key: the recipe key that names it, for messages.
        run_fn: runs a recipe, returns the exit status.
        chain: resolved paths of the recipes that lead here.
        trust: the recipe may import the code it names (``objective.import``).

    Returns:
        the :class:`Prerequisite`.
    Raises:
        PrerequisiteError: a missing reference, a folder without ``final/``, a cycle, or a failed training.
    """
    path = _check_exists(ref, key)
    if path.is_dir():
        return Prerequisite(key, ref, path, _folder_hash(path / "final"), "folder")
    resolved = str(path.resolve())
    this_hash = reference_hash(ref, key, chain, trust=trust)  # the whole chain (cycles, missing files) before training
    recipe = _load(ref, key, trust)
    run_dir = Path(recipe.output.dir)
    init = getattr(recipe.model, "init_from", None)
    expected_init = reference_hash(init, "model.init_from", (*chain, resolved), trust=trust) if init else None
    current, why = _current(run_dir, recipe, expected_init)
    if current:
        log.info("%s: reusing %s (%s finished with the same recipe)", key, run_dir / "final", ref)
        return Prerequisite(key, ref, run_dir, this_hash, "reused")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        log.warning("%s: training %s into %s first: %s", key, ref, run_dir, why)  # a run there is replaced
    else:  # the expected step of a first run
        log.info("%s: training %s into %s first: %s", key, ref, run_dir, why)
    if run_dir.is_dir() and any(run_dir.iterdir()):
        recipe.output.overwrite = True  # the folder is that recipe's own output.dir; its stale run goes
    status = run_fn(recipe, chain=(*chain, resolved))
    if status != 0 or not (run_dir / "final").is_dir():
        raise PrerequisiteError(f"{key}: training {ref} (into {run_dir}) failed with exit status {status}; "
                                "see its messages above")
    return Prerequisite(key, ref, run_dir, this_hash, "trained")


@dataclass
class Prerequisites:
    """The runs a recipe builds on: ``model.init_from`` (``init``) and ``eval.compare_with`` (``compare``)."""

    init: Prerequisite | None = None
    compare: list[Prerequisite] = field(default_factory=list)


def ensure_all(recipe: Any, run_fn: Callable[..., int], chain: tuple[str, ...] = ()) -> Prerequisites:
    """The runs ``recipe`` builds on, each reused or trained now (:func:`ensure`). After one trained, the accelerate
    state is reset (its process group kept), so that the caller's ``Accelerator`` may differ (mixed precision,
    plugins).

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        run_fn: runs a recipe (:func:`finetune.training.recipe.run_recipe`), returns the exit status.
        chain: resolved paths of the recipes that need ``recipe`` (empty for the run the user started).

    Raises:
        PrerequisiteError: as :func:`ensure`.
    """
    if recipe.source and not chain:
        chain = (str(Path(recipe.source).resolve()),)
    init_ref, trust = getattr(recipe.model, "init_from", None), recipe.trust_code
    init = ensure(init_ref, "model.init_from", run_fn, chain, trust=trust) if init_ref else None
    compare = [ensure(ref, f"eval.compare_with[{i}]", run_fn, chain, trust=trust)
               for i, ref in enumerate(getattr(recipe.eval, "compare_with", None) or [])]
    if any(p is not None and p.status == "trained" for p in [init, *compare]):
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return Prerequisites(init, compare)


def _references(recipe: Any) -> list[tuple[str, str]]:
    init = getattr(recipe.model, "init_from", None)
    return ([("model.init_from", init)] if init else []) + [
        (f"eval.compare_with[{i}]", ref) for i, ref in enumerate(getattr(recipe.eval, "compare_with", None) or [])]


def upstream_needs(recipe: Any, chain: tuple[str, ...] = ()) -> list[tuple[Need, Any]]:
    """Whether each run ``recipe`` builds on can be used, without training or loading anything: a run folder with a
    readable ``final/`` is ``ready``; a recipe is ``ready`` (its run is reused when current, else trained first) and
    comes with the loaded recipe when its run is not there yet, so that the caller checks what training it needs;
    a missing reference, a folder that is not a finished run or a recipe that does not load is ``missing``.

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        chain: resolved paths of the recipes that lead here (a cycle is left to the run's own check).

    Returns:
        ``(need, upstream recipe or None)`` for each reference, in recipe order.
    """
    chain = chain or ((str(Path(recipe.source).resolve()),) if recipe.source else ())
    out: list[tuple[Need, Any]] = []
    for key, target in _references(recipe):
        path = Path(target).expanduser()
        if path.is_dir():
            need = (weights_need(key, f"run folder {target}", path / "final", "its final/ is loaded")
                    if (path / "final").is_dir() else
                    Need(key, f"run folder {target}", "missing", "it has no final/ (not a finished run): train it "
                                                                 "first, or name its recipe"))
            out.append((need, None))
        elif not path.is_file():
            out.append((Need(key, f"recipe {target}", "missing", f"not found (read from {Path.cwd()}): give a recipe "
                                                                 "YAML or a run folder that holds final/"), None))
        elif str(path.resolve()) not in chain:
            try:  # read as the run will read it
                sub = _load(target, key, recipe.trust_code)
            except PrerequisiteError as exc:
                out.append((Need(key, f"recipe {target}", "missing", str(exc)), None))
                continue
            done = Path(sub.output.dir) / "final"
            out.append((Need(key, f"recipe {target}", "ready", f"its run {done} is reused when current, else it is "
                                                               "trained first"), None if done.is_dir() else sub))
    return out
