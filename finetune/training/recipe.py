"""A run, end to end, as a recipe class in the torchtune manner (:class:`FinetuneRecipe`): ``setup`` (the run folder,
the objective, the runs it builds on, the accelerator), ``setup_data`` (the sets, before the model), ``setup_model``
(the model, its adapter, the rows it trains on), ``setup_eval`` (Recall@K before), ``setup_training`` (the parts of
the loop, :func:`~finetune.training.loop.build_loop`, and the resume), ``train`` (the loop itself: fetch a batch,
forward, loss, backward, optimiser step, log, checkpoint) and ``finish`` (Recall@K after, ``final/``,
``metrics.json``, the report, the hub push), over one typed :class:`~finetune.training.context.RunContext`.

recipe -> data (+ its checks) -> model (family, Long-CLIP KPS, adapter) -> the rows it trains on (+ the preprocessing
the objective needs, cached) -> Recall@K before -> training -> Recall@K after -> run folder (recipe.yaml,
metrics.json, report.md, plots/, final/, checkpoints/) -> optional hub push.

:func:`run_recipe` runs one (the command line is :mod:`finetune.cli.train`)::

    from finetune.config import load_recipe
    from finetune.training import run_recipe
    status = run_recipe(load_recipe("recipes/quickstart.yaml", ["train.max_steps=10"]))
"""

from __future__ import annotations

import logging
from typing import Callable

from accelerate.utils import set_seed

from finetune.config import Recipe, RecipeError, dump_recipe, refuse_recipe
from finetune.data.images import DataError
from finetune.evaluation import RetrievalOptions, evaluate_sets, format_table
from finetune.models.finetuned import ModelNotFoundError
from finetune.models.weight_files import DamagedWeightsError
from finetune.runs.errors import RunFolderError
from finetune.runs.folder import clean_stale_temporaries, clear_previous_run
from finetune.runs.lock import RunLock, lock_on_main_process
from finetune.training.checkpoint import is_write_error
from finetune.training.context import RunContext
from finetune.training.distributed import check_engine, load_whole_under_fsdp, load_whole_under_zero3
from finetune.training.ending import stopped_or_failed
from finetune.training.environment import (cpu_threads, flat_scalars, launched_as_main, make_accelerator,
                                           setup_logging)
from finetune.training.inputs import load_data, training_set
from finetune.training.loop import LoopParts, TrainResult, build_loop
from finetune.training.model import load_start_model, parameter_counts, prepare_for_training
from finetune.training.outputs import evaluate_after, final_checkpoint, final_save_failed, write_outputs
from finetune.training.preflight import Preflight, output_action, preflight
from finetune.training.processes import start_processes
from finetune.training.signals import RunInterrupted, StopVote, TrainingStopped, graceful_stop, stop_signals
from finetune.training.size_checks import check_batch, check_room, check_warmup
from finetune.training.step import TrainModule
from finetune.training.upstream import PrerequisiteError, ensure_all

log = logging.getLogger("xlipkit")

__all__ = ["FinetuneRecipe", "run_recipe"]


class FinetuneRecipe:
    """One run of a recipe, stage by stage, over one :class:`~finetune.training.context.RunContext` (:attr:`ctx`).

    Nothing is written before the whole recipe is checked: everything :func:`~finetune.training.preflight.preflight`
    checks (the objective, built there once, and a stream it must read, every asset, the runs it builds on,
    ``output.dir``), then the resume target and the data. ``output.dir`` is locked while the run lasts
    (:class:`finetune.runs.lock.RunLock`, taken by the main process of a launch): another run into the same folder
    is refused naming this one's PID.

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        chain: resolved paths of the recipes that need this run (set when it runs as a prerequisite).
        checked: the recipe's :class:`~finetune.training.preflight.Preflight`, when the caller made it (the command
            line does); made here otherwise.

    Raises:
        RecipeError: the recipe cannot run (:meth:`Preflight.raise_if_refused`: every reason in one message).
    """

    def __init__(self, recipe: Recipe, *, chain: tuple[str, ...] = (), checked: Preflight | None = None) -> None:
        checked = checked if checked is not None else preflight(recipe)
        checked.raise_if_refused()
        self.ctx = RunContext(recipe=recipe, objective=checked.objective, chain=chain)

    # -- the stages ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """Decide what the run does with its folder, now that it holds the folder's lock, make sure the runs this one
        builds on exist (training them first when needed), then start the accelerator, the logging and the seed.

        Raises:
            RunFolderError: the run folder holds another run.
            PrerequisiteError: a run this one builds on cannot be used or failed.
        """
        ctx = self.ctx
        recipe = ctx.recipe
        ctx.action = output_action(recipe)  # the preflight's check again, under the lock: a run may have ended there
        setup_logging(launched_as_main())  # so that a prerequisite trained first is said (INFO) before it trains
        ctx.prerequisites = ensure_all(recipe, run_recipe, ctx.chain)
        ctx.accelerator = make_accelerator(recipe)
        check_engine(ctx.accelerator)  # a DeepSpeed release that cannot start these models: before anything loads
        load_whole_under_zero3(ctx.accelerator)
        load_whole_under_fsdp(ctx.accelerator)
        setup_logging(ctx.accelerator.is_main_process)
        cpu_threads(ctx.accelerator)
        set_seed(recipe.train.seed)

    def setup_data(self) -> None:
        """Load and check every set (and the resume checkpoint) before the model loads; then, on the main process,
        start the run folder: an overwritten run's files removed, what an interrupted run left cleaned up,
        ``recipe.yaml`` written (atomic, with the user's umask); then the trackers.

        Raises:
            DataError: a set that cannot be loaded.
            RunFolderError: a batch that does not fit the data or the processes; no usable checkpoint to resume.
        """
        ctx = self.ctx
        acc, out_dir = ctx.accelerator, ctx.out_dir
        ctx.data = load_data(ctx.recipe, acc)
        check_batch(ctx.recipe, ctx.data.train, acc.num_processes, ctx.objective)
        check_warmup(ctx.recipe, ctx.data.train, ctx.objective, acc.is_main_process)
        if acc.is_main_process:
            if ctx.action == "overwrite":
                removed = clear_previous_run(out_dir)
                log.warning("output.overwrite: removed the previous run's %s from %s", ", ".join(removed), out_dir)
            stale = clean_stale_temporaries(out_dir)
            if stale:
                log.info("removed what an interrupted run left in %s: %s", out_dir, ", ".join(stale))
            out_dir.mkdir(parents=True, exist_ok=True)
            dump_recipe(ctx.recipe, out_dir / "recipe.yaml")
        acc.wait_for_everyone()
        if ctx.recipe.train.trackers:
            acc.init_trackers(out_dir.name, config=flat_scalars(ctx.recipe_dict))

    def setup_model(self) -> None:
        """Load the start model, make it ready for the objective, check that the disk holds what the run will write,
        and prepare the rows it trains on (the objective's preprocessing, or the stream).

        Raises:
            ModelNotFoundError: an unknown model (the message lists the registry).
            RunFolderError: no room on the disk for what the run will write.
        """
        ctx = self.ctx
        recipe, acc = ctx.recipe, ctx.accelerator
        model = load_start_model(recipe.model, ctx.prerequisites.init)
        ctx.model = prepare_for_training(model, recipe, ctx.objective, acc.device)
        ctx.parameters = parameter_counts(ctx.model, ctx.objective)
        log.info("model %s (model family %s, architecture %s): %s parameters, %s trainable; text positions %d",
                 recipe.model.name_or_path, ctx.model.backend, ctx.model.family, f"{ctx.parameters[1]:,}",
                 f"{ctx.parameters[0]:,}", ctx.model.max_text_len)
        check_room(recipe, ctx.model, ctx.objective, ctx.data.train, acc)  # before any preprocessing or step
        ctx.training_set = training_set(recipe, ctx.data.train, ctx.objective, ctx.model, acc, ctx.data.stream_index)

    def setup_eval(self) -> None:
        """The evaluation options of the recipe, and Recall@K before training (``eval.before``)."""
        ctx = self.ctx
        ev = ctx.recipe.eval
        ctx.evaluation = RetrievalOptions.from_recipe(ctx.recipe)
        if ev.sets and ev.before:
            ctx.before = evaluate_sets(ctx.model, ev.sets, ctx.evaluation, accelerator=ctx.accelerator,
                                       sources=ctx.data.eval or None)
            if ctx.accelerator.is_main_process:
                print("Recall@K before training:\n" + format_table(None, ctx.before), flush=True)

    def setup_training(self) -> None:
        """The parts of the loop (:func:`~finetune.training.loop.build_loop`: the collate stack and the loader, the
        step, the reads, the checkpoints), resumed when ``train.resume`` says so."""
        ctx = self.ctx
        recipe = ctx.recipe
        ctx.loop = build_loop(ctx.accelerator, TrainModule(ctx.model, ctx.objective), ctx.training_set.rows,
                              recipe.train, ctx.out_dir, on_error=recipe.data.on_error,
                              num_workers=recipe.data.num_workers)
        ctx.loop.checkpoints.resume(recipe.train.resume, checkpoint=ctx.data.resume, recipe=recipe,
                                    ignore_changes=bool(getattr(recipe.train, "resume_ignore_changes", False)))

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> TrainResult:
        """The loop, top to bottom: fetch a batch (on the device), the objective told a new epoch, forward, loss,
        backward and the optimiser step, the objective's per-step work, the stop vote; at logging and checkpoint
        steps the one read of the device (the log) and the checkpoint. Returns (and keeps in the context) the
        history, the final per-term losses and the throughput.

        Between its reads the loop never waits on the device: the loss terms, the non-finite check, the skipped-step
        and truncation counts stay there (:class:`~finetune.training.meter.StepMeter`) and are read at logging steps
        (``train.log_every``, this part's first step and the last step) and checkpoints. ``on_step(step, values)``,
        when given, is called after every applied step with its values, which reads them every step (tests, tools).

        SIGINT / SIGTERM: the step in progress is finished, every process stops after the same step
        (:class:`~finetune.training.signals.StopVote`), a checkpoint is saved and :class:`TrainingStopped` raised; a
        person's second Ctrl-C exits at once (a repeated SIGTERM does not).

        Raises:
            TrainingStopped: a signal stopped the run (after saving a checkpoint).
            NonFiniteLossError: a non-finite loss under ``on_nonfinite: raise``.
            DivergedError: the trainable weights became non-finite (nothing saved).
            SaveFailedError: a checkpoint could not be written (the earlier ones are kept).
        """
        loop = self.ctx.loop
        cfg, state, objective = loop.cfg, loop.state, loop.objective
        first, last, epoch = state.step, loop.batches.total_steps, None
        clock = loop.progress.start(first, last)
        loop.wrapped.train()
        with graceful_stop() as stop:
            vote = StopVote(stop, loop.accelerator.num_processes, loop.vote_group)
            try:
                for batch_epoch, batch in loop.batches.from_step(first, clock):  # fetch a batch, on the device
                    step = state.step + 1
                    loop.batches.note_read(batch, state.step, loop.epochs)  # each epoch's samples and skipped ids
                    if batch_epoch != epoch:  # a new epoch: per-epoch schedules and draws
                        epoch = batch_epoch
                        objective.set_epoch(epoch)
                    if step == first + 1:  # every planned text length once, before this process's first step
                        loop.step.warm_up(batch)
                    loop.step(batch, step)  # forward, loss, backward, optimiser step: nothing read back
                    objective.after_step()  # the terms' clamps of their own parameters
                    state.step = step
                    loop.progress.stepped()
                    stopping = vote()  # a host flag (several processes: agreed through a CPU all-reduce)
                    log_now = step % cfg.log_every == 0 or step in (first + 1, last) or stopping
                    save_now = bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0 or stopping
                    if not (log_now or save_now or on_step is not None):
                        continue
                    values, applied = loop.progress.read(step, log_now=log_now)  # the read: history, trackers, bar
                    if stopping:  # this step saved, then every process stops after it
                        loop.progress.close()
                        raise loop.checkpoints.stopped(vote.signum, step, clock)
                    if save_now:
                        loop.checkpoints.save(clock)
                    if on_step is not None and applied:
                        on_step(step, values)
            finally:
                loop.progress.close()
            vote.close()
        self.ctx.result = loop.result()
        return self.ctx.result

    @classmethod
    def from_loop(cls, loop: LoopParts) -> "FinetuneRecipe":
        """A recipe whose one stage left is :meth:`train`, over a loop built from parts
        (:func:`~finetune.training.loop.build_loop`): how a model, objective and training set made by hand train
        with the run's own loop (tests, ``bench/loop.py``), without a recipe's other stages."""
        recipe = cls.__new__(cls)
        recipe.ctx = RunContext(recipe=None, objective=loop.objective, accelerator=loop.accelerator, loop=loop)
        return recipe

    def finish(self) -> int:
        """Recall@K after, ``final/``, ``metrics.json``, the report and plots, the hub push; returns the exit status.
        A signal now keeps the finished training in a checkpoint (:class:`TrainingStopped`).

        Raises:
            SaveFailedError: the outputs could not be written (names the checkpoint that keeps the training).
        """
        ctx = self.ctx
        try:
            done = evaluate_after(ctx)
            status, failure = 0, None
            if ctx.accelerator.is_main_process:
                try:
                    status = write_outputs(ctx, done)
                except Exception as exc:  # noqa: BLE001 - only write errors are handled, the rest re-raised
                    if not is_write_error(exc):
                        raise
                    failure = exc
            ctx.accelerator.wait_for_everyone()
        except RunInterrupted as exc:  # the training is done: keep it in a checkpoint before stopping
            raise TrainingStopped(exc.signum, ctx.loop.state.step, final_checkpoint(ctx.loop)) from None
        if failure is not None:
            raise final_save_failed(failure, ctx.loop, ctx.out_dir, done.model)
        return status

    # -- the whole run ------------------------------------------------------------------------------
    def run(self) -> int:
        """Every stage with ``output.dir`` locked; returns the exit status: 0, 2 on a recipe error (printed as
        ``recipe error: ...``), 1 when the hub push failed."""
        ctx = self.ctx
        lock = RunLock(ctx.out_dir, what=f"output.dir {str(ctx.out_dir)!r}",
                       command=f"finetune/run.py {ctx.recipe.source or ''}".strip())
        try:
            lock = lock_on_main_process(lock)
        except RunFolderError as exc:
            return refuse_recipe(str(exc))
        try:
            return self._stages()
        finally:
            if lock is not None:
                lock.release()

    def _stages(self) -> int:
        """The stages; what the user must fix in the recipe or its folder ends the run as ``recipe error: ...``,
        status 2 (a run folder this run started is removed when the model or the disk stops it)."""
        ctx = self.ctx
        try:
            self.setup()
            self.setup_data()
        except (RunFolderError, PrerequisiteError, DataError) as exc:
            return refuse_recipe(str(exc))
        try:
            self.setup_model()
            self.setup_eval()
            self.setup_training()
            self.train()
            return self.finish()
        except (ModelNotFoundError, RunFolderError, DamagedWeightsError, RecipeError) as exc:  # no model, no room,
            # bad weights, a value the model cannot take (model.max_text_len)
            if ctx.action == "new" and ctx.accelerator.is_main_process:  # leave no half-started run behind
                clear_previous_run(ctx.out_dir)
                if ctx.out_dir.is_dir() and not any(ctx.out_dir.iterdir()):
                    ctx.out_dir.rmdir()
            return refuse_recipe(f"model.name_or_path: {exc}" if isinstance(exc, ModelNotFoundError) else str(exc))
        finally:
            if ctx.chain:  # a prerequisite: the launch's process group still serves the run that needs it
                for tracker in ctx.accelerator.trackers:
                    tracker.finish()
            else:
                ctx.accelerator.end_training()


def run_recipe(recipe: Recipe, *, chain: tuple[str, ...] = (), checked: Preflight | None = None) -> int:
    """Run a validated recipe end to end (:class:`FinetuneRecipe`); returns the process exit status.

    The runs it builds on (``model.init_from``, ``eval.compare_with``) are reused when current, else trained
    first by this same function in this same process (in a multi-process launch, by every process together:
    one DDP run, see :mod:`finetune.training.upstream`). A signal or a failure the user can act on ends the
    run with a message and a status (:func:`finetune.training.ending.stopped_or_failed`), not a traceback.

    Before anything is loaded or written, the recipe goes through :func:`~finetune.training.preflight.preflight`
    (the same check as ``xlipkit validate``'s), unless the caller passes the one it made (``checked``); a recipe it
    refuses ends the run as ``recipe error: ...``, status 2, every reason in one message.

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        chain: resolved paths of the recipes that need this run (set when it runs as a prerequisite).
        checked: the recipe's :class:`~finetune.training.preflight.Preflight` when the caller made it (the command
            line does); its objective is the one the run trains.
    """
    checked = checked if checked is not None else preflight(recipe)
    if not checked.ok:
        return refuse_recipe(checked.message())
    if chain:  # a prerequisite: its stops and failures end the run that needs it, which says what to do
        return FinetuneRecipe(recipe, chain=chain, checked=checked).run()
    with stop_signals():
        try:
            start_processes(recipe)  # the launch checked, its first process group made (the rank decides the lock)
            return FinetuneRecipe(recipe, checked=checked).run()
        except BaseException as exc:  # noqa: B036 - a signal's RunInterrupted is a KeyboardInterrupt
            status = stopped_or_failed(exc, recipe)
            if status is None:
                raise
            return status
