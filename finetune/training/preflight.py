"""One check before a run (:func:`preflight`): whether a recipe can run, decided by the one function that ``xlipkit
validate``, ``xlipkit preview`` and ``xlipkit train`` (``finetune/run.py``, ``accelerate launch finetune/run.py``,
:func:`finetune.training.run_recipe`) all call, so that what one accepts the others accept. Nothing is loaded,
trained or written; each download host is asked at most one HEAD request.

It checks, and reports together in one message, before anything slow starts:

- the commands the recipe names: a ``pipe:`` shard command runs only when the user allowed the recipe's code
  (``--trust-recipe-code``, ``Recipe.trust_code``; an ``objective.import`` module is refused as the recipe loads);
- the objective, built once (the run trains this very object), whether its contrastive terms get batches of more
  than one example (:func:`check_contrastive_batch`), and whether it can train on a streamed ``data.train``
  (:func:`check_stream_recipe`);
- every asset the recipe needs (:mod:`finetune.training.assets`: models, checkpoint files, datasets, stream shards,
  extras) and the upstream runs it builds on (:mod:`finetune.training.upstream`), followed into the recipes of those
  that are trained first (their assets, objective and stream);
- ``output.dir``: whether the run may write there (:func:`output_action`; the run decides again once it holds the
  folder's lock).

What only the loaded data and model can tell (a batch larger than the data, the room on the disk, a warm-up as long
as the run) the run checks itself (:mod:`finetune.training.size_checks`).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config import TRUST_RULE, Recipe, RecipeError, recipe_to_dict
from finetune.config.secrets import without_secrets
from finetune.data.images import DataError
from finetune.data.sources import SourceSpec
from finetune.data.streams import STREAM_EXAMPLE_FIELDS, check_fields
from finetune.files import owner_alive, process_tag
from finetune.objectives import Objective, build_objective
from finetune.runs.errors import RunFolderError
from finetune.runs.folder import check_run_folder
from finetune.runs.lock import OWNER_NAME, RunLock
from finetune.training.assets import Need, asset_needs, planning
from finetune.training.upstream import upstream_needs

__all__ = ["Preflight", "check_contrastive_batch", "check_stream_recipe", "command_ref", "missing_message",
           "output_action", "preflight", "recipe_needs", "untrusted_commands"]


@dataclass
class Preflight:
    """What :func:`preflight` found.

    Attributes:
        recipe: the recipe checked.
        recipe_ref: how the user named it (its path), for messages.
        needs: every asset and upstream run it needs (:class:`~finetune.training.assets.Need`), one entry per thing.
        problems: what else stops it (the objective, the stream, ``output.dir``, a command it may not run), each a
            :class:`RecipeError` naming its key.
        objective: the run's objective, built once (``None`` when it could not be built).
    """

    recipe: Recipe
    recipe_ref: str
    needs: list[Need] = field(default_factory=list)
    problems: list[RecipeError] = field(default_factory=list)
    objective: Objective | None = None

    @property
    def missing(self) -> list[Need]:
        """The needs that are ``missing``."""
        return [n for n in self.needs if n.state == "missing"]

    @property
    def ok(self) -> bool:
        """Whether the recipe can run: no problem, nothing missing."""
        return not self.problems and not self.missing

    def message(self, *, listed: bool = False) -> str | None:
        """Everything that stops the recipe, in one message (``None`` when nothing does): the problems, then every
        missing need (:func:`missing_message`; with ``listed``, they were listed already and are counted)."""
        missing = missing_message(self.needs, self.recipe_ref, command=command_ref(self.recipe, self.recipe_ref),
                                  listed=listed)
        return "\n".join([*(str(p) for p in self.problems), *([missing] if missing else [])]) or None

    def raise_if_refused(self) -> None:
        """Raise the :class:`RecipeError` of :meth:`message` (keyed by its first problem) when the recipe cannot
        run."""
        message = self.message()
        if message is not None:
            first = self.problems[0].key if self.problems else self.missing[0].key.split(", ")[0]
            raise RecipeError(message, key=first)


def preflight(recipe: Recipe, recipe_ref: str | None = None, *, output: bool = True) -> Preflight:
    """Whether ``recipe`` can run: everything a run checks before anything slow starts, together (module docstring).

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        recipe_ref: how the user named the recipe (default its file), for the messages.
        output: check ``output.dir`` too (``xlipkit preview`` writes no run folder).

    Returns:
        the :class:`Preflight`: :attr:`~Preflight.ok`, the needs, the problems, the objective the run trains.
    """
    ref = recipe_ref or (str(recipe.source) if recipe.source else "RECIPE")
    problems = untrusted_commands(recipe)
    needs, upstream = _needs(recipe, command_ref(recipe, ref), ())
    needs = _merged(needs)
    listed = {key for n in needs if n.state == "missing" for key in n.key.split(", ")}
    objective, errors = _objective(recipe, listed)
    problems += errors
    for key, sub in upstream:  # a run trained first: its commands, objective and stream, as its own run checks them
        inner = {k.removeprefix(f"{key} -> ") for k in listed if k.startswith(f"{key} -> ")}
        errors = untrusted_commands(sub) + _objective(sub, inner)[1]
        problems += [RecipeError(f"{key}: {sub.source}: {error}", key=key) for error in errors]
    if output:
        try:
            output_action(recipe)
        except RunFolderError as exc:
            problems.append(RecipeError(str(exc), key="output.dir"))
    return Preflight(recipe, ref, needs, problems, objective)


def recipe_needs(recipe: Recipe, *, recipe_ref: str | None = None, plan_only: bool = False) -> list[Need]:
    """Everything ``recipe`` needs from outside the toolkit, without loading a model or a dataset: its assets
    (:func:`finetune.training.assets.asset_needs`) and the upstream runs it builds on
    (:func:`finetune.training.upstream.upstream_needs`), followed into the recipe of each run that is not there yet
    (its needs listed under its key: ``model.init_from -> model.name_or_path``).

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        recipe_ref: how the user named the recipe, for the commands in messages (default its file).
        plan_only: ask no host and ignore the offline flags: what is not there and can be fetched is ``download``
            (what ``xlipkit download`` would fetch where the network can be reached).

    Returns:
        the needs, in recipe order, one entry per thing (several keys asking for the same file share one).
    """
    with planning(plan_only):
        return _merged(_needs(recipe, command_ref(recipe, recipe_ref), ())[0])


def _needs(recipe: Recipe, ref: str, chain: tuple[str, ...]) -> tuple[list[Need], list[tuple[str, Recipe]]]:
    """The needs of ``recipe`` and of the upstream runs trained first, and those runs' recipes (under their key)."""
    chain = chain or ((str(Path(recipe.source).resolve()),) if recipe.source else ())
    needs = asset_needs(recipe, ref)
    trained: list[tuple[str, Recipe]] = []
    for need, sub in upstream_needs(recipe, chain):
        needs.append(need)
        if sub is not None:
            inner, inner_trained = _needs(sub, ref, (*chain, str(Path(sub.source).resolve())))
            needs += [Need(f"{need.key} -> {n.key}", n.what, n.state, n.how, n.fetch, n.blocked) for n in inner]
            trained += [(need.key, sub), *((f"{need.key} -> {k}", r) for k, r in inner_trained)]
    return needs, trained


def _merged(needs: list[Need]) -> list[Need]:
    """One entry per thing: the same file asked for by several keys (a set trained and evaluated on) is listed
    once, under all of them."""
    merged: dict[tuple[str, str, str], Need] = {}
    for need in needs:
        seen = merged.get((need.what, need.state, need.how))
        merged[(need.what, need.state, need.how)] = need if seen is None else Need(
            f"{seen.key}, {need.key}", need.what, need.state, need.how, seen.fetch, seen.blocked)
    return list(merged.values())


def _objective(recipe: Recipe, listed: set[str]) -> tuple[Objective | None, list[RecipeError]]:
    """The recipe's objective, its batch (:func:`check_contrastive_batch`) and, for a stream,
    :func:`check_stream_recipe`; an error about a key whose need is listed as missing (a FastSAM file, the extra it
    needs) is left to that need's line."""
    try:
        objective = build_objective(recipe.objective)
    except (ValueError, OSError) as exc:  # a term's options that cannot work together, nothing to optimise, ...
        if any(key in str(exc) for key in listed):
            return None, []
        return None, [exc if isinstance(exc, RecipeError) else RecipeError(str(exc), key="objective")]
    errors = []
    for check in (check_contrastive_batch, check_stream_recipe):
        try:
            check(recipe, objective)
        except RecipeError as exc:
            errors.append(exc)
    return objective, errors


def check_contrastive_batch(recipe: Recipe, objective: Objective) -> None:
    """A ``train.batch_size`` that gives a contrastive term (``clip``, ``siglip``, ...) batches of one example, whose
    loss is exactly 0 at every step (:meth:`~finetune.objectives.Objective.check_batch`).

    Raises:
        RecipeError: naming ``train.batch_size``.
    """
    try:
        objective.check_batch(recipe.train.batch_size, recipe.train.accumulation_steps)
    except ValueError as exc:
        raise RecipeError(str(exc), key="train.batch_size") from None


def untrusted_commands(recipe: Recipe) -> list[RecipeError]:
    """The commands a recipe names that may not run: each ``pipe:COMMAND`` of ``data.train.urls`` when the user did
    not allow the recipe's code (``Recipe.trust_code``). Nothing is run to find them."""
    if recipe.trust_code:
        return []
    train = recipe_to_dict(recipe)["data"].get("train")
    problems = []
    for i, entry in enumerate(train if isinstance(train, list) else [train] if train else []):
        urls = entry.get("urls") if isinstance(entry, dict) else None
        key = "data.train" + (f"[{i}]" if isinstance(train, list) else "") + ".urls"
        for url in [urls] if isinstance(urls, str) else urls or []:
            if str(url).startswith("pipe:"):
                problems.append(RecipeError(f"{key}: {str(url)!r} runs a command to read each shard; {TRUST_RULE}",
                                            key=key))
                break
    return problems


def output_action(recipe: Recipe) -> str:
    """What the run does with ``output.dir`` (:func:`finetune.runs.folder.check_run_folder`; nothing is written):
    ``new``, ``overwrite``, ``resume`` or ``rerun``.

    Raises:
        RunFolderError: the folder holds another run, the user's own files, or the recipe being run; another run
            writes into it now (:class:`~finetune.runs.errors.RunFolderBusy`, naming it, as the run's lock would).
    """
    _not_in_use(Path(recipe.output.dir))
    return check_run_folder(recipe.output.dir, recipe_to_dict(recipe),
                            overwrite=bool(getattr(recipe.output, "overwrite", False)), resume=recipe.train.resume,
                            ignore_changes=bool(getattr(recipe.train, "resume_ignore_changes", False)),
                            recipe_file=recipe.source)


def _not_in_use(folder: Path) -> None:
    """Refuse ``folder`` while another run writes into it, naming that run as the run's own lock does: asked (the
    lock taken and given back at once) only where the lock's owner record names a live process on this host other
    than this one, and only on the main process of a launch (``RANK``, or ``SLURM_PROCID`` under ``srun`` before the
    run sets ``RANK`` from it): the others' lock is the main process's, which may hold it already. A run missed here
    is still refused by the run's own lock."""
    if any(os.environ.get(name, "0").strip() not in ("", "0") for name in ("RANK", "SLURM_PROCID")):
        return
    try:
        owner = json.loads((folder / OWNER_NAME).read_text(encoding="utf-8"))
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if host == process_tag().partition("@")[2] and pid != os.getpid() and owner_alive(pid, host):
        RunLock(folder, what=f"output.dir {str(folder)!r}").acquire().release()


def command_ref(recipe: Recipe, recipe_ref: str | None = None) -> str:
    """The recipe as the commands in messages repeat it: its path and its command-line overrides, a token left out
    (:func:`finetune.config.secrets.without_secrets`), quoted for a shell."""
    ref = recipe_ref or (str(recipe.source) if recipe.source else "RECIPE")
    kept = [o for o in (without_secrets(o) for o in recipe.overrides) if o is not None]
    return shlex.join([ref, *kept]) if kept else ref


def missing_message(needs: list[Need], recipe_ref: str, *, command: str | None = None,
                    listed: bool = False) -> str | None:
    """The error for the needs that are ``missing``, all of them in one message; ``None`` when none is.

    Args:
        needs: what the recipe needs.
        recipe_ref: how the user named the recipe.
        command: the recipe and its overrides as the commands to run repeat them (default ``recipe_ref``).
        listed: the needs were just listed (``xlipkit validate``): count the missing ones instead of repeating them.
    """
    missing = [n for n in needs if n.state == "missing"]
    if not missing:
        return None
    command = command or recipe_ref
    fetchable = sum(n.fetch is not None for n in needs)
    download = (f"`xlipkit download {command}` fetches the {fetchable} that can be downloaded (where the network can "
                "be reached; --dry-run lists them)") if fetchable else ""
    if listed:
        head = (f"{recipe_ref} needs {len(missing)} thing{'s' * (len(missing) != 1)} that cannot be found or fetched "
                "(listed above under `missing`)")
        return f"{head}; {download}" if download else head
    tail = f"`xlipkit validate {command}` lists everything the recipe needs" + (f"; {download}" if download else "")
    if len(missing) == 1:  # one line, starting with the key, as the other recipe errors
        (n,) = missing
        return f"{n.key}: {n.what}: {n.how}\n{tail}"
    lines = [f"{recipe_ref} needs {len(missing)} things that cannot be found or fetched:"]
    lines += [f"  - {n.key}: {n.what}: {n.how}" for n in missing]
    return "\n".join([*lines, tail])


def check_stream_recipe(recipe: Recipe, objective: Objective) -> None:
    """Recipe checks for a streamed ``data.train``, run before the model loads.

    Args:
        recipe: a loaded recipe (``data.train`` a typed ``SourceSpec``).
        objective: the run's objective, built from ``recipe.objective``
            (:func:`finetune.objectives.build_objective`).

    Raises:
        RecipeError: ``train.max_steps`` is null (a stream has no length to count epochs with), an
            objective term cannot run on streamed examples (naming the option that makes it streamable), or a
            term reads an example field the stream does not pass through (``data.train.options.fields``).
    """
    spec = recipe.data.train  # a typed SourceSpec, checked (streams included) by load_recipe
    if not spec.is_stream:
        return
    if recipe.train.max_steps is None:
        raise RecipeError(
            f"data.train is a stream ({spec.name}) whose length is unknown, so train.epochs cannot be counted: "
            "set train.max_steps (the number of optimiser steps)", key="train.max_steps")
    try:
        objective.check_stream()
    except ValueError as error:
        raise RecipeError(str(error), key="objective") from None
    _check_example_fields(spec, objective, recipe)


def _check_example_fields(spec: SourceSpec, objective: Any, recipe: Any) -> None:
    """A RecipeError when a term reads an example field (:meth:`~finetune.objectives.base.Term.example_fields`)
    that the stream does not pass through: without it the first batch would raise, after the evaluation."""
    try:
        fields = check_fields(spec)
    except DataError as error:
        raise RecipeError(f"data.train: {error}", key="data.train.options.fields") from None
    passed = {key.rpartition(".")[2] for key in fields} | STREAM_EXAMPLE_FIELDS
    missing: dict[str, list[str]] = {}
    for term in objective.all_terms:
        for name, key in term.example_fields().items():
            if name not in passed:
                missing.setdefault(key, []).append(name)
    if missing:
        key, names = next(iter(missing.items()))
        given = ", ".join(fields) or "none"
        where = f"{recipe.source}: " if getattr(recipe, "source", None) else ""
        raise RecipeError(
            f"{where}{key} reads {', '.join(names)} from every example, which data.train (a {spec.name} stream) does "
            f"not pass through (data.train.options.fields: {given}): add "
            f"{', '.join('json.' + n if spec.name == 'webdataset' else n for n in names)} to "
            f"data.train.options.fields (json.FIELD for a field of a webdataset KEY.json), or set {key}: null",
            file=getattr(recipe, "source", None), key="data.train.options.fields")
