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
