"""Training (DESIGN 6): the Accelerate loop and everything a run does around it, one job per module.

The loop itself is :meth:`FinetuneRecipe.train <finetune.training.recipe.FinetuneRecipe.train>` (fetch a batch,
forward, loss, backward, optimiser step, log, checkpoint); its parts, built in one place
(:func:`~finetune.training.loop.build_loop`, :class:`~finetune.training.loop.LoopParts`):

- :mod:`~finetune.training.batches`: the collate stack (built in one place), the loader, the batches on the device;
- :mod:`~finetune.training.step`: one optimiser step without a host read (:class:`TrainStep`, :class:`TrainModule`);
- :mod:`~finetune.training.step_setup`: the attention backend, compiled blocks and the warm-up of the step;
- :mod:`~finetune.training.progress`: the reads: the history, the trackers, the progress bar, non-finite stops;
- :mod:`~finetune.training.meter`: the loss terms and counts kept on the device between reads (:class:`StepMeter`);
- :mod:`~finetune.training.checkpoint`: checkpoints written atomically, a full disk diagnosed, resumed from (reading
  them, the listing and finding the one to resume are :mod:`finetune.runs`);
- :mod:`~finetune.training.signals`: SIGINT / SIGTERM, the stop vote of several processes, data-loader workers;
- :mod:`~finetune.training.optim`: the optimiser and its schedule;
- :mod:`~finetune.training.loaders`: per-epoch seeded shuffles over one pass of persistent workers;
- :mod:`~finetune.training.throughput`: steady samples/s, data-wait share, FLOPs, MFU;

and around the loop:

- :mod:`~finetune.training.preflight`: the one check before a run, what ``xlipkit validate``, ``preview`` and ``train``
  all call (the recipe's code, its objective built once, its stream, the ``assets`` it needs from outside and the
  ``upstream`` runs it builds on, ``output.dir``);
- :mod:`~finetune.training.recipe`: a run end to end (:class:`FinetuneRecipe`, :func:`run_recipe`): ``setup``,
  ``setup_data``, ``setup_model``, ``setup_eval``, ``setup_training``, ``train``, ``finish`` over one typed
  :class:`~finetune.training.context.RunContext`, with the helpers of each stage: ``size_checks`` (the batch, the
  disk, the warm-up, once the data and model are loaded), ``inputs`` (the sets, the rows, the stream), ``model`` (the
  start model, made ready), ``outputs`` (after training), ``upstream`` (``model.init_from``, ``eval.compare_with``
  reused or trained first), ``environment`` (the accelerator, the logging, the threads), ``ending`` (how a stopped
  or failed run ends, and the command that continues it).

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
  workers are persistent and prefetch across epochs; batches are copied to the device on a side stream;
- a non-finite loss is never applied (fused AdamW skips the update on the device through ``found_inf``); at
  the next read the run stops naming the first bad step and term (``on_nonfinite: raise``) or goes on
  (``skip``, counted);
- every loss term and the learning rate logged to the recipe's trackers, a progress bar with the recent loss
  and samples/s on the main process; the steady samples/s, the data-wait share and TFLOP/s
  (:mod:`finetune.training.throughput`) in the result;
- ``train.compile``: the towers' transformer blocks compiled with ``torch.compile``
  (:mod:`finetune.models.compile`).
"""

from __future__ import annotations

from finetune.runs.checkpoints import list_checkpoints
from finetune.training.checkpoint import (Checkpoints, SaveFailedError, TrainState, describe_save_failure,
                                          is_write_error, save_checkpoint)
from finetune.training.meter import MeterReading, StepMeter
from finetune.training.optim import build_optimizer, build_scheduler, lr_lambda
from finetune.training.signals import (RunInterrupted, StopSignals, StopVote, TrainingStopped, stop_signals,
                                       worker_signals)
from finetune.training.progress import DivergedError, NonFiniteLossError
from finetune.training.step import TrainModule, TrainStep
from finetune.training.loop import LoopParts, TrainResult, build_loop
from finetune.training.context import RunContext  # the run, on top of the loop
from finetune.training.recipe import FinetuneRecipe, run_recipe

__all__ = ["Checkpoints", "DivergedError", "FinetuneRecipe", "LoopParts", "MeterReading", "NonFiniteLossError",
           "RunContext", "RunInterrupted", "SaveFailedError", "StepMeter", "StopSignals", "StopVote", "TrainModule",
           "TrainResult", "TrainState", "TrainStep", "TrainingStopped", "build_loop", "build_optimizer",
           "build_scheduler", "describe_save_failure", "is_write_error", "list_checkpoints", "lr_lambda", "run_recipe",
           "save_checkpoint", "stop_signals", "worker_signals"]
