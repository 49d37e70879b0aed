"""What a run writes after training (DESIGN 3): Recall@K after (and with captions cut at the base length),
``final/``, ``metrics.json``, ``report.md`` and ``plots/``, the verdict against the compared runs, and the hub push;
a write that fails (a full disk above all) names the checkpoint that keeps the training
(:func:`final_save_failed`)."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.evaluation import evaluate_sets, format_table
from finetune.evaluation.report import comparison_section, plot_losses, plot_recall, verdict, write_report
from finetune.files import write_json_atomic
from finetune.hub import HubPushError, push
from finetune.models.finetuned import save_finetuned
from finetune.runs.checkpoints import list_checkpoints
from finetune.training.checkpoint import SaveFailedError, describe_save_failure
from finetune.training.context import RunContext
from finetune.training.distributed import engine_record
from finetune.training.inputs import stream_report

log = logging.getLogger("xlipkit")

__all__ = ["AfterTraining", "evaluate_after", "final_checkpoint", "final_save_failed", "write_outputs"]


@dataclass
class AfterTraining:
    """What the run measured after training, on every process.

    Attributes:
        model: the trained model (unwrapped, in eval mode).
        after: Recall@K after training (``{}`` when not evaluated).
        at_base: Recall@K with captions cut at the model's base length (``eval.compare_base_length``), or None.
        truncated: training captions cut to the model's text length, summed over processes.
        stream: what a streamed ``data.train`` read (:func:`finetune.training.inputs.stream_report`), or None.
    """

    model: Any
    after: dict[str, Any]
    at_base: dict[str, Any] | None
    truncated: int
    stream: dict[str, Any] | None


def evaluate_after(ctx: RunContext) -> AfterTraining:
    """Recall@K of the trained model (read up to its text length, and cut at its base length when the recipe asks)
    and the counts every process contributes to; a collective, so every process calls it."""
    ev, acc, loop = ctx.recipe.eval, ctx.accelerator, ctx.loop
    acc.wait_for_everyone()
    model = loop.final_model()  # gathered where FSDP or ZeRO-3 shard it
    model.eval()
    options = dict(accelerator=acc, sources=ctx.data.eval or None)
    after = evaluate_sets(model, ev.sets, ctx.evaluation, **options) if ev.sets and ev.after else {}
    at_base = None
    if ev.sets and ev.compare_base_length and model.max_text_len > model.base_text_len:
        at_base = _evaluate_at_length(model, model.base_text_len, ev.sets, ctx.evaluation, options)
    truncated = torch.tensor(ctx.result.truncated_captions, device=acc.device)
    truncated = int(acc.reduce(truncated, reduction="sum")) if acc.num_processes > 1 else int(truncated)
    whole = int(loop.batches.epoch_at(loop.state.step) + 1e-9)  # the epochs read whole, as the progress bar counts
    stream = stream_report(loop.batches.stream, acc, whole) if ctx.training_set.streaming else None
    return AfterTraining(model, after, at_base, truncated, stream)


def _evaluate_at_length(model: Any, length: int, sets: list, evaluation: Any, options: dict) -> dict:
    """Recall@K of ``model`` with captions tokenised to at most ``length`` tokens (end token kept)."""
    model.tokenize = functools.partial(type(model).tokenize, model, max_length=length)
    try:
        return evaluate_sets(model, sets, evaluation, **options)
    finally:
        del model.tokenize


def write_outputs(ctx: RunContext, done: AfterTraining) -> int:
    """On the main process: ``final/``, the report, its plots and ``metrics.json``, the verdict, the hub push.
    Returns the exit status (1 when the push failed: the run folder is complete).

    Raises:
        Exception: a failed write, as raised (:func:`finetune.training.checkpoint.is_write_error` tells them).
    """
    recipe, out_dir, model = ctx.recipe, ctx.out_dir, done.model
    save_finetuned(model, out_dir / "final", recipe=ctx.recipe_dict)
    table = format_table(ctx.before, done.after) if done.after else "(no evaluation sets)"
    compared = [(p.ref, p.metrics()) for p in ctx.prerequisites.compare]
    extra = _sections(ctx, done, compared)
    print("Recall@K before -> after training:\n" + table, flush=True)
    metrics = _metrics(ctx, done)
    label = Path(ctx.label).name
    plot_losses(ctx.result.history, out_dir / "plots" / "loss.png",
                compare={ref: m.get("history") or [] for ref, m in compared}, batch_size=recipe.train.batch_size,
                label=label)
    plot_recall(ctx.before, done.after, out_dir / "plots" / "recall.png", label=label, compare=compared,
                at_base=done.at_base, base_text_len=model.base_text_len)
    write_json_atomic(out_dir / "metrics.json", metrics)
    report = write_report(out_dir, metrics, table=table, extra_sections=extra, compare=compared, label=ctx.label)
    said = verdict((ctx.label, metrics), compared, recipe.eval.seed_spread) if compared else None
    if said:
        print(f"Verdict: {said}", flush=True)
    print(f"wrote {out_dir / 'metrics.json'}, {report}, {out_dir / 'final'}", flush=True)
    if recipe.hub.push:
        try:
            push(out_dir, recipe.hub.repo_id, private=recipe.hub.private, revision=recipe.hub.revision,
                 token=recipe.hub.token)
        except HubPushError as exc:  # the run itself is complete and saved
            log.error("hub push failed (the run folder %s is intact): %s", out_dir, exc)
            return 1
    return 0


def _objective_name(ctx: RunContext) -> str:
    objective = ctx.recipe.objective
    return ", ".join([b for b in [objective.base] if b != "none"] + list(objective.terms))


def _sections(ctx: RunContext, done: AfterTraining, compared: list[tuple[str, dict]]) -> list[str]:
    """The report's extra sections: each term's own, the comparison with ``eval.compare_with``, and what reading
    past the base length buys."""
    model, loop = done.model, ctx.loop
    shown = loop.batches.stream.preview() if ctx.training_set.streaming else ctx.training_set.rows  # a stream: its first
    extra = [section for term in ctx.objective.all_terms for section in term.report_sections(ctx.out_dir, shown)]
    if compared:
        this = {"objective": _objective_name(ctx), "steps": ctx.result.steps, "max_text_len": model.max_text_len,
                "base_text_len": model.base_text_len, "before": ctx.before, "after": done.after,
                "after_at_base_length": done.at_base, "wall_time_s": ctx.result.wall_time_s}
        extra.append(comparison_section([(ctx.label, this), *compared]))
    if done.at_base:
        extra.append(
            f"## What reading past {model.base_text_len} tokens buys\n\nThe trained model evaluated "
            f"with every caption cut at {model.base_text_len} tokens (left) and read up to "
            f"{model.max_text_len} tokens (right):\n\n" + format_table(done.at_base, done.after))
    return extra


def _metrics(ctx: RunContext, done: AfterTraining) -> dict[str, Any]:
    """The run's ``metrics.json``."""
    model, result, source, stream = done.model, ctx.result, ctx.training_set.source, done.stream
    if stream is not None:
        skipped = {"train": stream["skipped"], "train_examples": stream["skipped_examples"]}
    else:
        skipped = {"train": source.skipped + len(result.skipped_examples),
                   "train_examples": [*source.skipped_examples, *result.skipped_examples],
                   "train_ids": [*source.skipped_ids, *(e["id"] for e in result.skipped_examples)]}
    return {
        "recipe": ctx.recipe_dict,
        "model_family": model.backend,  # the README's names: the family that loaded it (hf, open_clip, ...)
        "architecture": model.family,   # and what it is (clip, siglip, siglip2)
        "max_text_len": model.max_text_len,
        "base_text_len": model.base_text_len,
        "objective": _objective_name(ctx),
        "train_set": ctx.training_set.rows.spec.name if stream is not None else source.name,
        "train_examples": stream["used"] if stream is not None else len(source.dataset),
        "skipped": skipped,
        "train_stream": stream,
        "before": ctx.before,
        "after": done.after,
        "after_at_base_length": done.at_base,
        "terms": {t.name: t.summary() for t in ctx.objective.all_terms if t.summary()},
        "final_losses": result.final_losses,
        "steps": result.steps,
        "skipped_steps": result.skipped_steps,
        "truncated_captions": done.truncated,
        "wall_time_s": result.wall_time_s,
        "total_time_s": time.perf_counter() - ctx.started,
        "samples_per_s": result.samples_per_s,
        "throughput": result.throughput,  # steady samples/s, data-wait share, FLOPs, TFLOP/s, MFU
        "num_processes": ctx.accelerator.num_processes,
        "engine": engine_record(ctx.accelerator),  # what trained: DDP, FSDP (version, state dict), ZeRO stage
        "trainable_parameters": ctx.parameters[0],
        "total_parameters": ctx.parameters[1],
        "history": result.history,
        # the progress bar's epoch (epochs of the whole set)
        "epoch": round(ctx.loop.batches.epoch_at(result.steps), 4),
        "epochs": result.epochs,  # per epoch: samples read, their ids' digest, skipped ids (finetune.training.epochs)
        "init_from": ctx.prerequisites.init.record() if ctx.prerequisites.init is not None else None,
        "compare_with": [p.record() for p in ctx.prerequisites.compare],
    }


def final_checkpoint(loop: Any) -> Path:
    """A checkpoint of the finished training (the newest one when it is of the last step already), so that a run
    stopped during its evaluation or final save resumes at its end (``loop``: the run's
    :class:`~finetune.training.loop.LoopParts`)."""
    kept = list_checkpoints(loop.checkpoints.ckpt_dir)
    if kept and kept[-1].name == f"step-{loop.state.step}":
        return kept[-1]
    return loop.checkpoint()


def final_save_failed(error: BaseException, loop: Any, out_dir: Path, model: Any) -> SaveFailedError:
    """The :class:`~finetune.training.SaveFailedError` of a run whose outputs (``final/``, ``metrics.json``, the
    report) could not be written after training: why (a full disk: how much was needed and is free, where), and
    which checkpoint keeps the training."""
    trained = [p for p in model.parameters() if p.requires_grad]
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    need = full if len(trained) == len(list(model.parameters())) else sum(p.numel() * p.element_size() for p in trained)
    why, disk_full = describe_save_failure(error, out_dir, need)
    kept = list_checkpoints(loop.checkpoints.ckpt_dir)
    step, total = loop.state.step, loop.batches.total_steps
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
