"""Run folders are never silently overwritten, and a resume continues the run it claims to.

Before :func:`finetune.training.run_recipe` writes anything into ``output.dir`` it calls
:func:`check_run_folder`: a folder that holds a finished run (``metrics.json`` or ``final/``) or
the ``recipe.yaml`` of a different run is refused, unless ``output.overwrite: true`` (then
:func:`clear_previous_run` removes the old run's files first, so nothing of it mixes with the new
one) or ``train.resume`` continues the same run. Whatever ``output.overwrite`` says, a run never replaces what it
did not write: a folder holding ``report.md``, ``plots/`` or ``logs/`` but no run is the user's, and the recipe
file being run may not be the folder's own ``recipe.yaml`` unless a run wrote it.

"The same run" means the same :func:`continuation_view` of the recipe: what decides the weights a
continued run reaches (model, adapter, objective, training data, batch, optimiser and schedule).
A checkpoint records it, and resuming with a different one is an error listing the differing keys
(:func:`differing_keys`) unless ``train.resume_ignore_changes: true``.

One process writes into a run folder at a time: :class:`RunLock` holds an OS file lock
(``filelock.FileLock`` on ``.xlipkit.lock``, released by the kernel when the process dies) and records
its holder (``.xlipkit.owner.json``: PID, host, command), so that a second run is refused naming that
PID. Temporary files carry their writer's :func:`process_tag` (``PID@HOST``), and
:func:`clean_stale_temporaries` removes only those of processes that are gone.
:func:`check_writable` and :func:`check_free_space` (:mod:`finetune.run_space`) stop a run whose folder cannot take
what it will write before anything is written.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from finetune.files import _host, owner_alive, process_tag, tag_owner
from finetune.run_basics import RunFolderError, differing_keys
from finetune.run_space import check_free_space, estimate_run_bytes, folder_bytes

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
    "RunFolderBusy",
    "RunLock",
    "LOCK_NAME",
    "OWNER_NAME",
    "check_writable",
    "check_free_space",
    "estimate_run_bytes",
    "folder_bytes",
    "lock_on_main_process",
]

RECIPE_NAME = "recipe.yaml"
#: what a run writes into its folder (removed by ``output.overwrite: true``)
RUN_OUTPUTS = ("final", "metrics.json", "report.md", "plots", "checkpoints", "logs", RECIPE_NAME)
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


def _comparable(recipe: dict[str, Any]) -> dict[str, Any]:
    """The whole recipe less what may change between a run and its rerun in the same folder."""
    out = json.loads(json.dumps(recipe, default=str))
    out.pop("output", None)
    (out.get("hub") or {}).pop("token", None)
    for key in ("resume", "resume_ignore_changes", "resume_ignore_rng"):
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
    from finetune.config import safe_load_yaml  # aliases bounded: a run folder may come from anyone

    try:
        data = safe_load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise RunFolderError(f"{path} is not a readable recipe ({error}); choose another output.dir or set "
                             "output.overwrite: true to replace that folder's run") from error
    if not isinstance(data, dict):
        raise RunFolderError(f"{path} is not a recipe mapping; choose another output.dir or set output.overwrite: true")
    return data


def _check_recipe_file(folder: Path, recipe_file: str | os.PathLike | None) -> None:
    """Refuse a run of the recipe file ``FOLDER/recipe.yaml`` into ``folder`` unless a run wrote that file: the run
    writes its resolved recipe there, which would replace the user's recipe (and ``output.overwrite`` delete it)."""
    if recipe_file is None or not folder.is_dir():
        return
    path = Path(recipe_file)
    if path.resolve() != folder.resolve() / RECIPE_NAME:
        return
    from finetune.config.io import is_dumped_recipe

    try:
        if is_dumped_recipe(path.read_text(encoding="utf-8")):
            return  # the run's own resolved recipe (a resume, a rerun): replacing it loses nothing
    except (OSError, UnicodeDecodeError):
        pass
    raise RunFolderError(
        f"the recipe being run, {str(path)!r}, is the recipe.yaml of output.dir {str(folder)!r}, where a run writes "
        "its resolved recipe: the run would replace your recipe, comments and all (and output.overwrite would delete "
        f"it). Keep the recipe outside the output folder: move it (e.g. `mv {path} {folder.name}.yaml`) and run that "
        f"with the same output.dir, or choose another output.dir")


def check_run_folder(out_dir: str | os.PathLike, recipe: dict[str, Any], *, overwrite: bool = False,
                     resume: str | None = None, ignore_changes: bool = False,
                     recipe_file: str | os.PathLike | None = None) -> str:
    """Decide whether a run may write into ``out_dir``; nothing is written.

    Args:
        out_dir: the recipe's ``output.dir``.
        recipe: the new run's recipe as ``recipe_to_dict`` gives it.
        overwrite: ``output.overwrite``.
        resume: ``train.resume`` (``latest`` or a checkpoint path), or None.
        ignore_changes: ``train.resume_ignore_changes``.
        recipe_file: the recipe file being run (``Recipe.source``), or None.
    Returns:
        ``"new"`` (no run there), ``"overwrite"`` (a run is there and will be replaced),
        ``"resume"`` (the same run continues) or ``"rerun"`` (an unfinished run of the same
        recipe starts again).
    Raises:
        RunFolderError: the folder is a file; it holds a finished run or another recipe's run (the
            message lists the differing keys and the ways out; it suggests ``train.resume: latest``
            only where a usable checkpoint exists); ``train.resume: latest`` into a finished run with
            no usable checkpoint (it would train again from step 0 over the finished run). Whatever
            ``overwrite`` says: ``recipe_file`` is the folder's ``recipe.yaml`` and was not written by a
            run; the folder holds what a run writes (``report.md``, ``plots/``, ``logs/``) but no run.
    """
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"output.dir {str(folder)!r} is a file; set output.dir to a folder")
    _check_recipe_file(folder, recipe_file)
    previous = read_run_recipe(folder) if folder.is_dir() else None
    finished = [n for n in ("metrics.json", "final") if (folder / n).exists()]
    has_checkpoints = (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir())
    if previous is None and not finished and not has_checkpoints:
        _check_no_foreign_outputs(folder)
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


def _check_no_foreign_outputs(folder: Path) -> None:
    """Refuse a folder that holds no run but names a run writes (``report.md``, ``plots/``, ``logs/``): they are
    the user's own, and a run (or a failed one cleaning up, or ``output.overwrite``) would replace them."""
    if not folder.is_dir():
        return
    ckpt = folder / "checkpoints"
    found = [name + ("/" if (folder / name).is_dir() else "") for name in RUN_OUTPUTS
             if ((folder / name).exists() or (folder / name).is_symlink())
             and not (folder / name == ckpt and ckpt.is_dir() and not any(ckpt.iterdir()))]
    if found:
        raise RunFolderError(
            f"output.dir {str(folder)!r} holds {', '.join(found)} but no run (no {RECIPE_NAME}, metrics.json, final/ "
            "or checkpoints/): they look like your own files, which a run would replace (output.overwrite replaces "
            "only a run's files); choose another output.dir, or move them out of that folder")


def _resumable_checkpoints(folder: Path) -> list[str]:
    """The ``checkpoints/step-N`` folders of ``folder`` that ``train.resume: latest`` could continue from
    (complete, :func:`finetune.resume.checkpoint_problem` without reading every byte: the resume itself checks the
    sha256 of each file), oldest first, as ``checkpoints/step-N``."""
    from finetune.resume import CHECKPOINT_PREFIX, checkpoint_problem

    ckpt = folder / "checkpoints"
    if not ckpt.is_dir():
        return []
    steps = sorted((p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                    and p.name[len(CHECKPOINT_PREFIX):].isdigit()), key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))
    return [f"checkpoints/{p.name}" for p in steps if checkpoint_problem(p, hashes=False) is None]


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

    A name that carries its writer's :func:`process_tag` is removed only when that process is gone
    (:func:`owner_alive`); an untagged one (written by an older version, or by code that does not tag its
    names) only because the caller holds the folder's :class:`RunLock`, so no other run writes there.

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
    removed = []
    for path in stale:
        owner = tag_owner(path.name)
        if owner is not None and owner_alive(*owner):
            continue  # a live process (another rank, an evaluation) is writing it
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return sorted(str(p.relative_to(folder)) for p in removed)


# -- one run per folder -------------------------------------------------------------------------------
LOCK_NAME = ".xlipkit.lock"
OWNER_NAME = ".xlipkit.owner.json"


class RunFolderBusy(RunFolderError):
    """Another process holds the run folder's lock.

    Attributes:
        pid: the holder's PID (None when it has not recorded itself yet).
        host: the holder's host name, or None.
    """

    def __init__(self, message: str, pid: int | None = None, host: str | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.host = host


def _describe_os_error(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "it is on a read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.ENOSPC:
        return "the disk is full"
    return exc.strerror or str(exc)


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Create and remove a small file in ``folder`` (an existing folder): the one test of writability that
    a read-only mount, permissions, ACLs and a full disk all answer.

    Raises:
        RunFolderError: naming ``what`` (e.g. ``output.dir 'runs/x'``) and why.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=f".xlipkit-probe.{process_tag()}.", suffix=".tmp", dir=folder)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise RunFolderError(f"{what} is not writable ({_describe_os_error(exc)}); choose a writable folder, or "
                             "fix its permissions") from None


def _make_folder(folder: Path, what: str) -> Path | None:
    """``folder`` created with its missing parents; returns the topmost folder it created, or None."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunFolderError(f"{what} or one of its parents is a file; give a folder path") from None
    except OSError as exc:
        raise RunFolderError(f"{what} cannot be created ({_describe_os_error(exc)}); choose a writable place, or "
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
                raise RunFolderError(f"{self.what}: cannot lock it ({_describe_os_error(exc)})") from None
            self._lock = lock
            try:
                self._write_owner()
            except OSError as exc:
                self.release()
                raise RunFolderError(f"{self.what} is not writable ({_describe_os_error(exc)})") from None
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
            raise RunFolderError(f"--out {str(path)!r} is inside the model folder {str(folder)!r}, whose files it "
                                 "could overwrite; write the results elsewhere (e.g. the run folder's "
                                 "metrics_eval.json)")
    if path.exists():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            previous = None
        if not (isinstance(previous, dict) and "sets" in previous):
            raise RunFolderError(f"--out {str(path)!r} exists and is not an earlier evaluation result; "
                                 "give a new file path (or remove that file)")
    return path
