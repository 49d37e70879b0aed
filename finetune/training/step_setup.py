"""What a training run fixes about its step before the first batch (issues 29 and 37): the attention backend
(``train.attention``, :mod:`finetune.models.backends.attention`), ``train.compile`` (:mod:`finetune.models.compile`)
and the warm-up of every planned text length; the shapes themselves are the objective's
(:func:`~finetune.objectives.shapes.plan_shapes`), planned here from the model and the training set.

:func:`setup_step` runs once as the loop is built (:func:`finetune.training.loop.build_loop`); the step
(:class:`finetune.training.step.TrainStep`) runs inside :meth:`StepSetup.attention_context`, before its first step
:meth:`StepSetup.warm_up` (on a GPU or with compiled blocks every planned text length once, so that no later step
meets a new shape), its first step under :meth:`StepSetup.observing` (which SDPA kernels ran, at which shapes); the
run records :meth:`StepSetup.summary` in its log and ``metrics.json``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from finetune.models.backends.attention import SdpaCalls, attention_context, describe_attention
from finetune.models.compile import compile_blocks, compile_options, compiled_graphs
from finetune.objectives.base import TEXT_PLAN
from finetune.objectives.shapes import BatchShapes, is_causal_tower, plan_shapes

__all__ = ["StepSetup", "setup_step"]

log = logging.getLogger("xlipkit")


@dataclass
class StepSetup:
    """The fixed parts of a run's training step (module docstring).

    Attributes:
        shapes: the planned batch shapes (text bucket lengths, row capacities), which the objective's terms hold.
        attention: ``train.attention``; ``device``: where the step runs.
        compile: the ``torch.compile`` keywords of ``train.compile`` (None: off) and ``blocks`` compiled.
    """

    shapes: BatchShapes
    attention: str
    device: torch.device
    compile: dict[str, Any] | None = None
    blocks: int = 0
    #: the fused SDPA kernels the observed (first) step ran, by backend, and at how many distinct shapes
    first_step_kernels: dict[str, int] = field(default_factory=dict)
    first_step_shapes: int = 0
    #: warm-up passes run before the first step (:meth:`warm_up`), and the recompile limit set for compiled blocks
    warmup_passes: int = 0
    recompile_limit: int | None = None
    #: run :meth:`warm_up` on any device (a CPU dry run of a GPU benchmark); False: where it pays (:attr:`warms_up`)
    warm_up_always: bool = False

    def attention_context(self) -> Any:
        """The context every step runs in: SDPA restricted to ``train.attention``'s backends."""
        return attention_context(self.attention, self.device)

    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        """Count the fused SDPA kernels the block launches (:class:`SdpaCalls`): the first step's."""
        with SdpaCalls() as calls:
            yield
        self.first_step_kernels = dict(calls.kernels)
        self.first_step_shapes = len(set(calls.shapes))

    @property
    def warms_up(self) -> bool:
        """Whether :meth:`warm_up` runs: on a GPU (a new shape builds attention graphs: cuDNN's, CUDA graphs) and
        wherever blocks are compiled (a new shape recompiles them); on a CPU without compiled blocks a new shape
        costs nothing, and the first steps meet the lengths as they come (unless :attr:`warm_up_always`)."""
        return self.warm_up_always or self.device.type == "cuda" or self.compile is not None

    def warm_up(self, run: Callable[[dict[str, Any]], Any], batch: dict[str, Any]) -> int:
        """Run ``run`` (the step's forward and backward, no update) on ``batch`` at every planned text length
        (:meth:`~finetune.objectives.shapes.BatchShapes.warmup_lengths`), so that every (kind, length) shape of the
        run has run before the first step: attention graphs (cuDNN) and compiled blocks are built here (in the step's
        attention context), never later. The batch's rows are cut or padded to each length (a warm-up plan: its
        values are not used). The RNG state is restored after, so that the run trains as it would without the
        warm-up. Nothing to run (0) where it does not pay
        (:attr:`warms_up`) and where every kind has one planned length and no block is compiled: the first step runs
        that shape. Returns the passes run.

        Args:
            run: one forward and backward on a batch on the device, its gradients discarded by the caller.
            batch: the first batch of the run (on the device), with its :class:`TextPlan`.
        """
        plan = batch.get(TEXT_PLAN)
        if plan is None or not plan.lengths or not self.warms_up:
            return 0
        todo = self.shapes.warmup_lengths(list(plan.lengths))
        if len(todo) == 1 and self.compile is None:  # one length per kind: the first step is that shape
            return 0
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self.attention_context():
            for lengths in todo:
                run({**batch, TEXT_PLAN: replace(plan, lengths=lengths, warmup=True)})
        self.warmup_passes += len(todo)
        if todo:
            done = "; ".join(", ".join(f"{k} {v}" for k, v in sorted(t.items())) for t in todo)
            log.info("warm-up: %d forward+backward pass(es) ran every planned text length (%s)", len(todo), done)
        return len(todo)

    def summary(self) -> dict[str, Any]:
        """What ``metrics.json`` records: the shapes, the attention setting and the kernels of the first step, the
        compile mode and how many graphs were compiled so far in this process."""
        attention = {**describe_attention(self.attention, self.device),
                     "first_step_kernels": self.first_step_kernels or "math (or none fused)",
                     "first_step_shapes": self.first_step_shapes}
        compiled = None
        if self.compile is not None:
            compiled = {**self.compile, "blocks": self.blocks, "graphs_compiled": compiled_graphs(),
                        "recompile_limit": self.recompile_limit}
        return {"shapes": {**self.shapes.summary(), "warmup_passes": self.warmup_passes}, "attention": attention,
                "compile": compiled}


def setup_step(model: Any, objective: Any, cfg: Any, dataset: Any, device: torch.device | str) -> StepSetup:
    """Fix the step of a run: the objective's shapes planned from the model and the preprocessed training set (given
    to its terms before the data-loader workers copy them), the attention backend, and the compiled blocks.

    Args:
        model: the model being trained; ``objective``: its objective.
        cfg: the recipe's ``train`` section (``attention``, ``compile``, ``text_buckets``, ``group_by_length``).
        dataset: the preprocessed training set, or a stream (nothing is scanned then).
        device: the training device.

    Raises:
        ValueError: a ``train.text_buckets`` list the model cannot take
            (:func:`~finetune.objectives.shapes.run_buckets`).
    """
    shapes = plan_shapes(objective, model, dataset, getattr(cfg, "text_buckets", None),
                         grouped=bool(getattr(cfg, "group_by_length", False)))
    objective.set_shapes(shapes)
    if getattr(cfg, "group_by_length", False) and not is_causal_tower(model):
        log.warning("train.group_by_length: the %s text tower reads its padding, so every caption pass keeps "
                    "max_text_len (%d): grouping by length changes which captions share a batch and saves nothing "
                    "here; set train.group_by_length: false", getattr(model, "family", "?"), shapes.text_length)
    caps = ", ".join(f"{k} {v}" for k, v in sorted(shapes.capacities.items()))
    log.info("batch shapes: text passes padded to the smallest planned length that holds their longest row (%s)%s",
             "; ".join(f"{k} {list(v)}" for k, v in sorted(shapes.planned.items())),
             f"; rows per sample: {caps}" if caps else "")
    attention = str(getattr(cfg, "attention", "auto"))
    info = describe_attention(attention, device)
    log.info("train.attention: %s on %s (%s)", attention, info["device"],
             info["order"] if isinstance(info["order"], str) else "backends in order: " + ", ".join(info["order"]))
    options = compile_options(getattr(cfg, "compile", False))
    blocks, limit = 0, None
    if options is not None:
        blocks = compile_blocks(model, **options)
        limit = allow_recompiles(shapes)
        log.info("train.compile: %d transformer blocks compiled with torch.compile(%s); up to %d graphs per block "
                 "(one per planned shape)", blocks, ", ".join(f"{k}={v}" for k, v in options.items()), limit)
    return StepSetup(shapes, attention, torch.device(device), options, blocks, recompile_limit=limit)


def allow_recompiles(shapes: BatchShapes) -> int:
    """Raise dynamo's per-frame recompile limit (``torch._dynamo.config.recompile_limit``, 8 by default) to what the
    planned shapes need: a block's code serves the image pass and every planned text (kind, length), in training
    and again under evaluation's ``no_grad``, so that no planned shape falls back to eager. Returns the limit."""
    import torch._dynamo.config as dynamo

    need = 2 * (shapes.planned_pairs() + 4)
    limit = max(int(dynamo.recompile_limit), need)
    dynamo.recompile_limit = limit
    return limit
