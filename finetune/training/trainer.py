"""The Accelerate training loop (DESIGN 6): :class:`Trainer` runs the optimisation of a :class:`TrainModule`.

One job: the loop. The model and the objective's own parameters train as one module (:class:`TrainModule`), prepared
by accelerate in one place (:meth:`Trainer._prepare`); the contrastive accumulation with cached features is in one
place (:meth:`Trainer._step`); the model is unwrapped in one place (:meth:`Trainer.trained_model`). What the loop
does, feature by feature: :mod:`finetune.training`.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from accelerate.utils import gather_object, set_seed
from torch import Tensor, nn
from tqdm.auto import tqdm

from finetune.config import Recipe, recipe_to_dict
from finetune.data.collate import normalize_pixels
from finetune.data.prefetch import DevicePrefetcher
from finetune.data.skipping import SKIPPED_KEY
from finetune.data.streams import StreamLoader, set_terms_epoch
from finetune.objectives.base import Features, Objective
from finetune.objectives.planning import merge_features
from finetune.objectives.planning import split_batch
from finetune.runs.checkpoints import list_checkpoints, read_stream_states, rng_problem, rng_state_name
from finetune.runs.identity import continuation_view
from finetune.runs.resume import check_continuation, find_checkpoint
from finetune.training.distributed import (average_gradients, deepspeed_objects, fsdp2_scalars, gathered_model,
                                          layer_classes, local_shards, sharded)
from finetune.training.epochs import EpochLedger, count_batch
from finetune.training.checkpoint import SaveFailedError, TrainState, save_checkpoint
from finetune.training.loaders import map_loader
from finetune.training.meter import StepMeter
from finetune.training.optim import build_optimizer, build_scheduler
from finetune.training.signals import StopVote, TrainingStopped, stop_signals, vote_group, worker_signals
from finetune.training.throughput import LoopClock, count_flops, throughput_summary

log = logging.getLogger("xlipkit")

__all__ = ["DivergedError", "NonFiniteLossError", "TrainModule", "TrainResult", "Trainer", "term_values"]


def term_values(values: dict[str, float]) -> list[tuple[str, float]]:
    """The per-term loss values of a step's logged values (``clip``, ``structxlip/local``, ...): everything but
    the total, the learning rate and the logit scale."""
    return [(k, v) for k, v in values.items() if k not in ("loss", "lr", "logit_scale")]


class NonFiniteLossError(RuntimeError):
    """Raised when a loss term is NaN or infinite and ``train.on_nonfinite`` is ``raise``."""


class DivergedError(RuntimeError):
    """The trainable weights became NaN or infinite; the run stops without saving them (names the steps, the
    newest checkpoint with finite weights and what to change)."""


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
    #: this run part's steady throughput (:meth:`Trainer._throughput`): ``steady_samples_per_s``,
    #: ``data_wait_share``, ``flops_per_sample``, ``tflops_per_device``, ``mfu``, ...
    throughput: dict[str, Any] = field(default_factory=dict)
    epochs: list[dict[str, Any]] = field(default_factory=list)  # what each epoch read (finetune.training.epochs)



class Trainer:
    """Runs the optimisation of a :class:`TrainModule` on a dataset with a collate function.

    Args:
        accelerator: an ``accelerate.Accelerator`` (mixed precision and trackers already configured).
        module: the model + objective.
        dataset: a map-style dataset of examples (``len`` and ``__getitem__``), or a stream (a torch
            ``IterableDataset`` with ``state_dict`` / ``load_state_dict`` and ``epoch``, e.g.
            ``finetune.data.streams.ExampleStream``): then each process loads batches of its share of
            ``train.batch_size`` from its own shards with ``num_workers`` workers
            (``finetune.data.streams.StreamLoader``), ``train.max_steps`` steps, and checkpoints hold each
            process's stream position (``stream_state_<rank>.json``).
        collate_fn: examples -> batch dict.
        cfg: the recipe's ``train`` section.
        run_dir: the run folder (``checkpoints/`` goes inside).
        extra_no_decay: parameter names (of the model) to exclude from weight decay.
        num_workers: data-loader worker processes (the recipe's ``data.num_workers``).
    """

    def __init__(
        self,
        accelerator: Any,
        module: TrainModule,
        dataset: Any,
        collate_fn: Callable[[list[dict]], dict[str, Any]],
        cfg: Any,
        run_dir: str | Path,
        *,
        extra_no_decay: set[str] = frozenset(),
        num_workers: int = 0,
    ) -> None:
        self.acc = accelerator
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.module = module
        world = accelerator.num_processes
        if cfg.batch_size % (world * cfg.accumulation_steps):
            raise ValueError(
                f"train.batch_size={cfg.batch_size} must be divisible by processes x accumulation_steps "
                f"= {world} x {cfg.accumulation_steps}; change train.batch_size or train.accumulation_steps"
            )
        loader = self._loader(dataset, self._planned(collate_fn, module, cfg, dataset), num_workers)
        optimizer = build_optimizer(module, cfg, extra_no_decay)
        self._prepare(optimizer, build_scheduler(optimizer, cfg, self.total_steps), loader)
        self.state, self.epochs = TrainState(), EpochLedger()
        #: what the divergence check reads at each logging step (the weights an update can change)
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        #: a gloo group for the per-step stop flag of several processes (:class:`StopVote`), with the run's timeout
        self._vote_group = vote_group(world, cfg.process_group_timeout_s)
        self.meter = StepMeter(accelerator.device, reduce=accelerator.reduce if world > 1 else None,
                               sticky=cfg.on_nonfinite == "raise",
                               optimizer=getattr(self.optimizer, "optimizer", self.optimizer),
                               scaler=getattr(self.optimizer, "scaler", None))

    def _loader(self, dataset: Any, collate_fn: Callable, num_workers: int) -> Any:
        """The training loader; sets :attr:`stream`, :attr:`sampler`, :attr:`steps_per_epoch` and
        :attr:`total_steps`.

        A stream gets its own loader (``finetune.data.streams.StreamLoader``): each process reads its own shards with
        ``num_workers`` workers, batches of its share of the global batch, and keeps a resumable position. Map-style
        data: :func:`finetune.training.loaders.map_loader` (the global batch; accelerate splits it over processes
        with ``split_batches=True`` and :meth:`_step` each process's share into micro-batches)."""
        cfg = self.cfg
        self.stream = self.sampler = None
        if isinstance(dataset, torch.utils.data.IterableDataset):
            if not cfg.max_steps:
                raise ValueError("a streamed training set has no length: set train.max_steps")
            self.stream = StreamLoader(
                dataset, batch_size=cfg.batch_size // self.acc.num_processes, collate_fn=collate_fn,
                num_workers=num_workers, on_epoch=functools.partial(set_terms_epoch, self.module.objective),
                worker_init_fn=worker_signals())
            self.steps_per_epoch, self.total_steps = 0, cfg.max_steps
            return self.stream
        loader, self.sampler = map_loader(dataset, collate_fn, cfg, num_workers)
        self.steps_per_epoch, self.total_steps = self.sampler.steps_per_epoch, self.sampler.total_steps
        return loader

    def _prepare(self, optimizer: torch.optim.Optimizer, scheduler: Any, loader: Any) -> None:
        """``accelerator.prepare`` of everything that trains, in one place: the module (DDP, FSDP, DeepSpeed wrap
        it), the optimiser and the schedule; a map-style loader is prepared to split each global batch over the
        processes. Batches stay on the host here and reach the device through the loop's
        :class:`~finetune.data.prefetch.DevicePrefetcher` (a side-stream copy from pageable memory:
        :mod:`finetune.data.prefetch` says why not pinned memory)."""
        if self.acc.state.deepspeed_plugin is not None:
            optimizer, scheduler = deepspeed_objects(self.acc, self.module, optimizer, scheduler, self.cfg,
                                                     self.total_steps)
        #: 0-dim parameters FSDP2 leaves out (``fully_shard`` refuses scalars); their gradients are averaged here
        self._replicated = fsdp2_scalars(self.acc, self.module)
        self._skeleton = copy.deepcopy(self.module.model).cpu() if sharded(self.acc) else None
        self.wrapped, self.optimizer, self.scheduler = self.acc.prepare(self.module, optimizer, scheduler)
        self.loader = loader if self.stream is not None else self.acc.prepare_data_loader(
            loader, device_placement=False)
        self._model = self.trained_model()

    def _planned(self, collate_fn: Callable, module: TrainModule, cfg: Any, dataset: Any) -> Callable:
        """``collate_fn`` planned for the step: the run's fixed shapes, attention backend (``train.attention``) and
        compiled blocks (``train.compile``) set up by :func:`finetune.objectives.step_setup.setup_step`."""
        from finetune.objectives.step_setup import setup_step

        self.step_setup = setup_step(module, cfg, dataset, self.acc.device)
        return self.step_setup.collate(collate_fn)

    def trained_model(self) -> nn.Module:
        """The model as it trains, out of accelerate's wrapper (the one place that unwraps it; sharded weights stay
        sharded: :meth:`final_model` gathers them)."""
        return self.acc.unwrap_model(self.wrapped).model

    def final_model(self) -> nn.Module:
        """The trained model with its whole weights on every process, for the final evaluation, ``final/``, the push
        and the export: :meth:`trained_model`, or, where FSDP or DeepSpeed ZeRO-3 shard the weights, a copy of the
        model taken before sharding loaded with ``accelerator.get_state_dict`` (a collective: every process calls
        it)."""
        if self._skeleton is None:
            return self.trained_model()
        return gathered_model(self.acc, self.wrapped, self._skeleton)

    # -- checkpoints ------------------------------------------------------------------------------
    def maybe_resume(self, resume: str | None, *, checkpoint: str | Path | None = None,
                     recipe: Recipe | None = None, ignore_changes: bool = False,
                     ignore_rng: bool | None = None) -> bool:
        """Continue from ``train.resume`` (``latest`` or a checkpoint folder); True when resumed.

        Args:
            resume: the recipe's ``train.resume``.
            checkpoint: the folder already found by :func:`finetune.runs.resume.find_checkpoint`
                (skips the search).
            recipe: the run's recipe: its continuation view (:func:`finetune.runs.identity.continuation_view`) is
                saved in every checkpoint and compared with the checkpoint's on resume.
            ignore_changes: ``train.resume_ignore_changes``: continue despite a different recipe.
            ignore_rng: ``train.resume_ignore_rng`` (None: the recipe's): resume from a checkpoint whose RNG state
                is missing or damaged, with a fresh one seeded from ``train.seed`` and the step.
        Raises:
            finetune.runs.errors.CheckpointError: no usable checkpoint at a given path (names the file).
            finetune.runs.errors.RunFolderError: the checkpoint was saved with a different recipe.
        """
        view = continuation_view(recipe_to_dict(recipe)) if recipe is not None else None
        self.state.recipe = view
        if ignore_rng is None:
            ignore_rng = bool(getattr(self.cfg, "resume_ignore_rng", False))
        path = Path(checkpoint) if checkpoint is not None else find_checkpoint(
            resume, self.ckpt_dir, world_size=self.acc.num_processes, ignore_rng=ignore_rng)
        if path is None:
            return False
        saved = TrainState.from_json((path / "train_state.json").read_text())
        check_continuation(saved.recipe, view, path, ignore_changes=ignore_changes)
        rng_missing = rng_problem(path, self.acc.process_index) if ignore_rng else None
        if rng_missing is None and not (path / rng_state_name(self.acc.process_index)).is_file():
            rng_missing = (f"the checkpoint was saved by fewer processes (no "
                           f"{rng_state_name(self.acc.process_index)}): a requeue on another number of processes")
        self.acc.load_state(str(path))
        if rng_missing:  # accelerate skipped (or loaded a damaged) RNG state: a fresh one, reproducible from the step
            set_seed(self.cfg.seed + saved.step + 1_000_003 * self.acc.process_index)
            log.warning("train.resume_ignore_rng: %s; process %d continues with a fresh RNG state seeded from "
                        "train.seed and step %d", rng_missing, self.acc.process_index, saved.step)
        self.state = saved
        self.state.recipe = view if view is not None else saved.recipe
        self.epochs.load(saved.epochs if self.acc.is_main_process else [])  # on one process: merged sums them
        if self.stream is not None:
            self.stream.load_states(read_stream_states(path))
        log.info("resumed from %s at step %d", path, self.state.step)
        return True

    # -- the loop ---------------------------------------------------------------------------------
    def _step(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """Forward and backward of one optimiser step on ``batch`` (on the device): ``uint8`` pixels normalised
        (:func:`finetune.data.collate.normalize_pixels`), then one pass, or the accumulation scheme.

        The accumulation lives here, in one place: every micro-batch is encoded without gradients first, then
        re-encoded with gradients and scored against the cached features of the others (open_clip's accum-freq
        scheme, DESIGN 6), gradients synchronised on the last micro-batch only."""
        batch = normalize_pixels(batch)
        accum = self.cfg.accumulation_steps
        # backward runs even on a non-finite loss, so that every process takes part in the gradient
        # all-reduce; the step is then dropped (or the run stopped) by the caller
        if accum == 1:
            with self.acc.accumulate(self.wrapped):
                out = self.wrapped(batch)
                self.acc.backward(out["loss"])
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
            with self.acc.accumulate(self.wrapped):
                out = self.wrapped(mb, cache=cache, index=j, detach_params=j != accum - 1)
                self.acc.backward(out["loss"] * self.acc.gradient_accumulation_steps)
        return out

    def _warm_up(self, batch: dict[str, Any]) -> None:
        """Forward and backward of the first batch at every planned text length, gradients dropped, no update
        (:meth:`~finetune.objectives.step_setup.StepSetup.warm_up`). Not under DeepSpeed, whose backward steps the
        optimiser: there the first step at each length builds its graphs."""
        if self.acc.state.deepspeed_plugin is None:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            self.step_setup.warm_up(lambda b: (self._step(b), inner.zero_grad(set_to_none=True)), batch)

    def train_step(self, batch: dict[str, Any], step: int) -> None:
        """One optimiser step on a batch already on the device, without reading anything back: forward and
        backward (:meth:`_step`), the loss terms and the non-finite check into :attr:`meter`, clipping, the
        optimiser step (not applied where the meter says so), the schedule and the clamps. The loop calls it
        between its reads; ``bench/loop.py`` times it alone as the bare step."""
        cfg = self.cfg
        with self.step_setup.attention_context():
            out = self._step(batch)
        average_gradients(self._replicated, self.acc.num_processes)
        self.meter.add(out, step, batch.get("truncated"))
        if cfg.grad_clip:
            self.acc.clip_grad_norm_(self.wrapped.parameters(), cfg.grad_clip)
        if self.meter.device_skip or not bool(self.meter.found_inf):  # the fallback reads the flag
            self.optimizer.step()  # fused AdamW skips the update itself where found_inf is 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        model = self._model
        if cfg.logit_scale_max is not None:
            with torch.no_grad():
                model.logit_scale.clamp_(max=cfg.logit_scale_max)
        for term in self.module.objective.all_terms:  # e.g. clamp a term's own temperature
            term.after_optimizer_step()

    def _read(self, model: nn.Module, step: int) -> tuple[dict[str, float], int]:
        """Read the meter (the loop's one host read between logging steps), fold the interval's sums into the
        state, and stop the run on a non-finite value under ``on_nonfinite: raise``.

        Returns:
            ``(values, applied)``: the last applied step's logged values (every term, ``lr``, ``logit_scale``)
            and the number of steps applied since the previous read.
        """
        cfg = self.cfg
        r = self.meter.read([model.logit_scale.detach().float().exp(), self._nonfinite_weights()])
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
        self._truncated += r.truncated
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
        if not self._trainable:
            return torch.zeros((), device=self.acc.device)
        by_device: dict[torch.device, list[Tensor]] = {}
        for local in local_shards(self._trainable):  # FSDP2, ZeRO-3: each process its own shard, summed below
            by_device.setdefault(local.device, []).append(local.detach())
        bad = [(~torch.stack(torch._foreach_norm(ps, math.inf)).float().isfinite()).any().float().to(self.acc.device)
               for ps in by_device.values()]
        flag = torch.stack(bad).max() if bad else torch.zeros((), device=self.acc.device)  # a process may hold none
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

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> TrainResult:
        """Run until ``total_steps``; returns the history, the final per-term losses and the throughput.

        The loop does not wait on the host between reads: the loss terms, the non-finite check, the skipped-step
        and truncation counts stay on the device (:class:`StepMeter`) and are read at logging steps
        (``train.log_every``, step 1 and the last step) and checkpoints. ``on_step(step, values)``, when given,
        is called after every applied step with its values, which reads them every step (for tests and tools).

        SIGINT / SIGTERM (:class:`StopSignals`, installed here unless the caller did): the step in progress is
        finished, every process stops after the same step (:class:`StopVote`), a checkpoint is saved and
        :class:`TrainingStopped` raised; a person's second Ctrl-C exits at once (a repeated SIGTERM does not).

        Raises:
            TrainingStopped: a signal stopped the run (after saving a checkpoint).
            NonFiniteLossError: a non-finite loss under ``on_nonfinite: raise``.
            DivergedError: the trainable weights became non-finite (nothing saved).
            SaveFailedError: a checkpoint could not be written (the earlier ones are kept).
        """
        with stop_signals() as stop:
            graceful, stop.graceful = stop.graceful, True
            vote = StopVote(stop, self.acc.num_processes, self._vote_group)
            try:
                return self._train(on_step, vote)
            finally:
                stop.graceful = graceful

    def checkpoint(self) -> Path:
        """A checkpoint of the current step, now (a finished run stopped while it evaluates keeps its training)."""
        return self._save(self.clock)

    def _save(self, clock: Any) -> Path:
        """A checkpoint of the current step (time spent saving left out of the throughput)."""
        saving = time.perf_counter()
        self.state.train_time_s = self._time_before + clock.elapsed() - clock.excluded_s
        self.state.epochs = self.epochs.merged(self.acc)
        stream_state = self.stream.state_dict() if self.stream is not None else None
        index = self.stream.stream.source.index.to_json() if self.stream is not None else None
        path = save_checkpoint(self.acc, self.ckpt_dir, self.state, self.cfg.keep_checkpoints, stream_state,
                               need_bytes=self._checkpoint_bytes, stream_index=index)
        clock.excluded_s += time.perf_counter() - saving
        return path

    def _checkpoint_bytes(self) -> int:
        """About what one checkpoint takes: the model's and objective's tensors and the optimiser's state."""
        tensors = list(self.module.state_dict().values())
        for entry in getattr(self.optimizer, "state", {}).values():
            tensors += [v for v in entry.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _train(self, on_step: Callable[[int, dict[str, float]], None] | None, vote: StopVote) -> TrainResult:
        """:meth:`train`'s loop: a step, the stop vote, and at logging and checkpoint steps the one read."""
        cfg = self.cfg
        self._time_before = self.state.train_time_s  # the earlier parts of a resumed run
        self._truncated = 0
        first = self.state.step
        remaining = self.total_steps - first
        self.clock = clock = LoopClock(skip_steps=first + max(1, min(10, remaining // 10)))
        clock.mark(first, self.state.samples_seen)
        self._last_read_step = first
        bar = tqdm(total=self.total_steps, initial=first, disable=not self.acc.is_local_main_process,
                   desc="train", dynamic_ncols=True)
        batches = iter(DevicePrefetcher(self._batches(), self.acc.device))
        try:
            while self.state.step < self.total_steps:
                waited = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:  # a stream that ended: open it again (it counts its epochs)
                    batches = iter(DevicePrefetcher(self._batches(), self.acc.device))
                    continue
                clock.wait_s += time.perf_counter() - waited
                self._note_skipped(batch, count_batch(self.epochs, batch, self.state.step, self.steps_per_epoch))
                step = self.state.step + 1
                if step == first + 1:  # every planned text length runs once before this process's first step
                    self._warm_up(batch)
                if step == 1:  # FLOPs of the first step from the shapes (finetune.training.throughput); only in a
                    # fresh run: ops under a dispatch mode may round differently, and a resumed run must match
                    _, self.state.flops_per_step = count_flops(
                        lambda: self.step_setup.observed(lambda: self.train_step(batch, step)))
                else:
                    self.train_step(batch, step)
                self.state.step = step
                bar.update(1)
                stopping = vote()  # a host flag (several processes: agreed through a CPU all-reduce, one step behind)
                log_now = step % cfg.log_every == 0 or step == self.total_steps or step == first + 1 or stopping
                save_now = bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0 or stopping
                if log_now or save_now or on_step is not None:
                    self._at_read(step, bar, log_now=log_now, save_now=save_now, stopping=stopping, vote=vote,
                                  on_step=on_step)
        finally:
            bar.close()
        vote.close()
        return self._result(clock)

    def _at_read(self, step: int, bar: Any, *, log_now: bool, save_now: bool, stopping: bool, vote: StopVote,
                 on_step: Callable[[int, dict[str, float]], None] | None) -> None:
        """A step that reads the meter: the history entry and the trackers (logging steps), the progress bar, the
        checkpoint, and the stop (:class:`TrainingStopped`, after saving) when the processes voted for it."""
        values, applied = self._read(self._model, step)
        clock = self.clock
        clock.mark(step, self.state.samples_seen)
        if log_now and self.state.interval_counts:
            entry = self.state.close_interval(values)
            self.state.history.append({"step": step, **entry})
            self.acc.log({**{f"train/{k}": v for k, v in entry.items()}, "train/epoch": self.epoch_at(step)}, step=step)
        if values:
            rate = (self.state.samples_seen - clock.marks[0].samples) / max(clock.elapsed(), 1e-9)
            # the total, then every term's value under its logged name (``clip``, ``structxlip/local``)
            bar.set_postfix({"loss": f"{values['loss']:.4f}", **{k: f"{v:.4f}" for k, v in term_values(values)},
                             "epoch": f"{self.epoch_at(step):.2f}", "samples_s": f"{rate:.1f}"})
        if stopping:
            bar.close()
            try:
                saved = self._save(clock)
            except SaveFailedError as error:
                raise TrainingStopped(vote.signum, step, None, str(error)) from error
            raise TrainingStopped(vote.signum, step, saved)
        if save_now:
            self._save(clock)
        if on_step is not None and applied:
            on_step(step, values)

    def epoch_at(self, step: int) -> float:
        """The global epoch after ``step`` optimiser steps, in epochs of the whole training set (every process and
        worker together): the examples drawn so far over the examples of one epoch (a stream: its samples, bad ones
        included; map-style data: the steps of an epoch)."""
        if self.stream is not None:
            return step * self.cfg.batch_size / max(1, self.stream.stream.source.num_examples)
        return step / max(1, self.steps_per_epoch)

    def _result(self, clock: LoopClock) -> TrainResult:
        """The :class:`TrainResult` of a finished loop."""
        wall = self._time_before + clock.elapsed() - clock.excluded_s
        self.state.train_time_s = wall
        throughput = throughput_summary(clock, self.state.flops_per_step, batch_size=self.cfg.batch_size,
                                        world_size=self.acc.num_processes, device=self.acc.device,
                                        last_step=self.state.step)
        throughput.update(self.step_setup.summary())
        # the last step's values, saved in the checkpoint (a run resumed at its end trains no step); checkpoints
        # written before ``last_values`` existed give their last history entry
        last_losses = self.state.last_values or (
            {k: v for k, v in self.state.history[-1].items() if k != "step"} if self.state.history else {})
        return TrainResult(
            steps=self.state.step,
            history=self.state.history,
            final_losses={k: v for k, v in last_losses.items() if k not in ("lr",)},
            wall_time_s=wall,
            samples_per_s=self.state.samples_seen / max(wall, 1e-9),
            skipped_steps=self.state.skipped_steps,
            truncated_captions=self._truncated,
            skipped_examples=self._all_skipped(),
            throughput=throughput,
            epochs=self.epochs.merged(self.acc),
        )

    def _batches(self) -> Iterator[dict[str, Any]]:
        """The batches from the current step on, epoch after epoch; the model in train mode.

        Map-style data: one seeded permutation per epoch (:class:`EpochShuffleSampler`), from the current step
        on, in one pass of the loader. A stream: its own loader, continuing from the stream's position (the stream
        counts epochs). Batches are on the host: :meth:`train` moves them (:class:`DevicePrefetcher`)."""
        if self.stream is not None:
            epoch = None
            for batch in self.loader:
                if self.stream.epoch != epoch:
                    epoch = self.stream.epoch
                    for term in self.module.objective.all_terms:
                        term.set_epoch(epoch)
                    self.wrapped.train()
                yield batch
            return
        # one pass from the current step to the end; the terms get each epoch as its first batch arrives (the
        # workers got it with the indices)
        self.sampler.start_step, self.sampler.total_steps = self.state.step, self.total_steps
        step, epoch = self.state.step, None
        for batch in self.loader:
            if step // self.steps_per_epoch != epoch:
                epoch = step // self.steps_per_epoch
                for term in self.module.objective.all_terms:  # per-epoch schedules (StructXLIP compat official)
                    term.set_epoch(epoch)
                self.wrapped.train()
            step += 1
            yield batch

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A batch of :attr:`loader` (on the host) on the training device, as the loop moves it."""
        return next(iter(DevicePrefetcher([batch], self.acc.device)))

    def _note_skipped(self, batch: dict[str, Any], epoch: int) -> None:
        """Record the examples the data loader passed over (unreadable images, ``data.on_error: skip``)."""
        known = {e["id"] for e in self.state.skipped_examples}
        self.epochs.skip([e["id"] for e in batch.get(SKIPPED_KEY) or ()], epoch)
        for entry in batch.pop(SKIPPED_KEY, None) or ():
            if entry["id"] not in known:
                known.add(entry["id"])
                self.state.skipped_examples.append(entry)
                log.warning("training example id=%s (image %s) skipped: %s", entry["id"], entry["path"],
                            entry["reason"])

    def _all_skipped(self) -> list[dict[str, str]]:
        """The passed-over examples of every process, each id once."""
        entries = self.state.skipped_examples
        if self.acc.num_processes > 1:
            entries = gather_object([entries])
            entries = [e for part in entries for e in part]
        unique = {e["id"]: e for e in entries}
        return sorted(unique.values(), key=lambda e: e["id"])
