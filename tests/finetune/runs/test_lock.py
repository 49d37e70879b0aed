"""One run writes into a folder at a time (:mod:`finetune.runs.lock`): a lock that names its holder, dies with it, and
refuses a second run on every process of its launch; a folder that cannot be made or written is a clear error
before anything runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from finetune.runs.errors import RunFolderBusy, RunFolderError
from finetune.runs.folder import clean_stale_temporaries
from finetune.runs.lock import OWNER_NAME, RunLock
from tests.finetune.mounts import require_read_only_possible, tmpfs
from tests.finetune.runs.tiny_runs import REPO, env, run, start, tiny_recipe, tiny_recipe_file

pytestmark = pytest.mark.usefixtures("own_log_handlers")


HOLDER = """
import sys, time
from pathlib import Path
from finetune.files import process_tag
from finetune.runs.lock import RunLock
folder = Path(sys.argv[1])
lock = RunLock(folder, command="a test holder").acquire()  # held while referenced
(folder / f".metrics.json.{process_tag()}.k1ll3d.tmp").write_text("{")  # a write in progress
print("held", flush=True)
time.sleep(600)
"""


def _hold(folder: Path) -> subprocess.Popen:
    """Another process that holds ``folder``'s lock (and has a temporary file open there)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True,
                              env=env(), cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_folder_held_by_another_process_is_refused_naming_its_pid_and_freed_when_it_dies(tmp_path):
    folder = tmp_path / "run"
    holder = _hold(folder)
    try:
        with pytest.raises(RunFolderBusy, match=rf"'{folder}' is in use by another run: PID {holder.pid} on "
                                                rf"\S+, a test holder, since .*choose another output.dir") as info:
            RunLock(folder).acquire()
        assert info.value.pid == holder.pid
        in_progress = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
        assert len(in_progress) == 1
        assert clean_stale_temporaries(folder) == []  # the live writer's file stays
        assert (folder / in_progress[0]).exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(folder) as lock:  # the kernel dropped the dead holder's lock; its record is replaced
        assert lock.held
        assert json.loads((folder / OWNER_NAME).read_text())["pid"] == os.getpid()
        assert clean_stale_temporaries(folder) == in_progress  # now a dead process's leftover
    assert not (folder / OWNER_NAME).exists()


def test_a_lock_on_a_new_folder_leaves_nothing_when_released(tmp_path):
    folder = tmp_path / "a" / "b" / "run"
    lock = RunLock(folder).acquire()
    assert sorted(p.name for p in folder.iterdir()) == sorted([".xlipkit.lock", OWNER_NAME])
    lock.release()
    assert not (tmp_path / "a").exists()
    lock.release()  # twice is fine
    (tmp_path / "kept").mkdir()
    with RunLock(tmp_path / "kept"):
        pass
    assert (tmp_path / "kept").is_dir()  # a folder that was there stays (its lock file too)


def test_a_read_only_or_unmakeable_folder_is_a_clear_error(tmp_path):
    with tmpfs(tmp_path / "ro", "1m") as mount:
        require_read_only_possible(mount)
        mount.read_only()
        with pytest.raises(RunFolderError, match=r"'.*ro/run' cannot be created \((it is on a read-only file "
                                                 r"system|permission denied)\)"):
            RunLock(mount.path / "run", what=f"output.dir {str(mount.path / 'run')!r}").acquire()
        with pytest.raises(RunFolderError, match=r"is not writable \((it is on a read-only file system|permission "
                                                 r"denied)\)"):
            RunLock(mount.path).acquire()
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderError, match="is a file"):
        RunLock(tmp_path / "file").acquire()


def test_a_read_only_output_dir_exits_2_before_anything_runs(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "1m") as mount:
        require_read_only_possible(mount)
        mount.read_only()
        out = mount.path / "run"
        assert run(tiny_recipe(tmp_path, Path("tiny-clip"), out)) == 2
        err = capsys.readouterr().err
        assert f"recipe error: output.dir '{out}' cannot be created" in err and "Traceback" not in err
        assert not out.exists()


@pytest.mark.slow
def test_two_real_runs_into_one_folder_one_is_refused_naming_the_other(tmp_path, tiny_model):
    out = tmp_path / "run"
    first = tiny_recipe_file(tmp_path, tiny_model, out, "a")  # trains until killed
    runs = [start(first), start(first)]  # the same recipe, started together
    try:
        deadline = time.monotonic() + 300
        while all(r.poll() is None for r in runs):
            assert time.monotonic() < deadline, "neither run stopped"
            time.sleep(0.2)
        loser = next(r for r in runs if r.poll() is not None)
        winner = next(r for r in runs if r is not loser)
        err = loser.communicate()[1]
        assert loser.returncode == 2, err[-3000:]
        assert f"is in use by another run: PID {winner.pid} on " in err and "Traceback" not in err
        assert winner.poll() is None  # untouched by the refused one

        # a second recipe started while the first trains (it has written a checkpoint): refused, writes nothing
        def _checkpointed() -> bool:  # keep_checkpoints=1 replaces step-5 by step-10 quickly: any finished one
            return any(p.is_dir() and p.name.startswith("step-") and "." not in p.name
                       for p in (out / "checkpoints").glob("step-*"))

        while not _checkpointed():
            assert winner.poll() is None, winner.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.2)
        second = tiny_recipe_file(tmp_path, tiny_model, out, "b", lr=2e-3)
        late = start(second)
        err = late.communicate(timeout=300)[1]
        assert late.returncode == 2 and f"in use by another run: PID {winner.pid} on " in err, err[-3000:]
        assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["lr"] == 1e-3
    finally:
        for r in runs:
            if r.poll() is None:
                r.send_signal(signal.SIGKILL)
            r.communicate()
    with RunLock(out):  # killed with -9: its lock died with it
        pass


@pytest.mark.slow
def test_a_two_process_launch_into_a_held_folder_is_refused_without_a_hang(tmp_path, tiny_model):
    out = tmp_path / "run"
    holder = _hold(out)
    try:
        recipe = tiny_recipe_file(tmp_path, tiny_model, out, "a", max_steps=2)
        launch = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                 str(REPO / "finetune" / "run.py"), str(recipe)], cwd=REPO,
                                env={**env(), "ACCELERATE_USE_CPU": "true"},
                                capture_output=True, text=True, timeout=600)
        assert launch.returncode != 0
        # the main process is refused by the preflight, which only the main process of a launch asks about the
        # lock (what lets test_multi_process's launches run at all); the launcher then stops the other rank,
        # wherever its start-up is: no hang, one refusal, nothing written
        assert launch.stderr.count(f"is in use by another run: PID {holder.pid} on ") == 1, launch.stderr[-6000:]
        assert not (out / "recipe.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
