"""Probes of the FLAIR / F-CAST draw tests: the largest CPU allocation of a call, host reads of tensors, and a
fake process group of any size (issue 22: a process draws only its own rows of the negative matrix).
Imported as ``tests.losses.flair_probes`` by the losses and the objective tests."""

from __future__ import annotations

from typing import Any

import torch


def largest_cpu_allocation(fn: Any) -> int:
    """The largest block any one operator allocated on the CPU while ``fn`` ran (bytes), from the
    profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


class HostReads(torch.overrides.TorchFunctionMode):
    """Records torch calls that read a tensor back to the host (a device sync on an accelerator):
    ``bool()``, ``int()``, ``float()``, ``.item()``, ``.tolist()``, ``.cpu()``, ``torch.equal``,
    ``nonzero``, ``unique``, boolean-mask indexing, ..."""

    NAMES = frozenset({"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "equal", "allclose",
                       "cpu", "numpy", "nonzero", "unique", "argwhere", "masked_select"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        name = getattr(func, "__name__", str(func))
        if name in self.NAMES or (name == "__getitem__" and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1:])):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def as_rank(monkeypatch: Any, rank: int, world: int) -> None:
    """Make ``losses.flair`` (and the FLAIR term) believe they run as rank ``rank`` of ``world``
    processes; the all-gather tiles the local rows (the sizes matter here, not the values)."""
    import finetune.objectives.flair as term_module
    import losses.flair as module

    monkeypatch.setattr(module, "world_info", lambda: (rank, world))
    monkeypatch.setattr(term_module, "world_info", lambda: (rank, world), raising=False)
    monkeypatch.setattr(module, "should_gather", lambda gather: gather is not False)
    monkeypatch.setattr(module, "gather_with_grad", lambda x: x.repeat(world, *([1] * (x.dim() - 1))))
