"""Deprecated: the training loop is the package :mod:`finetune.training` (issue 32), one job per module.

This module forwards its old names for one release, with a ``FutureWarning`` that names the new path; import
them from ``finetune.training`` (or the module named in :data:`MOVED`) instead.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: every public name of the old ``finetune.train`` -> the module that holds it now
MOVED = {
    **dict.fromkeys(("Trainer", "TrainModule", "TrainResult", "NonFiniteLossError", "DivergedError", "term_values"),
                    "finetune.training.trainer"),
    **dict.fromkeys(("EpochShuffleSampler", "EpochIndexed", "PREFETCH_BATCHES"), "finetune.training.loaders"),
    **dict.fromkeys(("lr_lambda", "build_optimizer"), "finetune.training.optim"),
    **dict.fromkeys(("TrainState", "SaveFailedError", "is_write_error", "describe_save_failure", "save_checkpoint"),
                    "finetune.training.checkpoint"),
    **dict.fromkeys(("CHECKPOINT_PREFIX", "list_checkpoints", "stream_state_file"), "finetune.runs.checkpoints"),
    **dict.fromkeys(("MeterReading", "StepMeter"), "finetune.training.meter"),
    **dict.fromkeys(("STOP_SIGNALS", "RunInterrupted", "TrainingStopped", "StopSignals", "stop_signals",
                     "ignore_stop_signals", "limit_worker_threads", "init_worker", "worker_signals", "StopVote"),
                    "finetune.training.signals"),
}

warnings.warn("finetune.train is deprecated and will be removed in the next release: import from "
              "finetune.training (Trainer, TrainModule, build_optimizer, ...; finetune.train.MOVED lists each name's "
              "new module)", FutureWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    if name in MOVED:
        return getattr(importlib.import_module(MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (finetune.train moved to finetune.training)")
