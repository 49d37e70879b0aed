"""Fine-tune a CLIP-family model from a recipe.

    accelerate launch --config_file configs/accelerate/one_process.yaml -q finetune/run.py RECIPE.yaml [key=value ...]
    accelerate launch --num_processes 8 finetune/run.py recipes/structxlip_docci.yaml train.lr=1e-5
    python finetune/run.py --list
    python finetune/run.py --schema > recipe.schema.json

recipe -> model (backend, Long-CLIP KPS, adapter) -> data (+ the preprocessing the objective needs, cached)
-> Recall@K before -> training -> Recall@K after -> run folder (recipe.yaml, metrics.json, report.md,
plots/, final/, checkpoints/) -> optional hub push.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder would shadow real packages (e.g. `evaluate`) on sys.path.
_here = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]

import argparse  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

log = logging.getLogger("xlipkit")

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _parser(prog: str = "finetune/run.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Fine-tune a CLIP / SigLIP / SigLIP2 model on long captions from a YAML recipe: load the model, "
            "stretch its text positions (Long-CLIP KPS), add a LoRA/DoRA adapter or train fully, run the "
            "recipe's objective (clip, siglip, longclip + StructXLIP ...), and report Recall@K before and "
            "after. Launch with `accelerate launch` for mixed precision and multi-GPU (DDP/FSDP/DeepSpeed)."
        ),
        epilog=(
            "examples:\n"
            "  accelerate launch --config_file configs/accelerate/one_process.yaml --quiet finetune/run.py "
            "recipes/quickstart.yaml\n"
            "  accelerate launch finetune/run.py recipes/structxlip_docci.yaml train.lr=1e-5 adapter.type=lora\n"
            "  ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 finetune/run.py recipes/quickstart.yaml "
            "train.max_steps=20   # two CPU processes\n"
            "  python finetune/run.py --list\n"
            "  python finetune/run.py --schema > recipe.schema.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", nargs="?", help="path to a recipe YAML (see --list)")
    p.add_argument("overrides", nargs="*", help="recipe overrides as key.sub=value (typed, validated)")
    p.add_argument("--list", action="store_true", help="list the recipes shipped in recipes/ and exit")
    p.add_argument("--schema", action="store_true",
                   help="print the recipe JSON schema (for editors: `# yaml-language-server: $schema=FILE`) and exit")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line (``finetune/run.py``, ``xlipkit train``); returns the exit status: 0, 2 on a recipe
    error (printed as ``recipe error: ...``), else the run's. ``prog`` names the command in usage and help."""
    parser = _parser(prog) if prog else _parser()
    args = parser.parse_args(argv)
    from finetune.config import RecipeError, list_recipes, load_recipe

    if args.schema:
        import json

        from finetune.config import recipe_json_schema

        print(json.dumps(recipe_json_schema(), indent=2))
        return 0
    if args.list:
        for name, desc in list_recipes(RECIPES_DIR):
            print(f"{name:34s} {desc}")
        return 0
    if not args.recipe:
        parser.print_usage(sys.stderr)
        print("error: give a recipe path (see --list)", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    try:
        return run(recipe)
    except RecipeError as exc:  # found with the objective (a stream it cannot read), before anything is written
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2


def run(recipe: Any, *, chain: tuple[str, ...] = ()) -> int:
    """Run a validated recipe end to end; returns the process exit status.

    The runs it builds on (``model.init_from``, ``eval.compare_with``) are reused when current, else trained
    first by this same function in this same process (in a multi-process launch, by every process together:
    one DDP run, see :mod:`finetune.training.prerequisites`).

    ``output.dir`` is locked while the run lasts (:class:`finetune.run_folder.RunLock`, taken by the main
    process of a launch): another run into the same folder is refused (exit 2) naming this one's PID, and
    a prerequisite's folder is locked while it trains.

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        chain: resolved paths of the recipes that need this run (set when it runs as a prerequisite).

    Raises:
        RecipeError: the objective cannot be built from ``objective``, or cannot run on a streamed
            ``data.train`` (checked with the run's one objective before anything is written or loaded).
    """
    if chain:  # a prerequisite: its stops and failures end the run that needs it, which says what to do
        return _run_locked(recipe, chain)
    from finetune.training.signals import stop_signals

    with stop_signals():
        try:
            return _run_locked(recipe, chain)
        except BaseException as exc:  # noqa: B036 - a signal's RunInterrupted is a KeyboardInterrupt
            status = _stopped_or_failed(exc, recipe)
            if status is None:
                raise
            return status


def _run_locked(recipe: Any, chain: tuple[str, ...]) -> int:
    """:func:`run` with ``output.dir`` locked."""
    lock, refused = _lock_output_dir(recipe)
    if refused:
        print(f"recipe error: {refused}", file=sys.stderr)
        return 2
    try:
        return _run_in_folder(recipe, chain)
    finally:
        if lock is not None:
            lock.release()


def _main_rank() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"


def _stopped_or_failed(exc: BaseException, recipe: Any) -> int | None:
    """The exit status and message of a run that a signal stopped or that failed in a way the user can act on
    (no traceback), or None for anything else (re-raised with its traceback).

    - SIGINT / SIGTERM during training: the step was finished and a checkpoint saved; the resume command is
      printed; status 128 + the signal (130, 143).
    - SIGINT / SIGTERM before training: nothing to save; the same status.
    - a checkpoint or ``final/`` that could not be written, weights that diverged, a non-finite loss under
      ``on_nonfinite: raise``, data that broke during training: the message, what was kept, status 1.
    """
    from finetune.data.images import DataError
    from finetune.training import (DivergedError, NonFiniteLossError, RunInterrupted, SaveFailedError,
                                TrainingStopped)

    out = Path(recipe.output.dir)
    resume = f"\n  {_resume_command()}"
    if isinstance(exc, TrainingStopped):
        import signal

        name = signal.Signals(exc.signum).name
        if _main_rank():
            if exc.checkpoint is not None:
                print(f"{name}: stopped after step {exc.step}; saved {exc.checkpoint}. Continue the run with:{resume}",
                      file=sys.stderr, flush=True)
            else:
                print(f"{name}: stopped after step {exc.step}, but its checkpoint could not be saved: {exc.error}. "
                      f"Continue from the kept checkpoint with:{resume}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    if isinstance(exc, RunInterrupted):
        if _main_rank():
            print(f"{exc.args[0]}: stopped before training started (no checkpoint was written in {out}: start the "
                  "run again to train)", file=sys.stderr, flush=True)
        return 128 + exc.signum
    if isinstance(exc, SaveFailedError):
        if _main_rank():
            then = ("Free some space (or move output.dir and the run folder with it), then continue with:"
                    if exc.disk_full else "Fix the cause, then continue with:")
            print(f"error: {exc}. {then}{resume}" if exc.kept is not None else f"error: {exc}",
                  file=sys.stderr, flush=True)
        return 1
    if isinstance(exc, (DivergedError, NonFiniteLossError)):
        if _main_rank():
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    if isinstance(exc, DataError):  # raised while training (a stream's shard, a worker): every rank says its own
        print(f"data error: {_worker_message(exc)}", file=sys.stderr, flush=True)
        return 1
    return None


def _worker_message(exc: BaseException) -> str:
    """The message of an exception, without the traceback text torch adds when it re-raises an exception of a
    data-loader worker (``Caught DataError in DataLoader worker process 0. Original Traceback ...``)."""
    text = str(exc)
    if "Original Traceback" not in text:
        return text
    marker = f"{type(exc).__name__}: "
    return text[text.rindex(marker) + len(marker):].strip() if marker in text else text.splitlines()[-1]


def _launch_argv() -> list[str]:
    """The command line that started this run: the launcher's (``accelerate launch``, ``torchrun``) when one started
    this process, else this process's own; an interpreter running a console script is shown as the script."""
    import os

    own = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    argv = own
    try:
        parent = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
    except (OSError, UnicodeDecodeError):
        parent = []
    names = [Path(a).name for a in parent]
    launchers = {"torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
                 "accelerate.commands.accelerate_cli"}
    if ("torchrun" in names or ("accelerate" in names and "launch" in parent)
            or any(a == "-m" and b in launchers for a, b in zip(parent, parent[1:]))):
        argv = parent
    if len(argv) > 1 and Path(argv[0]).name.startswith("python") and not argv[1].startswith("-") \
            and not argv[1].endswith(".py"):
        argv = [Path(argv[1]).name, *argv[2:]]  # /venv/bin/python /venv/bin/accelerate launch ... -> accelerate launch
    return argv


def _resume_command() -> str:
    """This run's command line with ``train.resume=latest`` (and without ``output.overwrite=...``, which would remove
    the checkpoints it resumes from)."""
    import shlex

    argv = [a for a in _launch_argv() if not a.startswith(("train.resume=", "output.overwrite="))]
    return shlex.join([*argv, "train.resume=latest"])


def _lock_output_dir(recipe: Any) -> tuple[Any, str | None]:
    """``(lock or None, refusal or None)``: the main process (global rank 0) takes the lock of ``output.dir``;
    in a multi-process launch the other ranks learn whether it was refused."""
    from finetune.run_folder import RunFolderError, RunLock, lock_on_main_process

    out_dir = Path(recipe.output.dir)
    lock = RunLock(out_dir, what=f"output.dir {str(out_dir)!r}",
                   command=f"finetune/run.py {recipe.source or ''}".strip())
    try:
        return lock_on_main_process(lock), None
    except RunFolderError as exc:
        return None, str(exc)


def _run_in_folder(recipe: Any, chain: tuple[str, ...]) -> int:
    """:func:`run` while the run folder is locked."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration, set_seed

    from finetune.config import dump_recipe, recipe_to_dict
    from finetune.data.images import DataError
    from finetune.run_folder import (RunFolderError, check_run_folder, clean_stale_temporaries,
                                     clear_previous_run)

    out_dir = Path(recipe.output.dir)
    recipe_dict = recipe_to_dict(recipe)
    # nothing is written before the whole recipe is checked: the run folder, the resume target, the data
    try:
        action = check_run_folder(out_dir, recipe_dict, overwrite=bool(getattr(recipe.output, "overwrite", False)),
                                  resume=recipe.train.resume,
                                  ignore_changes=bool(getattr(recipe.train, "resume_ignore_changes", False)))
    except RunFolderError as exc:
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    from finetune.data.streams import check_stream_recipe
    from finetune.objectives import build_objective
    from finetune.training.prerequisites import PrerequisiteError

    from finetune.config import RecipeError

    try:  # the run's one objective, built (no model, no random draws) and checked before any prerequisite trains
        objective = build_objective(recipe.objective)
    except RecipeError:
        raise
    except ValueError as exc:  # a term's options that cannot work together, nothing to optimise, ...
        raise RecipeError(str(exc), key="objective") from None
    check_stream_recipe(recipe, objective)  # a RecipeError (main prints it) before anything slow
    try:
        prerequisites = _prerequisites(recipe, chain)
    except PrerequisiteError as exc:
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    trackers = list(recipe.train.trackers or [])
    accelerator = Accelerator(
        mixed_precision=recipe.train.mixed_precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(out_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),  # pinned batches overlap
    )
    _setup_logging(out_dir, accelerator.is_main_process)
    _cpu_threads(accelerator)
    set_seed(recipe.train.seed)
    try:
        data = _load_data(recipe, accelerator)
        _check_batch(recipe, data, accelerator.num_processes, objective)
    except (DataError, RunFolderError) as exc:
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    if accelerator.is_main_process:
        if action == "overwrite":
            removed = clear_previous_run(out_dir)
            log.warning("output.overwrite: removed the previous run's %s from %s", ", ".join(removed), out_dir)
        stale = clean_stale_temporaries(out_dir)
        if stale:
            log.info("removed what an interrupted run left in %s: %s", out_dir, ", ".join(stale))
        out_dir.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, out_dir / "recipe.yaml")  # atomic, with the user's umask
    accelerator.wait_for_everyone()
    if trackers:
        accelerator.init_trackers(out_dir.name, config=_flat_scalars(recipe_dict))
    from finetune.models.loading import ModelNotFoundError

    try:
        return _run(recipe, recipe_dict, accelerator, out_dir, data, objective, prerequisites)
    except (ModelNotFoundError, RunFolderError) as exc:  # an unknown model (the registry list), no room
        prefix = "model.name_or_path: " if isinstance(exc, ModelNotFoundError) else ""
        print(f"recipe error: {prefix}{exc}", file=sys.stderr)
        if action == "new" and accelerator.is_main_process:  # leave no half-started run behind
            clear_previous_run(out_dir)
            if out_dir.is_dir() and not any(out_dir.iterdir()):
                out_dir.rmdir()
        return 2
    finally:
        if chain:  # a prerequisite: the launch's process group still serves the run that needs it
            for tracker in accelerator.trackers:
                tracker.finish()
        else:
            accelerator.end_training()


def _prerequisites(recipe: Any, chain: tuple[str, ...]) -> dict[str, Any]:
    """The runs ``recipe`` builds on, reused or trained now (:func:`finetune.training.prerequisites.ensure`):
    ``{"init": Prerequisite | None, "compare": [Prerequisite, ...]}``. After a prerequisite trained, the
    accelerate state is reset (its process group kept), so that this run's ``Accelerator`` may differ
    (mixed precision, plugins)."""
    from finetune.training.prerequisites import ensure

    if recipe.source and not chain:
        chain = (str(Path(recipe.source).resolve()),)
    init_ref = getattr(recipe.model, "init_from", None)
    init = ensure(init_ref, "model.init_from", run, chain) if init_ref else None
    compare = [ensure(ref, f"eval.compare_with[{i}]", run, chain)
               for i, ref in enumerate(getattr(recipe.eval, "compare_with", None) or [])]
    if any(p is not None and p.status == "trained" for p in [init, *compare]):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return {"init": init, "compare": compare}


def _load_start_model(m: Any, init: Any) -> Any:
    """The model a run starts from: ``model.name_or_path`` as loaded, or the ``final/`` of the run that
    ``model.init_from`` names (an adapter folded into its base), stretched to ``model.max_text_len``."""
    from finetune import load_model
    from finetune.config.schema import family_loader_options
    from finetune.models.families import recipe_family

    kps = dict(vars(m.kps)) if m.kps is not None else None
    if init is None:
        return load_model(m.name_or_path, family=recipe_family(m), max_text_len=m.max_text_len, dtype=m.dtype,
                          trust_remote_code=m.trust_remote_code, kps=kps, family_options=family_loader_options(m))
    from finetune.models.adapters import load_finetuned, read_info
    from finetune.models.loading import apply_text_length

    log.info("model.init_from: starting from %s (%s, %s); model.name_or_path is not loaded", init.final, init.ref,
             init.status)
    if read_info(init.final)["kind"] == "full":
        return load_model(str(init.final), max_text_len=m.max_text_len, dtype=m.dtype, kps=kps).train()
    import torch

    model = load_finetuned(init.final, merge=True)
    if m.max_text_len is not None:
        apply_text_length(model, int(m.max_text_len), kps)
    if m.dtype is not None:
        model.to(getattr(torch, m.dtype))
    return model.train()


def _cpu_threads(accelerator: Any) -> None:
    """``accelerate launch`` without ``--cpu`` on a machine without a GPU exports ``OMP_NUM_THREADS=1``, which
    leaves a single CPU process one core: give it every core it may run on, and say so. With ``--cpu`` the
    user's (or accelerate's) ``--num_cpu_threads_per_process`` stands."""
    import os

    import torch

    launched = "ACCELERATE_USE_CPU" in os.environ and os.environ["ACCELERATE_USE_CPU"].lower() not in ("1", "true")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if (launched and accelerator.device.type == "cpu" and accelerator.num_processes == 1
            and os.environ.get("OMP_NUM_THREADS") == "1" and torch.get_num_threads() == 1 and cores > 1):
        torch.set_num_threads(cores)
        logging.getLogger("xlipkit").info(
            "accelerate launch set OMP_NUM_THREADS=1 for this one CPU process: using all %d cores "
            "(accelerate launch --cpu --num_cpu_threads_per_process N chooses N)", cores)


def _load_data(recipe: Any, accelerator: Any) -> dict[str, Any]:
    """Load and validate the training set and every evaluation set (and find the resume
    checkpoint) before the model loads or anything is written; errors name the set.

    Returns:
        ``{"train": LoadedSource (None for a stream), "eval": [LoadedSource, ...] (one per eval.sets entry),
        "resume": checkpoint folder or None}``.
    Raises:
        DataError: a set that cannot be loaded (unknown name, missing files, bad examples with
            ``data.on_error: raise``).
        RunFolderError: a ``train.resume`` that names no usable checkpoint.
    """
    from finetune.data.images import DEFAULT_MAX_IMAGE_PIXELS, DataError, set_max_image_pixels
    from finetune.data.sources import load_source
    from finetune.evaluation import set_label

    resume = _find_resume(recipe, accelerator)
    set_max_image_pixels(getattr(recipe.data, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS))
    validate = getattr(recipe.data, "validate", "header")
    options = dict(on_error=recipe.data.on_error, cache_dir=recipe.data.cache_dir, validate=validate)
    train = None  # a stream (finetune.data.streams) is opened by the training loop; its shard count checked here
    if recipe.data.train.is_stream:  # a typed SourceSpec since load_recipe
        from finetune.data.streams import check_stream_columns, check_stream_shards

        try:
            check_stream_shards(recipe.data.train, accelerator.num_processes)
            # the columns (a caption column of numbers) before the model loads, on every process (its own shards)
            check_stream_columns(recipe.data.train, rank=accelerator.process_index,
                                 world_size=accelerator.num_processes)
        except DataError as exc:
            raise DataError(f"training set (data.train): {exc}") from exc
    else:
        with accelerator.main_process_first():
            try:
                train = load_source(recipe.data.train, **options)
            except (DataError, OSError) as exc:
                raise DataError(f"training set (data.train) could not be loaded: {exc}") from exc
    sets = []
    ev = recipe.eval
    if ev.sets and (ev.before or ev.after or ev.compare_base_length):
        for spec in ev.sets:
            with accelerator.main_process_first():
                try:
                    sets.append(load_source(spec, **options))
                except (DataError, OSError) as exc:
                    raise DataError(f"evaluation set {set_label(spec)!r} (eval.sets) could not be loaded: {exc}") from exc
    return {"train": train, "eval": sets, "resume": resume}


def _find_resume(recipe: Any, accelerator: Any) -> Path | None:
    """The checkpoint ``train.resume`` names (:func:`finetune.resume.find_checkpoint`: every file's sha256 checked,
    ``latest`` falling back past damaged ones), found by the main process and told to the others, so that the
    files are read once.

    Raises:
        CheckpointError: on every process, naming the file.
    """
    from finetune.resume import CheckpointError, find_checkpoint

    t = recipe.train
    found, error = None, None
    if accelerator.is_main_process:
        try:
            found = find_checkpoint(t.resume, Path(recipe.output.dir) / "checkpoints",
                                    world_size=accelerator.num_processes,
                                    ignore_rng=bool(getattr(t, "resume_ignore_rng", False)))
        except CheckpointError as exc:
            error = str(exc)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        found, error = broadcast_object_list([found, error])
    if error:
        raise CheckpointError(error)
    return found


def _run(recipe: Any, recipe_dict: dict, accelerator: Any, out_dir: Path, data: dict[str, Any], objective: Any,
         prerequisites: dict[str, Any] | None = None) -> int:
    import torch

    from finetune.data.collate import Collator
    from finetune.data.skipping import drop_undecodable
    from finetune.evaluation import evaluate_sets, format_table
    from finetune.models.adapters import apply_adapter, save_finetuned
    from finetune.files import write_json_atomic
    from finetune.evaluation.report import comparison_section, plot_losses, plot_recall, verdict, write_report
    from finetune.evaluation.scorers import get_scorer
    from finetune.training import RunInterrupted, TrainingStopped, TrainModule, Trainer

    t0 = time.perf_counter()
    streaming = recipe.data.train.is_stream
    m = recipe.model
    prerequisites = prerequisites or {"init": None, "compare": []}
    model = _load_start_model(m, prerequisites["init"])
    model = apply_adapter(model, recipe.adapter)
    if m.gradient_checkpointing:
        from finetune.models.adapters import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    for term in objective.all_terms:  # terms that drop one sample's unusable field (FAST-GOAL's boxes) follow it
        if hasattr(term, "on_error"):
            term.on_error = recipe.data.on_error
    if model.logit_bias is not None and not any(t.uses_logit_bias for t in objective.all_terms):
        # an unused parameter breaks DDP (open_clip #1076): InfoNCE on a SigLIP model leaves the bias alone
        model.logit_bias.requires_grad_(False)
    model.to(accelerator.device)
    objective.prepare_model(model)  # heads the terms add (GRM's) exist before the count and the optimiser
    n_train, n_total = parameter_counts(model, objective)
    log.info("model %s (model family %s, architecture %s): %s parameters, %s trainable; text positions %d",
             m.name_or_path, model.backend, model.family, f"{n_total:,}", f"{n_train:,}", model.max_text_len)
    _check_room(recipe, model, objective, out_dir, data, accelerator)  # before any preprocessing or step

    if streaming:
        train_src, train_ds = None, _open_train_stream(recipe, objective, model, accelerator)
    else:
        train_src = data["train"]
        _log_skips("train", train_src)
        with accelerator.main_process_first():  # cached preprocessing: computed once, then reused by the others
            rows = train_src.dataset
            if _preprocesses(objective):  # it decodes every image: bad ones must not reach it
                rows, dropped = drop_undecodable(rows, on_error=recipe.data.on_error, cache_dir=recipe.data.cache_dir)
                if dropped:
                    train_src.skipped += len(dropped)
                    train_src.skipped_examples.extend(dropped)
                    train_src.skipped_ids.extend(e["id"] for e in dropped)
                    log.warning("train set: skipped %d images that do not decode before preprocessing (first: %s)",
                                len(dropped), ", ".join(e["id"] for e in dropped[:5]))
            train_ds = objective.preprocess(rows, model, cache_dir=recipe.data.cache_dir, log=log)

    ev = recipe.eval
    eval_kwargs = dict(batch_size=ev.batch_size, ks=tuple(ev.ks), on_error=recipe.data.on_error,
                       cache_dir=recipe.data.cache_dir, accelerator=accelerator, scorer=get_scorer(ev.scorer),
                       rerank_top_k=ev.rerank_top_k, block_size=ev.block_size, sources=data["eval"] or None)
    before = evaluate_sets(model, ev.sets, **eval_kwargs) if ev.sets and ev.before else None
    if before is not None and accelerator.is_main_process:
        print("Recall@K before training:\n" + format_table(None, before), flush=True)

    module = TrainModule(model, objective)
    from finetune.data.skipping import SkippingDataset, SkipReportingCollate

    collator = Collator(model, objective, tensor_images=True)  # uint8 pixels, normalised on the device
    rows = train_ds if streaming else SkippingDataset(train_ds, recipe.data.on_error, decode=collator.decode)
    trainer = Trainer(accelerator, module, rows, SkipReportingCollate(collator), recipe.train, out_dir,
                      num_workers=recipe.data.num_workers)
    trainer.maybe_resume(recipe.train.resume, checkpoint=data["resume"], recipe=recipe,
                         ignore_changes=bool(getattr(recipe.train, "resume_ignore_changes", False)))
    result = trainer.train()
    try:
        return _finish(recipe, recipe_dict, accelerator, out_dir, data, prerequisites, t0, model, objective,
                       trainer, result, before, eval_kwargs, streaming, train_src, train_ds, n_train, n_total)
    except RunInterrupted as exc:  # the training is done: keep it in a checkpoint before stopping
        raise TrainingStopped(exc.signum, trainer.state.step, _final_checkpoint(trainer)) from None


def _final_checkpoint(trainer: Any) -> Path:
    """A checkpoint of the finished training (the newest one when it is of the last step already), so that a run
    stopped during its evaluation or final save resumes at its end."""
    from finetune.training import list_checkpoints

    kept = list_checkpoints(trainer.ckpt_dir)
    if kept and kept[-1].name == f"step-{trainer.state.step}":
        return kept[-1]
    return trainer._save(trainer.clock)


def _finish(recipe: Any, recipe_dict: dict, accelerator: Any, out_dir: Path, data: dict[str, Any],
            prerequisites: dict[str, Any], t0: float, model: Any, objective: Any, trainer: Any, result: Any,
            before: Any, eval_kwargs: dict, streaming: bool, train_src: Any, train_ds: Any, n_train: int,
            n_total: int) -> int:
    """After training: Recall@K after, ``final/``, ``metrics.json``, the report and plots, the hub push."""
    import torch

    from finetune.evaluation import evaluate_sets, format_table
    from finetune.models.adapters import save_finetuned
    from finetune.files import write_json_atomic
    from finetune.evaluation.report import comparison_section, plot_losses, plot_recall, verdict, write_report
    from finetune.training.checkpoint import is_write_error

    ev = recipe.eval
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(trainer.wrapped).model
    model.eval()

    after = evaluate_sets(model, ev.sets, **eval_kwargs) if ev.sets and ev.after else {}
    at_base = None
    if ev.sets and ev.compare_base_length and model.max_text_len > model.base_text_len:
        at_base = _evaluate_at_length(model, model.base_text_len, ev.sets, eval_kwargs)
    truncated = torch.tensor(result.truncated_captions, device=accelerator.device)
    truncated = int(accelerator.reduce(truncated, reduction="sum")) if accelerator.num_processes > 1 else int(truncated)
    stream_report = _stream_report(trainer.stream, accelerator) if streaming else None

    status, failure = 0, None
    if accelerator.is_main_process:
        try:
            save_finetuned(model, out_dir / "final", recipe=recipe_dict)
            table = format_table(before, after) if after else "(no evaluation sets)"
            shown = trainer.stream.preview() if streaming else train_ds  # a stream: its first examples
            extra = [section for term in objective.all_terms for section in term.report_sections(out_dir, shown)]
            compared = [(p.ref, p.metrics()) for p in prerequisites["compare"]]
            if compared:
                extra.append(comparison_section([(str(recipe.source or out_dir), _partial_metrics(
                    recipe, model, result, before, after, at_base, objective)), *compared]))
            if at_base:
                extra.append(
                    f"## What reading past {model.base_text_len} tokens buys\n\nThe trained model evaluated "
                    f"with every caption cut at {model.base_text_len} tokens (left) and read up to "
                    f"{model.max_text_len} tokens (right):\n\n" + format_table(at_base, after))
            print("Recall@K before -> after training:\n" + table, flush=True)
            metrics = {
                "recipe": recipe_dict,
                "model_family": model.backend,  # the README's names: the family that loaded it (hf, open_clip, ...)
                "architecture": model.family,   # and what it is (clip, siglip, siglip2)
                "max_text_len": model.max_text_len,
                "base_text_len": model.base_text_len,
                "objective": ", ".join([b for b in [recipe.objective.base] if b != "none"] + list(recipe.objective.terms)),
                "train_set": train_ds.spec.name if streaming else train_src.name,
                "train_examples": stream_report["used"] if streaming else len(train_src.dataset),
                "skipped": ({"train": stream_report["skipped"], "train_examples": stream_report["skipped_examples"]}
                            if streaming else
                            {"train": train_src.skipped + len(result.skipped_examples),
                             "train_examples": [*train_src.skipped_examples, *result.skipped_examples],
                             "train_ids": [*train_src.skipped_ids, *(e["id"] for e in result.skipped_examples)]}),
                "train_stream": stream_report,
                "before": before,
                "after": after,
                "after_at_base_length": at_base,
                "terms": {t.name: t.summary() for t in objective.all_terms if t.summary()},
                "final_losses": result.final_losses,
                "steps": result.steps,
                "skipped_steps": result.skipped_steps,
                "truncated_captions": truncated,
                "wall_time_s": result.wall_time_s,
                "total_time_s": time.perf_counter() - t0,
                "samples_per_s": result.samples_per_s,
                "throughput": result.throughput,  # steady samples/s, data-wait share, FLOPs, TFLOP/s, MFU
                "num_processes": accelerator.num_processes,
                "trainable_parameters": n_train,
                "total_parameters": n_total,
                "history": result.history,
                "init_from": prerequisites["init"].record() if prerequisites["init"] is not None else None,
                "compare_with": [p.record() for p in prerequisites["compare"]],
            }
            label = str(recipe.source or out_dir)
            plot_losses(result.history, out_dir / "plots" / "loss.png",
                        compare={ref: m.get("history") or [] for ref, m in compared}, batch_size=recipe.train.batch_size,
                        label=Path(label).name)
            plot_recall(before, after, out_dir / "plots" / "recall.png", label=Path(label).name, compare=compared,
                        at_base=at_base, base_text_len=model.base_text_len)
            write_json_atomic(out_dir / "metrics.json", metrics)
            report = write_report(out_dir, metrics, table=table, extra_sections=extra, compare=compared, label=label)
            said = verdict((label, metrics), compared, recipe.eval.seed_spread) if compared else None
            if said:
                print(f"Verdict: {said}", flush=True)
            print(f"wrote {out_dir / 'metrics.json'}, {report}, {out_dir / 'final'}", flush=True)
            if recipe.hub.push:
                from finetune.hub import HubPushError, push

                try:
                    push(out_dir, recipe.hub.repo_id, private=recipe.hub.private, revision=recipe.hub.revision,
                         token=recipe.hub.token)
                except HubPushError as exc:  # the run itself is complete and saved
                    log.error("hub push failed (the run folder %s is intact): %s", out_dir, exc)
                    status = 1
        except Exception as exc:  # noqa: BLE001 - only write errors are handled, the rest re-raised
            if not is_write_error(exc):
                raise
            failure = exc
    accelerator.wait_for_everyone()
    if failure is not None:
        raise _final_save_failed(failure, trainer, out_dir, model)
    return status


def _final_save_failed(error: BaseException, trainer: Any, out_dir: Path, model: Any) -> Any:
    """The :class:`~finetune.training.SaveFailedError` of a run whose outputs (``final/``, ``metrics.json``, the report)
    could not be written after training: why (a full disk: how much was needed and is free, where), and which
    checkpoint keeps the training."""
    from finetune.training.checkpoint import SaveFailedError, describe_save_failure, list_checkpoints

    trained = [p for p in model.parameters() if p.requires_grad]
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    need = full if len(trained) == len(list(model.parameters())) else sum(p.numel() * p.element_size() for p in trained)
    why, disk_full = describe_save_failure(error, out_dir, need)
    kept = list_checkpoints(trainer.ckpt_dir)
    step, total = trainer.state.step, trainer.total_steps
    if not kept:
        said = ("no checkpoint was kept (train.checkpoint_every is 0), so the training cannot be continued; set "
                "train.checkpoint_every to keep one next time")
    elif kept[-1].name == f"step-{step}":
        said = (f"the training is kept in {kept[-1]} (its last step, {step}): continuing the run trains no more steps, "
                "it evaluates and writes final/ again")
    else:
        said = (f"the newest checkpoint is {kept[-1]}, {step - int(kept[-1].name[5:])} of the run's {total} steps "
                "before its end: continuing the run trains from there")
    return SaveFailedError(f"the run's outputs could not be written in {out_dir} after training: {why}; {said}",
                           kept=kept[-1] if kept else None, disk_full=disk_full)


def _check_batch(recipe: Any, data: dict[str, Any], num_processes: int, objective: Any) -> None:
    """A training set smaller than one optimiser step, or a batch that does not split over the processes,
    is a recipe error found with the data, before the model loads or anything is written.

    Raises:
        RunFolderError: naming the keys to change.
    """
    from finetune.run_folder import RunFolderError

    t = recipe.train
    if t.batch_size % (num_processes * t.accumulation_steps):
        raise RunFolderError(f"train.batch_size={t.batch_size} must be divisible by processes x "
                             f"train.accumulation_steps = {num_processes} x {t.accumulation_steps}; change "
                             "train.batch_size or train.accumulation_steps")
    train = data.get("train")
    if train is None:
        return
    examples = objective.training_examples(train.dataset)  # GRM: one per caption
    if examples < t.batch_size:
        skipped = f" ({train.skipped} unreadable examples skipped)" if train.skipped else ""
        raise RunFolderError(f"the training set (data.train) has {examples} usable examples{skipped}, "
                             f"fewer than one batch (train.batch_size={t.batch_size}): lower train.batch_size or "
                             "add data")


def _check_room(recipe: Any, model: Any, objective: Any, out_dir: Path, data: dict[str, Any],
                accelerator: Any) -> None:
    """Stop before training when ``output.dir``'s disk cannot hold what the run will write: ``final/`` and
    the checkpoints kept at once (:func:`finetune.run_folder.estimate_run_bytes`), less an earlier
    ``final/`` and checkpoints that the run replaces. The main process checks; every process gets its answer.

    Raises:
        RunFolderError: how much is needed and free.
    """
    import itertools

    from finetune.run_folder import RunFolderError, check_free_space, estimate_run_bytes, folder_bytes

    t = recipe.train
    error = None
    if accelerator.is_main_process:
        tensors = itertools.chain(model.state_dict().values(), objective.state_dict().values())
        trained = [p for p in itertools.chain(model.parameters(), objective.parameters()) if p.requires_grad]
        train = data.get("train")
        steps = t.max_steps or (t.epochs * (len(train.dataset) // t.batch_size) if train is not None else 0)
        written = steps // t.checkpoint_every if t.checkpoint_every else 0
        estimate = estimate_run_bytes(
            model_bytes=sum(x.numel() * x.element_size() for x in tensors),
            trainable_bytes=sum(p.numel() * p.element_size() for p in trained),
            trainable_numel=sum(p.numel() for p in trained), full=recipe.adapter.type == "full",
            checkpoints_written=written, keep=t.keep_checkpoints)
        detail = f"final/ {estimate['final'] / 2**20:.1f} MiB"
        if estimate["checkpoints"]:
            detail += f" + {estimate['checkpoints']} checkpoints x {estimate['checkpoint'] / 2**20:.1f} MiB"
        try:
            check_free_space(out_dir, estimate["total"], what=f"output.dir {str(out_dir)!r}", detail=detail,
                             reclaimed=folder_bytes(out_dir / "final") + folder_bytes(out_dir / "checkpoints"))
        except RunFolderError as exc:
            error = str(exc)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error:
        raise RunFolderError(error)


def parameter_counts(model: Any, objective: Any) -> tuple[int, int]:
    """``(trainable, total)`` parameters of what trains: the model and the objective's own parameters
    (StructXLIP's structure temperature, GRM's head), so that trainable never exceeds total."""
    params = list({id(p): p for p in [*model.parameters(), *objective.parameters()]}.values())  # a head in both
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _partial_metrics(recipe: Any, model: Any, result: Any, before: Any, after: Any, at_base: Any,
                     objective: Any) -> dict[str, Any]:
    """The parts of this run's ``metrics.json`` that :func:`finetune.evaluation.report.comparison_section` reads."""
    return {"objective": ", ".join([b for b in [recipe.objective.base] if b != "none"] + list(recipe.objective.terms)),
            "steps": result.steps, "max_text_len": model.max_text_len, "base_text_len": model.base_text_len,
            "before": before, "after": after, "after_at_base_length": at_base, "wall_time_s": result.wall_time_s}


def _open_train_stream(recipe: Any, objective: Any, model: Any, accelerator: Any) -> Any:
    """``data.train`` as this process's :class:`~finetune.data.streams.ExampleStream`, the objective's
    per-example work (``stream_map``) run on every example."""
    import functools

    from finetune.data.streams import ExampleStream, check_stream_shards, open_stream, shard_layout

    spec = recipe.data.train
    rank, world = accelerator.process_index, accelerator.num_processes
    raw = open_stream(spec, rank=rank, world_size=world)
    shards = check_stream_shards(spec, world)  # None for a hub dataset
    log.info("training on a stream: %s, %s; process %d reads %d, %d steps", spec.name,
             shard_layout(shards, world, recipe.data.num_workers) if shards else f"{world} process(es)",
             rank, raw.num_shards, recipe.train.max_steps)
    return ExampleStream(raw, spec, on_error=recipe.data.on_error, rank=rank, world_size=world,
                         transform=functools.partial(objective.stream_map, model=model))


def _stream_report(loader: Any, accelerator: Any) -> dict:
    """The streams' counts summed over processes and their data-loader workers: examples ``read``, ``used``,
    ``skipped`` (and the first skipped ones), broken webdataset shards whose rest was skipped
    (``skipped_shard_count``, each time; ``skipped_shards``, the first few with why), the ``epoch`` of process 0 (its
    slowest worker's), ``num_processes``, ``num_workers`` (of process 0)."""
    from accelerate.utils import gather_object

    reports = gather_object([loader.report()]) if accelerator.num_processes > 1 else [loader.report()]
    skipped_examples = [e for r in reports for e in r["skipped_examples"]][:5]
    skipped = sum(r["skipped"] for r in reports)
    if skipped:
        log.warning("train stream %s: skipped %d unreadable examples (first: %s)", loader.spec.name, skipped,
                    ", ".join(str(e["id"]) for e in skipped_examples))
    shards = list({e["shard"]: e for r in reports for e in r.get("skipped_shards", [])}.values())[:5]
    broken = sum(r.get("skipped_shard_count", 0) for r in reports)
    if broken:
        log.warning("train stream %s: skipped the rest of %d broken shard(s) %d time(s) in all: %s", loader.spec.name,
                    len(shards), broken, ", ".join(f"{e['shard']} ({e['reason']})" for e in shards))
    return {"format": loader.spec.name, "num_processes": len(reports), "num_workers": reports[0]["num_workers"],
            "epoch": reports[0]["epoch"], "read": sum(r["read"] for r in reports),
            "used": sum(r["used"] for r in reports), "skipped": skipped, "skipped_examples": skipped_examples,
            "skipped_shard_count": broken, "skipped_shards": shards}


def _evaluate_at_length(model: Any, length: int, sets: list, eval_kwargs: dict) -> dict:
    """Recall@K of ``model`` with captions tokenised to at most ``length`` tokens (end token kept)."""
    import functools

    from finetune.evaluation import evaluate_sets

    model.tokenize = functools.partial(type(model).tokenize, model, max_length=length)
    try:
        return evaluate_sets(model, sets, **eval_kwargs)
    finally:
        del model.tokenize


def _preprocesses(objective: Any) -> bool:
    """Whether a term of ``objective`` has a whole-dataset ``preprocess`` step (which decodes images)."""
    from finetune.objectives import Term

    return any(type(t).preprocess is not Term.preprocess for t in objective.all_terms)


def _log_skips(role: str, src: Any) -> None:
    if src.skipped:
        ids = ", ".join(str(e.get("id")) for e in src.skipped_examples[:5])
        log.warning("%s set %s: skipped %d unreadable examples (first: %s)", role, src.name, src.skipped, ids)


def _flat_scalars(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_scalars(v, key + "."))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        elif v is not None:
            out[key] = str(v)
    return out


def _setup_logging(out_dir: Path, main: bool) -> None:
    level = logging.INFO if main else logging.WARNING
    logger = logging.getLogger("xlipkit")
    logger.setLevel(level)
    if not logger.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(h)
        logger.propagate = False


def _accelerate_traceback_follows() -> bool:
    """Whether ``accelerate launch``'s single-process launcher started this script without ``--quiet``: it then
    answers a non-zero exit with a ``CalledProcessError`` traceback of its own (accelerate 1.x
    ``simple_launcher``; ``--quiet`` makes it exit 1 instead)."""
    import os

    if "ACCELERATE_USE_CPU" not in os.environ or os.environ.get("WORLD_SIZE", "1") != "1":
        return False  # not accelerate's simple launcher (DDP launches go through torch's elastic agent)
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    script = next((i for i, a in enumerate(parent) if a.endswith(b".py") and i > 1), len(parent))
    return not {b"--quiet", b"-q"} & set(parent[:script])  # launcher options come before the script


if __name__ == "__main__":
    status = main()
    if status and _accelerate_traceback_follows():
        print("(accelerate launch answers a failed script with a CalledProcessError traceback of its own; it adds "
              "nothing to the error above, and `accelerate launch --quiet` leaves it out)", file=sys.stderr, flush=True)
    sys.exit(status)
