"""The parts of the training loop (:class:`LoopParts`), built in one place (:func:`build_loop`); the loop itself, which
calls them, is :meth:`finetune.training.recipe.FinetuneRecipe.train`.

One job each: the batches (:class:`~finetune.training.batches.Batches`, over the collate stack of
:func:`~finetune.training.batches.collate_stack`), the step (:class:`~finetune.training.step.TrainStep`: forward,
loss, backward, optimiser step), the reads and what they report (:class:`~finetune.training.progress.Progress`), the
checkpoints (:class:`~finetune.training.checkpoint.Checkpoints`), the step's fixed set-up
(:class:`~finetune.training.step_setup.StepSetup`), and the stop vote's process group. ``accelerator.prepare`` is
called in one place (:func:`build_loop`), and the model is unwrapped in one place (:meth:`LoopParts.trained_model`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate.utils import gather_object
from torch import nn

from finetune.training.batches import Batches, collate_stack, open_batches
from finetune.training.checkpoint import Checkpoints, TrainState
from finetune.training.distributed import deepspeed_objects, fsdp2_scalars, gathered_model, sharded
from finetune.training.epochs import EpochLedger
from finetune.training.optim import build_optimizer, build_scheduler
from finetune.training.progress import Progress
from finetune.training.signals import vote_group
from finetune.training.step import TrainModule, TrainStep
from finetune.training.step_setup import StepSetup, setup_step
from finetune.training.throughput import throughput_summary

__all__ = ["LoopParts", "TrainResult", "build_loop"]


@dataclass
class TrainResult:
    """Summary of a finished (or resumed-and-finished) run."""

    steps: int
    history: list[dict[str, float]]
    final_losses: dict[str, float]
    wall_time_s: float
    samples_per_s: float
    skipped_steps: int
    truncated_captions: int
    skipped_examples: list[dict[str, str]] = field(default_factory=list)
    #: this run part's steady throughput (:func:`~finetune.training.throughput.throughput_summary`):
    #: ``steady_samples_per_s``, ``data_wait_share``, ``flops_per_sample``, ``tflops_per_device``, ``mfu``, ...
    throughput: dict[str, Any] = field(default_factory=dict)
    epochs: list[dict[str, Any]] = field(default_factory=list)  # what each epoch read (finetune.training.epochs)


@dataclass
class LoopParts:
    """The parts of the training loop of one run (module docstring); :meth:`FinetuneRecipe.train` runs them.

    Attributes:
        accelerator: the run's ``accelerate.Accelerator``; ``cfg``: the recipe's ``train`` section.
        module: the model and the objective (:class:`TrainModule`); ``wrapped``: it prepared by accelerate;
            ``optimizer`` and ``scheduler``: prepared too.
        state: the loop's state (step, history, ...), one object every part shares.
        setup: the step's shapes, attention backend, compiled blocks and warm-up.
        batches: the batches of the steps, on the device; ``step``: one optimiser step; ``progress``: the reads;
            ``checkpoints``: writing and resuming.
        epochs: what each epoch read, this process's (:class:`~finetune.training.epochs.EpochLedger`; carried by the
            checkpoints, merged over the processes in the result).
        vote_group: the gloo group of the stop vote of several processes (None for one), with the run's timeout.
    """

    accelerator: Any
    cfg: Any
    module: TrainModule
    wrapped: nn.Module
    optimizer: Any
    scheduler: Any
    state: TrainState
    setup: StepSetup
    batches: Batches
    step: TrainStep
    progress: Progress
    checkpoints: Checkpoints
    epochs: EpochLedger
    vote_group: Any = None
    #: a copy of the model taken before sharding (FSDP, ZeRO-3), loaded with the whole weights by :meth:`final_model`
    skeleton: nn.Module | None = None

    @property
    def objective(self) -> Any:
        """The run's objective."""
        return self.module.objective

    def trained_model(self) -> nn.Module:
        """The model as it trains, out of accelerate's wrapper (the one place that unwraps it; sharded weights stay
        sharded: :meth:`final_model` gathers them)."""
        return self.accelerator.unwrap_model(self.wrapped).model

    def final_model(self) -> nn.Module:
        """The trained model with its whole weights on every process, for the final evaluation, ``final/``, the push
        and the export: :meth:`trained_model`, or, where FSDP or DeepSpeed ZeRO-3 shard the weights, a copy of the
        model taken before sharding loaded with ``accelerator.get_state_dict`` (a collective: every process calls
        it)."""
        if self.skeleton is None:
            return self.trained_model()
        return gathered_model(self.accelerator, self.wrapped, self.skeleton)

    def checkpoint(self) -> Path:
        """A checkpoint of the current step, now (a finished run stopped while it evaluates keeps its training)."""
        return self.checkpoints.save(self.progress.clock)

    def result(self) -> TrainResult:
        """The :class:`TrainResult` of the loop that ran last: its history, final per-term losses, throughput."""
        state, clock, acc = self.state, self.progress.clock, self.accelerator
        state.train_time_s = wall = clock.trained_s()
        throughput = throughput_summary(clock, state.flops_per_step, batch_size=self.cfg.batch_size,
                                        world_size=acc.num_processes, device=acc.device, last_step=state.step)
        throughput.update(self.setup.summary())
        # the last step's values, saved in the checkpoint (a run resumed at its end trains no step); checkpoints
        # written before ``last_values`` existed give their last history entry
        last_losses = state.last_values or (
            {k: v for k, v in state.history[-1].items() if k != "step"} if state.history else {})
        return TrainResult(
            steps=state.step,
            history=state.history,
            final_losses={k: v for k, v in last_losses.items() if k not in ("lr",)},
            wall_time_s=wall,
            samples_per_s=state.samples_seen / max(wall, 1e-9),
            skipped_steps=state.skipped_steps,
            truncated_captions=self.progress.truncated,
            skipped_examples=self._all_skipped(),
            throughput=throughput,
            epochs=self.epochs.merged(acc),
        )

    def _all_skipped(self) -> list[dict[str, str]]:
        """The passed-over examples of every process, each id once."""
        entries = self.state.skipped_examples
        if self.accelerator.num_processes > 1:
            entries = gather_object([entries])
            entries = [e for part in entries for e in part]
        unique = {e["id"]: e for e in entries}
        return sorted(unique.values(), key=lambda e: e["id"])


def build_loop(accelerator: Any, module: TrainModule, rows: Any, cfg: Any, run_dir: str | Path, *,
               on_error: str = "raise", num_workers: int = 0,
               collate_fn: Callable[[list[dict]], dict[str, Any]] | None = None) -> LoopParts:
    """Build the loop of a run, every part in order: the step's set-up (the objective's shapes planned from the
    training set, the attention backend, compiled blocks), the collate stack and the loader, the optimiser and its
    schedule, ``accelerator.prepare`` of everything that trains (the module under DDP, FSDP or DeepSpeed, the
    optimiser, the schedule), the step (with its meter), the reads, the checkpoints and the stop vote's group.

    Args:
        accelerator: an ``accelerate.Accelerator`` (mixed precision and trackers already configured).
        module: the model and the objective (:class:`TrainModule`).
        rows: the training set after the objective's preprocessing (map-style: ``len`` and ``__getitem__``), or a
            stream (a torch ``IterableDataset`` with ``state_dict`` / ``load_state_dict`` and ``epoch``, e.g.
            :class:`finetune.data.streams.ExampleStream`): then each process loads batches of its share of
            ``train.batch_size`` from its own shards, ``train.max_steps`` steps, and checkpoints hold each process's
            stream position (``stream_state_<rank>.json``).
        cfg: the recipe's ``train`` section.
        run_dir: the run folder (``checkpoints/`` goes inside).
        on_error: ``data.on_error`` (map-style data: an unreadable image skipped or raised).
        num_workers: data-loader worker processes (the recipe's ``data.num_workers``).
        collate_fn: examples -> batch in place of the run's collator (:func:`~finetune.training.batches.collate_stack`).

    Raises:
        ValueError: a batch that does not split over the processes and the accumulation steps, a stream without
            ``train.max_steps``, a training set smaller than one batch, ``train.text_buckets`` the model cannot take.
    """
    world = accelerator.num_processes
    if cfg.batch_size % (world * cfg.accumulation_steps):
        raise ValueError(
            f"train.batch_size={cfg.batch_size} must be divisible by processes x accumulation_steps "
            f"= {world} x {cfg.accumulation_steps}; change train.batch_size or train.accumulation_steps")
    state = TrainState()
    setup = setup_step(module.model, module.objective, cfg, rows, accelerator.device)
    rows, collate = collate_stack(module.model, module.objective, rows, cfg, on_error=on_error, collate_fn=collate_fn)
    batches = open_batches(accelerator, rows, collate, cfg, state, num_workers=num_workers,
                           lengths=setup.shapes.text_lengths)
    optimizer = build_optimizer(module, cfg)
    scheduler = build_scheduler(optimizer, cfg, batches.total_steps)
    if accelerator.state.deepspeed_plugin is not None:
        optimizer, scheduler = deepspeed_objects(accelerator, module, optimizer, scheduler, cfg, batches.total_steps)
    replicated = fsdp2_scalars(accelerator, module)  # 0-dim parameters FSDP2 leaves out: averaged by the step
    skeleton = copy.deepcopy(module.model).cpu() if sharded(accelerator) else None
    wrapped, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    step = TrainStep(accelerator, wrapped, optimizer, scheduler, cfg, setup=setup, state=state, replicated=replicated)
    progress = Progress(accelerator, cfg, state, step, trainable=[p for p in module.parameters() if p.requires_grad],
                        ckpt_dir=Path(run_dir) / "checkpoints", epoch_at=batches.epoch_at)
    inner, epochs = getattr(optimizer, "optimizer", optimizer), EpochLedger()
    checkpoints = Checkpoints(accelerator, run_dir, state, cfg, epochs, stream=batches.stream,
                              sized=lambda: _checkpoint_tensors(module, inner))
    return LoopParts(accelerator, cfg, module, wrapped, optimizer, scheduler, state, setup, batches, step, progress,
                     checkpoints, epochs, vote_group(world, cfg.process_group_timeout_s), skeleton)


def _checkpoint_tensors(module: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """The tensors a checkpoint holds: the module's state and the optimiser's."""
    tensors = list(module.state_dict().values())
    for entry in getattr(optimizer, "state", {}).values():
        tensors += [v for v in entry.values() if torch.is_tensor(v)]
    return tensors
