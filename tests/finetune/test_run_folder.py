"""Run folders are never silently overwritten; a failed run leaves a finished one intact; what a
killed run leaves behind is cleaned; run files get the user's umask; ``--out`` never hits the model.
One run writes into a folder at a time (a lock that names its holder and dies with it); a folder that
cannot take the run (read-only, too small) or a dataset smaller than one batch stops it before anything
is written."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from accelerate.state import AcceleratorState, GradientState

from finetune.config import load_recipe
from finetune.files import process_tag
from finetune.run_folder import (
    OWNER_NAME,
    RunFolderBusy,
    RunFolderError,
    RunLock,
    check_eval_output,
    check_run_folder,
    clean_stale_temporaries,
    clear_previous_run,
    continuation_view,
    differing_keys,
    estimate_run_bytes,
)
from tests.finetune.mounts import require_mount, require_read_only_possible, tmpfs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _log_handler_of_this_test():
    """The run's log handler writes to the stderr of the test that made it: give each test its own."""
    import logging

    logger = logging.getLogger("xlipkit")
    saved = logger.handlers[:]
    logger.handlers.clear()
    yield
    logger.handlers[:] = saved


def _recipe_dict(**train) -> dict:
    return {"model": {"name_or_path": "tiny-clip"}, "adapter": {"type": "full"}, "objective": {"base": "clip"},
            "data": {"train": {"name": "synthetic", "size": 16}, "num_workers": 0},
            "train": {"lr": 1e-3, "max_steps": 4, "resume": None, "log_every": 1, **train},
            "eval": {"sets": []}, "output": {"dir": "x"}}


def _finished(folder: Path, recipe: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (folder / "metrics.json").write_text("{}")
    (folder / "final").mkdir()
    return folder


def _checkpoint(folder: Path, step: int) -> Path:
    """A complete checkpoint as finetune.resume.checkpoint_problem sees it: weights, process 0's RNG state (as
    accelerate saves it) and the manifest of both."""
    import torch
    from safetensors.torch import save_file

    from finetune.resume import STATE_NAME, file_manifest, rng_state_name

    path = folder / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    torch.save({"torch_manual_seed": torch.get_rng_state()}, path / rng_state_name(0))
    (path / STATE_NAME).write_text(json.dumps({"step": step, "files": file_manifest(path)}))
    return path


def test_new_and_empty_folders_are_fine(tmp_path):
    assert check_run_folder(tmp_path / "nothing", _recipe_dict()) == "new"
    (tmp_path / "empty").mkdir()
    assert check_run_folder(tmp_path / "empty", _recipe_dict()) == "new"


def test_a_finished_run_is_refused_even_with_the_same_recipe(tmp_path):
    folder = _finished(tmp_path / "run", _recipe_dict())
    with pytest.raises(RunFolderError, match=r"holds a finished run \(metrics.json, final\).*output.overwrite: true"):
        check_run_folder(folder, _recipe_dict())
    assert check_run_folder(folder, _recipe_dict(), overwrite=True) == "overwrite"


def test_the_refusal_suggests_a_resume_only_where_a_checkpoint_continues_the_run(tmp_path):
    folder = _finished(tmp_path / "run", _recipe_dict())
    with pytest.raises(RunFolderError) as refused:
        check_run_folder(folder, _recipe_dict())
    assert "train.resume" not in str(refused.value)  # without a checkpoint a resume would start again
    # following that hint anyway: refused, it would retrain from step 0 over the finished run
    with pytest.raises(RunFolderError, match=r"train.resume: latest: .*holds a finished run \(metrics.json, final\) "
                                             r"and no usable checkpoint.*from step 0.*output.overwrite: true"):
        check_run_folder(folder, _recipe_dict(), resume="latest")
    broken = folder / "checkpoints" / "step-2"
    broken.mkdir(parents=True)  # a checkpoint whose save was interrupted (no train_state.json) does not count
    with pytest.raises(RunFolderError, match="no usable checkpoint"):
        check_run_folder(folder, _recipe_dict(), resume="latest")
    _checkpoint(folder, 4)
    with pytest.raises(RunFolderError, match=r"or train.resume: latest to continue it from checkpoints/step-4\)"):
        check_run_folder(folder, _recipe_dict())
    assert check_run_folder(folder, _recipe_dict(), resume="latest") == "resume"
    # a checkpoint named explicitly is the user's choice (finetune.resume.find_checkpoint checks it)
    assert check_run_folder(folder, _recipe_dict(), resume=str(folder / "checkpoints" / "step-4")) == "resume"


def test_another_unfinished_run_is_refused_listing_what_differs(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "recipe.yaml").write_text(yaml.safe_dump(_recipe_dict(lr=1e-3)))
    with pytest.raises(RunFolderError, match=r"holds another run .*train\.lr: 0\.001 -> 0\.002"):
        check_run_folder(folder, _recipe_dict(lr=2e-3))
    # the same recipe starting again after a crash (no resume) is allowed
    assert check_run_folder(folder, _recipe_dict(lr=1e-3)) == "rerun"


def test_resume_into_another_runs_folder_lists_the_differing_keys(tmp_path):
    folder = _finished(tmp_path / "run", _recipe_dict(lr=1e-3, max_steps=4))
    _checkpoint(folder, 4)
    with pytest.raises(RunFolderError, match=r"differing keys: train\.lr: 0\.001 -> 0\.002; "
                                             r"train\.max_steps: 4 -> 8.*resume_ignore_changes"):
        check_run_folder(folder, _recipe_dict(lr=2e-3, max_steps=8), resume="latest")
    assert check_run_folder(folder, _recipe_dict(lr=2e-3), resume="latest", ignore_changes=True) == "resume"
    # bookkeeping keys are not part of what a continuation must match
    assert check_run_folder(folder, _recipe_dict(lr=1e-3, max_steps=4, log_every=50), resume="latest") == "resume"


def test_continuation_view_and_differing_keys():
    view = continuation_view(_recipe_dict(checkpoint_every=2, trackers=["tensorboard"]))
    assert set(view) == {"model", "adapter", "objective", "data", "train"}
    assert "checkpoint_every" not in view["train"] and view["train"]["lr"] == 1e-3
    assert view["data"] == {"train": {"name": "synthetic", "size": 16}}
    assert differing_keys({"a": {"b": 1}}, {"a": {"b": 1, "c": "x"}}) == ['a.c: (unset) -> "x"']


def test_clear_previous_run_and_stale_temporaries(tmp_path):
    folder = _finished(tmp_path / "run", _recipe_dict())
    for name in ("plots", "logs", "checkpoints/step-2", "checkpoints/step-4.tmp", ".final.tmp-abc12", ".final.old-1a2b"):
        (folder / name).mkdir(parents=True)
    (folder / ".metrics.json.x1y2.tmp").write_text("{")
    (folder / "notes.txt").write_text("mine")
    assert clean_stale_temporaries(folder) == [".final.old-1a2b", ".final.tmp-abc12", ".metrics.json.x1y2.tmp",
                                               "checkpoints/step-4.tmp"]
    assert (folder / "checkpoints" / "step-2").is_dir()
    assert sorted(clear_previous_run(folder)) == sorted(["final", "metrics.json", "plots", "checkpoints", "logs",
                                                         "recipe.yaml"])
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_eval_out_never_hits_the_model(tmp_path):
    model = tmp_path / "run" / "final"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "clip"}')
    with pytest.raises(RunFolderError, match=r"inside the model folder"):
        check_eval_output(model / "config.json", [model])
    with pytest.raises(RunFolderError, match=r"is a folder; give a file path"):
        check_eval_output(tmp_path, [model])
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    with pytest.raises(RunFolderError, match=r"exists and is not an earlier evaluation result"):
        check_eval_output(other, [model])
    earlier = tmp_path / "eval.json"
    earlier.write_text('{"sets": {}}')
    assert check_eval_output(earlier, [model]) == earlier
    assert check_eval_output(tmp_path / "new.json", [model]) == tmp_path / "new.json"


def test_evaluate_cli_refuses_out_onto_the_model_before_loading_it(tmp_path, capsys):
    from finetune.cli.evaluate import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main([str(model), "--sets", "synthetic", "--out", str(model / "config.json")]) == 2
    assert "inside the model folder" in capsys.readouterr().err
    assert (model / "config.json").read_text() == "{}"
    assert main([str(model), "--sets", "synthetic", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from finetune.models.registry import save_tiny

    return save_tiny("tiny-clip", tmp_path_factory.mktemp("models") / "tiny-clip")


def _recipe(tmp_path: Path, model: Path, out: Path, *extra: str):
    path = tmp_path / "recipe.yaml"
    path.write_text("# a tiny run\nmodel: {name_or_path: x}\n")
    return load_recipe(path, [
        f"model.name_or_path={model}", "model.dtype=null",
        'data.train={"name": "synthetic", "size": 8, "options": {"image_size": 32}}',
        'eval.sets=[{"name": "synthetic", "split": "test", "size": 4, "options": {"image_size": 32}}]',
        "eval.batch_size=4", "eval.before=false", "train.max_steps=2", "train.batch_size=4", "train.trackers=[]",
        "train.checkpoint_every=0", f"output.dir={out}", *extra])


def _run(recipe) -> int:
    from finetune.training import run_recipe

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return run_recipe(recipe)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_folder_of_the_users_own_report_is_never_trained_into(tmp_path, tiny_model, capsys):
    out = tmp_path / "notes"
    (out / "plots").mkdir(parents=True)
    (out / "logs").mkdir()
    (out / "report.md").write_text("# my own report\n")
    (out / "plots" / "figure.png").write_bytes(b"png")
    mine = _snapshot(out)
    for overwrite in (False, True):  # output.overwrite replaces a run's files, and there is no run here
        with pytest.raises(RunFolderError, match=r"holds report.md, plots/, logs/ but no run .*your own files"):
            check_run_folder(out, _recipe_dict(), overwrite=overwrite)
    for extra in ((), ("output.overwrite=true",)):
        assert _run(_recipe(tmp_path, tiny_model, out, *extra)) == 2
        assert "holds report.md, plots/, logs/ but no run" in capsys.readouterr().err
        assert {k: v for k, v in _snapshot(out).items() if k != ".xlipkit.lock"} == mine
    (out / "report.md").unlink()
    with pytest.raises(RunFolderError, match=r"holds plots/, logs/ but no run"):
        check_run_folder(out, _recipe_dict())


def test_a_recipe_kept_in_its_output_folder_is_never_replaced(tmp_path, tiny_model, capsys):
    out = tmp_path / "experiment"
    out.mkdir()
    kept = out / "recipe.yaml"
    kept.write_text(f"# my experiment: keep these notes\nmodel:\n  name_or_path: {tiny_model}  # the tiny one\n"
                    f"output: {{dir: {out}}}\n")
    mine = kept.read_bytes()
    overrides = ['data.train={"name": "synthetic", "size": 8, "options": {"image_size": 32}}', "eval.sets=[]",
                 "train.max_steps=2", "train.batch_size=4", "train.trackers=[]", "model.dtype=null"]
    for extra in ((), ("output.overwrite=true",)):
        assert _run(load_recipe(kept, [*overrides, *extra])) == 2
        err = capsys.readouterr().err
        assert f"the recipe being run, '{kept}', is the recipe.yaml of output.dir" in err, err
        assert f"mv {kept} experiment.yaml" in err and "another run" not in err
        # refused by the preflight, before the run takes the folder's lock: the folder is as it was
        assert kept.read_bytes() == mine and sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]
    # through a symbolic link to it: the same file
    link = tmp_path / "link.yaml"
    link.symlink_to(kept)
    with pytest.raises(RunFolderError, match="the recipe being run"):
        check_run_folder(out, _recipe_dict(), recipe_file=link)
    # the advice: the same recipe moved out of the folder runs into it
    moved = tmp_path / "experiment.yaml"
    kept.rename(moved)
    assert check_run_folder(out, _recipe_dict(), recipe_file=moved) == "new"

    # a run's own recipe.yaml (as the run wrote it) continues that run
    recipe = load_recipe(moved, overrides)
    from finetune.config import dump_recipe, recipe_to_dict

    dump_recipe(recipe, out / "recipe.yaml")
    _checkpoint(out, 2)
    again = load_recipe(out / "recipe.yaml", ["train.resume=latest"])
    assert check_run_folder(out, recipe_to_dict(again), resume="latest", recipe_file=out / "recipe.yaml") == "resume"
    # ... but not once a person has edited it
    edited = out / "recipe.yaml"
    edited.write_text(edited.read_text() + "# lr to try next: 1e-4\n")
    with pytest.raises(RunFolderError, match="the recipe being run"):
        check_run_folder(out, recipe_to_dict(again), resume="latest", recipe_file=edited)


@pytest.mark.slow
def test_second_run_and_failed_run_leave_a_finished_run_intact(tmp_path, tiny_model, capsys):
    out = tmp_path / "run"
    assert _run(_recipe(tmp_path, tiny_model, out)) == 0
    good = _snapshot(out)
    assert "recipe.yaml" in good and "metrics.json" in good and "final/xlipkit.json" in good

    # a second run into the finished folder: refused, nothing written
    assert _run(_recipe(tmp_path, tiny_model, out, "train.lr=0.5")) == 2
    assert "holds a finished run" in capsys.readouterr().err
    assert _snapshot(out) == good

    # a run that fails validation, even with output.overwrite: the good run's recipe.yaml stays
    bad = _recipe(tmp_path, tiny_model, out, "train.lr=0.5", "output.overwrite=true",
                  f'eval.sets=[{{"name": "jsonl", "path": "{tmp_path / "missing.jsonl"}"}}]')
    assert _run(bad) == 2
    err = capsys.readouterr().err
    assert "recipe error: eval.sets[0].path: jsonl files" in err and "missing.jsonl" in err and "Traceback" not in err
    assert _snapshot(out) == good

    # output.overwrite: the old run's files are replaced, not mixed
    (out / "checkpoints" / "step-99").mkdir(parents=True)
    again = _recipe(tmp_path, tiny_model, out, "train.lr=0.002", "output.overwrite=true")
    assert _run(again) == 0
    assert not (out / "checkpoints").exists()
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["lr"] == 0.002
    assert json.loads((out / "metrics.json").read_text())["recipe"]["train"]["lr"] == 0.002


@pytest.mark.slow
def test_following_the_refusals_hint_never_retrains_over_a_finished_run(tmp_path, tiny_model, capsys):
    out = tmp_path / "run"
    assert _run(_recipe(tmp_path, tiny_model, out)) == 0  # train.checkpoint_every=0: no checkpoint
    good = _snapshot(out)
    assert _run(_recipe(tmp_path, tiny_model, out)) == 2
    refusal = capsys.readouterr().err
    assert "holds a finished run" in refusal and "train.resume" not in refusal
    # train.resume: latest with nothing to resume from: refused before anything is written
    assert _run(_recipe(tmp_path, tiny_model, out, "train.resume=latest")) == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "from step 0" in err and "Traceback" not in err
    assert _snapshot(out) == good


@pytest.mark.slow
def test_a_kill_during_the_final_save_is_cleaned_and_files_get_the_umask(tmp_path, tiny_model):
    out = tmp_path / "run"
    out.mkdir()
    leftover = out / ".final.tmp-k1ll3d"  # what a kill during save_finetuned leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    old = os.umask(0o022)
    try:
        assert _run(_recipe(tmp_path, tiny_model, out)) == 0
    finally:
        os.umask(old)
    assert not leftover.exists()
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name or ".old-" in p.name]
    assert stat.S_IMODE((out / "final").stat().st_mode) == 0o755
    for name in ("metrics.json", "recipe.yaml", "report.md"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name


@pytest.mark.slow
def test_an_unknown_model_is_a_clean_exit_2_with_the_registry_list(tmp_path, capsys):
    out = tmp_path / "run"
    recipe = _recipe(tmp_path, Path("no-such-model-xyz"), out)
    assert _run(recipe) == 2
    err = capsys.readouterr().err
    assert "recipe error: model.name_or_path: could not load model 'no-such-model-xyz'" in err
    assert "Registry names (random weights): " in err and "tiny-clip" in err and "Traceback" not in err
    assert not out.exists()  # nothing half-started is left to block the corrected run


@pytest.mark.slow
def test_a_bad_training_data_path_is_found_before_the_model_loads(tmp_path, tiny_model, monkeypatch, capsys):
    import finetune.training.model as start

    monkeypatch.setattr(start, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    recipe = _recipe(tmp_path, tiny_model, out, f'data.train={{"name": "jsonl", "path": "{tmp_path / "nope.jsonl"}"}}')
    assert _run(recipe) == 2
    err = capsys.readouterr().err
    assert "recipe error: data.train.path: jsonl files" in err and "nope.jsonl does not exist" in err
    assert "Traceback" not in err
    assert not out.exists()


# ------------------------------------------------------------------------------- one run per folder

HOLDER = """
import sys, time
from pathlib import Path
from finetune.files import process_tag
from finetune.run_folder import RunLock
folder = Path(sys.argv[1])
lock = RunLock(folder, command="a test holder").acquire()  # held while referenced
(folder / f".metrics.json.{process_tag()}.k1ll3d.tmp").write_text("{")  # a write in progress
print("held", flush=True)
time.sleep(600)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _hold(folder: Path) -> subprocess.Popen:
    """Another process that holds ``folder``'s lock (and has a temporary file open there)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True,
                              env=_env(), cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


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


def test_cleanup_removes_only_what_dead_processes_left(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints" / "step-4.tmp").mkdir(parents=True)
    dead = _dead_pid()
    host = process_tag().split("@")[1]
    names = {
        "mine": f".recipe.yaml.{process_tag()}.x_uiorh8.tmp",  # this live process writes it right now
        "dead": f".recipe.yaml.{dead}@{host}.x_uiorh8.tmp",
        "elsewhere": f".final.tmp-{dead}@other-host.ab12cd34",  # another machine's: cannot be judged here
        "untagged": ".metrics.json.x1y2.tmp",  # an older version's: the lock holder may remove it
    }
    for name in names.values():
        (folder / name).write_text("x")
    removed = clean_stale_temporaries(folder)
    assert removed == sorted([names["dead"], names["untagged"], "checkpoints/step-4.tmp"])
    assert (folder / names["mine"]).exists() and (folder / names["elsewhere"]).exists()


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


def test_estimate_run_bytes():
    full = estimate_run_bytes(model_bytes=1000, trainable_bytes=1000, trainable_numel=250, full=True,
                              checkpoints_written=5, keep=2)
    assert full["final"] == 1000 and full["checkpoint"] == 1000 + 8 * 250 and full["checkpoints"] == 3
    assert full["total"] == 3 * 3000 + 3 * 3000 // 20 + 16 * 2**20  # 3 checkpoints while the 3rd is written
    lora = estimate_run_bytes(model_bytes=1000, trainable_bytes=40, trainable_numel=10, full=False,
                              checkpoints_written=0, keep=2)
    assert lora["final"] == 40 and lora["checkpoints"] == 0 and lora["total"] == 40 + 2 + 16 * 2**20


def _tiny_recipe_file(tmp_path: Path, model: Path, out: Path, name: str, **train) -> Path:
    recipe = {
        "model": {"name_or_path": str(model), "dtype": None},
        "data": {"train": {"name": "synthetic", "size": 8, "options": {"image_size": 32}}},
        "eval": {"sets": []},
        "train": {"lr": 1e-3, "batch_size": 4, "max_steps": 100000, "log_every": 1, "trackers": [],
                  "checkpoint_every": 5, "keep_checkpoints": 1, **train},
        "output": {"dir": str(out)},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text("# a tiny run\n" + yaml.safe_dump(recipe))
    return path


def _start(recipe: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "finetune" / "run.py"), str(recipe)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_real_runs_into_one_folder_one_is_refused_naming_the_other(tmp_path, tiny_model):
    out = tmp_path / "run"
    first = _tiny_recipe_file(tmp_path, tiny_model, out, "a")  # trains until killed
    runs = [_start(first), _start(first)]  # the same recipe, started together
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
        second = _tiny_recipe_file(tmp_path, tiny_model, out, "b", lr=2e-3)
        late = _start(second)
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


# ------------------------------------------------------------------------------- checked before anything is written


@pytest.mark.slow
def test_a_dataset_smaller_than_one_batch_stops_before_anything_is_written(tmp_path, tiny_model, monkeypatch, capsys):
    import finetune

    out = tmp_path / "run"
    small = _recipe(tmp_path, tiny_model, out, "train.batch_size=16")  # 8 examples
    with monkeypatch.context() as patch:
        patch.setattr(finetune, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
        assert _run(small) == 2
    err = capsys.readouterr().err
    assert "the training set (data.train) has 8 usable examples, fewer than one batch (train.batch_size=16)" in err
    assert "Traceback" not in err and not out.exists()
    assert _run(_recipe(tmp_path, tiny_model, out, "train.batch_size=4")) == 0  # the corrected rerun is not refused


def test_a_read_only_output_dir_exits_2_before_anything_runs(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "1m") as mount:
        require_read_only_possible(mount)
        mount.read_only()
        out = mount.path / "run"
        assert _run(_recipe(tmp_path, Path("tiny-clip"), out)) == 2
        err = capsys.readouterr().err
        assert f"recipe error: output.dir '{out}' cannot be created" in err and "Traceback" not in err
        assert not out.exists()


@pytest.mark.slow
def test_no_room_for_the_run_exits_2_and_leaves_nothing(tmp_path, tiny_model, monkeypatch, capsys):
    import shutil as shutil_module

    out = tmp_path / "run"
    real = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: real(p)._replace(free=5 * 2**20))
    recipe = _recipe(tmp_path, tiny_model, out, "train.checkpoint_every=1", "train.keep_checkpoints=2")
    assert _run(recipe) == 2
    err = capsys.readouterr().err
    assert f"recipe error: output.dir '{out}' has 5.0 MiB free, but about" in err
    assert "(final/ " in err and " + 2 checkpoints x " in err and "Traceback" not in err
    assert not out.exists()  # nothing of the refused run stays to block the next one


@pytest.mark.slow
def test_a_small_tmpfs_is_refused_and_a_large_enough_one_is_not(tmp_path, tiny_model, capsys):
    with tmpfs(tmp_path / "small", "8m") as small:
        require_mount(small)
        out = small.path / "run"
        assert _run(_recipe(tmp_path, tiny_model, out)) == 2
        assert "has 8.0 MiB free, but about" in capsys.readouterr().err
        assert list(small.path.iterdir()) == []
    with tmpfs(tmp_path / "large", "96m") as large:
        out = large.path / "run"
        assert _run(_recipe(tmp_path, tiny_model, out, "train.checkpoint_every=1")) == 0
        assert (out / "final").is_dir() and (out / "metrics.json").is_file()


@pytest.mark.slow
def test_a_two_process_launch_into_a_held_folder_is_refused_on_every_rank(tmp_path, tiny_model):
    out = tmp_path / "run"
    holder = _hold(out)
    try:
        recipe = _tiny_recipe_file(tmp_path, tiny_model, out, "a", max_steps=2)
        env = {**_env(), "ACCELERATE_USE_CPU": "true"}
        launch = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                 str(REPO / "finetune" / "run.py"), str(recipe)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=600)
        assert launch.returncode != 0
        # the main process was refused and the other rank learnt it from the main one, without a hang (that
        # only the main process takes the lock is what lets test_multi_process's launches run at all)
        assert launch.stderr.count(f"is in use by another run: PID {holder.pid} on ") == 2, launch.stderr[-3000:]
        assert not (out / "recipe.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
