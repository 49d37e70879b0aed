"""run.py's process set-up: CPU threads under `accelerate launch`."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from finetune.run import _cpu_threads

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.fixture
def one_thread(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)


def _accelerator(processes: int = 1, device: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), num_processes=processes)


@pytest.mark.skipif(CORES < 2, reason="needs 2 cores")
def test_accelerate_launch_without_cpu_flag_gets_every_core(one_thread, monkeypatch, caplog):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")  # what `accelerate launch` exports without --cpu
    with caplog.at_level("INFO", logger="xlipkit"):
        _cpu_threads(_accelerator())
    assert torch.get_num_threads() == CORES
    assert "OMP_NUM_THREADS=1" in caplog.text


@pytest.mark.parametrize("env, processes", [({"ACCELERATE_USE_CPU": "True"}, 1),  # --cpu: the user's threads
                                            ({"ACCELERATE_USE_CPU": "False"}, 2),  # several processes share cores
                                            ({}, 1)])  # not under accelerate launch
def test_chosen_threads_are_left_alone(one_thread, monkeypatch, env, processes):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _cpu_threads(_accelerator(processes))
    assert torch.get_num_threads() == 1


def test_the_parameter_count_includes_the_objectives_own_parameters():
    """"trainable parameters 8,008,706 of 8,008,705": StructXLIP's structure temperature trains with the model."""
    from finetune.config import load_recipe
    from finetune.models.registry import build_model
    from finetune.objectives import build_objective
    from finetune.run import parameter_counts

    model = build_model("tiny-clip")
    objective = build_objective(load_recipe("recipes/quickstart.yaml").objective)
    in_model = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in objective.parameters()) == 1  # tau' of L_{I',T'}
    assert parameter_counts(model, objective) == (in_model + 1, in_model + 1)
    for p in model.parameters():
        p.requires_grad_(False)
    assert parameter_counts(model, objective) == (1, in_model + 1)
