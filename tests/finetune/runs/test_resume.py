"""Resume checks what it resumes: missing or damaged checkpoint files are named, a checkpoint of
another recipe is refused listing the differing keys, and metrics cover the whole run."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

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
from finetune.runs.errors import CheckpointError, RunFolderError
from finetune.runs.resume import find_checkpoint
from finetune.training import FinetuneRecipe, TrainModule, build_loop

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def scenes():
    return load_source({"name": "synthetic", "size": 16, "seed": 0, "options": {"image_size": 32}}).dataset


def _recipe(lr: float = 1e-3, max_steps: int = 4) -> Any:
    """The recipe a checkpoint of these tests records (its continuation view is compared on resume)."""
    return load_recipe(REPO / "recipes" / "quickstart_clip.yaml",
                       ["model.name_or_path=tiny-clip", "adapter.type=full", "objective.base=clip",
                        "data.train={name: synthetic, size: 16}", f"train.lr={lr}", f"train.max_steps={max_steps}",
                        "train.batch_size=4", "train.checkpoint_every=2"])


def _trainer(tmp_path, scenes, **train):
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"train": {"lr": 1e-3, "batch_size": 4, "max_steps": 4, "trackers": [],
                                              "log_every": 1, "checkpoint_every": 2, "keep_checkpoints": 5,
                                              "warmup_steps": 0, **train}}))
    torch.manual_seed(0)
    model = load_model("tiny-clip")
    objective = Objective(ClipTerm())
    return build_loop(acc, TrainModule(model, objective), scenes, load_recipe(path).train, tmp_path / "run")


def _train(loop):
    return FinetuneRecipe.from_loop(loop).train()


#: the folders ``Accelerator.save_state`` wrote the checkpoints of :func:`finished` into
SAVED_INTO: list[str] = []


@pytest.fixture(scope="module")
def finished(tmp_path_factory, scenes):
    """A run of 4 steps with checkpoints at steps 2 and 4, saved with recipe ``_recipe()`` under umask 027 (the
    folders accelerate wrote into recorded in :data:`SAVED_INTO`)."""
    import os

    tmp = tmp_path_factory.mktemp("finished")
    trainer = _trainer(tmp, scenes)
    trainer.checkpoints.resume(None, recipe=_recipe())
    save_state = Accelerator.save_state

    def recording(self, output_dir=None, **kwargs):
        SAVED_INTO.append(output_dir)
        return save_state(self, output_dir, **kwargs)

    before = os.umask(0o027)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Accelerator, "save_state", recording)
            result = _train(trainer)
    finally:
        os.umask(before)
    return tmp, result


def _copy(finished, tmp_path):
    import shutil

    src, _ = finished
    shutil.copytree(src / "run", tmp_path / "run")
    return tmp_path / "run" / "checkpoints"


def test_a_checkpoint_records_the_size_and_sha256_of_every_file(finished):
    import hashlib
    import json

    folder = finished[0] / "run" / "checkpoints" / "step-4"
    state = json.loads((folder / "train_state.json").read_text())
    assert state["step"] == 4 and state["recipe"]["train"]["lr"] == 1e-3
    files = sorted(p.name for p in folder.iterdir() if p.name != "train_state.json")
    assert sorted(state["files"]) == files and {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= set(files)
    for name, entry in state["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert checkpoint_problem(folder) is None


def test_checkpoint_files_follow_the_umask_and_temp_folders_name_their_writer(finished):
    """safetensors writes 0600 whatever the umask; the temporary folder carries the writer's PID@HOST, so that a
    cleanup never removes the folder of a live run."""
    import os
    import stat

    from finetune.files import process_tag, tag_owner

    assert [os.path.basename(w) for w in SAVED_INTO] == [f"step-2.{process_tag()}.tmp", f"step-4.{process_tag()}.tmp"]
    assert tag_owner(os.path.basename(SAVED_INTO[0]))[0] == os.getpid()
    folder = finished[0] / "run" / "checkpoints" / "step-4"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path.name


def _flip(path, offset_from_end: int = 100) -> None:
    """Flip one bit of a file, keeping its size (a bad disk sector, a bit rot)."""
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_same_size_bit_flip_is_named_and_latest_falls_back(finished, tmp_path, caplog):
    ckpt = _copy(finished, tmp_path)
    _flip(ckpt / "step-4" / "model.safetensors")  # a weight, not the header: the header still parses
    with pytest.raises(CheckpointError, match=r"step-4 is not a checkpoint folder \(model\.safetensors is damaged "
                                              r"\(its sha256 differs from the one recorded when it was saved"):
        find_checkpoint(str(ckpt / "step-4"), ckpt)
    with caplog.at_level(logging.WARNING, logger="xlipkit"):
        assert find_checkpoint("latest", ckpt) == ckpt / "step-2"
    assert "skipped step-4: model.safetensors is damaged (its sha256 differs" in caplog.text
    _flip(ckpt / "step-2" / "optimizer.bin", 5000)
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step-4: model.safetensors is damaged .*; "
                                              r"step-2: optimizer.bin is damaged"):
        find_checkpoint("latest", ckpt)


def test_a_damaged_or_missing_rng_state_is_an_error_unless_ignored(finished, tmp_path, scenes, caplog):
    """accelerate skips an unreadable RNG state with an INFO line, and the resumed run silently stops repeating an
    uninterrupted one: here it is an error naming the file, or (train.resume_ignore_rng) a warning and a fresh
    state seeded from the step."""
    ckpt = _copy(finished, tmp_path)
    rng = ckpt / "step-4" / "random_states_0.pkl"
    _flip(rng, 40)
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl is damaged \(its sha256 differs.*"
                                              r"set train\.resume_ignore_rng: true"):
        find_checkpoint(str(ckpt / "step-4"), ckpt)
    rng.unlink()
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl is missing: the RNG state of process 0"):
        find_checkpoint(str(ckpt / "step-4"), ckpt)
    # a requeue on more processes than the checkpoint's: the saved states are checked, the new process starts fresh
    assert find_checkpoint(str(ckpt / "step-2"), ckpt, world_size=2) == ckpt / "step-2"
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl is missing"):
        find_checkpoint(str(ckpt / "step-4"), ckpt, world_size=2)
    # garbage that is not a pickle, with no manifest to compare against (a checkpoint of an older version)
    import json

    state_file = ckpt / "step-2" / "train_state.json"
    state = json.loads(state_file.read_text())
    state["files"] = {name: entry["bytes"] for name, entry in state["files"].items()}  # sizes only, as before
    state_file.write_text(json.dumps(state))
    (ckpt / "step-2" / "random_states_0.pkl").write_bytes(b"x" * state["files"]["random_states_0.pkl"])
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl is unreadable"):
        find_checkpoint(str(ckpt / "step-2"), ckpt)
    with caplog.at_level(logging.WARNING, logger="xlipkit"):
        assert find_checkpoint("latest", ckpt, ignore_rng=True) == ckpt / "step-4"
        trainer = _trainer(tmp_path, scenes, resume_ignore_rng=True)
        assert trainer.checkpoints.resume("latest", recipe=_recipe())
    assert trainer.state.step == 4
    assert "train.resume_ignore_rng: step-4: random_states_0.pkl is missing" in caplog.text
    assert "process 0 continues with a fresh RNG state seeded from train.seed and step 4" in caplog.text


def test_a_checkpoint_of_an_older_version_without_hashes_still_resumes(finished, tmp_path):
    import json

    ckpt = _copy(finished, tmp_path)
    state_file = ckpt / "step-4" / "train_state.json"
    state = json.loads(state_file.read_text())
    state["files"] = {name: entry["bytes"] for name, entry in state["files"].items()}
    state_file.write_text(json.dumps(state))
    assert find_checkpoint("latest", ckpt) == ckpt / "step-4"


def test_latest_without_a_checkpoint_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        assert find_checkpoint("latest", tmp_path / "checkpoints") is None
    assert "no checkpoint in" in caplog.text and "starts at step 0" in caplog.text
    assert find_checkpoint(None, tmp_path) is None


def test_a_missing_weights_file_is_named(finished, tmp_path):
    ckpt = _copy(finished, tmp_path)
    (ckpt / "step-4" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"step-4 is not a checkpoint folder \(model\.safetensors is missing\)"):
        find_checkpoint(str(ckpt / "step-4"), ckpt)


def test_a_corrupt_safetensors_header_is_named(finished, tmp_path):
    ckpt = _copy(finished, tmp_path)
    weights = ckpt / "step-4" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(b"\xff" * size)  # same size: the hash tells, and without one (older checkpoints) the header
    with pytest.raises(CheckpointError, match=r"model\.safetensors is damaged \(its sha256 differs"):
        find_checkpoint(str(ckpt / "step-4"), ckpt)
    import json

    state_file = ckpt / "step-4" / "train_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "files": {k: v["bytes"] for k, v in state["files"].items()}}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt"):
        find_checkpoint(str(ckpt / "step-4"), ckpt)
    weights.write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is damaged \(10 bytes, \d+ when saved\)"):
        find_checkpoint(str(ckpt / "step-4"), ckpt)


def test_latest_skips_an_incomplete_checkpoint_saying_which_and_why(finished, tmp_path, caplog):
    ckpt = _copy(finished, tmp_path)
    (ckpt / "step-4" / "train_state.json").unlink()
    with caplog.at_level(logging.WARNING, logger="xlipkit"):
        assert find_checkpoint("latest", ckpt) == ckpt / "step-2"
    assert "skipped step-4: train_state.json is missing" in caplog.text and "resuming from step-2" in caplog.text
    (ckpt / "step-2" / "optimizer.bin").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step-4: train_state.json is missing .*; "
                                              r"step-2: optimizer.bin is missing"):
        find_checkpoint("latest", ckpt)


def test_resume_with_another_recipe_lists_the_differing_keys(finished, tmp_path, scenes, caplog):
    _copy(finished, tmp_path)
    trainer = _trainer(tmp_path, scenes, lr=2e-3, max_steps=6)
    with pytest.raises(RunFolderError, match=r"different recipe; differing keys: train\.lr: 0\.001 -> 0\.002; "
                                             r"train\.max_steps: 4 -> 6"):
        trainer.checkpoints.resume("latest", recipe=_recipe(lr=2e-3, max_steps=6))
    assert trainer.state.step == 0
    with caplog.at_level(logging.WARNING, logger="xlipkit"):
        assert trainer.checkpoints.resume("latest", recipe=_recipe(lr=2e-3, max_steps=6), ignore_changes=True)
    assert "resume_ignore_changes" in caplog.text and "train.lr: 0.001 -> 0.002" in caplog.text
    assert trainer.state.step == 4 and trainer.state.recipe["train"]["lr"] == 2e-3


@pytest.mark.slow
def test_metrics_after_a_resume_cover_the_whole_run(finished, tmp_path, scenes):
    _copy(finished, tmp_path)
    _, straight = finished
    # resumed at the end: nothing left to train, the run's own final losses and time are reported
    done = _trainer(tmp_path, scenes)
    assert done.checkpoints.resume("latest", recipe=_recipe())
    result = _train(done)
    assert result.final_losses and result.final_losses["loss"] == straight.history[-1]["loss"]
    assert result.wall_time_s >= done.state.train_time_s > 0
    # resumed mid-way: time and samples/s over all 4 steps, not only the last 2
    import shutil

    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-4")
    half = _trainer(tmp_path, scenes)
    assert half.checkpoints.resume("latest", recipe=_recipe())
    before = half.state.train_time_s
    assert before > 0
    result = _train(half)
    assert result.wall_time_s > before
    assert math.isclose(result.samples_per_s, 4 * 4 / result.wall_time_s, rel_tol=1e-6)
    assert result.final_losses["loss"] == pytest.approx(straight.final_losses["loss"], abs=1e-6)


@pytest.mark.slow
def test_a_bad_resume_path_is_found_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import finetune.training.model as start
    from finetune.training import run_recipe

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(start, "load_model", no_model)
    path = tmp_path / "r.yaml"
    path.write_text("# r\ntrain: {trackers: []}\n")
    recipe = load_recipe(path, [f"output.dir={tmp_path / 'run'}", f"train.resume={tmp_path / 'nowhere'}",
                                "train.trackers=[]"])
    AcceleratorState._reset_state(reset_partial_state=True)
    assert run_recipe(recipe) == 2
    err = capsys.readouterr().err
    assert "nowhere is not a checkpoint folder (it does not exist)" in err
    assert not (tmp_path / "run").exists()
