"""The process a run trains in: its ``Accelerator`` (mixed precision, trackers, the run folder as project folder),
its logging, and its CPU threads under ``accelerate launch``."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration

__all__ = ["cpu_threads", "flat_scalars", "make_accelerator", "setup_logging"]


def make_accelerator(recipe: Any) -> Accelerator:
    """The run's ``Accelerator``: ``train.mixed_precision``, the trackers of ``train.trackers`` logging into
    ``output.dir/logs``, and loaders that split each global batch over the processes (``split_batches``)."""
    out_dir = Path(recipe.output.dir)
    trackers = list(recipe.train.trackers or [])
    return Accelerator(
        mixed_precision=recipe.train.mixed_precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(out_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),  # pinned batches overlap
    )


def setup_logging(main: bool) -> None:
    """The ``xlipkit`` logger on stderr: INFO on the main process, WARNING on the others (once per process)."""
    level = logging.INFO if main else logging.WARNING
    logger = logging.getLogger("xlipkit")
    logger.setLevel(level)
    if not logger.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(h)
        logger.propagate = False


def cpu_threads(accelerator: Any) -> None:
    """``accelerate launch`` without ``--cpu`` on a machine without a GPU exports ``OMP_NUM_THREADS=1``, which
    leaves a single CPU process one core: give it every core it may run on, and say so. With ``--cpu`` the
    user's (or accelerate's) ``--num_cpu_threads_per_process`` stands."""
    launched = "ACCELERATE_USE_CPU" in os.environ and os.environ["ACCELERATE_USE_CPU"].lower() not in ("1", "true")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if (launched and accelerator.device.type == "cpu" and accelerator.num_processes == 1
            and os.environ.get("OMP_NUM_THREADS") == "1" and torch.get_num_threads() == 1 and cores > 1):
        torch.set_num_threads(cores)
        logging.getLogger("xlipkit").info(
            "accelerate launch set OMP_NUM_THREADS=1 for this one CPU process: using all %d cores "
            "(accelerate launch --cpu --num_cpu_threads_per_process N chooses N)", cores)


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
