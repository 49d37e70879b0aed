"""A warm-up as long as the run or longer (issue 31 item 9): ``warmup_steps: 1000`` with ``max_steps: 4`` trained at
0.4 % of ``train.lr`` without a word. The run is allowed (a smoke run of a shipped recipe does it on purpose), and
the run says so (``finetune.training.size_checks.check_warmup``), naming the keys and the learning rate reached, once
the step count is known and before the model loads."""

from __future__ import annotations

import logging

import pytest
import yaml

from finetune.cli.train import main
from finetune.training.recipe import FinetuneRecipe


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def records(monkeypatch):
    """The ``xlipkit`` log of the run, and the stages from model loading on (``FinetuneRecipe.setup_model``,
    ``setup_eval``, ``setup_training``, ``train``, ``finish``) replaced by a marker in that log."""
    handler = _Records()
    logger = logging.getLogger("xlipkit")
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "propagate", False)

    def model_loads(self) -> None:
        handler.messages.append("MODEL LOADS")

    monkeypatch.setattr(FinetuneRecipe, "setup_model", model_loads)
    for stage in ("setup_eval", "setup_training", "train"):
        monkeypatch.setattr(FinetuneRecipe, stage, lambda self: None)
    monkeypatch.setattr(FinetuneRecipe, "finish", lambda self: 0)
    return handler.messages


def _recipe(tmp_path, **train) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": "random:tiny-clip"},
        "data": {"train": {"name": "synthetic", "size": 16, "seed": 0, "options": {"image_size": 32}}},
        "train": {"lr": 1e-3, "batch_size": 8, "trackers": [], **train},
        "eval": {"sets": []},
        "output": {"dir": str(tmp_path / "run")},
    }))
    return str(path)


def _warnings(messages: list[str]) -> list[str]:
    return [m for m in messages if m.startswith("WARNING") and "warmup_steps" in m]


def test_warmup_past_max_steps_is_a_warning_before_the_model_loads(tmp_path, records):
    assert main([_recipe(tmp_path, max_steps=4, epochs=None, warmup_steps=1000)]) == 0
    [warning] = _warnings(records)
    assert "train.warmup_steps=1000 is not below the run's 4 optimiser steps (train.max_steps=4)" in warning
    # the last of the 4 steps trains at lr * 4 / 1000
    assert "reaches 4e-06 at the last step, not train.lr=0.001, and the cosine decay never starts" in warning
    assert "Lower train.warmup_steps below 4" in warning
    assert records.index(warning) < records.index("MODEL LOADS")


def test_warmup_past_the_epochs_steps_names_the_epochs(tmp_path, records):
    # 16 scenes in batches of 8: 2 steps per epoch, 2 epochs, 4 steps
    assert main([_recipe(tmp_path, epochs=2, warmup_steps=4, schedule="constant")]) == 0
    [warning] = _warnings(records)
    assert "train.warmup_steps=4 is not below the run's 4 optimiser steps (train.epochs=2 x 2 steps per epoch" in warning
    assert "reaches 0.001 at the last step" in warning and "cosine" not in warning
    assert records.index(warning) < records.index("MODEL LOADS")


def test_a_warmup_that_ends_before_the_run_says_nothing(tmp_path, records):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert main([_recipe(tmp_path / "a", epochs=2, warmup_steps=3)]) == 0
    assert main([_recipe(tmp_path / "b", max_steps=4, epochs=None, warmup_steps=3)]) == 0
    assert _warnings(records) == [] and records.count("MODEL LOADS") == 2
