"""A disk that fills up during a run (past the free-space check made before it): a checkpoint or the final save that
does not fit keeps the last good checkpoint, says that the disk is full, how much was needed, how much is free and
where, and ends with status 1 and no traceback; with room again, the printed command continues the run. Real small
``tmpfs`` mounts (skipped where mounting is not permitted)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState

from finetune import load_model
from finetune.config import load_recipe
from finetune.data.sources import load_source
from finetune.objectives import ClipTerm, Objective
from finetune.runs.checkpoints import checkpoint_problem
from finetune.training import FinetuneRecipe, LoopParts, SaveFailedError, TrainModule, build_loop
from tests.finetune.mounts import require_mount, tmpfs

@pytest.fixture(autouse=True)
def _log_handler_of_this_test():
    """The run's log handler writes to the stderr of the test that made it: give each test its own."""
    import logging

    logger = logging.getLogger("xlipkit")
    saved = logger.handlers[:]
    logger.handlers.clear()
    yield
    logger.handlers[:] = saved


def _trainer(folder: Path, **train) -> LoopParts:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    path = folder.parent / f"{folder.name}.yaml"
    path.write_text(yaml.safe_dump({"train": {"lr": 1e-3, "batch_size": 4, "max_steps": 4, "trackers": [],
                                              "log_every": 1, "warmup_steps": 0, **train}}))
    torch.manual_seed(0)
    model = load_model("tiny-clip", max_text_len=248)
    objective = Objective(ClipTerm())
    scenes = load_source({"name": "synthetic", "size": 8, "seed": 0, "options": {"image_size": 32}}).dataset
    return build_loop(acc, TrainModule(model, objective), scenes, load_recipe(path).train, folder)


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_keeps_the_last_one_and_says_why(tmp_path):
    # a checkpoint of tiny-clip at 248 text positions takes 19.6 MB (6.5 MB of weights, 13 MB of AdamW moments):
    # room for one, not two
    with tmpfs(tmp_path / "disk", "30m") as disk:
        require_mount(disk)
        run = disk.path / "run"
        trainer = _trainer(run, checkpoint_every=2, keep_checkpoints=1)
        with pytest.raises(SaveFailedError) as failed:
            FinetuneRecipe.from_loop(trainer).train()
        where = re.escape(str(run / "checkpoints"))
        assert re.fullmatch(
            rf"checkpoint step-4 could not be saved in {where}: the disk is full \(about 1\d\.\d MiB are needed, "
            rf"[\d.]+ (KiB|MiB|bytes) free now in {where}, on the file system mounted at {re.escape(str(disk.path))}\); "
            r"the newest complete checkpoint, checkpoints/step-2, is kept", str(failed.value)), str(failed.value)
        assert failed.value.disk_full and failed.value.kept == run / "checkpoints" / "step-2"
        # the last good checkpoint is intact (every file's sha256) and nothing half-written is left
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
        assert checkpoint_problem(run / "checkpoints" / "step-2") is None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from finetune.models.registry import save_tiny

    return save_tiny("tiny-clip", tmp_path_factory.mktemp("models") / "tiny-clip")


def _recipe(tmp_path: Path, model: Path, out: Path, *extra: str):
    path = tmp_path / "recipe.yaml"
    path.write_text("# a tiny run\nmodel: {name_or_path: x}\n")
    return load_recipe(path, [
        f"model.name_or_path={model}", "model.dtype=null",
        'data.train={"name": "synthetic", "size": 8, "options": {"image_size": 32}}', "eval.sets=[]",
        "train.max_steps=4", "train.batch_size=4", "train.trackers=[]", "train.checkpoint_every=2",
        "train.keep_checkpoints=1", f"output.dir={out}", *extra])


def _run(recipe) -> int:
    from finetune.training import run_recipe

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return run_recipe(recipe)


def _grow(disk, size: str) -> None:
    done = subprocess.run(["mount", "-o", f"remount,size={size}", str(disk.path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def no_upfront_check(monkeypatch):
    """The free-space estimate made before training would refuse these small disks: let the run start, as on a
    disk that other writers fill while it trains."""
    monkeypatch.setattr("finetune.training.size_checks.check_free_space", lambda *args, **kwargs: None)


@pytest.mark.slow
def test_a_run_whose_checkpoint_does_not_fit_exits_1_and_continues_once_there_is_room(tmp_path, tiny_model,
                                                                                      no_upfront_check, capsys):
    with tmpfs(tmp_path / "disk", "30m") as disk:
        require_mount(disk)
        out = disk.path / "run"
        assert _run(_recipe(tmp_path, tiny_model, out)) == 1
        err = capsys.readouterr().err
        assert f"error: checkpoint step-4 could not be saved in {out / 'checkpoints'}: the disk is full (about" in err
        assert "the newest complete checkpoint, checkpoints/step-2, is kept. Free some space" in err
        assert err.rstrip().endswith("train.resume=latest") and "Traceback" not in err
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
        _grow(disk, "96m")
        assert _run(_recipe(tmp_path, tiny_model, out, "train.resume=latest")) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["steps"] == 4 and metrics["history"][-1]["step"] == 4


@pytest.mark.slow
def test_a_full_disk_at_the_final_save_keeps_the_training_and_says_how_to_continue(tmp_path, tiny_model,
                                                                                   no_upfront_check, capsys):
    """The final save used to fail with ``SafetensorError: ... No space left on device`` and lose the training."""
    with tmpfs(tmp_path / "disk", "26m") as disk:  # the step-4 checkpoint fits, final/ after it does not
        require_mount(disk)
        out = disk.path / "run"
        assert _run(_recipe(tmp_path, tiny_model, out, "train.checkpoint_every=4")) == 1
        err = capsys.readouterr().err
        assert (f"error: the run's outputs could not be written in {out} after training: the disk is full (about "
                in err), err[-3000:]
        assert (f"the training is kept in {out / 'checkpoints' / 'step-4'} (its last step, 4): continuing the run "
                "trains no more steps, it evaluates and writes final/ again") in err
        assert err.rstrip().endswith("train.resume=latest") and "Traceback" not in err
        assert not (out / "final").exists() and not [p.name for p in out.iterdir() if ".tmp" in p.name]
        assert checkpoint_problem(out / "checkpoints" / "step-4") is None
        _grow(disk, "96m")
        saved = json.loads((out / "checkpoints" / "step-4" / "train_state.json").read_text())
        assert _run(_recipe(tmp_path, tiny_model, out, "train.checkpoint_every=4", "train.resume=latest")) == 0
        assert (out / "final" / "model.safetensors").is_file()
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["steps"] == 4 and metrics["history"] == saved["history"]  # no step trained again
