"""What a training run fixes about its step before the first batch (issue 29 items 1-2), in one place the trainer
calls: the batch shapes (:mod:`finetune.objectives.shapes`), the attention backend (``train.attention``,
:mod:`finetune.models.backends.attention`) and ``train.compile`` (:mod:`finetune.models.compile`).

The trainer calls :func:`setup_step` once, wraps its collate function with :meth:`StepSetup.collate`, runs every
step inside :meth:`StepSetup.attention`, its first step through :meth:`StepSetup.observed` (which SDPA kernels ran,
at which shapes) and records :meth:`StepSetup.summary` in the run's log and ``metrics.json``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from finetune.models.backends.attention import SdpaCalls, attention_context, describe_attention
from finetune.models.compile import compile_blocks, compile_options, compiled_graphs

from .planning import PlannedCollate
from .shapes import BatchShapes, plan_shapes

__all__ = ["StepSetup", "setup_step"]

log = logging.getLogger("xlipkit")


@dataclass
class StepSetup:
    """The fixed parts of a run's training step (module docstring).

    Attributes:
        objective: the run's objective (its terms hold :attr:`shapes`).
        model: the model being trained.
        shapes: the batch shapes every batch is padded to.
        attention: ``train.attention``; ``device``: where the step runs.
        compile: the ``torch.compile`` keywords of ``train.compile`` (None: off) and ``blocks`` compiled.
        micro_batches: ``train.accumulation_steps``.
    """

    objective: Any
    model: Any
    shapes: BatchShapes
    attention: str
    device: torch.device
    compile: dict[str, Any] | None = None
    blocks: int = 0
    micro_batches: int = 1
    #: the fused SDPA kernels the observed (first) step ran, by backend, and at how many distinct shapes
    first_step_kernels: dict[str, int] = field(default_factory=dict)
    first_step_shapes: int = 0

    def collate(self, collate_fn: Callable[[list[dict]], dict[str, Any]]) -> PlannedCollate:
        """``collate_fn`` planned for the step (:class:`~finetune.objectives.planning.PlannedCollate`)."""
        return PlannedCollate(collate_fn, self.objective, self.model, micro_batches=self.micro_batches)

    def attention_context(self) -> Any:
        """The context every step runs in: SDPA restricted to ``train.attention``'s backends."""
        return attention_context(self.attention, self.device)

    def observed(self, step: Callable[[], Any]) -> Any:
        """Run ``step`` counting the fused SDPA kernels it launches (:class:`SdpaCalls`); returns what it returns."""
        with SdpaCalls() as calls:
            out = step()
        self.first_step_kernels = dict(calls.kernels)
        self.first_step_shapes = len(set(calls.shapes))
        return out

    def summary(self) -> dict[str, Any]:
        """What ``metrics.json`` records: the shapes, the attention setting and the kernels of the first step, the
        compile mode and how many graphs were compiled so far in this process."""
        attention = {**describe_attention(self.attention, self.device),
                     "first_step_kernels": self.first_step_kernels or "math (or none fused)",
                     "first_step_shapes": self.first_step_shapes}
        compiled = None
        if self.compile is not None:
            compiled = {**self.compile, "blocks": self.blocks, "graphs_compiled": compiled_graphs()}
        return {"shapes": self.shapes.summary(), "attention": attention, "compile": compiled}


def setup_step(module: Any, cfg: Any, dataset: Any, device: torch.device | str) -> StepSetup:
    """Fix the step of a run: the shapes from the model and the preprocessed training set (given to the objective's
    terms before the data-loader workers copy them), the attention backend, and the compiled blocks.

    Args:
        module: the ``TrainModule`` (``.model``, ``.objective``).
        cfg: the recipe's ``train`` section (``attention``, ``compile``, ``accumulation_steps``).
        dataset: the preprocessed training set, or a stream (nothing is scanned then).
        device: the training device.
    """
    model, objective = module.model, module.objective
    shapes = plan_shapes(objective, model, dataset)
    objective.set_shapes(shapes)
    caps = ", ".join(f"{k} {v}" for k, v in sorted(shapes.capacities.items()))
    log.info("fixed shapes: texts padded to %d tokens, short texts to %d%s", shapes.text_length,
             shapes.short_length, f"; rows per sample: {caps}" if caps else "")
    attention = str(getattr(cfg, "attention", "auto"))
    info = describe_attention(attention, device)
    log.info("train.attention: %s on %s (%s)", attention, info["device"],
             info["order"] if isinstance(info["order"], str) else "backends in order: " + ", ".join(info["order"]))
    options = compile_options(getattr(cfg, "compile", False))
    blocks = 0
    if options is not None:
        blocks = compile_blocks(model, **options)
        log.info("train.compile: %d transformer blocks compiled with torch.compile(%s)", blocks,
                 ", ".join(f"{k}={v}" for k, v in options.items()))
    return StepSetup(objective, model, shapes, attention, torch.device(device), options, blocks,
                     int(getattr(cfg, "accumulation_steps", 1)))
