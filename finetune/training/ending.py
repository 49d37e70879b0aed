"""How a run ends when a signal stops it or it fails in a way the user can act on: one message (what was kept, how
to continue) and an exit status, no traceback (:func:`stopped_or_failed`); and the command that continues it
(:func:`resume_command`): the command line the user typed (the launcher's, ``accelerate launch`` or ``torchrun``, when
one started this process, read from the parent process's ``/proc/<ppid>/cmdline``) with ``train.resume=latest``."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from finetune.config.secrets import mask_secrets, without_secrets
from finetune.data.images import DataError
from finetune.training.checkpoint import SaveFailedError
from finetune.training.processes import LaunchError, timeout_message
from finetune.training.signals import RunInterrupted, TrainingStopped
from finetune.training.progress import DivergedError, NonFiniteLossError

__all__ = ["accelerate_traceback_follows", "launch_argv", "parent_argv", "resume_command", "secrets_left_out",
           "stopped_or_failed", "worker_message"]


def _main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def stopped_or_failed(exc: BaseException, recipe: Any) -> int | None:
    """The exit status of a run that a signal stopped or that failed in a way the user can act on, after printing
    its message (on the main process; a data error on every process), or None for anything else (re-raised with
    its traceback).

    - SIGINT / SIGTERM during training: the step was finished and a checkpoint saved; the resume command is
      printed; status 128 + the signal (130, 143).
    - SIGINT / SIGTERM before training: nothing to save; the same status.
    - a checkpoint or ``final/`` that could not be written, weights that diverged, a non-finite loss under
      ``on_nonfinite: raise``, data that broke during training: the message, what was kept, status 1.
    - a launch that cannot form one run or have its engine (:class:`~finetune.training.processes.LaunchError`):
      ``launch error: ...`` on every process, status 2.
    - a collective that timed out (another process stopped answering): one line naming this process and
      ``train.process_group_timeout_s`` (:func:`~finetune.training.processes.timeout_message`) on each process that
      waited, status 1.
    """
    out = Path(recipe.output.dir)
    if isinstance(exc, LaunchError):
        _say(f"launch error: {exc}")
        return 2
    timed_out = timeout_message(exc, recipe)
    if timed_out is not None:
        _say(f"error: {timed_out}")
        return 1
    resume = f"\n  {resume_command()}{secrets_left_out()}"
    if isinstance(exc, TrainingStopped):
        name = signal.Signals(exc.signum).name
        if _main_rank() and exc.checkpoint is not None:
            _say(f"{name}: stopped after step {exc.step}; saved {exc.checkpoint}. Continue the run with:{resume}")
        elif _main_rank():
            _say(f"{name}: stopped after step {exc.step}, but its checkpoint could not be saved: {exc.error}. "
                 f"Continue from the kept checkpoint with:{resume}")
        return 128 + exc.signum
    if isinstance(exc, RunInterrupted):
        if _main_rank():
            _say(f"{exc.args[0]}: stopped before training started (no checkpoint was written in {out}: start the "
                 "run again to train)")
        return 128 + exc.signum
    if isinstance(exc, SaveFailedError):
        if _main_rank():
            then = ("Free some space (or move output.dir and the run folder with it), then continue with:"
                    if exc.disk_full else "Fix the cause, then continue with:")
            _say(f"error: {exc}. {then}{resume}" if exc.kept is not None else f"error: {exc}")
        return 1
    if isinstance(exc, (DivergedError, NonFiniteLossError)):
        if _main_rank():
            _say(f"error: {exc}")
        return 1
    if isinstance(exc, DataError):  # raised while training (a stream's shard, a worker): every rank says its own
        _say(f"data error: {worker_message(exc)}")
        return 1
    return None


def worker_message(exc: BaseException) -> str:
    """The message of an exception, without the traceback text torch adds when it re-raises an exception of a
    data-loader worker (``Caught DataError in DataLoader worker process 0. Original Traceback ...``)."""
    text = str(exc)
    if "Original Traceback" not in text:
        return text
    marker = f"{type(exc).__name__}: "
    return text[text.rindex(marker) + len(marker):].strip() if marker in text else text.splitlines()[-1]


# -- the command that continues the run ----------------------------------------------------------------------
#: ``python -m ...`` launchers that start one process per device
_LAUNCHER_MODULES = {"torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
                     "accelerate.commands.accelerate_cli"}


def parent_argv() -> list[bytes] | None:
    """The parent process's command line (``/proc/<ppid>/cmdline``, Linux), or None where it cannot be read."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None


def launch_argv() -> list[str]:
    """The command line that started this run: the launcher's (``accelerate launch``, ``torchrun``) when one started
    this process, else this process's own; an interpreter running a console script is shown as the script."""
    own = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    argv = own
    try:
        parent = [a.decode() for a in parent_argv() or [] if a]
    except UnicodeDecodeError:
        parent = []
    names = [Path(a).name for a in parent]
    if ("torchrun" in names or ("accelerate" in names and "launch" in parent)
            or any(a == "-m" and b in _LAUNCHER_MODULES for a, b in zip(parent, parent[1:]))):
        argv = parent
    if len(argv) > 1 and Path(argv[0]).name.startswith("python") and not argv[1].startswith("-") \
            and not argv[1].endswith(".py"):
        argv = [Path(argv[1]).name, *argv[2:]]  # /venv/bin/python /venv/bin/accelerate launch ... -> accelerate launch
    return argv


def _resume_argv() -> tuple[list[str], bool]:
    """The arguments of :func:`resume_command`, and whether a secret was left out of them."""
    argv, left_out = [], False
    for arg in launch_argv():
        if arg.startswith(("train.resume=", "output.overwrite=")):
            continue
        kept = without_secrets(arg) if "=" in arg else arg
        left_out = left_out or kept != arg
        if kept is not None:
            argv.append(kept)
    return argv, left_out


def resume_command() -> str:
    """This run's command line with ``train.resume=latest`` (and without ``output.overwrite=...``, which would remove
    the checkpoints it resumes from). A stopped run prints it, so it never holds a secret: a ``hub.token=...``
    override is left out, a section override is repeated without its token (:func:`finetune.config.secrets.
    without_secrets`), and what else looks like a secret is masked (:func:`finetune.config.secrets.mask_secrets`)."""
    argv, _ = _resume_argv()
    return mask_secrets(shlex.join([*argv, "train.resume=latest"]))


def secrets_left_out() -> str:
    """What to say after :func:`resume_command` when it left a token of the command line out ("" when none)."""
    return ("\n  (the hub token given on the command line is left out: set HF_TOKEN, or run `hf auth login`, before "
            "continuing)") if _resume_argv()[1] else ""


def accelerate_traceback_follows() -> bool:
    """Whether ``accelerate launch``'s single-process launcher started this script without ``--quiet``: it then
    answers a non-zero exit with a ``CalledProcessError`` traceback of its own (accelerate 1.x
    ``simple_launcher``; ``--quiet`` makes it exit 1 instead)."""
    if "ACCELERATE_USE_CPU" not in os.environ or os.environ.get("WORLD_SIZE", "1") != "1":
        return False  # not accelerate's simple launcher (DDP launches go through torch's elastic agent)
    parent = parent_argv()
    if parent is None:
        return True
    script = next((i for i, a in enumerate(parent) if a.endswith(b".py") and i > 1), len(parent))
    return not {b"--quiet", b"-q"} & set(parent[:script])  # launcher options come before the script
