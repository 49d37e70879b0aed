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
- no host read of a device tensor between logging steps: the loss terms, the non-finite check and the counts
  accumulate on the device (:class:`StepMeter`) and are read at ``train.log_every``, checkpoints and the end;
  batches are planned and JPEGs decoded to ``uint8`` in the data-loader workers
  (:class:`finetune.objectives.planning.PlannedCollate`), pixels normalised on the device; the map-style loader's
  workers are persistent and prefetch across epochs, its batches pinned;
- a non-finite loss is never applied (fused AdamW skips the update on the device through ``found_inf``); at
  the next read the run stops naming the first bad step and term (``on_nonfinite: raise``) or goes on
  (``skip``, counted);
- every loss term and the learning rate logged to the recipe's trackers, a progress bar with the recent loss
  and samples/s on the main process; the steady samples/s, the data-wait share and TFLOP/s
  (:mod:`finetune.throughput`) in the result;
- fixed shapes: every text and image pass takes its shape from a small set fixed before training, at most two
  text passes per step (:mod:`finetune.objectives.shapes`); ``train.attention`` chooses the attention backend,
  ``train.compile`` compiles the towers' transformer blocks once (:mod:`finetune.objectives.step_setup`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler

from .data.prefetch import DevicePrefetcher
from .models.weight_decay import param_groups
from .objectives.base import Features, Objective, merge_features

log = logging.getLogger("xlipkit")

CHECKPOINT_PREFIX = "step-"
#: batches each data-loader worker keeps ready (``DataLoader(prefetch_factor=...)``)
PREFETCH_BATCHES = 4


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


class EpochShuffleSampler(Sampler[tuple[int, int]]):
    """``(epoch, index)`` for every example of the steps ``start_step .. total_steps``, epoch after epoch: each
    epoch a permutation of ``range(n)`` drawn from ``seed + epoch`` (the same order on every resume), cut to whole
    batches as ``drop_last`` does, so that ``DataLoader(batch_size=batch_size)`` over it gives the same batches as
    one shuffled pass per epoch.

    One pass over it spans the whole run: the data-loader workers (persistent, prefetching) never drain at an
    epoch boundary, a resumed run starts where it stopped without loading the batches it skips, and the epoch
    travels with each index to the workers (:class:`EpochIndexed`), where per-epoch choices of the terms (FLAIR's
    sub-captions) are made.
    """

    def __init__(self, n: int, seed: int, batch_size: int = 1) -> None:
        self.n = n
        self.seed = seed
        self.batch_size = batch_size
        self.steps_per_epoch = n // batch_size
        self.start_step = 0
        self.total_steps = self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Accepted for the loaders that call it; the epochs follow from the steps."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        step, b = self.start_step, self.batch_size
        while step < self.total_steps:
            epoch, within = divmod(step, self.steps_per_epoch)
            g = torch.Generator().manual_seed(self.seed + epoch)
            stop = min(self.steps_per_epoch, within + self.total_steps - step)
            for i in torch.randperm(self.n, generator=g)[within * b:stop * b].tolist():
                yield epoch, i
            step += stop - within

    def __len__(self) -> int:
        return max(0, self.total_steps - self.start_step) * self.batch_size


class EpochIndexed:
    """A map-style dataset read by ``(epoch, index)`` (:class:`EpochShuffleSampler`): row ``index`` with the
    epoch under :data:`finetune.data.collate.EPOCH_KEY`, which :class:`finetune.objectives.planning.PlannedCollate`
    hands to the terms in the worker that collates the batch."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        from .data.collate import EPOCH_KEY

        epoch, index = key
        return {**self.dataset[index], EPOCH_KEY: epoch}

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """A batch of rows in one call of the dataset's ``__getitems__`` where it has one (a columnar read)."""
        from .data.collate import EPOCH_KEY

        many = getattr(self.dataset, "__getitems__", None)
        if many is None:
            return [self[key] for key in keys]
        return [{**row, EPOCH_KEY: epoch} for (epoch, _), row in zip(keys, many([i for _, i in keys]))]


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
    #: ``{file: {"bytes": size, "sha256": hex}}`` of the checkpoint beside this state, checked on resume
    files: dict[str, Any] = field(default_factory=dict)
    #: FLOPs of one step on one process (counted at step 1, :func:`finetune.throughput.count_flops`)
    flops_per_step: int | None = None

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
    #: this run part's steady throughput (:meth:`Trainer._throughput`): ``steady_samples_per_s``,
    #: ``data_wait_share``, ``flops_per_sample``, ``tflops_per_device``, ``mfu``, ...
    throughput: dict[str, Any] = field(default_factory=dict)


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


class SaveFailedError(RuntimeError):
    """A checkpoint (or ``final/``) could not be written: the disk is full, or another I/O error. The message says
    how much was needed and free, where, and what was kept; :mod:`finetune.run` prints it and exits 1.

    Attributes:
        kept: the newest complete checkpoint (None when there is none).
        disk_full: whether the disk (or quota) ran out.
    """

    def __init__(self, message: str, *, kept: Path | None = None, disk_full: bool = False) -> None:
        super().__init__(message)
        self.kept = kept
        self.disk_full = disk_full


_WRITER_WORDS = ("inline_container", "PytorchStreamWriter", "file write failed")
#: how the writers that name no errno (safetensors, tokenizers: Rust ``io::Error``) say that the disk is full
_FULL_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded", "os error 28", "os error 122")


def is_write_error(error: BaseException) -> bool:
    """Whether ``error`` is a failed write: an ``OSError``, safetensors' ``SafetensorError``, torch's zip writer's
    ``RuntimeError``, or any error that says the disk is full (the tokenizers library raises a bare ``Exception``:
    ``No space left on device (os error 28)``)."""
    from safetensors import SafetensorError

    if isinstance(error, (OSError, SafetensorError)):
        return True
    text = str(error)
    if any(words in text for words in _FULL_WORDS):
        return True
    return isinstance(error, RuntimeError) and any(words in text for words in _WRITER_WORDS)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() or not os.path.ismount(path):
        if path.parent == path:
            break
        path = path.parent
    return path


def describe_save_failure(error: BaseException, folder: Path, need: int | None) -> tuple[str, bool]:
    """``(why, disk_full)`` for a failed write into ``folder`` of about ``need`` bytes: a full disk (``ENOSPC`` or
    ``EDQUOT`` anywhere in the exception chain, the words of torch's and safetensors' writers, or a torch zip
    writer error while the disk has less free space than the save needs) is said so, with how much was needed,
    how much is free and on which file system; any other error is named as it is."""
    import errno

    chain, seen = [], error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(f"{type(e).__name__}: {e}" for e in chain)
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain) or any(
        words in text for words in _FULL_WORDS)
    if not full and need is not None and free < need and any(words in text for words in _WRITER_WORDS):
        full = True  # torch's zip writer names no errno; it fails so when the data no longer fits
    if full:
        needed = f"about {_size(need)} are needed, " if need else ""
        return (f"the disk is full ({needed}{_size(free)} free now in {existing}, on the file system mounted at "
                f"{_mount_point(existing)})", True)
    first = chain[-1] if chain else error
    return f"{type(first).__name__}: {first}".splitlines()[0], False


def _agree(accelerator: Any, failure: str | None) -> str | None:
    """The first failure any process reports (every process gets the same answer; a collective, so every process
    calls it at the same point)."""
    if accelerator.num_processes == 1:
        return failure
    from accelerate.utils import gather_object

    return next((f for f in gather_object([failure]) if f), None)


def save_checkpoint(
    accelerator: Any, ckpt_dir: Path, state: TrainState, keep: int, stream_state: dict | None = None, *,
    need_bytes: Callable[[], int] | None = None,
) -> Path:
    """``accelerator.save_state`` into a temporary folder, then an atomic rename to ``step-N``; the older
    checkpoints beyond the last ``keep`` (and any of a later step, left by the trajectory a resume from an
    earlier checkpoint abandoned) are removed only once the new one is complete.

    The temporary folder is ``step-N.<PID@HOST>.tmp`` (the main process's :func:`finetune.run_folder.process_tag`:
    a later run removes it only once that process is gone). ``stream_state``: this process's stream position
    (``StreamLoader.state_dict()``), written by each process as ``stream_state_<rank>.json``; every other file is
    written by accelerate (the main process for shared files, each process its ``random_states_<rank>.pkl``), so
    on a filesystem shared by several nodes each file has one writer. The main process then records the size and
    sha256 of every file (:func:`finetune.resume.file_manifest`) in ``train_state.json``, gives the files the
    user's umask (safetensors writes ``0600``) and renames the folder.

    Raises:
        SaveFailedError: a write failed on some process (every process raises it): the temporary folder is
            removed, the earlier checkpoints are kept, and the message says why (a full disk: how much was
            needed and is free, where) and which checkpoint is the newest complete one.
    """
    from .models.atomic import apply_umask, replace_dir
    from .resume import STATE_NAME, file_manifest
    from .run_folder import folder_bytes, process_tag

    main = accelerator.is_main_process
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{state.step}"
    name = f"{CHECKPOINT_PREFIX}{state.step}.{process_tag()}.tmp"
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        name = broadcast_object_list([name])[0]  # the main process's tag
    tmp = ckpt_dir / name

    def need() -> int | None:
        previous = list_checkpoints(ckpt_dir)
        sizes = [folder_bytes(previous[-1])] if previous else []
        if need_bytes is not None:
            sizes.append(need_bytes())
        return max(sizes) if sizes else None

    def attempt(write: Callable[[], None]) -> str | None:
        try:
            write()
        except Exception as error:  # noqa: BLE001 - every process must learn of it, or the others wait forever
            if not is_write_error(error):
                log.error("saving checkpoint %s failed on process %d", final.name, accelerator.process_index,
                          exc_info=True)
            why, _ = describe_save_failure(error, ckpt_dir, need())
            return why
        return None

    def begin() -> None:
        if main:
            ckpt_dir.mkdir(parents=True, exist_ok=True)

    def write_state() -> None:
        accelerator.save_state(str(tmp))
        if stream_state is not None:
            stream_state_file(tmp, accelerator.process_index).write_text(json.dumps(stream_state))

    def finish() -> None:
        if main:
            state.files = file_manifest(tmp)
            (tmp / STATE_NAME).write_text(state.to_json())
            apply_umask(tmp)
            replace_dir(tmp, final)

    failure = None
    for write in (begin, write_state, finish):
        failure = _agree(accelerator, attempt(write))  # also the barrier between the phases
        if failure:
            break
    if failure:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = list_checkpoints(ckpt_dir)
        last = kept[-1] if kept else None
        said = (f"the newest complete checkpoint, {last.parent.name}/{last.name}, is kept" if last is not None
                else "no earlier checkpoint exists")
        raise SaveFailedError(f"checkpoint {final.name} could not be saved in {ckpt_dir}: {failure}; {said}",
                              kept=last, disk_full=failure.startswith("the disk is full"))
    if main:
        from .resume import _steps

        # checkpoints past this step belong to the trajectory a resume left (from an earlier or damaged one):
        # `latest` must not go back to them
        for old in [p for p in _steps(ckpt_dir) if int(p.name[len(CHECKPOINT_PREFIX):]) > state.step]:
            log.info("removed %s: the run continued from an earlier checkpoint", old)
            shutil.rmtree(old, ignore_errors=True)
        for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


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


def _split(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Split a collated batch into ``n`` equal micro-batches (:func:`finetune.objectives.planning.split_batch`)."""
    from .objectives.planning import split_batch

    return split_batch(batch, n)


# -- stopping on SIGINT / SIGTERM ----------------------------------------------------------------------------------
#: the signals a run stops on: Ctrl-C, and what SLURM, Kubernetes and torchrun send before they kill a process
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while no training step runs (loading, evaluation, the final save): raised at once, like
    Ctrl-C's ``KeyboardInterrupt``; :mod:`finetune.run` exits with status 128 + the signal, without a traceback."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class TrainingStopped(Exception):
    """The loop stopped on SIGINT / SIGTERM: the current step was finished and ``checkpoint`` saved (None when
    saving it failed: then ``error`` says why).

    Attributes:
        signum: the signal (``signal.SIGTERM`` ...); the process exits with 128 + it (130 for SIGINT, 143 for
            SIGTERM), as a shell reports a process killed by it.
        step: the last step trained.
        checkpoint: the checkpoint that continues the run (``train.resume: latest`` finds it).
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None, error: str | None = None) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"{name}: stopped after step {step}" + (f"; saved {checkpoint}" if checkpoint else ""))
        self.signum, self.step, self.checkpoint, self.error = signum, step, checkpoint, error


def _say(message: str) -> None:
    """Write a line to stderr from a signal handler (no logging locks, no buffering)."""
    try:
        os.write(2, f"\n{message}\n".encode())
    except OSError:
        pass


class StopSignals:
    """SIGINT and SIGTERM handlers for one run (installed by :func:`stop_signals`).

    Inside the training loop (``graceful``) the first signal only sets :attr:`received`: the loop finishes the
    step it is in, every process agrees to stop after the same step, a checkpoint is saved and
    :class:`TrainingStopped` raised. Elsewhere the first signal raises :class:`RunInterrupted` at once. A second
    signal always ends the process at once (``os._exit(128 + signal)``), saving nothing more; what it was
    writing is a temporary folder tagged with its PID, which the next run removes.
    """

    #: the handlers installed now, if any
    active: "StopSignals | None" = None

    def __init__(self) -> None:
        self.received: int | None = None
        self.graceful = False
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Install the handlers (only the main thread may); False where they cannot be installed."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        StopSignals.active = self
        return True

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if StopSignals.active is self:
            StopSignals.active = None

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            _say(f"{name} again: exiting at once (status {128 + signum}), without saving")
            os._exit(128 + signum)
        self.received = signum
        if not self.graceful:
            raise RunInterrupted(signum)
        _say(f"{name} received: finishing this step and saving a checkpoint before stopping (send it again to exit "
             "at once)")


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """:class:`StopSignals` installed for the block (the ones already installed, when a caller did it), and the
    previous handlers restored after it."""
    if StopSignals.active is not None:
        yield StopSignals.active
        return
    stop = StopSignals()
    installed = stop.install()
    try:
        yield stop
    finally:
        if installed:
            stop.uninstall()


#: set (in a worker) to the training process's "exiting" event (:func:`worker_signals`)
_EXITING: Any = None


def _exiting_event() -> Any:
    """An event the training process sets as it exits (``atexit``, which runs before multiprocessing's own
    exit handler terminates the daemonic data-loader workers with SIGTERM)."""
    global _EXITING
    if _EXITING is None:
        import atexit
        import multiprocessing

        _EXITING = multiprocessing.Event()
        atexit.register(_EXITING.set)
    return _EXITING


def _worker_sigterm(signum: int, frame: Any) -> None:
    if _EXITING is not None and _EXITING.is_set():
        os._exit(0)  # the training process is exiting and terminates its workers


def ignore_stop_signals(worker_id: int = 0, exiting: Any = None) -> None:
    """``worker_init_fn`` of the data-loader workers (with ``exiting``: :func:`worker_signals`): they ignore SIGINT
    and SIGTERM (Ctrl-C reaches the whole process group, SLURM signals every process of a job step), so that a
    stopping run still gets the batches it needs and no worker death interrupts its checkpoint; the training
    process decides. A SIGTERM after the training process began to exit (its shutdown of the workers) ends the
    worker; a worker whose training process died ends by itself (torch's worker watchdog)."""
    global _EXITING
    _EXITING = exiting
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _worker_sigterm)


def limit_worker_threads() -> None:
    """Keep a data-loader worker's tokenizer on one thread. Hugging Face's fast tokenizers encode a batch on a
    thread pool as wide as the machine (``TOKENIZERS_PARALLELISM``): with 8 workers on 16 cores that is about 130
    threads competing with the training process, whose one thread must launch thousands of kernels per step.
    Each worker is already one of several processes working in parallel; torch already runs one thread in a
    worker. (OpenCV's pool is left alone: ``cv2.setNumThreads`` in a forked worker can deadlock on the pool it
    inherited.)"""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def init_worker(worker_id: int = 0, exiting: Any = None) -> None:
    """``worker_init_fn`` of the training loaders: stop signals left to the training process
    (:func:`ignore_stop_signals`) and a single-threaded tokenizer (:func:`limit_worker_threads`)."""
    ignore_stop_signals(worker_id, exiting)
    limit_worker_threads()


def worker_signals() -> Callable[[int], None]:
    """The ``worker_init_fn`` of the training loaders (:func:`init_worker`): workers leave SIGINT / SIGTERM to the
    training process and run on one thread each."""
    return functools.partial(init_worker, exiting=_exiting_event())


class StopVote:
    """Whether to stop after the current step, the same answer on every process.

    One process: the handler's flag, a host variable (no cost). Several: a signal may reach one process first (or
    only one), and each process must stop after the same step (they meet in every step's gradient all-reduce and
    in the checkpoint's collectives). After each step every process posts its flag in an all-reduce (MAX) over a
    gloo group on the CPU, without waiting, and reads the one it posted after the previous step: all read the
    same value after the same step, so they agree, one step after the first process saw a signal. The device is
    never waited for; the cost is one small CPU collective per step that completes while the step runs (measured
    by ``bench/stop_vote.py``).
    """

    def __init__(self, stop: StopSignals, world_size: int, group: Any = None) -> None:
        self.stop = stop
        self.world_size = world_size
        self.group = group
        self.signum = 0
        self._pending: tuple[Any, Tensor] | None = None

    def __call__(self) -> bool:
        """Post this step's flag; True when the process group agreed to stop now (:attr:`signum` set)."""
        flag = self.stop.received or 0
        if self.world_size == 1:
            self.signum = flag
            return bool(flag)
        import torch.distributed as dist

        if self._pending is not None:
            work, posted = self._pending
            work.wait()
            self.signum = int(posted[0])  # a CPU tensor: no device read
        posted = torch.tensor([flag], dtype=torch.int32)
        self._pending = (dist.all_reduce(posted, op=dist.ReduceOp.MAX, group=self.group, async_op=True), posted)
        return bool(self.signum)

    def close(self) -> None:
        """Wait for the last posted flag (every process posted as many)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


class DivergedError(RuntimeError):
    """The trainable weights became NaN or infinite; the run stops without saving them (names the steps, the
    newest checkpoint with finite weights and what to change)."""



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
        collate_fn = self._planned(collate_fn, module, cfg, dataset)
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
                on_epoch=functools.partial(set_terms_epoch, module.objective), worker_init_fn=worker_signals())
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
        self.wrapped, self.optimizer, self.scheduler = accelerator.prepare(module, optimizer, scheduler)
        # batches stay on the host here and reach the device through the loop's DevicePrefetcher (a side-stream
        # copy from pageable memory: finetune.data.prefetch says why not pinned memory)
        self.loader = loader if self.stream is not None else accelerator.prepare_data_loader(
            loader, device_placement=False)
        self.state = TrainState()
        self._model = self._unwrapped_model()
        #: what the divergence check reads at each logging step (the weights an update can change)
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        #: a gloo group for the per-step stop flag of several processes (:class:`StopVote`)
        self._vote_group = None
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._vote_group = torch.distributed.new_group(backend="gloo")
        self.meter = StepMeter(accelerator.device, reduce=accelerator.reduce if world > 1 else None,
                               sticky=cfg.on_nonfinite == "raise",
                               optimizer=getattr(self.optimizer, "optimizer", self.optimizer),
                               scaler=getattr(self.optimizer, "scaler", None))

    def _planned(self, collate_fn: Callable, module: TrainModule, cfg: Any, dataset: Any) -> Callable:
        """``collate_fn`` planned for the step: the run's fixed shapes, attention backend (``train.attention``) and
        compiled blocks (``train.compile``) set up by :func:`finetune.objectives.step_setup.setup_step`."""
        from .objectives.step_setup import setup_step

        self.step_setup = setup_step(module, cfg, dataset, self.acc.device)
        return self.step_setup.collate(collate_fn)

    def _map_loader(self, dataset: Any, collate_fn: Callable, cfg: Any, num_workers: int) -> DataLoader:
        """The loader of a map-style dataset; sets ``sampler``, ``steps_per_epoch`` and ``total_steps``."""
        # the loader yields the global batch of one optimiser step; accelerate splits it over processes
        # (split_batches=True) and `_step` splits each process's share into `accum` micro-batches
        if len(dataset) < cfg.batch_size:
            raise ValueError(
                f"the training set has {len(dataset)} examples, fewer than train.batch_size="
                f"{cfg.batch_size}: lower train.batch_size or add data"
            )
        self.sampler = EpochShuffleSampler(len(dataset), cfg.seed, cfg.batch_size)
        # workers stay up and keep batches ready over the whole run (one pass of the sampler spans every epoch);
        # batches are not pinned: DevicePrefetcher copies them on a side stream (finetune.data.prefetch)
        loader = DataLoader(
            EpochIndexed(dataset),
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=True,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            prefetch_factor=PREFETCH_BATCHES if num_workers > 0 else None,
            worker_init_fn=worker_signals() if num_workers > 0 else None,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        self.steps_per_epoch = self.sampler.steps_per_epoch
        if self.steps_per_epoch == 0:
            raise ValueError("the training set is smaller than one optimiser step; lower train.batch_size")
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        self.sampler.total_steps = self.total_steps
        return loader

    # -- checkpoints ------------------------------------------------------------------------------
    def maybe_resume(self, resume: str | None, *, checkpoint: str | Path | None = None,
                     recipe: dict[str, Any] | None = None, ignore_changes: bool = False,
                     ignore_rng: bool | None = None) -> bool:
        """Continue from ``train.resume`` (``latest`` or a checkpoint folder); True when resumed.

        Args:
            resume: the recipe's ``train.resume``.
            checkpoint: the folder already found by :func:`finetune.resume.find_checkpoint`
                (skips the search).
            recipe: the run's recipe (``recipe_to_dict``): its continuation view is saved in every
                checkpoint and compared with the checkpoint's on resume.
            ignore_changes: ``train.resume_ignore_changes``: continue despite a different recipe.
            ignore_rng: ``train.resume_ignore_rng`` (None: the recipe's): resume from a checkpoint whose RNG state
                is missing or damaged, with a fresh one seeded from ``train.seed`` and the step.
        Raises:
            finetune.resume.CheckpointError: no usable checkpoint at a given path (names the file).
            finetune.run_folder.RunFolderError: the checkpoint was saved with a different recipe.
        """
        from .resume import check_continuation, find_checkpoint, rng_problem
        from .run_folder import continuation_view

        view = continuation_view(recipe) if recipe is not None else None
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
        self.acc.load_state(str(path))
        if rng_missing:  # accelerate skipped (or loaded a damaged) RNG state: a fresh one, reproducible from the step
            from accelerate.utils import set_seed

            set_seed(self.cfg.seed + saved.step + 1_000_003 * self.acc.process_index)
            log.warning("train.resume_ignore_rng: %s; process %d continues with a fresh RNG state seeded from "
                        "train.seed and step %d", rng_missing, self.acc.process_index, saved.step)
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
        """Forward and backward of one optimiser step on ``batch`` (on the device): ``uint8`` pixels normalised
        (:func:`finetune.data.collate.normalize_pixels`), then one pass, or the accumulation scheme."""
        from .data.collate import normalize_pixels

        batch = normalize_pixels(batch)
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

    def train_step(self, batch: dict[str, Any], step: int) -> None:
        """One optimiser step on a batch already on the device, without reading anything back: forward and
        backward (:meth:`_step`), the loss terms and the non-finite check into :attr:`meter`, clipping, the
        optimiser step (not applied where the meter says so), the schedule and the clamps. The loop calls it
        between its reads; ``bench/loop.py`` times it alone as the bare step."""
        cfg = self.cfg
        with self.step_setup.attention_context():
            out = self._step(batch)
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

    def _add_to_interval(self, sums: dict[str, float], counts: dict[str, int]) -> None:
        """Add each term's sum over ``counts[term]`` applied steps to the running sums of the current logging
        interval (host-side, in :class:`TrainState`, so that checkpoints carry them)."""
        for key, value in sums.items():
            self.state.interval_sums[key] = self.state.interval_sums.get(key, 0.0) + value
            self.state.interval_counts[key] = self.state.interval_counts.get(key, 0) + counts[key]

    def _close_interval(self, values: dict[str, float]) -> dict[str, float]:
        """The history entry of a logging step: each loss term's mean over the steps since the last
        entry (every step counts, not one in ``log_every``), the learning rate and logit scale of this
        step; starts the next interval."""
        sums, counts = self.state.interval_sums, self.state.interval_counts
        entry = {key: sums[key] / counts[key] if counts.get(key) else value for key, value in values.items()}
        self.state.interval_sums, self.state.interval_counts = {}, {}
        return entry

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
        self._add_to_interval(r.sums, r.counts)
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
        for p in self._trainable:
            by_device.setdefault(p.device, []).append(p.detach())
        bad = [(~torch.stack(torch._foreach_norm(ps, math.inf)).float().isfinite()).any().float().to(self.acc.device)
               for ps in by_device.values()]
        flag = torch.stack(bad).max()
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
        :class:`TrainingStopped` raised; a second signal exits at once.

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

    def _save(self, clock: Any) -> Path:
        """A checkpoint of the current step (time spent saving left out of the throughput)."""
        saving = time.perf_counter()
        self.state.train_time_s = self._time_before + clock.elapsed() - clock.excluded_s
        stream_state = self.stream.state_dict() if self.stream is not None else None
        path = save_checkpoint(self.acc, self.ckpt_dir, self.state, self.cfg.keep_checkpoints, stream_state,
                               need_bytes=self._checkpoint_bytes)
        clock.excluded_s += time.perf_counter() - saving
        return path

    def _checkpoint_bytes(self) -> int:
        """About what one checkpoint takes: the model's and objective's tensors and the optimiser's state."""
        tensors = list(self.module.state_dict().values())
        for entry in getattr(self.optimizer, "state", {}).values():
            tensors += [v for v in entry.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _train(self, on_step: Callable[[int, dict[str, float]], None] | None, vote: StopVote) -> TrainResult:
        """:meth:`train`'s loop."""
        from tqdm.auto import tqdm

        from .throughput import LoopClock, count_flops

        cfg, acc = self.cfg, self.acc
        model = self._model
        self._time_before = self.state.train_time_s  # the earlier parts of a resumed run
        self._truncated = 0
        first = self.state.step
        remaining = self.total_steps - first
        self.clock = clock = LoopClock(skip_steps=first + max(1, min(10, remaining // 10)))
        clock.mark(first, self.state.samples_seen)
        self._last_read_step = first
        bar = tqdm(total=self.total_steps, initial=first, disable=not acc.is_local_main_process,
                   desc="train", dynamic_ncols=True)
        batches = iter(DevicePrefetcher(self._batches(), acc.device))
        while self.state.step < self.total_steps:
            waited = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:  # a stream that ended: open it again (it counts its epochs)
                batches = iter(DevicePrefetcher(self._batches(), acc.device))
                continue
            clock.wait_s += time.perf_counter() - waited
            self._note_skipped(batch)
            step = self.state.step + 1
            if step == 1:  # FLOPs of the first step from the shapes (finetune.throughput); only in a fresh run,
                # because ops under a dispatch mode may round differently and a resumed run must match a straight one
                _, self.state.flops_per_step = count_flops(
                    lambda: self.step_setup.observed(lambda: self.train_step(batch, step)))
            else:
                self.train_step(batch, step)
            self.state.step = step
            bar.update(1)
            stopping = vote()  # a host flag (several processes: agreed through a CPU all-reduce, one step behind)
            log_now = step % cfg.log_every == 0 or step == self.total_steps or step == first + 1 or stopping
            save_now = bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0 or stopping
            if not (log_now or save_now or on_step is not None):
                continue
            try:
                values, applied = self._read(model, step)
            except (NonFiniteLossError, DivergedError):
                bar.close()
                raise
            clock.mark(step, self.state.samples_seen)
            if log_now and self.state.interval_counts:
                entry = self._close_interval(values)
                self.state.history.append({"step": step, **entry})
                acc.log({f"train/{k}": v for k, v in entry.items()}, step=step)
            if values:
                rate = (self.state.samples_seen - clock.marks[0].samples) / max(clock.elapsed(), 1e-9)
                # the total, then every term's value under its logged name (``clip``, ``structxlip/local``)
                bar.set_postfix({"loss": f"{values['loss']:.4f}",
                                 **{k: f"{v:.4f}" for k, v in term_values(values)},
                                 "samples_s": f"{rate:.1f}"})
            if stopping:
                bar.close()
                try:
                    saved = self._save(clock)
                except SaveFailedError as error:
                    raise TrainingStopped(vote.signum, step, None, str(error)) from error
                raise TrainingStopped(vote.signum, step, saved)
            if save_now:
                try:
                    self._save(clock)
                except SaveFailedError:
                    bar.close()
                    raise
            if on_step is not None and applied:
                on_step(step, values)
        bar.close()
        vote.close()
        wall = self._time_before + clock.elapsed() - clock.excluded_s
        self.state.train_time_s = wall
        throughput = self._throughput(clock, self.state.flops_per_step)
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
        )

    def _throughput(self, clock: Any, flops_per_step: int | None) -> dict[str, Any]:
        """``TrainResult.throughput``: the steady rates of this run part (:meth:`LoopClock.steady`), FLOPs and
        TFLOP/s per device and MFU where the device's peak is known; logged once."""
        from .throughput import peak_tflops

        steady = clock.steady()
        world = self.acc.num_processes
        per_device_batch = self.cfg.batch_size // world
        out: dict[str, Any] = {"steady_samples_per_s": None, "data_wait_share": None, "steady_steps": 0,
                               "flops_per_sample": None, "tflops_per_device": None, "mfu": None,
                               "flops_counted_by": "torch.utils.flop_counter on the first step (matmul, conv, "
                                                   "SDPA forward and backward)", **self.step_setup.summary()}
        if flops_per_step:
            out["flops_per_sample"] = flops_per_step / per_device_batch
        if steady is not None:
            out.update(steady_samples_per_s=steady["samples_per_s"], data_wait_share=steady["data_wait_share"],
                       steady_steps=steady["steps"], steady_from_step=steady["first_step"])
            if flops_per_step:
                tflops = flops_per_step * steady["steps_per_s"] / 1e12
                out["tflops_per_device"] = tflops
                peak = peak_tflops(self.acc.device)
                out["mfu"] = tflops / peak if peak else None
            log.info("steady throughput (steps %d-%d): %.1f samples/s, %.0f%% of the time waiting for data%s",
                     steady["first_step"], self.state.step, steady["samples_per_s"],
                     100 * steady["data_wait_share"],
                     f", {out['tflops_per_device']:.1f} TFLOP/s per device" if out["tflops_per_device"] else "")
        return out

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
