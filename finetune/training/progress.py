"""What the training loop reports, at its reads (DESIGN 6: no host read between logging steps): the meter brought to
the host in one read (:class:`~finetune.training.meter.StepMeter`), folded into the run's state (the loss history, the
interval sums a checkpoint carries), sent to the recipe's trackers and shown on the progress bar, with the clock of
the throughput (:class:`~finetune.training.throughput.LoopClock`) marked there; a non-finite loss under
``on_nonfinite: raise`` (:class:`NonFiniteLossError`) and weights that became NaN or infinite
(:class:`DivergedError`) stop the run at that read.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from finetune.runs.checkpoints import list_checkpoints
from finetune.training.checkpoint import TrainState
from finetune.training.distributed import local_shards
from finetune.training.meter import StepMeter
from finetune.training.throughput import LoopClock

log = logging.getLogger("xlipkit")

__all__ = ["DivergedError", "NonFiniteLossError", "Progress", "term_values"]


def term_values(values: dict[str, float]) -> list[tuple[str, float]]:
    """The per-term loss values of a step's logged values (``clip``, ``structxlip/local``, ...): everything but
    the total, the learning rate and the logit scale."""
    return [(k, v) for k, v in values.items() if k not in ("loss", "lr", "logit_scale")]


class NonFiniteLossError(RuntimeError):
    """Raised when a loss term is NaN or infinite and ``train.on_nonfinite`` is ``raise``."""


class DivergedError(RuntimeError):
    """The trainable weights became NaN or infinite; the run stops without saving them (names the steps, the
    newest checkpoint with finite weights and what to change)."""


class Progress:
    """The loop's reads and what they report (module docstring).

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (trackers, the main process's bar, several processes).
        cfg: the recipe's ``train`` section (``batch_size``, ``on_nonfinite``).
        state: the loop's state, which the reads fill.
        step: the step (:class:`~finetune.training.step.TrainStep`): its meter (the device-side accounting), its
            schedule (the logged ``lr``) and its model (the logged logit scale).
        trainable: the weights an update can change (the divergence check).
        ckpt_dir: where the checkpoints are (named when the weights diverge); ``epoch_at``: the global epoch after
            a step (:meth:`finetune.training.batches.Batches.epoch_at`).
    """

    def __init__(self, accelerator: Any, cfg: Any, state: TrainState, step: Any, *,
                 trainable: list[torch.nn.Parameter], ckpt_dir: Path, epoch_at: Callable[[int], float]) -> None:
        self.accelerator, self.cfg, self.state = accelerator, cfg, state
        self.meter: StepMeter = step.meter
        self.scheduler, self.model = step.scheduler, step.model
        self.trainable, self.ckpt_dir, self.epoch_at = trainable, ckpt_dir, epoch_at
        self.clock = LoopClock()
        self.truncated = 0
        self._last_read_step = 0
        self._bar: Any = None

    def start(self, first: int, total: int) -> LoopClock:
        """Start the clock and the progress bar of a loop from step ``first`` to ``total``; returns the clock (its
        steady window leaves out the first steps: warm-up, first compilations, the loader's first batches)."""
        remaining = total - first
        self.clock = LoopClock(skip_steps=first + max(1, min(10, remaining // 10)), before_s=self.state.train_time_s)
        self.clock.mark(first, self.state.samples_seen)
        self.truncated, self._last_read_step = 0, first
        self._bar = tqdm(total=total, initial=first, disable=not self.accelerator.is_local_main_process,
                         desc="train", dynamic_ncols=True)
        return self.clock

    def stepped(self) -> None:
        """One more step on the progress bar."""
        self._bar.update(1)

    def close(self) -> None:
        """Close the progress bar (before a message follows it)."""
        if self._bar is not None:
            self._bar.close()

    def read(self, step: int, *, log_now: bool) -> tuple[dict[str, float], int]:
        """The read of step ``step``: the meter brought to the host (:meth:`values`), the clock marked, at a logging
        step (``log_now``) the history entry and the trackers, and the bar's figures.

        Returns:
            ``(values, applied)``: the last applied step's logged values (every term, ``lr``, ``logit_scale``)
            and the number of steps applied since the previous read.
        """
        values, applied = self.values(step)
        state, clock = self.state, self.clock
        clock.mark(step, state.samples_seen)
        if log_now and state.interval_counts:
            entry = state.close_interval(values)
            state.history.append({"step": step, **entry})
            self.accelerator.log({**{f"train/{k}": v for k, v in entry.items()}, "train/epoch": self.epoch_at(step)},
                                 step=step)
        if values:
            rate = (state.samples_seen - clock.marks[0].samples) / max(clock.elapsed(), 1e-9)
            # the total, then every term's value under its logged name (``clip``, ``structxlip/local``)
            self._bar.set_postfix({"loss": f"{values['loss']:.4f}", **{k: f"{v:.4f}" for k, v in term_values(values)},
                                   "epoch": f"{self.epoch_at(step):.2f}", "samples_s": f"{rate:.1f}"})
        return values, applied

    def values(self, step: int) -> tuple[dict[str, float], int]:
        """Read the meter (the loop's one host read between logging steps), fold the interval's sums into the
        state, and stop the run on a non-finite value under ``on_nonfinite: raise`` or on diverged weights.

        Raises:
            NonFiniteLossError: a non-finite loss under ``on_nonfinite: raise``.
            DivergedError: the trainable weights became non-finite.
        """
        cfg = self.cfg
        r = self.meter.read([self.model.logit_scale.detach().float().exp(), self._nonfinite_weights()])
        if r.extra[1] > 0:
            self._diverged(step, r.first_bad)
        self._last_read_step = step
        if r.first_bad is not None:
            bad_step, term, value = r.first_bad
            msg = (f"non-finite loss at step {bad_step}: term '{term}' = {value}. Lower train.lr, enable "
                   f"train.grad_clip, check the data, or set train.on_nonfinite: skip")
            if cfg.on_nonfinite == "raise":
                raise NonFiniteLossError(msg + " (that step and those after it were not applied)")
            log.warning("%s (%d step(s) skipped up to step %d)", msg, r.skipped, step)
        self.state.skipped_steps += r.skipped
        self.state.samples_seen += r.applied * cfg.batch_size
        self.truncated += r.truncated
        self.state.add_to_interval(r.sums, r.counts)
        values = dict(self.state.last_values)
        if r.last is not None:  # else no step applied yet in this run: keep the saved values
            values = {**r.last, "lr": self.scheduler.get_last_lr()[0], "logit_scale": r.extra[0]}
            self.state.last_values = values
        return values, r.applied

    def _nonfinite_weights(self) -> Tensor:
        """``1.`` (a 0-dim tensor on the device) when a trainable weight is NaN or infinite, else ``0.``, summed over
        processes: the max-abs of every trainable tensor in one fused ``torch._foreach_norm(ord=inf)`` (no overflow:
        the max of finite values is finite), read with the meter's read at logging steps only."""
        device = self.accelerator.device
        if not self.trainable:
            return torch.zeros((), device=device)
        by_device: dict[torch.device, list[Tensor]] = {}
        for local in local_shards(self.trainable):  # FSDP2, ZeRO-3: each process its own shard, summed below
            by_device.setdefault(local.device, []).append(local.detach())
        bad = [(~torch.stack(torch._foreach_norm(ps, math.inf)).float().isfinite()).any().float().to(device)
               for ps in by_device.values()]
        flag = torch.stack(bad).max() if bad else torch.zeros((), device=device)  # a process may hold none
        if self.meter.reduce is not None:  # a sharded model (FSDP) holds other weights on each process
            flag = self.meter.reduce(flag, reduction="sum")
        return flag

    def _diverged(self, step: int, first_bad: tuple[int, str, float] | None) -> None:
        """Stop the run: the weights are no longer finite (checked at each read). Nothing is saved."""
        kept = list_checkpoints(self.ckpt_dir)
        since = f"between step {self._last_read_step} and step {step}" if self._last_read_step < step - 1 else \
            f"at step {step}"
        loss = (f"; the first non-finite loss was at step {first_bad[0]} (term '{first_bad[1]}' = {first_bad[2]})"
                if first_bad else "")
        skip = (" With train.on_nonfinite: skip every later step would be skipped; " if self.cfg.on_nonfinite == "skip"
                else " ")
        where = (f"The newest checkpoint, {kept[-1]}, was saved with finite weights: resume from it with those "
                 "changes (train.resume=latest train.resume_ignore_changes=true)" if kept else
                 "No checkpoint was saved before it (train.checkpoint_every keeps some)")
        raise DivergedError(
            f"the trainable weights became NaN or infinite {since} (checked at each logging step, train.log_every)"
            f"{loss}.{skip}the run stops here and saves nothing of these weights. {where}. To avoid it: lower "
            "train.lr, set train.grad_clip (e.g. 1.0), raise train.warmup_steps, or check the data")
