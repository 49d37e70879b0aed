"""The processes of a launch (finetune.training.processes): the launcher's and srun's variables checked before any
wait, the engines a CPU launch cannot have refused, a process alone at the rendezvous ended within
``train.process_group_timeout_s``, a signal taken while the main thread waits in torch's C++ code, and a process that
stops answering in the middle of a two-process run ending the run within the timeout with one line that names it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from finetune.training.processes import LaunchError, engine_problem, launch_variables, start_processes

REPO = Path(__file__).resolve().parents[3]
#: the run of these tests: random:tiny-clip on 16 synthetic pairs, nothing evaluated
TINY = ["model.name_or_path=random:tiny-clip", "data.train.size=16", "train.batch_size=8", "train.trackers=[]",
        "train.log_every=1", "train.warmup_steps=1", "eval.sets=[]", "eval.compare_base_length=false"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.parametrize("variables, said", [
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 is outside the run's 2 process(es)"),
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not a number"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0: a run has at least one process"),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "2"}, "RANK=5 is outside the run's 2 process(es)"),
    ({"SLURM_PROCID": "abc", "SLURM_NTASKS": "2"}, "SLURM_PROCID='abc' is not a number"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc"}, "SLURM_NTASKS='abc' is not a number"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "0"}, "SLURM_NNODES=0: a job step runs on at least"),
])
def test_a_rank_no_one_would_join_is_refused_before_any_wait(variables, said):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **variables}
    if "SLURM_PROCID" in variables:
        env["SLURM_STEP_ID"] = "0"
    with pytest.raises(LaunchError) as caught:
        start_processes(None, env)  # refused before the recipe is read: no process group is made
    assert said in str(caught.value)
    assert launch_variables({"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2)


def test_engines_a_cpu_launch_cannot_have_are_refused_naming_the_remedy():
    deepspeed = {"ACCELERATE_USE_DEEPSPEED": "true"}
    assert "is not installed: pip install -e \".[deepspeed]\" in the clone" in engine_problem(
        deepspeed, accelerator=False, deepspeed=False)
    assert "accelerate drops DeepSpeed and trains plain DDP. Leave out --cpu" in engine_problem(
        {**deepspeed, "ACCELERATE_USE_CPU": "true"}, accelerator=False, deepspeed=True)
    assert engine_problem(deepspeed, accelerator=False, deepspeed=True) is None  # DeepSpeed over gloo on CPUs
    fsdp = {"ACCELERATE_USE_FSDP": "true"}
    assert "FSDP version 1 was asked for on CPU processes" in engine_problem(fsdp, accelerator=False, deepspeed=False)
    assert engine_problem({**fsdp, "FSDP_VERSION": "2"}, accelerator=False, deepspeed=False) is None
    assert engine_problem(fsdp, accelerator=True, deepspeed=False) is None  # accelerate's own, on GPUs
    assert engine_problem({}, accelerator=False, deepspeed=False) is None


@pytest.mark.slow
def test_a_process_alone_at_the_rendezvous_ends_within_the_timeout(tmp_path):
    """srun started task 1 of 2 and task 0 never came: the wait ends after train.process_group_timeout_s (torch's
    store waited 30 minutes whatever the setting), status 2, one line naming the setting."""
    env = _env(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_STEP_ID="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=_free_port())
    cmd = [sys.executable, str(REPO / "finetune" / "run.py"), str(REPO / "recipes" / "quickstart_clip.yaml"), *TINY,
           "train.process_group_timeout_s=2", f"output.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"launch error: process 1 of 2: the other processes did not join within 2 s "
                     r"\(train.process_group_timeout_s=2\)", proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


_WAIT = textwrap.dedent('''
    """A wait in torch's C++ code (a store client connecting to a port no one serves, 120 s), under the run's signal
    handlers, as the rendezvous is."""
    import datetime, sys
    import torch.distributed as dist
    from finetune.training.processes import interruptible
    from finetune.training.signals import stop_signals

    with stop_signals():
        with interruptible("waiting for the others"):
            print("waiting", file=sys.stderr, flush=True)
            dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=120))
''')


@pytest.mark.slow
def test_a_signal_ends_a_wait_in_torch_s_cpp_code_at_once(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(_WAIT)
    proc = subprocess.Popen([sys.executable, str(script), _free_port()], cwd=REPO, env=_env(), text=True,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stderr.readline() == "waiting\n"
        time.sleep(1)  # inside the C++ wait
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert proc.wait(timeout=60) == 143
        assert time.monotonic() - sent < 30  # not after the store's 120 s
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert "SIGTERM: stopped while waiting for the others, before training started" in err, err[-3000:]


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (neither gone nor a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
def test_a_process_that_stops_answering_ends_the_run_within_the_timeout_naming_it(tmp_path):
    """One of two CPU processes is stopped (SIGSTOP) while they train: the other ends the run after
    train.process_group_timeout_s with one line naming itself and the setting (gloo's default is 30 minutes), and
    exits; the launcher's run fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "finetune" / "run.py"), str(REPO / "recipes" / "quickstart_clip.yaml"), *TINY,
           "train.max_steps=400", "train.process_group_timeout_s=10", f"output.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(ACCELERATE_USE_CPU="true"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    err = b""
    stopped = None
    try:
        os.set_blocking(proc.stderr.fileno(), False)
        deadline = time.monotonic() + 300
        while not re.search(rb"\| [2-9]\d*/400 \[", err):  # the progress bar is past step 2
            assert proc.poll() is None and time.monotonic() < deadline, err.decode(errors="replace")[-3000:]
            err += proc.stderr.read() or b""
            time.sleep(0.1)
        ranks = {}
        for pid in subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK=")), None)
            if rank is not None:
                ranks[int(rank)] = int(pid)
        assert sorted(ranks) == [0, 1]  # the world of two
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        since = time.monotonic()
        while _running(ranks[0]):  # it gives up after the timeout and exits
            assert time.monotonic() - since < 10 + 120, "process 0 did not end within the timeout and a margin"
            err += proc.stderr.read() or b""
            time.sleep(0.2)
        # torchrun then sends the stopped one a SIGTERM, which waits while it is stopped, and its SIGKILL after a grace
        # of 30 s (torch 2.14's failure path ignores --shutdown-timeout); that SIGKILL here, at once
        os.kill(stopped, signal.SIGKILL)
        proc.wait(timeout=120)
        err += proc.stderr.read() or b""
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    text = err.decode(errors="replace")
    assert proc.returncode != 0
    assert ("error: process 0 of 2 waited 10 s (train.process_group_timeout_s=10) for the other processes at a "
            "collective and gave up") in text, text[-4000:]
    assert "raise train.process_group_timeout_s" in text


def test_an_absurd_timeout_is_a_recipe_error_naming_the_key():
    from finetune.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"train.process_group_timeout_s. must be <= 2.592e\+06"):
        load_recipe(REPO / "recipes" / "quickstart_clip.yaml", ["train.process_group_timeout_s=1e30"])
    assert load_recipe(REPO / "recipes" / "quickstart_clip.yaml",
                       ["train.process_group_timeout_s=2592000"]).train.process_group_timeout_s == 2_592_000
