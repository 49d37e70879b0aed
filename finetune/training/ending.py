"""How a run that a signal stopped, or that failed in a way the user can act on, ends: one message (what was kept,
how to continue) and an exit status, no traceback (:func:`stopped_or_failed`)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from finetune.data.images import DataError
from finetune.training.checkpoint import SaveFailedError
from finetune.training.launch import resume_command, secrets_left_out
from finetune.training.signals import RunInterrupted, TrainingStopped
from finetune.training.trainer import DivergedError, NonFiniteLossError

__all__ = ["stopped_or_failed", "worker_message"]


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
    """
    out = Path(recipe.output.dir)
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
