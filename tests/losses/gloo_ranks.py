"""Spawn gloo processes for the losses' multi-process tests (CPU, a file rendezvous, one thread each).

``run_ranks(fn, folder, world)`` starts ``world`` processes; each joins the group, saves ``fn(rank, world)``
(a dict of tensors and numbers) to ``folder/rank{r}.pt`` and destroys the group, and the caller gets every
rank's dict back. ``fn`` must be a module-level function, as ``torch.multiprocessing.spawn`` pickles it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable[[int, int], dict[str, Any]], folder: str, world: int, name: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{name}", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world), os.path.join(folder, f"{name}{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[[int, int], dict[str, Any]], folder: str, world: int, name: str = "rank") -> list[dict]:
    """Run ``fn(rank, world)`` in ``world`` gloo processes; returns each rank's result, rank order."""
    mp.spawn(_worker, args=(fn, folder, world, name), nprocs=world, join=True)
    return [torch.load(os.path.join(folder, f"{name}{r}.pt"), weights_only=True) for r in range(world)]
