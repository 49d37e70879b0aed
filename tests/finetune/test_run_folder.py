"""Run folders are never silently overwritten; a failed run leaves a finished one intact; what a
killed run leaves behind is cleaned; run files get the user's umask; ``--out`` never hits the model."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml
from accelerate.state import AcceleratorState, GradientState

from finetune.config import load_recipe
from finetune.run_folder import (
    RunFolderError,
    check_eval_output,
    check_run_folder,
    clean_stale_temporaries,
    clear_previous_run,
    continuation_view,
    differing_keys,
)


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
    """A complete checkpoint as finetune.resume.checkpoint_problem sees it (a manifest of no files)."""
    path = folder / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    (path / "train_state.json").write_text(json.dumps({"step": step, "files": {}}))
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
    from finetune.evaluate import main

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
    from finetune.run import run

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return run(recipe)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


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
    assert "evaluation set 'jsonl'" in err and "missing.jsonl" in err and "Traceback" not in err
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
    import finetune

    monkeypatch.setattr(finetune, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    recipe = _recipe(tmp_path, tiny_model, out, f'data.train={{"name": "jsonl", "path": "{tmp_path / "nope.jsonl"}"}}')
    assert _run(recipe) == 2
    err = capsys.readouterr().err
    assert "training set (data.train) could not be loaded" in err and "nope.jsonl" in err and "Traceback" not in err
    assert not out.exists()
