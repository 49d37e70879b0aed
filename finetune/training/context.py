"""One typed value for everything a run holds (:class:`RunContext`), filled stage by stage by
:class:`finetune.training.recipe.FinetuneRecipe`, instead of parameter lists and string-keyed dicts."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config import Recipe, recipe_to_dict
from finetune.evaluation import RetrievalOptions
from finetune.objectives import Objective
from finetune.training.upstream import Prerequisites
from finetune.training.loop import LoopParts, TrainResult

__all__ = ["RunContext", "RunData", "TrainingSet"]


@dataclass
class RunData:
    """The sets a run reads, loaded and checked before the model loads (:func:`finetune.training.inputs.load_data`).

    Attributes:
        train: ``data.train`` as loaded (a ``LoadedSource``), or None for a stream (opened by the loop).
        eval: one ``LoadedSource`` per ``eval.sets`` entry (empty when nothing is evaluated).
        resume: the checkpoint ``train.resume`` names, found and checked, or None.
        stream_index: a streamed ``data.train``'s shard index (the same on every process), or None.
    """

    train: Any
    eval: list[Any] = field(default_factory=list)
    resume: Path | None = None
    stream_index: Any = None


@dataclass
class TrainingSet:
    """What the loop trains on.

    Attributes:
        rows: the training examples after the objective's preprocessing (map-style), or the stream
            (:class:`finetune.data.streams.ExampleStream`).
        source: the loaded ``data.train`` they came from (None for a stream).
    """

    rows: Any
    source: Any = None

    @property
    def streaming(self) -> bool:
        """Whether the run trains on a stream."""
        return self.source is None


@dataclass
class RunContext:
    """Everything one run holds. The recipe class fills it stage by stage (``setup`` -> ``setup_data`` ->
    ``setup_model`` -> ``setup_eval`` -> ``setup_training`` -> ``train`` -> ``finish``); a field is None until its
    stage ran.

    Attributes:
        recipe: the loaded, validated recipe (None for a loop built from parts,
            :meth:`~finetune.training.recipe.FinetuneRecipe.from_loop`).
        objective: the run's one objective, built from ``recipe.objective`` before anything else.
        chain: resolved paths of the recipes that need this run (set when it runs as a prerequisite).
        action: what the run does with ``output.dir`` (:func:`finetune.runs.folder.check_run_folder`: ``new``,
            ``resume``, ``overwrite``, ...).
        prerequisites: the runs it builds on (``model.init_from``, ``eval.compare_with``).
        accelerator: the ``accelerate.Accelerator``.
        data: the sets, loaded and checked.
        model: the DualEncoder being trained (adapter applied, on the device).
        parameters: ``(trainable, total)`` of the model and the objective's own parameters.
        training_set: what the loop trains on.
        evaluation: how the sets are evaluated (:class:`~finetune.evaluation.RetrievalOptions` of the recipe).
        before: Recall@K before training (None when not evaluated).
        loop: the parts of the training loop (:class:`~finetune.training.loop.LoopParts`).
        result: what the loop returned.
        started: ``time.perf_counter()`` when the run began (``total_time_s`` in ``metrics.json``).
    """

    recipe: Recipe | None
    objective: Objective
    chain: tuple[str, ...] = ()
    action: str = "new"
    prerequisites: Prerequisites = field(default_factory=Prerequisites)
    accelerator: Any = None
    data: RunData | None = None
    model: Any = None
    parameters: tuple[int, int] = (0, 0)
    training_set: TrainingSet | None = None
    evaluation: RetrievalOptions | None = None
    before: dict[str, Any] | None = None
    loop: LoopParts | None = None
    result: TrainResult | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def out_dir(self) -> Path:
        """The run folder (``output.dir``)."""
        return Path(self.recipe.output.dir)

    @functools.cached_property
    def recipe_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain values (``recipe.yaml``, ``metrics.json``, checkpoints), computed once."""
        return recipe_to_dict(self.recipe)

    @property
    def label(self) -> str:
        """The run's name in reports: its recipe file, else its folder."""
        return str(self.recipe.source or self.out_dir)
