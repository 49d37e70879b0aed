"""SIGINT and SIGTERM stop a real run cleanly: the step in progress is finished, a checkpoint saved, the command that
continues the run printed, and the process exits 130 / 143 (what SLURM, Kubernetes and a shell expect); a repeated
SIGTERM changes nothing and a person's second Ctrl-C exits at once; several processes stop after the same step, SIGTERM
to a launcher and all its processes included; a hub token given on the command line is never printed or written.
Real runs in subprocesses, real ``os.kill``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]
#: steps of the tiny runs: enough that a signal sent once the progress bar shows step 2 arrives before the end
STEPS = 40


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from finetune.models.registry import save_tiny

    return save_tiny("tiny-clip", tmp_path_factory.mktemp("models") / "tiny-clip")


def _recipe(tmp_path: Path, model: Path, out: Path, **train) -> Path:
    recipe = {
        "model": {"name_or_path": str(model), "dtype": None},
        "data": {"train": {"name": "synthetic", "size": 16, "seed": 0, "options": {"image_size": 32}},
                 "num_workers": 1},
        "eval": {"sets": []},
        "train": {"lr": 1e-3, "batch_size": 4, "max_steps": STEPS, "log_every": 1, "trackers": [], "warmup_steps": 0,
                  "checkpoint_every": 0, "seed": 0, **train},
        "output": {"dir": str(out)},
    }
    path = tmp_path / f"{out.name}.yaml"
    path.write_text("# a tiny run\n" + yaml.safe_dump(recipe))
    return path


class _Run:
    """A run in a subprocess whose stderr is read as it comes (the progress bar says which step it is at)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env or _env(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.err = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        fd = self.proc.stderr.fileno()
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                return
            self.err += chunk.decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.err)
            if found:
                return found
            assert self.proc.poll() is None, f"the run ended before {pattern!r}:\n{self.err[-4000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} in time:\n{self.err[-4000:]}"
            time.sleep(0.05)

    def step(self, at_least: int) -> None:
        """Wait until the progress bar shows ``at_least`` (a single digit) steps done."""
        self.wait_for(rf"\| (?:[{at_least}-9]|\d\d+)/{STEPS} \[")

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(10)
        return code


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def _run_py(recipe: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(REPO / "finetune" / "run.py"), str(recipe), *overrides]


def _stopped(run: _Run, name: str) -> tuple[int, Path, str]:
    """``(step, checkpoint, command)`` from what a stopped run printed."""
    found = re.search(rf"{name}: stopped after step (\d+); saved (\S+)\. Continue the run with:\n  (.+)\n", run.err)
    assert found, run.err[-4000:]
    return int(found.group(1)), Path(found.group(2)), found.group(3)


def _secret_in(folder: Path, secret: str) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.slow
def test_sigterm_saves_and_the_printed_resume_without_the_hub_token_reaches_the_uninterrupted_weights(tmp_path,
                                                                                                      tiny_model):
    """The run is given a hub token on the command line (flat and in a whole-section override, pushing nothing):
    under SLURM or Kubernetes stderr is a log file, so the resume command it prints leaves the token out, never
    prints or writes it, and still continues the run to the weights of the uninterrupted one."""
    straight = _Run(_run_py(_recipe(tmp_path, tiny_model, tmp_path / "straight")))
    assert straight.finish() == 0, straight.err[-4000:]

    secret = "mysecret-4f2a9c"
    recipe = _recipe(tmp_path, tiny_model, tmp_path / "run")
    run = _Run(_run_py(recipe, f"hub.token={secret}", f"hub={{token: {secret}-2, push: false}}"))
    run.step(2)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 143, run.err[-4000:]
    assert "SIGTERM received: finishing this step and saving a checkpoint" in run.err
    assert "Traceback" not in run.err
    step, checkpoint, command = _stopped(run, "SIGTERM")
    assert 2 <= step < STEPS and checkpoint == tmp_path / "run" / "checkpoints" / f"step-{step}"
    assert json.loads((checkpoint / "train_state.json").read_text())["step"] == step
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / "metrics.json").exists()
    # the exact command line, less the token
    assert command == shlex.join([*_run_py(recipe), "hub={push: false}", "train.resume=latest"])
    assert "(the hub token given on the command line is left out: set HF_TOKEN" in run.err
    assert secret not in run.err
    assert _secret_in(tmp_path / "run", secret) == []

    resumed = _Run(shlex.split(command))
    assert resumed.finish() == 0, resumed.err[-4000:]
    assert f"resumed from {checkpoint} at step {step}" in resumed.err and secret not in resumed.err
    assert _secret_in(tmp_path / "run", secret) == []
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "run")
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    metrics = [json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("straight", "run")]
    assert metrics[1]["final_losses"] == metrics[0]["final_losses"] and metrics[1]["steps"] == STEPS


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_exits_130_without_a_traceback(tmp_path, tiny_model):
    recipe = _recipe(tmp_path, tiny_model, tmp_path / "run", checkpoint_every=3, keep_checkpoints=1)
    run = _Run(_run_py(recipe, "train.lr=0.001"))
    run.step(1)
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.err[-4000:]
    assert "KeyboardInterrupt" not in run.err and "Traceback" not in run.err
    step, checkpoint, command = _stopped(run, "SIGINT")
    assert checkpoint.name == f"step-{step}" and (checkpoint / "random_states_0.pkl").is_file()
    from finetune.runs.checkpoints import checkpoint_problem

    assert checkpoint_problem(checkpoint) is None
    assert command.endswith("train.lr=0.001 train.resume=latest")


SLOW_SAVE = textwrap.dedent('''
    """finetune/run.py with a checkpoint save that takes a minute (the window a second signal arrives in)."""
    import sys
    import time

    import finetune.training.checkpoint as checkpoint

    save = checkpoint.save_checkpoint

    def slow(*args, **kwargs):
        print("saving", file=sys.stderr, flush=True)
        time.sleep(60)
        return save(*args, **kwargs)

    checkpoint.save_checkpoint = slow
    from finetune.cli.train import main

    from finetune.process_exit import exit_process

    exit_process(main(sys.argv[1:]))  # as finetune/run.py ends
''')


@pytest.mark.slow
def test_a_repeated_sigterm_changes_nothing_and_a_second_ctrl_c_exits_at_once(tmp_path, tiny_model):
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE)
    recipe = _recipe(tmp_path, tiny_model, tmp_path / "run")
    run = _Run([sys.executable, str(script), str(recipe)])
    run.step(1)
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for(r"(^|\n)saving\n")  # the first signal's checkpoint is being written
    run.proc.send_signal(signal.SIGTERM)  # a scheduler's, repeated (torchrun forwards the one it got)
    run.wait_for("SIGTERM again: already stopping after this step")
    time.sleep(1.5)
    assert run.proc.poll() is None  # still saving
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGINT)  # a person's Ctrl-C
    assert run.finish(timeout=50) == 130, run.err[-4000:]
    assert time.monotonic() - sent < 30  # not after the minute the save takes
    assert "SIGINT again: exiting at once (status 130), without saving" in run.err
    assert "Continue the run with" not in run.err and "Traceback" not in run.err
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not [p for p in checkpoints.iterdir() if not p.name.endswith(".tmp")]


@pytest.mark.slow
def test_a_signal_before_training_exits_without_a_traceback(tmp_path, tiny_model):
    script = tmp_path / "slow_load.py"
    script.write_text(textwrap.dedent('''
        import sys, time
        import finetune.training.recipe as recipe
        from finetune.cli.train import main

        load = recipe.load_start_model

        def slow(*args, **kwargs):
            print("loading", file=sys.stderr, flush=True)
            time.sleep(60)
            return load(*args, **kwargs)

        recipe.load_start_model = slow
        from finetune.process_exit import exit_process

        exit_process(main(sys.argv[1:]))  # as finetune/run.py ends
    '''))
    run = _Run([sys.executable, str(script), str(_recipe(tmp_path, tiny_model, tmp_path / "run"))])
    run.wait_for(r"(^|\n)loading\n")
    run.proc.send_signal(signal.SIGINT)
    assert run.finish(timeout=50) == 130, run.err[-4000:]
    assert "SIGINT: stopped before training started (no checkpoint was written" in run.err
    assert "Traceback" not in run.err


VOTE = textwrap.dedent('''
    """Two processes vote after every step; a real SIGTERM reaches process 1 only, during step 5."""
    import json, os, signal, sys

    import torch.distributed as dist

    from finetune.training import StopVote, stop_signals

    dist.init_process_group("gloo")
    assert dist.get_world_size() == 2, dist.get_world_size()
    rank = dist.get_rank()
    with stop_signals() as stop:
        stop.graceful = True
        vote = StopVote(stop, 2, dist.new_group(backend="gloo"))
        stopped = None
        for step in range(1, 30):
            if rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            if vote():
                stopped = step
                break
        vote.close()
    with open(os.path.join(sys.argv[1], f"vote_{rank}.json"), "w") as f:
        json.dump({"stopped": stopped, "signum": vote.signum, "received": stop.received}, f)
    dist.destroy_process_group()  # gloo's threads end before the interpreter does (else a rare abort at exit)
''')


@pytest.mark.slow
def test_every_process_stops_after_the_same_step(tmp_path):
    script = tmp_path / "vote.py"
    script.write_text(VOTE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    votes = [json.loads((tmp_path / f"vote_{r}.json").read_text()) for r in range(2)]
    # process 1 saw it during step 5; both learn it after step 6, from the vote posted after step 5
    assert [v["stopped"] for v in votes] == [6, 6]
    assert [v["signum"] for v in votes] == [signal.SIGTERM, signal.SIGTERM]
    assert [v["received"] for v in votes] == [None, signal.SIGTERM]


def _trainers(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the processes a launcher started."""
    ranks = {}
    for line in subprocess.run(["ps", "-o", "pid=", "--ppid", str(launcher)], capture_output=True,
                               text=True).stdout.split():
        environ = Path(f"/proc/{line}/environ").read_bytes().split(b"\0")
        rank = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[int(rank)] = int(line)
    return ranks


@pytest.mark.slow
def test_sigterm_to_the_launcher_and_every_process_saves_one_checkpoint(tmp_path, tiny_model):
    """What SLURM does at a job's time limit or a preemption: SIGTERM to every process of the job step at once, the
    launcher (torchrun) included, which forwards it to its processes milliseconds later - each gets it twice. One
    checkpoint is saved (a repeated SIGTERM used to exit at once without saving; status 143 then), and the launcher's
    command that continues the run is printed once."""
    recipe = _recipe(tmp_path, tiny_model, tmp_path / "run", batch_size=8)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "finetune" / "run.py"), str(recipe)]
    run = _Run(cmd, _env(ACCELERATE_USE_CPU="true"))
    run.step(2)
    ranks = _trainers(run.proc.pid)
    assert sorted(ranks) == [0, 1]  # the world of two
    for pid in (run.proc.pid, *ranks.values()):
        os.kill(pid, signal.SIGTERM)
    run.wait_for("(?s)(SIGTERM received.*){2}", timeout=60)  # both took it (deliveries before that merge into one)
    for pid in ranks.values():  # torchrun's forward (here after both took the first, whatever the timing)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    run.finish()  # torchrun itself ends with its own SignalException, after its processes
    assert "exiting at once" not in run.err, run.err[-4000:]
    step, checkpoint, command = _stopped(run, "SIGTERM")  # printed once, by rank 0
    assert run.err.count("stopped after step") == 1
    from finetune.runs.checkpoints import checkpoint_problem, list_checkpoints

    assert list_checkpoints(tmp_path / "run" / "checkpoints") == [checkpoint]  # one checkpoint
    assert checkpoint_problem(checkpoint, world_size=2) is None  # both RNG states, one step
    assert json.loads((checkpoint / "train_state.json").read_text())["step"] == step
    assert command.startswith(shlex.join([sys.executable, "-m", "torch.distributed.run"]))
    assert command.endswith("train.resume=latest")
