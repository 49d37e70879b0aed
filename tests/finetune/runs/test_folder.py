"""Run folders are never silently overwritten (:mod:`finetune.runs.folder`): a finished run, another recipe's run
or the user's own files are refused; a failed run leaves a finished one intact; what a killed run leaves behind is
cleaned, but never what a live process is writing; run files get the user's umask; ``--out`` never hits the model; a
dataset smaller than one batch stops a run before anything is written."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.config import load_recipe
from finetune.files import process_tag
from finetune.runs.errors import RunFolderError
from finetune.runs.folder import check_eval_output, check_run_folder, clean_stale_temporaries, clear_previous_run
from tests.finetune.runs.tiny_runs import checkpoint, finished, recipe_dict, run, tiny_recipe

pytestmark = pytest.mark.usefixtures("own_log_handlers")


def test_new_and_empty_folders_are_fine(tmp_path):
    assert check_run_folder(tmp_path / "nothing", recipe_dict()) == "new"
    (tmp_path / "empty").mkdir()
    assert check_run_folder(tmp_path / "empty", recipe_dict()) == "new"


def test_a_finished_run_is_refused_even_with_the_same_recipe(tmp_path):
    folder = finished(tmp_path / "run", recipe_dict())
    with pytest.raises(RunFolderError, match=r"holds a finished run \(metrics.json, final\).*output.overwrite: true"):
        check_run_folder(folder, recipe_dict())
    assert check_run_folder(folder, recipe_dict(), overwrite=True) == "overwrite"


def test_the_refusal_suggests_a_resume_only_where_a_checkpoint_continues_the_run(tmp_path):
    folder = finished(tmp_path / "run", recipe_dict())
    with pytest.raises(RunFolderError) as refused:
        check_run_folder(folder, recipe_dict())
    assert "train.resume" not in str(refused.value)  # without a checkpoint a resume would start again
    # following that hint anyway: refused, it would retrain from step 0 over the finished run
    with pytest.raises(RunFolderError, match=r"train.resume: latest: .*holds a finished run \(metrics.json, final\) "
                                             r"and no usable checkpoint.*from step 0.*output.overwrite: true"):
        check_run_folder(folder, recipe_dict(), resume="latest")
    broken = folder / "checkpoints" / "step-2"
    broken.mkdir(parents=True)  # a checkpoint whose save was interrupted (no train_state.json) does not count
    with pytest.raises(RunFolderError, match="no usable checkpoint"):
        check_run_folder(folder, recipe_dict(), resume="latest")
    checkpoint(folder, 4)
    with pytest.raises(RunFolderError, match=r"or train.resume: latest to continue it from checkpoints/step-4\)"):
        check_run_folder(folder, recipe_dict())
    assert check_run_folder(folder, recipe_dict(), resume="latest") == "resume"
    # a checkpoint named explicitly is the user's choice (finetune.runs.resume.find_checkpoint checks it)
    assert check_run_folder(folder, recipe_dict(), resume=str(folder / "checkpoints" / "step-4")) == "resume"


def test_another_unfinished_run_is_refused_listing_what_differs(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe_dict(lr=1e-3)))
    with pytest.raises(RunFolderError, match=r"holds another run .*train\.lr: 0\.001 -> 0\.002"):
        check_run_folder(folder, recipe_dict(lr=2e-3))
    # the same recipe starting again after a crash (no resume) is allowed
    assert check_run_folder(folder, recipe_dict(lr=1e-3)) == "rerun"


def test_resume_into_another_runs_folder_lists_the_differing_keys(tmp_path):
    folder = finished(tmp_path / "run", recipe_dict(lr=1e-3, max_steps=4))
    checkpoint(folder, 4)
    with pytest.raises(RunFolderError, match=r"differing keys: train\.lr: 0\.001 -> 0\.002; "
                                             r"train\.max_steps: 4 -> 8.*resume_ignore_changes"):
        check_run_folder(folder, recipe_dict(lr=2e-3, max_steps=8), resume="latest")
    assert check_run_folder(folder, recipe_dict(lr=2e-3), resume="latest", ignore_changes=True) == "resume"
    # bookkeeping keys are not part of what a continuation must match
    assert check_run_folder(folder, recipe_dict(lr=1e-3, max_steps=4, log_every=50), resume="latest") == "resume"


def test_clear_previous_run_and_stale_temporaries(tmp_path):
    folder = finished(tmp_path / "run", recipe_dict())
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


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


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
            check_run_folder(out, recipe_dict(), overwrite=overwrite)
    for extra in ((), ("output.overwrite=true",)):
        assert run(tiny_recipe(tmp_path, tiny_model, out, *extra)) == 2
        assert "holds report.md, plots/, logs/ but no run" in capsys.readouterr().err
        assert {k: v for k, v in _snapshot(out).items() if k != ".xlipkit.lock"} == mine
    (out / "report.md").unlink()
    with pytest.raises(RunFolderError, match=r"holds plots/, logs/ but no run"):
        check_run_folder(out, recipe_dict())


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
        assert run(load_recipe(kept, [*overrides, *extra])) == 2
        err = capsys.readouterr().err
        assert f"the recipe being run, '{kept}', is the recipe.yaml of output.dir" in err, err
        assert f"mv {kept} experiment.yaml" in err and "another run" not in err
        # refused by the preflight, before the run takes the folder's lock: the folder is as it was
        assert kept.read_bytes() == mine and sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]
    # through a symbolic link to it: the same file
    link = tmp_path / "link.yaml"
    link.symlink_to(kept)
    with pytest.raises(RunFolderError, match="the recipe being run"):
        check_run_folder(out, recipe_dict(), recipe_file=link)
    # the advice: the same recipe moved out of the folder runs into it
    moved = tmp_path / "experiment.yaml"
    kept.rename(moved)
    assert check_run_folder(out, recipe_dict(), recipe_file=moved) == "new"

    # a run's own recipe.yaml (as the run wrote it) continues that run
    recipe = load_recipe(moved, overrides)
    from finetune.config import dump_recipe, recipe_to_dict

    dump_recipe(recipe, out / "recipe.yaml")
    checkpoint(out, 2)
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
    assert run(tiny_recipe(tmp_path, tiny_model, out)) == 0
    good = _snapshot(out)
    assert "recipe.yaml" in good and "metrics.json" in good and "final/xlipkit.json" in good

    # a second run into the finished folder: refused, nothing written
    assert run(tiny_recipe(tmp_path, tiny_model, out, "train.lr=0.5")) == 2
    assert "holds a finished run" in capsys.readouterr().err
    assert _snapshot(out) == good

    # a run that fails validation, even with output.overwrite: the good run's recipe.yaml stays
    bad = tiny_recipe(tmp_path, tiny_model, out, "train.lr=0.5", "output.overwrite=true",
                  f'eval.sets=[{{"name": "jsonl", "path": "{tmp_path / "missing.jsonl"}"}}]')
    assert run(bad) == 2
    err = capsys.readouterr().err
    assert "recipe error: eval.sets[0].path: jsonl files" in err and "missing.jsonl" in err and "Traceback" not in err
    assert _snapshot(out) == good

    # output.overwrite: the old run's files are replaced, not mixed
    (out / "checkpoints" / "step-99").mkdir(parents=True)
    again = tiny_recipe(tmp_path, tiny_model, out, "train.lr=0.002", "output.overwrite=true")
    assert run(again) == 0
    assert not (out / "checkpoints").exists()
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["lr"] == 0.002
    assert json.loads((out / "metrics.json").read_text())["recipe"]["train"]["lr"] == 0.002


@pytest.mark.slow
def test_following_the_refusals_hint_never_retrains_over_a_finished_run(tmp_path, tiny_model, capsys):
    out = tmp_path / "run"
    assert run(tiny_recipe(tmp_path, tiny_model, out)) == 0  # train.checkpoint_every=0: no checkpoint
    good = _snapshot(out)
    assert run(tiny_recipe(tmp_path, tiny_model, out)) == 2
    refusal = capsys.readouterr().err
    assert "holds a finished run" in refusal and "train.resume" not in refusal
    # train.resume: latest with nothing to resume from: refused before anything is written
    assert run(tiny_recipe(tmp_path, tiny_model, out, "train.resume=latest")) == 2
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
        assert run(tiny_recipe(tmp_path, tiny_model, out)) == 0
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
    recipe = tiny_recipe(tmp_path, Path("no-such-model-xyz"), out)
    assert run(recipe) == 2
    err = capsys.readouterr().err
    assert "recipe error: model.name_or_path: could not load model 'no-such-model-xyz'" in err
    assert "Registry names (random weights): " in err and "tiny-clip" in err and "Traceback" not in err
    assert not out.exists()  # nothing half-started is left to block the corrected run


@pytest.mark.slow
def test_a_bad_training_data_path_is_found_before_the_model_loads(tmp_path, tiny_model, monkeypatch, capsys):
    import finetune.training.model as start

    monkeypatch.setattr(start, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    missing = tmp_path / "nope.jsonl"
    recipe = tiny_recipe(tmp_path, tiny_model, out, f'data.train={{"name": "jsonl", "path": "{missing}"}}')
    assert run(recipe) == 2
    err = capsys.readouterr().err
    assert "recipe error: data.train.path: jsonl files" in err and "nope.jsonl does not exist" in err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_a_dataset_smaller_than_one_batch_stops_before_anything_is_written(tmp_path, tiny_model, monkeypatch, capsys):
    import finetune

    out = tmp_path / "run"
    small = tiny_recipe(tmp_path, tiny_model, out, "train.batch_size=16")  # 8 examples
    with monkeypatch.context() as patch:
        patch.setattr(finetune, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
        assert run(small) == 2
    err = capsys.readouterr().err
    assert "the training set (data.train) has 8 usable examples, fewer than one batch (train.batch_size=16)" in err
    assert "Traceback" not in err and not out.exists()
    assert run(tiny_recipe(tmp_path, tiny_model, out, "train.batch_size=4")) == 0  # the corrected rerun is not refused
