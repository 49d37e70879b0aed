"""The Accelerate training loop (DESIGN 6).

Features:
- one process, DDP, FSDP or DeepSpeed, from ``accelerate config`` / ``accelerate launch``; mixed precision
  (``train.mixed_precision``);
- ``train.batch_size`` is the GLOBAL batch of one optimiser step (the papers' number), split over processes
  and over ``train.accumulation_steps`` micro-batches;
- contrastive gradient accumulation with cached features (open_clip's accum-freq scheme): every micro-batch
  is first encoded without gradients, then re-encoded with gradients and scored against the cached features
  of the others, so negatives span the whole accumulated batch and the gradient equals the one of a single
  big batch; parameters the loss reads directly (logit scale, temperatures) get their gradient once;
- AdamW (fused where the device supports it) with no weight decay on biases, norms, positional tables and
  logit scale/bias; cosine-to-``min_lr`` or constant schedule with linear warmup; gradient clipping;
  ``train.logit_scale_max`` clamps the LOG logit scale after every step (StructXLIP D.2);
- ``drop_last`` loaders with a per-epoch seeded shuffle, so a resumed run sees the same batches; streamed data
  (``finetune.data.streams``) runs ``train.max_steps`` steps and resumes from each process's saved position;
- checkpoints (``accelerator.save_state``) every ``train.checkpoint_every`` steps into
  ``checkpoints/step-N`` written atomically (temp folder, then rename), the last ``keep_checkpoints`` kept;
  ``train.resume: latest | PATH`` continues to the same weights as an uninterrupted run;
- a non-finite loss stops the run naming the step and the term (``on_nonfinite: raise``) or skips the step
  (``skip``, counted);
- every loss term and the learning rate logged to the recipe's trackers, a progress bar with loss and
  throughput on the main process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler

from .models.weight_decay import param_groups
from .objectives.base import Features, Objective, all_finite, merge_features

log = logging.getLogger("xlipkit")

CHECKPOINT_PREFIX = "step-"


def term_values(values: dict[str, float]) -> list[tuple[str, float]]:
    """The per-term loss values of a step's logged values (``clip``, ``structxlip/local``, ...): everything but
    the total, the learning rate and the logit scale."""
    return [(k, v) for k, v in values.items() if k not in ("loss", "lr", "logit_scale")]


class NonFiniteLossError(RuntimeError):
    """Raised when a loss term is NaN or infinite and ``train.on_nonfinite`` is ``raise``."""


class TrainModule(nn.Module):
    """The model and the objective's own parameters in one module, so that ``accelerator.prepare`` wraps
    both (DDP synchronises the temperatures of added terms too) and every encoder call runs inside the
    wrapped module's ``forward``."""

    def __init__(self, model: nn.Module, objective: Objective) -> None:
        super().__init__()
        self.model = model
        self.objective = objective

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


class EpochShuffleSampler(Sampler[int]):
    """A permutation of ``range(n)`` drawn from ``seed + epoch``: the same order on every resume."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base lr at step ``s``: linear warmup, then cosine to ``min_ratio`` or constant."""

    def f(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_optimizer(module: nn.Module, cfg: Any, extra_no_decay: set[str] = frozenset()) -> torch.optim.Optimizer:
    """AdamW over :func:`finetune.models.weight_decay.param_groups`; fused when ``cfg.fused_optimizer`` allows and
    the device has it."""
    groups = param_groups(module, cfg.weight_decay, extra_no_decay)
    fused = cfg.fused_optimizer
    if fused == "auto":
        params = [p for g in groups for p in g["params"]]
        fused = all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params) and all(
            p.device.type in ("cpu", "cuda", "xpu", "mps") for p in params
        )
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=bool(fused) or None
    )


@dataclass
class TrainState:
    """What a checkpoint stores beside accelerate's state (as JSON): the step and the loss history."""

    step: int = 0
    skipped_steps: int = 0
    samples_seen: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    #: per-term sums and counts over the steps since the last history entry (an entry holds the interval's
    #: mean, as transformers' Trainer logs its loss); kept here so a resumed run logs what a straight one does
    interval_sums: dict[str, float] = field(default_factory=dict)
    interval_counts: dict[str, int] = field(default_factory=dict)
    #: every logged value of the last finished step
    last_values: dict[str, float] = field(default_factory=dict)
    skipped_examples: list[dict[str, str]] = field(default_factory=list)
    #: seconds spent training up to ``step`` (over every resumed part)
    train_time_s: float = 0.0
    #: the recipe's continuation view (``finetune.run_folder.continuation_view``), checked on resume
    recipe: dict[str, Any] | None = None
    #: ``{file: bytes}`` of the checkpoint beside this state, checked on resume
    files: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


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


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp folders of an interrupted save are ignored)."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX):].isdigit():
            if (p / "train_state.json").is_file():
                found.append(p)
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def resolve_resume(resume: str | None, ckpt_dir: Path) -> Path | None:
    """``latest`` -> newest usable checkpoint (None when there is none yet); a path -> that folder,
    checked (see :func:`finetune.resume.find_checkpoint`, which names a missing or damaged file)."""
    from .resume import find_checkpoint

    return find_checkpoint(resume, ckpt_dir)


def stream_state_file(folder: Path, rank: int) -> Path:
    """Where process ``rank`` keeps its stream position in a checkpoint folder."""
    return folder / f"stream_state_{rank}.json"


def save_checkpoint(
    accelerator: Any, ckpt_dir: Path, state: TrainState, keep: int, stream_state: dict | None = None
) -> Path:
    """``accelerator.save_state`` into ``step-N.tmp``, then an atomic rename to ``step-N``.

    ``stream_state``: this process's stream position (``StreamLoader.state_dict()``: its data-loader workers'
    positions), written by each process as ``stream_state_<rank>.json`` into the temporary folder before the
    rename; every other file is written by accelerate (the main process for shared files), so on a filesystem
    shared by several nodes each file has one writer.
    """
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{state.step}"
    tmp = ckpt_dir / f"{CHECKPOINT_PREFIX}{state.step}.tmp"
    if accelerator.is_main_process:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if stream_state is not None:
        stream_state_file(tmp, accelerator.process_index).write_text(json.dumps(stream_state))
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        from .resume import file_manifest

        state.files = file_manifest(tmp)
        (tmp / "train_state.json").write_text(state.to_json())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _split(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Split a collated batch into ``n`` equal micro-batches along dim 0 of every per-sample field."""
    if n == 1:
        return [batch]
    size = len(batch["input_ids"])
    step = size // n
    parts = []
    for i in range(n):
        sl = slice(i * step, (i + 1) * step)
        parts.append(_slice(batch, sl, size))
    return parts


def _slice(obj: Any, sl: slice, size: int) -> Any:
    if isinstance(obj, dict):
        return {k: _slice(v, sl, size) for k, v in obj.items()}
    if isinstance(obj, (Tensor, list)) and len(obj) == size:
        return obj[sl]
    return obj


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
        world = accelerator.num_processes
        accum = cfg.accumulation_steps
        if cfg.batch_size % (world * accum):
            raise ValueError(
                f"train.batch_size={cfg.batch_size} must be divisible by processes x accumulation_steps "
                f"= {world} x {accum}; change train.batch_size or train.accumulation_steps"
            )
        #: a stream's loader (``finetune.data.streams.StreamLoader``): each process reads its own shards with
        #: ``num_workers`` workers, batches of its share of the global batch, and keeps a resumable position
        self.stream = None
        if isinstance(dataset, torch.utils.data.IterableDataset):
            if not cfg.max_steps:
                raise ValueError("a streamed training set has no length: set train.max_steps")
            from .data.streams import StreamLoader, set_terms_epoch

            loader = self.stream = StreamLoader(
                dataset, batch_size=cfg.batch_size // world, collate_fn=collate_fn, num_workers=num_workers,
                pin_memory=accelerator.device.type == "cuda",
                on_epoch=functools.partial(set_terms_epoch, module.objective))
            self.steps_per_epoch = 0
            self.total_steps = cfg.max_steps
        else:
            loader = self._map_loader(dataset, collate_fn, cfg, num_workers)
        self.module = module
        optimizer = build_optimizer(module, cfg, extra_no_decay)
        min_ratio = cfg.min_lr / cfg.lr if cfg.lr else 0.0
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(cfg.schedule, cfg.warmup_steps, self.total_steps, min_ratio)
        )
        if self.stream is not None:
            self.wrapped, self.optimizer, self.scheduler = accelerator.prepare(module, optimizer, scheduler)
            self.loader = loader
        else:
            self.wrapped, self.optimizer, self.loader, self.scheduler = accelerator.prepare(
                module, optimizer, loader, scheduler
            )
        self.state = TrainState()

    def _map_loader(self, dataset: Any, collate_fn: Callable, cfg: Any, num_workers: int) -> DataLoader:
        """The loader of a map-style dataset; sets ``sampler``, ``steps_per_epoch`` and ``total_steps``."""
        # the loader yields the global batch of one optimiser step; accelerate splits it over processes
        # (split_batches=True) and `_step` splits each process's share into `accum` micro-batches
        if len(dataset) < cfg.batch_size:
            raise ValueError(
                f"the training set has {len(dataset)} examples, fewer than train.batch_size="
                f"{cfg.batch_size}: lower train.batch_size or add data"
            )
        self.sampler = EpochShuffleSampler(len(dataset), cfg.seed)
        loader = DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        self.steps_per_epoch = len(loader)
        if self.steps_per_epoch == 0:
            raise ValueError("the training set is smaller than one optimiser step; lower train.batch_size")
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        return loader

    # -- checkpoints ------------------------------------------------------------------------------
    def maybe_resume(self, resume: str | None, *, checkpoint: str | Path | None = None,
                     recipe: dict[str, Any] | None = None, ignore_changes: bool = False) -> bool:
        """Continue from ``train.resume`` (``latest`` or a checkpoint folder); True when resumed.

        Args:
            resume: the recipe's ``train.resume``.
            checkpoint: the folder already found by :func:`finetune.resume.find_checkpoint`
                (skips the search).
            recipe: the run's recipe (``recipe_to_dict``): its continuation view is saved in every
                checkpoint and compared with the checkpoint's on resume.
            ignore_changes: ``train.resume_ignore_changes``: continue despite a different recipe.
        Raises:
            finetune.resume.CheckpointError: no usable checkpoint at a given path (names the file).
            finetune.run_folder.RunFolderError: the checkpoint was saved with a different recipe.
        """
        from .resume import check_continuation, find_checkpoint
        from .run_folder import continuation_view

        view = continuation_view(recipe) if recipe is not None else None
        self.state.recipe = view
        path = Path(checkpoint) if checkpoint is not None else find_checkpoint(resume, self.ckpt_dir)
        if path is None:
            return False
        saved = TrainState.from_json((path / "train_state.json").read_text())
        check_continuation(saved.recipe, view, path, ignore_changes=ignore_changes)
        self.acc.load_state(str(path))
        self.state = saved
        self.state.recipe = view if view is not None else saved.recipe
        if self.stream is not None:
            file = stream_state_file(path, self.acc.process_index)
            if not file.is_file():
                raise FileNotFoundError(
                    f"train.resume: {path} has no stream position for process {self.acc.process_index} ({file.name}): "
                    "it was saved from map-style data or with fewer processes; resume with the data.train and "
                    "number of processes it was saved with")
            self.stream.load_state_dict(json.loads(file.read_text()))
        log.info("resumed from %s at step %d", path, self.state.step)
        return True

    # -- the loop ---------------------------------------------------------------------------------
    def _unwrapped_model(self) -> nn.Module:
        return self.acc.unwrap_model(self.wrapped).model

    def _step(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        accum = self.cfg.accumulation_steps
        # backward runs even on a non-finite loss, so that every process takes part in the gradient
        # all-reduce; the step is then dropped (or the run stopped) by the caller
        if accum == 1:
            out = self.wrapped(batch)
            self.acc.backward(out["loss"])
            return out
        micro = _split(batch, accum)
        with torch.no_grad():
            cache = [self.wrapped(mb, encode_only=True) for mb in micro]
        cache = [{k: v.detach() for k, v in feats.items()} for feats in cache]
        out: dict[str, Tensor] = {}
        for j, mb in enumerate(micro):
            last = j == accum - 1
            ctx = self.acc.no_sync(self.wrapped) if not last else contextlib.nullcontext()
            with ctx:
                out = self.wrapped(mb, cache=cache, index=j, detach_params=not last)
                self.acc.backward(out["loss"])
        return out

    def _nonfinite(self, out: dict[str, Tensor]) -> str | None:
        bad = all_finite(out)
        flag = torch.tensor(0.0 if bad is None else 1.0, device=self.acc.device)
        if self.acc.num_processes > 1:
            flag = self.acc.reduce(flag, reduction="sum")
        if float(flag) == 0:
            return None
        return bad or "(another process)"

    def _add_to_interval(self, losses: dict[str, float]) -> None:
        """Add one step's loss terms to the running sums of the current logging interval."""
        sums, counts = self.state.interval_sums, self.state.interval_counts
        for key, value in losses.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1

    def _close_interval(self, values: dict[str, float]) -> dict[str, float]:
        """The history entry of a logging step: each loss term's mean over the steps since the last
        entry (every step counts, not one in ``log_every``), the learning rate and logit scale of this
        step; starts the next interval."""
        sums, counts = self.state.interval_sums, self.state.interval_counts
        entry = {key: sums[key] / counts[key] if counts.get(key) else value for key, value in values.items()}
        self.state.interval_sums, self.state.interval_counts = {}, {}
        return entry

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> TrainResult:
        """Run until ``total_steps``; returns the history and the final per-term losses."""
        from tqdm.auto import tqdm

        cfg, acc = self.cfg, self.acc
        model = self._unwrapped_model()
        start = time.perf_counter()
        start_samples = self.state.samples_seen
        self._time_before = self.state.train_time_s  # the earlier parts of a resumed run
        truncated = 0
        bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not acc.is_local_main_process,
                   desc="train", dynamic_ncols=True)
        while self.state.step < self.total_steps:
            for batch in self._batches():
                if self.state.step >= self.total_steps:
                    break
                self._note_skipped(batch)
                out = self._step(batch)
                bad = self._nonfinite(out)
                step = self.state.step + 1
                if bad is not None:
                    value = float(out[bad].detach()) if bad in out else float("nan")
                    msg = (f"non-finite loss at step {step}: term '{bad}' = {value}. Lower train.lr, enable "
                           f"train.grad_clip, check the data, or set train.on_nonfinite: skip")
                    if cfg.on_nonfinite == "raise":
                        bar.close()
                        raise NonFiniteLossError(msg)
                    log.warning(msg + " (step skipped)")
                    self.optimizer.zero_grad(set_to_none=True)
                    self.state.skipped_steps += 1
                    self.state.step = step
                    self.scheduler.step()
                    continue
                if cfg.grad_clip:
                    acc.clip_grad_norm_(self.wrapped.parameters(), cfg.grad_clip)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                if cfg.logit_scale_max is not None:
                    with torch.no_grad():
                        model.logit_scale.clamp_(max=cfg.logit_scale_max)
                for term in self.module.objective.all_terms:  # e.g. clamp a term's own temperature
                    term.after_optimizer_step()
                if "truncated" in batch:
                    truncated += int(batch["truncated"].sum())
                self.state.step = step
                self.state.samples_seen += cfg.batch_size
                values = {k: float(v.detach()) for k, v in out.items()}
                values = self._mean_over_processes(values)
                self._add_to_interval(values)
                values["lr"] = self.scheduler.get_last_lr()[0]
                values["logit_scale"] = float(model.logit_scale.detach().exp())
                self.state.last_values = values
                if step % cfg.log_every == 0 or step == self.total_steps or step == 1:
                    entry = self._close_interval(values)
                    self.state.history.append({"step": step, **entry})
                    acc.log({f"train/{k}": v for k, v in entry.items()}, step=step)
                elapsed = time.perf_counter() - start
                rate = (self.state.samples_seen - start_samples) / max(elapsed, 1e-9)
                # the total, then every term's value under its logged name (``clip``, ``structxlip/local``)
                bar.set_postfix({"loss": f"{values['loss']:.4f}",
                                 **{k: f"{v:.4f}" for k, v in term_values(values)},
                                 "samples_s": f"{rate:.1f}"})
                bar.update(1)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    self.state.train_time_s = self._time_before + time.perf_counter() - start
                    stream_state = self.stream.state_dict() if self.stream is not None else None
                    save_checkpoint(acc, self.ckpt_dir, self.state, cfg.keep_checkpoints, stream_state)
                if on_step is not None:
                    on_step(step, values)
                if self.state.step >= self.total_steps:
                    break
        bar.close()
        wall = self._time_before + time.perf_counter() - start
        self.state.train_time_s = wall
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
            truncated_captions=truncated,
            skipped_examples=self._all_skipped(),
        )

    def _batches(self) -> Iterator[dict[str, Any]]:
        """The batches from the current step on, epoch after epoch; the model in train mode.

        Map-style data: one seeded permutation per epoch, the batches a resumed run already trained on
        skipped. A stream: its own loader, continuing from the stream's position (the stream counts epochs),
        batches moved to the device here (they do not pass through an accelerate loader)."""
        acc = self.acc
        if self.stream is not None:
            from accelerate.utils import send_to_device

            epoch = None
            for batch in self.loader:
                if self.stream.epoch != epoch:
                    epoch = self.stream.epoch
                    for term in self.module.objective.all_terms:
                        term.set_epoch(epoch)
                    self.wrapped.train()
                yield send_to_device(batch, acc.device)
            return
        while True:
            epoch, within = divmod(self.state.step, self.steps_per_epoch)
            loader = self.loader
            if within:
                loader = acc.skip_first_batches(self.loader, within)
            # accelerate's loaders re-seed the sampler with their own pass counter: give them the epoch
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            self.sampler.set_epoch(epoch)
            for term in self.module.objective.all_terms:  # per-epoch schedules (StructXLIP compat official)
                term.set_epoch(epoch)
            self.wrapped.train()
            yield from loader

    def _note_skipped(self, batch: dict[str, Any]) -> None:
        """Record the examples the data loader passed over (unreadable images, ``data.on_error: skip``)."""
        from .data.skipping import SKIPPED_KEY

        known = {e["id"] for e in self.state.skipped_examples}
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
            from accelerate.utils import gather_object

            entries = gather_object([entries])
            entries = [e for part in entries for e in part]
        unique = {e["id"]: e for e in entries}
        return sorted(unique.values(), key=lambda e: e["id"])

    def _mean_over_processes(self, values: dict[str, float]) -> dict[str, float]:
        if self.acc.num_processes == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], device=self.acc.device)
        t = self.acc.reduce(t, reduction="mean")
        return dict(zip(keys, t.tolist()))
