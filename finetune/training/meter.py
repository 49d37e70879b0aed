"""What the loop keeps on the device between its reads (DESIGN 6: no host read between logging steps): the loss
terms, the non-finite check and the counts of the steps since the last read (:class:`StepMeter`)."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

log = logging.getLogger("xlipkit")

__all__ = ["MeterReading", "StepMeter"]


@dataclass
class MeterReading:
    """What :meth:`StepMeter.read` brings to the host: per-term sums and counts over the applied steps since the
    last read, the number of ``applied`` and ``skipped`` steps, the last applied step's values (``last``, None
    before the first), the first non-finite ``(step, term, value)`` since the last read (since the start under
    ``on_nonfinite: raise``), the ``truncated`` captions and the ``extra`` values asked for."""

    sums: dict[str, float]
    counts: dict[str, int]
    applied: int
    skipped: int
    last: dict[str, float] | None
    first_bad: tuple[int, str, float] | None
    truncated: int
    extra: list[float]


class StepMeter:
    """The loss terms, the non-finite check and the counts of the steps since the last read, kept on the device,
    so that the loop never waits for the device between reads (DESIGN 6).

    Every step, :meth:`add` stacks the step's loss values (``(T,)``, one per logged name), checks them on the
    device (all-reduced over processes, so that every process skips the same steps) and sets ``found_inf`` to 1
    when the step must not be applied: a non-finite value this step (``on_nonfinite: skip``) or at any step so far
    (``raise``, which stops the run at the next read; the steps in between are not applied either). Fused torch
    AdamW reads ``found_inf`` as it does under ``GradScaler`` (``torch.optim.adam._fused_adam``, torch 2.11-2.14:
    the kernel leaves parameters and moments as they are and the step count is taken back) with no host read.
    Other optimisers, and fp16 training whose ``GradScaler`` owns ``found_inf``, read the flag every step
    instead (``device_skip`` False): one host read per step, logged once.

    Args:
        device: where the loss values live.
        reduce: ``accelerator.reduce`` when several processes train, else None.
        sticky: ``on_nonfinite: raise``: once a step was non-finite no later step is applied.
        optimizer: the torch optimiser (inside accelerate's wrapper); ``found_inf`` is set on it when it honours it.
        scaler: accelerate's ``GradScaler`` (fp16), or None.
    """

    def __init__(self, device: torch.device, *, reduce: Callable | None = None, sticky: bool = True,
                 optimizer: torch.optim.Optimizer | None = None, scaler: Any = None) -> None:
        self.device = torch.device(device)
        self.reduce = reduce
        self.sticky = sticky
        self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        fused = isinstance(optimizer, torch.optim.Adam) and bool(optimizer.defaults.get("fused"))
        self.device_skip = fused and scaler is None
        if self.device_skip:
            optimizer.found_inf = self.found_inf
        else:
            log.info("the optimiser (%s%s) cannot skip a non-finite step on the device: the loop reads the "
                     "non-finite flag every step", type(optimizer).__name__,
                     ", fp16 GradScaler" if scaler is not None else "")
        self._wide = torch.float32 if self.device.type == "mps" else torch.float64

        def zero(dtype: torch.dtype = torch.long) -> Tensor:
            return torch.zeros((), dtype=dtype, device=self.device)

        self.applied, self.skipped, self.truncated, self.first_term = zero(), zero(), zero(), zero()
        self.first_step = torch.full((), -1, dtype=torch.long, device=self.device)
        self.first_value = zero(torch.float32)
        self.keys: list[str] = []
        self.sums = torch.zeros(0, dtype=self._wide, device=self.device)
        self.counts = torch.zeros(0, dtype=torch.long, device=self.device)
        self.last = torch.zeros(0, dtype=torch.float32, device=self.device)
        self._present: dict[tuple[str, ...], Tensor] = {}

    def _layout(self, names: tuple[str, ...]) -> Tensor:
        """Grow the per-term tensors for names not seen before; the ``(T,)`` mask of the terms this step has
        (kept on the device per set of names: no host-to-device copy per step)."""
        new = [k for k in names if k not in self.keys]
        if new:
            self.keys += new
            grow = functools.partial(torch.zeros, len(new), device=self.device)
            self.sums = torch.cat([self.sums, grow(dtype=self._wide)])
            self.counts = torch.cat([self.counts, grow(dtype=torch.long)])
            self.last = torch.cat([self.last, grow(dtype=torch.float32).fill_(math.nan)])
            self._present.clear()
        if names not in self._present:
            self._present[names] = torch.tensor([k in names for k in self.keys], device=self.device)
        return self._present[names]

    def add(self, out: dict[str, Tensor], step: int, truncated: Tensor | None = None) -> None:
        """Account one step: ``out`` its loss dict (0-dim tensors), ``truncated`` its ``(B,)`` flags."""
        names = tuple(out)
        present = self._layout(names)
        given = {k: v.detach().float().reshape(()) for k, v in out.items()}
        missing = self.found_inf.new_zeros(())
        vals = torch.stack([given.get(k, missing) for k in self.keys])
        bad = ~torch.isfinite(vals)
        if self.reduce is not None:  # every process skips the same steps
            bad = self.reduce(bad.float(), reduction="sum") > 0
        any_bad = bad.any()
        new = (self.first_step < 0) & any_bad
        term = bad.to(torch.int8).argmax()
        self.first_step = torch.where(new, step, self.first_step)
        self.first_term = torch.where(new, term, self.first_term)
        self.first_value = torch.where(new, vals.gather(0, term.reshape(1))[0], self.first_value)
        skip = (self.first_step >= 0) if self.sticky else any_bad
        ok = ~skip
        use = present & ok
        self.sums += torch.where(use, vals.to(self._wide), 0.0)
        self.counts += use
        self.last = torch.where(use, vals, self.last)
        self.applied += ok
        self.skipped += skip
        if truncated is not None:
            self.truncated += truncated.sum()
        self.found_inf.copy_(skip)

    def read(self, extra: list[Tensor] | tuple[Tensor, ...] = ()) -> MeterReading:
        """Bring everything to the host in ONE read (the sums and last values averaged over processes first)
        and start the next interval; ``extra`` 0-dim tensors (the logit scale) travel with them."""
        sums, last = self.sums, self.last
        if self.reduce is not None and self.keys:
            sums, last = self.reduce(sums, reduction="mean"), self.reduce(last, reduction="mean")
        scalars = [self.applied, self.skipped, self.first_step, self.first_term, self.first_value, self.truncated,
                   *(t.detach().reshape(()) for t in extra)]
        packed = torch.cat([sums.double(), self.counts.double(), last.double(),
                            torch.stack([s.double() for s in scalars])])
        host = packed.tolist()  # the read
        n = len(self.keys)
        sums_h, counts_h, last_h, rest = host[:n], host[n:2 * n], host[2 * n:3 * n], host[3 * n:]
        applied, skipped, first_step, first_term, first_value, truncated = rest[:6]
        self.sums.zero_()
        self.counts.zero_()
        for t in (self.applied, self.skipped, self.truncated):
            t.zero_()
        first_bad = None
        if first_step >= 0:
            first_bad = (int(first_step), self.keys[int(first_term)], first_value)
            if not self.sticky:
                self.first_step.fill_(-1)
        seen = [k for k, v in zip(self.keys, last_h) if not math.isnan(v)]
        return MeterReading(
            sums={k: s for k, s, c in zip(self.keys, sums_h, counts_h) if c},
            counts={k: int(c) for k, c in zip(self.keys, counts_h) if c},
            applied=int(applied), skipped=int(skipped),
            last={k: v for k, v in zip(self.keys, last_h) if k in seen} or None,
            first_bad=first_bad, truncated=int(truncated), extra=rest[6:])

