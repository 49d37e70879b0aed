"""A streamed run on two CPU processes with two data-loader workers each (``ACCELERATE_USE_CPU=true torchrun
--nproc_per_node 2``), killed with SIGKILL after a checkpoint and resumed with ``train.resume: latest`` as a
two-node launch (two torchrun launchers, ``--nnodes 2 --node_rank R --master_addr --master_port``, one process
each, sharing the run folder as nodes share a filesystem), trains on every example exactly once per epoch: the
steps up to the checkpoint plus the resumed steps cover the webdataset shards once, and the resumed run repeats
the killed run's lost step with the same examples."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.finetune.data.test_streams import _scenes, write_webdataset

REPO = Path(__file__).resolve().parents[3]

# finetune/run.py's main, with each optimiser step's example ids appended (and flushed) to ids_<tag>_<rank>.jsonl;
# with HANG_AT_STEP=N the process stops before step N and waits to be killed, as a preempted job would be
_SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path

    from finetune.cli.train import main
    from finetune.training import TrainStep

    out, tag = Path(os.environ["IDS_DIR"]), os.environ["IDS_TAG"]
    hang = int(os.environ.get("HANG_AT_STEP", "0"))
    # torchrun starts each trainer in a session of its own: the test kills these groups (trainer + workers)
    (out / f"pid_{tag}_{os.environ['RANK']}").write_text(str(os.getpid()))
    original = TrainStep.forward_backward

    def recording(self, batch):
        step, rank = self.state.step + 1, self.accelerator.process_index
        if step == hang:
            (out / f"hung_{rank}").write_text(str(os.getpid()))
            time.sleep(3600)
        record = {"step": step, "ids": list(batch["ids"]), "world_size": self.accelerator.num_processes,
                  "env_world_size": int(os.environ["WORLD_SIZE"]), "node": int(os.environ["GROUP_RANK"])}
        with open(out / f"ids_{tag}_{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\\n")
            f.flush()
            os.fsync(f.fileno())
        return original(self, batch)

    TrainStep.forward_backward = recording
    from finetune.process_exit import exit_process

    exit_process(main(sys.argv[1:]))  # as finetune/run.py ends
''')


def _launch(tmp_path: Path, tag: str, args: list[str], nodes: list[str] | None = None, **env: str) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node 2``, or with ``nodes`` (torchrun's node options) one node's
    launcher of a multi-node job."""
    environ = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "IDS_DIR": str(tmp_path), "IDS_TAG": tag, **env}
    where = nodes or ["--standalone", "--nproc_per_node", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, str(tmp_path / "run_recording.py"), *args]
    node = nodes[nodes.index("--node_rank") + 1] if nodes and "--node_rank" in nodes else ""
    log = open(tmp_path / f"{tag}{node}.log", "w")
    # a session of its own: the kill reaches the launcher, both trainers and their data-loader workers
    return subprocess.Popen(cmd, cwd=tmp_path, env=environ, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill(tmp_path: Path, tag: str, launchers: list[subprocess.Popen]) -> None:
    """SIGKILL to every launcher's process group and to every trainer's (torchrun gives each trainer a session
    of its own; its data-loader workers are in its group): the whole job at once, as a preemption."""
    for file in tmp_path.glob(f"pid_{tag}_*"):
        try:
            os.killpg(int(file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for launcher in launchers:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait(timeout=60)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _steps(tmp_path: Path, tag: str, rank: int) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"ids_{tag}_{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_two_workers_killed_and_resumed_see_each_example_once_per_epoch(tmp_path):
    from finetune.models.registry import save_tiny

    tiny = save_tiny("tiny-clip", tmp_path / "tiny")
    scenes = _scenes(32)
    write_webdataset(tmp_path / "shards", scenes, 4)  # 8 shards: 4 per process, 2 per worker
    (tmp_path / "run_recording.py").write_text(_SCRIPT)
    urls = str(tmp_path / "shards" / "shard-{00000..00007}.tar")
    args = [str(REPO / "recipes" / "quickstart_clip.yaml"), f"model.name_or_path={tiny}", "model.dtype=null",
            "model.max_text_len=null", f"data.train={{name: webdataset, urls: '{urls}', seed: 7}}",
            "data.num_workers=2", "eval.sets=[]", "eval.compare_base_length=false", "train.batch_size=4",
            "train.max_steps=12", "train.checkpoint_every=3", "train.keep_checkpoints=5", "train.trackers=[]",
            "train.mixed_precision=no", f"output.dir={tmp_path / 'run'}"]
    steps_per_epoch = 32 // 4

    killed = _launch(tmp_path, "killed", args, HANG_AT_STEP="8")
    try:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"hung_{r}").exists() for r in range(2)):
            assert killed.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-4000:]
            time.sleep(0.5)
    finally:
        _kill(tmp_path, "killed", [killed])
    trainers = [int((tmp_path / f"pid_killed_{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in trainers):  # really gone before the resume starts
        assert time.monotonic() < deadline, f"trainers {trainers} survived SIGKILL"
        time.sleep(0.2)
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step-3", "step-6"] and not (tmp_path / "run" / "metrics.json").exists()
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-6" / "stream_state_1.json").read_text())
    assert (state["rank"], state["world_size"], state["num_workers"], state["readers"]) == (1, 2, 2, 4)

    with socket.socket() as sock:  # a free port for the "main process" of the two-node launch
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    launchers = [_launch(tmp_path, "resumed", [*args, "train.resume=latest"],
                         nodes=["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                                "--master_addr", "127.0.0.1", "--master_port", port])
                 for node in range(2)]
    try:
        for node, launcher in enumerate(launchers):
            assert launcher.wait(timeout=300) == 0, (tmp_path / f"resumed{node}.log").read_text()[-4000:]
    finally:
        _kill(tmp_path, "resumed", launchers)  # nothing left when it failed

    before = [_steps(tmp_path, "killed", r) for r in range(2)]
    after = [_steps(tmp_path, "resumed", r) for r in range(2)]
    for r in range(2):
        assert {(s["world_size"], s["env_world_size"]) for s in before[r] + after[r]} == {(2, 2)}
        assert {s["node"] for s in before[r]} == {0} and {s["node"] for s in after[r]} == {r}  # one node, then two
        assert [s["step"] for s in before[r]] == list(range(1, 8))  # step 7 trained, then killed before step 8
        assert [s["step"] for s in after[r]] == list(range(7, 13))  # resumed from step-6
        assert after[r][0]["ids"] == before[r][6]["ids"]  # the lost step 7 again, with the same examples
        assert all(len(s["ids"]) == 2 for s in before[r] + after[r])
    trained = {r: [s["ids"] for s in before[r][:6] + after[r]] for r in range(2)}  # up to step-6, then resumed
    epoch_0 = [i for r in range(2) for ids in trained[r][:steps_per_epoch] for i in ids]
    assert sorted(epoch_0) == sorted(s["id"] for s in scenes)  # every example exactly once in the epoch
    epoch_1 = [i for r in range(2) for ids in trained[r][steps_per_epoch:] for i in ids]
    assert len(epoch_1) == len(set(epoch_1)) == 16  # half of the next epoch, no example twice
    for part in (slice(0, steps_per_epoch), slice(steps_per_epoch, None)):  # each process its own samples
        ranks = [{i for ids in trained[r][part] for i in ids} for r in range(2)]
        assert not ranks[0] & ranks[1]

    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["num_processes"] == 2 and metrics["steps"] == 12
    stream = metrics["train_stream"]
    assert (stream["num_processes"], stream["num_workers"], stream["used"], stream["read"], stream["epoch"]) == (
        2, 2, 48, 48, 1)


def _uneven_args(tmp_path: Path, sizes: list[int], *extra: str) -> tuple[list[str], list[dict]]:
    """A tiny model, webdataset shards of ``sizes`` samples, and the recording script's recipe arguments."""
    from finetune.models.registry import save_tiny
    from tests.finetune.data.test_streams import _write_sized

    tiny = save_tiny("tiny-clip", tmp_path / "tiny")
    scenes = _scenes(sum(sizes))
    _write_sized(tmp_path / "shards", scenes, sizes)
    (tmp_path / "run_recording.py").write_text(_SCRIPT)
    urls = str(tmp_path / "shards" / f"shard-{{00000..{len(sizes) - 1:05d}}}.tar")
    args = [str(REPO / "recipes" / "quickstart_clip.yaml"), f"model.name_or_path={tiny}", "model.dtype=null",
            "model.max_text_len=null", f"data.train={{name: webdataset, urls: '{urls}', seed: 11}}",
            "eval.sets=[]", "eval.compare_base_length=false", "train.batch_size=6", "train.trackers=[]",
            "train.mixed_precision=no", f"output.dir={tmp_path / 'run'}", *extra]
    return args, scenes


def _wait(tmp_path: Path, tag: str, launcher: subprocess.Popen) -> None:
    try:
        assert launcher.wait(timeout=600) == 0, (tmp_path / f"{tag}.log").read_text()[-4000:]
    finally:
        _kill(tmp_path, tag, [launcher])


@pytest.mark.slow
def test_a_requeue_on_three_processes_continues_the_epoch_and_reads_uneven_shards_once_per_epoch(tmp_path):
    """36 samples in 8 shards of 1 to 9. Killed on 2 processes x 2 workers after its step-2 checkpoint (12 of 36
    samples; step 3 trained and lost), resumed on 3 gloo processes x 2 workers (6 readers) with a global batch of 6:
    the 24 samples left of epoch 0 are split over the 6 new readers (steps 3-6), nothing skipped or read twice, then
    epochs 1 and 2 (steps 7-12, 13-18) read every sample once, 6 per reader (a reader given one sample too many or
    too few in epoch 1 leaves it to epoch 2), and metrics.json's epoch is the global one. (Split by
    shards, 8 shards of these sizes cannot give 6 readers the same number of samples.) With 4 samples left per
    reader each worker's batches of 2 end with the epoch; with 3 a batch would span two epochs, as it may."""
    sizes = [1, 7, 3, 9, 2, 5, 4, 5]
    args, scenes = _uneven_args(tmp_path, sizes, "train.max_steps=18", "train.checkpoint_every=2",
                                "train.keep_checkpoints=5")
    killed = _launch(tmp_path, "killed", [*args, "data.num_workers=2"], HANG_AT_STEP="4")
    try:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"hung_{r}").exists() for r in range(2)):
            assert killed.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-4000:]
            time.sleep(0.5)
    finally:
        _kill(tmp_path, "killed", [killed])
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-2"]
    for r in range(2):
        (tmp_path / f"hung_{r}").unlink()
    resumed = _launch(tmp_path, "resumed", [*args, "data.num_workers=2", "train.resume=latest"],
                      nodes=["--standalone", "--nproc_per_node", "3", "--nnodes", "1"])
    _wait(tmp_path, "resumed", resumed)
    before = [[s for s in _steps(tmp_path, "killed", r) if s["step"] <= 2] for r in range(2)]
    after = [_steps(tmp_path, "resumed", r) for r in range(3)]
    assert {s["world_size"] for r in before for s in r} == {2} and {s["world_size"] for r in after for s in r} == {3}
    assert {(s["world_size"], s["env_world_size"]) for r in after for s in r} == {(3, 3)}  # three processes
    assert all([s["step"] for s in r] == list(range(3, 19)) and all(len(s["ids"]) == 2 for s in r) for r in after)
    epoch_0 = [i for r in before for s in r for i in s["ids"]] + [i for r in after for s in r[:4] for i in s["ids"]]
    assert sorted(epoch_0) == sorted(s["id"] for s in scenes)  # 12 before the kill, 24 after: each once
    for epoch in (1, 2):
        ids = [i for r in after for s in r[4 + 6 * (epoch - 1):4 + 6 * epoch] for i in s["ids"]]
        assert sorted(ids) == sorted(s["id"] for s in scenes), epoch
    log = (tmp_path / "resumed.log").read_text()
    assert "saved by 2 process(es) x 2 worker(s) and continues on 3 x 2: the 24 samples left of epoch 0" in log
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["num_processes"] == 3 and metrics["steps"] == 18 and metrics["train_stream"]["used"] == 108
    assert metrics["train_stream"]["epoch"] == 3
