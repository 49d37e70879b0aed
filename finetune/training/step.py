"""One optimiser step (DESIGN 6): forward, loss, backward and the update of a batch already on the device, without
reading anything back (:class:`TrainStep`), over the model and the objective's own parameters trained as one module
(:class:`TrainModule`). The loop that calls it is :meth:`finetune.training.recipe.FinetuneRecipe.train`.

The contrastive accumulation with cached features is in one place (:meth:`TrainStep.forward_backward`): every
micro-batch is encoded without gradients first, then re-encoded with gradients and scored against the cached
features of the others (open_clip's accum-freq scheme), gradients synchronised on the last micro-batch only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from finetune.objectives.base import Features, Objective
from finetune.objectives.planning import merge_features, split_batch
from finetune.training.checkpoint import TrainState
from finetune.training.distributed import average_gradients, layer_classes
from finetune.training.meter import StepMeter
from finetune.training.step_setup import StepSetup

__all__ = ["TrainModule", "TrainStep"]


class TrainModule(nn.Module):
    """The model and the objective's own parameters in one module, so that ``accelerator.prepare`` wraps
    both (DDP synchronises the temperatures of added terms too) and every encoder call runs inside the
    wrapped module's ``forward``."""

    def __init__(self, model: nn.Module, objective: Objective) -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        #: the encoder layers of the model's family, each one FSDP unit under accelerate's transformer wrap policy
        self._no_split_modules = layer_classes(model)

    def forward(
        self,
        batch: dict[str, Any],
        *,
        encode_only: bool = False,
        cache: list[Features] | None = None,
        index: int = 0,
        detach_params: bool = False,
    ) -> dict[str, Tensor] | Features:
        """Encode ``batch`` and return the loss dict ``{"loss": total, "<term>": value, ...}``.

        Args:
            encode_only: return the features instead of the loss (first pass of accumulation).
            cache: features of every micro-batch of the step; ``cache[index]`` is replaced by this
                micro-batch's fresh features before the loss is computed on their concatenation.
            detach_params: see :meth:`Term.loss`.
        """
        feats = self.objective.encode(self.model, batch)
        if encode_only:
            return feats
        if cache is not None:
            parts = list(cache)
            parts[index] = feats
            feats = merge_features(parts)
        return self.objective.loss(self.model, feats, detach_params=detach_params)


class TrainStep:
    """The optimiser step of a run on a batch on the device (:meth:`__call__`), without reading anything back: the
    loop calls it between its reads; ``bench/loop.py`` times it alone as the bare step.

    Args:
        accelerator: the run's ``accelerate.Accelerator``.
        wrapped: the prepared :class:`TrainModule`; ``optimizer``, ``scheduler``: prepared too.
        cfg: the recipe's ``train`` section (``accumulation_steps``, ``grad_clip``, ``logit_scale_max``,
            ``on_nonfinite``).
        setup: the step's attention backend, compiled blocks and warm-up (:class:`StepSetup`).
        state: the loop's state (``flops_per_step`` is counted at step 1).
        replicated: 0-dim parameters FSDP2 leaves out, whose gradients are averaged here.

    Attributes:
        meter: where the loss terms and the non-finite check stay on the device between the loop's reads
            (:class:`StepMeter`; a non-finite step is not applied).
        model: the model as it trains, out of accelerate's wrapper (its logit scale is clamped here).
    """

    def __init__(self, accelerator: Any, wrapped: nn.Module, optimizer: Any, scheduler: Any, cfg: Any, *,
                 setup: StepSetup, state: TrainState, replicated: list[nn.Parameter]) -> None:
        self.accelerator, self.wrapped, self.optimizer, self.scheduler = accelerator, wrapped, optimizer, scheduler
        self.cfg, self.setup, self.state, self.replicated = cfg, setup, state, replicated
        world = accelerator.num_processes
        self.meter = StepMeter(accelerator.device, reduce=accelerator.reduce if world > 1 else None,
                               sticky=cfg.on_nonfinite == "raise", optimizer=getattr(optimizer, "optimizer", optimizer),
                               scaler=getattr(optimizer, "scaler", None))
        self.model = accelerator.unwrap_model(wrapped).model

    def __call__(self, batch: dict[str, Any], step: int) -> None:
        """Optimiser step number ``step`` on ``batch`` (on the device): forward and backward
        (:meth:`forward_backward`), the loss terms and the non-finite check into :attr:`meter`, clipping, the
        optimiser step (not applied where the meter says so), the schedule, the logit scale's clamp."""
        cfg = self.cfg
        with self._first_step_counted(step), self.setup.attention_context():
            out = self.forward_backward(batch)
        average_gradients(self.replicated, self.accelerator.num_processes)
        self.meter.add(out, step, batch.get("truncated"))
        if cfg.grad_clip:
            self.accelerator.clip_grad_norm_(self.wrapped.parameters(), cfg.grad_clip)
        if self.meter.device_skip or not bool(self.meter.found_inf):  # the fallback reads the flag
            self.optimizer.step()  # fused AdamW skips the update itself where found_inf is 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if cfg.logit_scale_max is not None:
            with torch.no_grad():
                self.model.logit_scale.clamp_(max=cfg.logit_scale_max)

    @contextlib.contextmanager
    def _first_step_counted(self, step: int) -> Iterator[None]:
        """A fresh run's first step: its FLOPs (``state.flops_per_step``, from the shapes that ran:
        :func:`~finetune.training.throughput.count_flops`) and attention kernels (:meth:`StepSetup.observing`) counted
        over its forward and backward. Only then: ops under a dispatch mode may round differently, and a resumed run
        must match a straight one."""
        if step != 1:
            yield
            return
        with FlopCounterMode(display=False) as counter, self.setup.observing():
            yield
        self.state.flops_per_step = int(counter.get_total_flops())

    def forward_backward(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """Forward and backward of one optimiser step on ``batch`` (on the device, pixels normalised): one pass, or
        the accumulation scheme (module docstring); returns the last micro-batch's loss dict, which is the whole
        batch's. Backward runs even on a non-finite loss, so that every process takes part in the gradient
        all-reduce; the step is then dropped (or the run stopped) by the meter."""
        acc, accum = self.accelerator, self.cfg.accumulation_steps
        if accum == 1:
            with acc.accumulate(self.wrapped):
                out = self.wrapped(batch)
                acc.backward(out["loss"])
            return out
        micro = split_batch(batch, accum)
        with torch.no_grad():
            cache = [self.wrapped(mb, encode_only=True) for mb in micro]
        cache = [{k: v.detach() for k, v in feats.items()} for feats in cache]
        out: dict[str, Tensor] = {}
        for j, mb in enumerate(micro):
            # accelerate's accumulate: no gradient sync and no optimiser step (DeepSpeed's engine included) before the
            # last micro-batch. Each micro-batch's loss is the whole accumulated batch's, so their gradients add up to
            # its gradient: the division by the accelerator's accumulation steps that accelerate (or the engine) applies
            # is undone here
            with acc.accumulate(self.wrapped):
                out = self.wrapped(mb, cache=cache, index=j, detach_params=j != accum - 1)
                acc.backward(out["loss"] * acc.gradient_accumulation_steps)
        return out

    def warm_up(self, batch: dict[str, Any]) -> None:
        """Forward and backward of the first batch at every planned text length, gradients dropped, no update
        (:meth:`~finetune.training.step_setup.StepSetup.warm_up`). Not under DeepSpeed, whose backward steps the
        optimiser: there the first step at each length builds its graphs."""
        if self.accelerator.state.deepspeed_plugin is None:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            self.setup.warm_up(lambda b: (self.forward_backward(b), inner.zero_grad(set_to_none=True)), batch)
