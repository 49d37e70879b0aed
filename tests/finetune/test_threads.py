"""Where a CPU run's threads come from (finetune.threads.cpu_thread_plan): a count the user gives is kept, and a
one-process run that `accelerate launch` gave its default OMP_NUM_THREADS=1 uses every core, told apart by the
launcher's own environment and command line."""

from __future__ import annotations

import pytest

import finetune.threads as threads

CORES = threads.available_cores()
LAUNCHER = ["/venv/bin/python3", "/venv/bin/accelerate", "launch", "--config_file",
            "configs/accelerate/one_process.yaml", "-q", "finetune/run.py", "recipes/quickstart.yaml"]


@pytest.fixture
def launched(monkeypatch):
    """This process as accelerate's single-process launcher starts it: ACCELERATE_USE_CPU and OMP_NUM_THREADS
    exported; the launcher's argv and environment are what the test gives."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "WORLD_SIZE", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                 "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")

    def parent(argv, environ):
        monkeypatch.setattr(threads, "_parent", lambda kind: {"cmdline": argv, "environ": environ}[kind])
    return parent


def test_accelerate_launchs_default_one_thread_becomes_every_core(launched, monkeypatch):
    launched(LAUNCHER, ["PATH=/usr/bin", "HOME=/root"])
    target, source = threads.cpu_thread_plan(1, num_processes=1)
    assert target == CORES
    assert threads.thread_line(target, source) == (
        f"CPU threads: {CORES} (all cores; OMP_NUM_THREADS=1 was accelerate launch's default, no thread count given), "
        "OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE)")
    # --cpu: accelerate gives the physical cores (here 2 of them), still its default, not the user's
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    launched(["/usr/bin/python", "-m", "accelerate.commands.launch", "--cpu", "-m", "finetune.cli", "train", "r.yaml"],
             [])
    target, source = threads.cpu_thread_plan(2, num_processes=1)
    assert target == CORES and source.startswith("all cores; OMP_NUM_THREADS=2 was accelerate launch's default")


@pytest.mark.parametrize("argv, environ", [
    (LAUNCHER, ["OMP_NUM_THREADS=1"]),  # OMP_NUM_THREADS=1 accelerate launch ...
    (LAUNCHER, ["MKL_NUM_THREADS=1"]),
    (LAUNCHER[:3] + ["--num_cpu_threads_per_process", "1"] + LAUNCHER[3:], []),
    (LAUNCHER[:3] + ["--num_cpu_threads_per_process=1"] + LAUNCHER[3:], []),
    (LAUNCHER[:3] + ["--num_cpu_threads", "1"] + LAUNCHER[3:], []),  # argparse takes a unique prefix
    (["/usr/bin/python", "-m", "torch.distributed.run", "finetune/run.py", "r.yaml"], []),  # not accelerate
])
def test_a_thread_count_the_user_gave_is_kept(launched, argv, environ):
    launched(argv, environ)
    target, source = threads.cpu_thread_plan(1, num_processes=1)
    assert target is None
    assert threads.thread_line(1, source).startswith("CPU threads: 1 (OMP_NUM_THREADS=1),"), source


def test_several_processes_keep_accelerates_count(launched):
    launched(LAUNCHER, [])
    target, source = threads.cpu_thread_plan(1, num_processes=2)
    assert target is None
    assert source.startswith("OMP_NUM_THREADS=1: accelerate launch's default for 2 processes"), source


def test_without_proc_the_count_is_kept_and_the_log_says_it_cannot_tell(launched, monkeypatch):
    monkeypatch.setattr(threads, "_parent", lambda kind: None)
    target, source = threads.cpu_thread_plan(1, num_processes=1)
    assert target is None
    assert "yours or accelerate launch's default, which cannot be told apart here" in source


@pytest.mark.parametrize("env, threads_now, said", [
    ({}, CORES, f"CPU threads: {CORES} (all cores; OMP_NUM_THREADS unset)"),
    ({"OMP_NUM_THREADS": "1"}, 1, "CPU threads: 1 (OMP_NUM_THREADS=1)"),
    ({"MKL_NUM_THREADS": "3"}, 3, "CPU threads: 3 (MKL_NUM_THREADS=3)"),
    ({}, CORES + 1, f"CPU threads: {CORES + 1} (of {CORES} cores: torch.set_num_threads before the run"),
])
def test_without_a_launcher_the_count_stands_and_its_source_is_said(monkeypatch, env, threads_now, said):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    target, source = threads.cpu_thread_plan(threads_now, num_processes=1)
    assert target is None and threads.thread_line(threads_now, source).startswith(said), source
