"""Fine-tune a CLIP-family model from a recipe.

    accelerate launch finetune/run.py RECIPE.yaml [key.sub=value ...]
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="finetune/run.py",
        description=(
            "Fine-tune a CLIP / SigLIP / SigLIP2 model on long captions from a YAML recipe: load the model, "
            "stretch its text positions (Long-CLIP KPS), add a LoRA/DoRA adapter or train fully, run the "
            "recipe's objective (clip, siglip, longclip + StructXLIP ...), and report Recall@K before and "
            "after. Launch with `accelerate launch` for mixed precision and multi-GPU (DDP/FSDP/DeepSpeed)."
        ),
        epilog=(
            "examples:\n"
            "  accelerate launch finetune/run.py recipes/quickstart.yaml\n"
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
        _parser().print_usage(sys.stderr)
        print("error: give a recipe path (see --list)", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        from finetune.data.streams import check_stream_recipe

        check_stream_recipe(recipe)
    except RecipeError as exc:
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    return run(recipe)


def run(recipe: Any, *, chain: tuple[str, ...] = ()) -> int:
    """Run a validated recipe end to end; returns the process exit status.

    The runs it builds on (``model.init_from``, ``eval.compare_with``) are reused when current, else trained
    first by this same function in this same process (in a multi-process launch, by every process together:
    one DDP run, see :mod:`finetune.prerequisites`).

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        chain: resolved paths of the recipes that need this run (set when it runs as a prerequisite).
    """
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
    from finetune.prerequisites import PrerequisiteError

    check_stream_recipe(recipe)  # a RecipeError before any prerequisite trains
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
        return _run(recipe, recipe_dict, accelerator, out_dir, data, prerequisites)
    except ModelNotFoundError as exc:  # an unknown model.name_or_path: the registry list, no traceback
        print(f"recipe error: model.name_or_path: {exc}", file=sys.stderr)
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
    """The runs ``recipe`` builds on, reused or trained now (:func:`finetune.prerequisites.ensure`):
    ``{"init": Prerequisite | None, "compare": [Prerequisite, ...]}``. After a prerequisite trained, the
    accelerate state is reset (its process group kept), so that this run's ``Accelerator`` may differ
    (mixed precision, plugins)."""
    from finetune.prerequisites import ensure

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
    from finetune.models.families import model_family_options, recipe_family

    kps = dict(vars(m.kps)) if m.kps is not None else None
    if init is None:
        return load_model(m.name_or_path, family=recipe_family(m), max_text_len=m.max_text_len, dtype=m.dtype,
                          trust_remote_code=m.trust_remote_code, kps=kps, family_options=model_family_options(m))
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
    from finetune.config import parse_source_shorthand
    from finetune.data.images import DEFAULT_MAX_IMAGE_PIXELS, DataError, set_max_image_pixels
    from finetune.data.sources import SourceSpec, load_source
    from finetune.evaluate import set_label
    from finetune.resume import find_checkpoint

    resume = find_checkpoint(recipe.train.resume, Path(recipe.output.dir) / "checkpoints")
    set_max_image_pixels(getattr(recipe.data, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS))
    validate = getattr(recipe.data, "validate", "header")
    options = dict(on_error=recipe.data.on_error, cache_dir=recipe.data.cache_dir, validate=validate)
    train = None  # a stream (finetune.data.streams) is opened and checked by the training loop itself
    if not SourceSpec.parse(recipe.data.train).is_stream:
        with accelerator.main_process_first():
            try:
                train = load_source(recipe.data.train, **options)
            except (DataError, OSError) as exc:
                raise DataError(f"training set (data.train) could not be loaded: {exc}") from exc
    sets = []
    ev = recipe.eval
    if ev.sets and (ev.before or ev.after or ev.compare_base_length):
        for spec in ev.sets:
            spec = parse_source_shorthand(spec) if isinstance(spec, str) else spec
            with accelerator.main_process_first():
                try:
                    sets.append(load_source(spec, **options))
                except (DataError, OSError) as exc:
                    raise DataError(f"evaluation set {set_label(spec)!r} (eval.sets) could not be loaded: {exc}") from exc
    return {"train": train, "eval": sets, "resume": resume}


def _run(recipe: Any, recipe_dict: dict, accelerator: Any, out_dir: Path, data: dict[str, Any],
         prerequisites: dict[str, Any] | None = None) -> int:
    import torch

    from finetune.data.collate import Collator
    from finetune.data.skipping import drop_undecodable
    from finetune.evaluate import evaluate_sets, format_table
    from finetune.models.adapters import apply_adapter, save_finetuned
    from finetune.objectives import build_objective
    from finetune.report import comparison_section, plot_losses, plot_recall, write_json_atomic, write_report
    from finetune.scorers import get_scorer
    from finetune.train import TrainModule, Trainer

    from finetune.data.sources import SourceSpec
    from finetune.data.streams import check_stream_recipe

    t0 = time.perf_counter()
    check_stream_recipe(recipe)  # before the model loads
    streaming = SourceSpec.parse(recipe.data.train).is_stream
    m = recipe.model
    prerequisites = prerequisites or {"init": None, "compare": []}
    model = _load_start_model(m, prerequisites["init"])
    model = apply_adapter(model, recipe.adapter)
    if m.gradient_checkpointing:
        from finetune.models.adapters import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    objective = build_objective(recipe.objective)
    if model.logit_bias is not None and not any(t.uses_logit_bias for t in objective.all_terms):
        # an unused parameter breaks DDP (open_clip #1076): InfoNCE on a SigLIP model leaves the bias alone
        model.logit_bias.requires_grad_(False)
    model.to(accelerator.device)
    objective.prepare_model(model)  # heads the terms add (GRM's) exist before the count and the optimiser
    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad) + sum(
        p.numel() for p in objective.parameters() if p.requires_grad)
    log.info("model %s (%s, %s): %s parameters, %s trainable; text positions %d", m.name_or_path,
             model.backend, model.family, f"{n_total:,}", f"{n_train:,}", model.max_text_len)

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
    trainer.maybe_resume(recipe.train.resume, checkpoint=data["resume"], recipe=recipe_dict,
                         ignore_changes=bool(getattr(recipe.train, "resume_ignore_changes", False)))
    result = trainer.train()
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(trainer.wrapped).model
    model.eval()

    after = evaluate_sets(model, ev.sets, **eval_kwargs) if ev.sets and ev.after else {}
    at_base = None
    if ev.sets and ev.compare_base_length and model.max_text_len > model.base_text_len:
        at_base = _evaluate_at_length(model, model.base_text_len, ev.sets, eval_kwargs)
    truncated = torch.tensor(result.truncated_captions, device=accelerator.device)
    truncated = int(accelerator.reduce(truncated, reduction="sum")) if accelerator.num_processes > 1 else int(truncated)
    stream_report = _stream_report(train_ds, accelerator) if streaming else None

    if accelerator.is_main_process:
        save_finetuned(model, out_dir / "final", recipe=recipe_dict)
        table = format_table(before, after) if after else "(no evaluation sets)"
        shown = train_ds.preview if streaming else train_ds  # a stream: the first examples it yielded
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
            "backend": model.backend,
            "family": model.family,
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
        plot_losses(result.history, out_dir / "plots" / "loss.png",
                    compare={ref: m.get("history") or [] for ref, m in compared})
        plot_recall(before, after, out_dir / "plots" / "recall.png")
        write_json_atomic(out_dir / "metrics.json", metrics)
        report = write_report(out_dir, metrics, table=table, extra_sections=extra)
        print(f"wrote {out_dir / 'metrics.json'}, {report}, {out_dir / 'final'}", flush=True)
        if recipe.hub.push:
            from finetune.hub import HubPushError, push

            try:
                push(out_dir, recipe.hub.repo_id, private=recipe.hub.private, revision=recipe.hub.revision,
                     token=recipe.hub.token)
            except HubPushError as exc:  # the run itself is complete and saved
                log.error("hub push failed (the run folder %s is intact): %s", out_dir, exc)
                return 1
    accelerator.wait_for_everyone()
    return 0


def _partial_metrics(recipe: Any, model: Any, result: Any, before: Any, after: Any, at_base: Any,
                     objective: Any) -> dict[str, Any]:
    """The parts of this run's ``metrics.json`` that :func:`finetune.report.comparison_section` reads."""
    return {"objective": ", ".join([b for b in [recipe.objective.base] if b != "none"] + list(recipe.objective.terms)),
            "steps": result.steps, "max_text_len": model.max_text_len, "base_text_len": model.base_text_len,
            "before": before, "after": after, "after_at_base_length": at_base, "wall_time_s": result.wall_time_s}


def _open_train_stream(recipe: Any, objective: Any, model: Any, accelerator: Any) -> Any:
    """``data.train`` as this process's :class:`~finetune.data.streams.ExampleStream`, the objective's
    per-example work (``stream_map``) run on every example."""
    import functools

    from finetune.data.sources import SourceSpec
    from finetune.data.streams import ExampleStream, open_stream

    spec = SourceSpec.parse(recipe.data.train)
    rank, world = accelerator.process_index, accelerator.num_processes
    raw = open_stream(spec, rank=rank, world_size=world)
    log.info("training on a stream: %s (%d shards over %d processes), %d steps", spec.name, raw.num_shards, world,
             recipe.train.max_steps)
    return ExampleStream(raw, spec, on_error=recipe.data.on_error, rank=rank, world_size=world,
                         transform=functools.partial(objective.stream_map, model=model))


def _stream_report(stream: Any, accelerator: Any) -> dict:
    """The streams' counts summed over processes: examples ``read``, ``used``, ``skipped`` (and the first
    skipped ones), the last ``epoch`` of process 0, ``num_processes``."""
    from accelerate.utils import gather_object

    reports = gather_object([stream.report()]) if accelerator.num_processes > 1 else [stream.report()]
    skipped_examples = [e for r in reports for e in r["skipped_examples"]][:5]
    skipped = sum(r["skipped"] for r in reports)
    if skipped:
        log.warning("train stream %s: skipped %d unreadable examples (first: %s)", stream.spec.name, skipped,
                    ", ".join(str(e["id"]) for e in skipped_examples))
    return {"format": stream.spec.name, "num_processes": len(reports), "epoch": reports[0]["epoch"],
            "read": sum(r["read"] for r in reports), "used": sum(r["used"] for r in reports),
            "skipped": skipped, "skipped_examples": skipped_examples}


def _evaluate_at_length(model: Any, length: int, sets: list, eval_kwargs: dict) -> dict:
    """Recall@K of ``model`` with captions tokenised to at most ``length`` tokens (end token kept)."""
    import functools

    from finetune.evaluate import evaluate_sets

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


if __name__ == "__main__":
    sys.exit(main())
