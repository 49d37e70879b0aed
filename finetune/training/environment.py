"""The process a run trains in: its ``Accelerator`` (mixed precision, trackers, the run folder as project folder),
its logging, and what it says of its CPU threads."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs, ProjectConfiguration

from finetune.config.secrets import mask_secrets
from finetune.threads import cpu_thread_plan, thread_line
from finetune.training.distributed import slurm_environment
from finetune.training.processes import fsdp_on_cpu, group_timeout

__all__ = ["MaskSecrets", "cpu_threads", "flat_scalars", "launched_as_main", "make_accelerator", "setup_logging"]


def make_accelerator(recipe: Any) -> Accelerator:
    """The run's ``Accelerator``: ``train.mixed_precision``, the trackers of ``train.trackers`` logging into
    ``output.dir/logs``, loaders that split each global batch over the processes (``split_batches``),
    ``train.accumulation_steps`` micro-batches per optimiser step (accelerate's ``accumulate`` counts them, so that the
    optimiser, DeepSpeed's engine included, steps once per accumulated batch), the process group's timeout
    (``train.process_group_timeout_s``; a launch's group itself, with its backend, is made first by
    :func:`~finetune.training.processes.start_processes`), under ``srun`` without a launcher
    SLURM's variables (:func:`~finetune.training.distributed.slurm_environment`), and FSDP version 2 on CPU processes
    that asked for it (:func:`~finetune.training.processes.fsdp_on_cpu`)."""
    slurm_environment()
    out_dir = Path(recipe.output.dir)
    trackers = list(recipe.train.trackers or [])
    accelerator = Accelerator(
        mixed_precision=recipe.train.mixed_precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(out_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),  # pinned batches overlap
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=recipe.train.accumulation_steps,
                                                                sync_with_dataloader=False),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=group_timeout(recipe))],
    )
    fsdp_on_cpu(accelerator)
    return accelerator


def launched_as_main() -> bool:
    """Whether this is the main process by what its launcher exported (``RANK`` of accelerate and torchrun,
    ``SLURM_PROCID`` of srun): known before an ``Accelerator`` exists."""
    return all(os.environ.get(v, "0") == "0" for v in ("RANK", "SLURM_PROCID"))


class MaskSecrets(logging.Filter):
    """A log record's message with every secret masked (:func:`finetune.config.secrets.mask_secrets`: tokens,
    storage credentials, credentials inside shard URLs), whatever module logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_secrets(message)
        if masked != message:
            record.msg, record.args = masked, ()
        return True


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is when a record is emitted, not the stream it was made with
    (a caller that swaps ``sys.stderr`` for a while, as pytest's capture or a progress bar does, would otherwise
    leave the handler writing to a closed stream)."""

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it
        pass


def setup_logging(main: bool) -> None:
    """The ``xlipkit`` logger on stderr: INFO on the main process, WARNING on the others (once per process); what it
    prints never shows a secret (:class:`MaskSecrets`)."""
    level = logging.INFO if main else logging.WARNING
    logger = logging.getLogger("xlipkit")
    logger.setLevel(level)
    if not logger.handlers:
        h = _CurrentStderr()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        h.addFilter(MaskSecrets())
        logger.addHandler(h)
        logger.propagate = False


def cpu_threads(accelerator: Any) -> None:
    """A CPU run's thread count, and a log line that says where it comes from (:func:`finetune.threads.
    cpu_thread_plan`): the count a user gives (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``accelerate launch
    --num_cpu_threads_per_process``, ``torch.set_num_threads`` before the run) is kept; a one-process run that
    ``accelerate launch`` gave its default ``OMP_NUM_THREADS=1`` gets every core, as without the launcher."""
    if accelerator.device.type == "cpu":
        target, source = cpu_thread_plan(torch.get_num_threads(), accelerator.num_processes)
        if target is not None:
            torch.set_num_threads(target)
        logging.getLogger("xlipkit").info("%s", thread_line(torch.get_num_threads(), source))


def flat_scalars(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict (the resolved recipe) as ``{"a.b": scalar}``, what trackers take as a run's config."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_scalars(v, key + "."))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        elif v is not None:
            out[key] = str(v)
    return out
