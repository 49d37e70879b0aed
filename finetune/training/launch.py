"""How this process was launched, for the messages a stopped run prints: the command line the user typed (the
launcher's: ``accelerate launch``, ``torchrun``, when one started this process), and the command that continues the
run (:func:`resume_command`). The launcher's command line is the parent process's (``/proc/<ppid>/cmdline``), read
here only."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from finetune.config.secrets import mask_secrets, without_secrets

__all__ = ["accelerate_traceback_follows", "launch_argv", "parent_argv", "resume_command", "secrets_left_out"]

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
