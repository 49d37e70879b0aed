"""A run, end to end, as a recipe class in the torchtune manner (:class:`FinetuneRecipe`): ``setup`` (the run folder,
the objective, the runs it builds on, the accelerator), ``setup_data`` (the sets, before the model), ``setup_model``
(the model, its adapter, the rows it trains on), ``setup_eval`` (Recall@K before), ``train`` and ``finish``
(Recall@K after, ``final/``, ``metrics.json``, the report, the hub push), over one typed
:class:`~finetune.training.context.RunContext`.

recipe -> model (family, Long-CLIP KPS, adapter) -> data (+ the preprocessing the objective needs, cached)
-> Recall@K before -> training -> Recall@K after -> run folder (recipe.yaml, metrics.json, report.md,
plots/, final/, checkpoints/) -> optional hub push.

:func:`run_recipe` runs one (the command line is :mod:`finetune.cli.train`)::

    from finetune.config import load_recipe
    from finetune.training import run_recipe
    status = run_recipe(load_recipe("recipes/quickstart.yaml", ["train.max_steps=10"]))
"""

from __future__ import annotations

import logging

from accelerate.utils import set_seed

from finetune.config import Recipe, RecipeError, dump_recipe, refuse_recipe
from finetune.data.collate import Collator
from finetune.data.images import DataError
from finetune.data.skipping import SkippingDataset, SkipReportingCollate
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
from finetune.training.model import load_start_model, parameter_counts, prepare_for_training
from finetune.training.outputs import evaluate_after, final_checkpoint, final_save_failed, write_outputs
from finetune.training.preflight import Preflight, output_action, preflight
from finetune.training.processes import start_processes
from finetune.training.signals import RunInterrupted, TrainingStopped, stop_signals
from finetune.training.size_checks import check_batch, check_room, check_warmup
from finetune.training.trainer import Trainer, TrainModule
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

    def train(self) -> None:
        """Build the loop (:class:`~finetune.training.Trainer`), resume it when ``train.resume`` says so, and train."""
        ctx = self.ctx
        recipe = ctx.recipe
        module = TrainModule(ctx.model, ctx.objective)
        collator = Collator(ctx.model, ctx.objective, tensor_images=True)  # uint8 pixels, normalised on the device
        rows = ctx.training_set.rows
        if not ctx.training_set.streaming:
            rows = SkippingDataset(rows, recipe.data.on_error, decode=collator.decode)
        ctx.trainer = Trainer(ctx.accelerator, module, rows, SkipReportingCollate(collator), recipe.train, ctx.out_dir,
                              num_workers=recipe.data.num_workers)
        ctx.trainer.maybe_resume(recipe.train.resume, checkpoint=ctx.data.resume, recipe=recipe,
                                 ignore_changes=bool(getattr(recipe.train, "resume_ignore_changes", False)))
        ctx.result = ctx.trainer.train()

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
            raise TrainingStopped(exc.signum, ctx.trainer.state.step, final_checkpoint(ctx.trainer)) from None
        if failure is not None:
            raise final_save_failed(failure, ctx.trainer, ctx.out_dir, done.model)
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
