"""Two real processes on a CPU: `ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2` (``accelerate
launch --num_processes 2 --cpu`` starts one with accelerate 1.15). A run over two processes gives
the losses and final weights of one process on the same global batch, and resumes to them too. The runs read
length-grouped batches (``train.group_by_length``): every process draws the same grouped global batch and trains on
its slice (that the key reaches the loop's sampler: test_loaders.py; the ungrouped batches of two processes against
one's: test_engines_launched.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]


def _recipe(tmp_path: Path, model: Path, out: Path, **train) -> Path:
    recipe = {
        "model": {"name_or_path": str(model), "dtype": None},
        "data": {"train": {"name": "synthetic", "size": 16, "seed": 0, "options": {"image_size": 32}}},
        "eval": {"sets": []},
        "train": {"lr": 1e-3, "batch_size": 8, "max_steps": 4, "log_every": 1, "trackers": [], "warmup_steps": 0,
                  "checkpoint_every": 2, "keep_checkpoints": 3, **train},
        "output": {"dir": str(out)},
    }
    path = tmp_path / f"{out.name}.yaml"
    path.write_text("# tiny two-process run\n" + yaml.safe_dump(recipe))
    return path


def _launch(recipe: Path, processes: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "ACCELERATE_USE_CPU": "true"}
    if processes == 1:
        cmd = [sys.executable, str(REPO / "finetune" / "run.py"), str(recipe)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(REPO / "finetune" / "run.py"), str(recipe)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = Path(yaml.safe_load(recipe.read_text())["output"]["dir"])
    return json.loads((out / "metrics.json").read_text())


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted((out / "final").glob("*.safetensors")):
        tensors.update({f"{file.name}:{k}": v for k, v in load_file(file).items()})
    assert tensors
    return tensors


def _losses(metrics: dict) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in metrics["history"]]


#: an epoch's 2 batches sorted together by caption length
GROUPED = {"group_by_length": True, "length_group_batches": 2}


@pytest.mark.slow
def test_two_processes_train_like_one_on_length_grouped_batches_and_resume(tmp_path):
    from finetune.models.registry import save_tiny

    model = save_tiny("tiny-clip", tmp_path / "tiny-clip")
    one = _launch(_recipe(tmp_path, model, tmp_path / "one", **GROUPED), 1)
    two = _launch(_recipe(tmp_path, model, tmp_path / "two", **GROUPED), 2)
    assert one["num_processes"] == 1 and two["num_processes"] == 2  # the world size each really ran with
    assert [s for s, _ in _losses(two)] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(_losses(one), _losses(two)):
        assert abs(a - b) < 1e-5, (_losses(one), _losses(two))
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert set(w1) == set(w2)
    for key in w1:
        if key.endswith("k_proj.bias"):
            # softmax ignores a key bias: its true gradient is 0, so Adam turns summation-order noise of
            # ~1e-10 into updates of either sign; every other tensor must match
            continue
        torch.testing.assert_close(w2[key], w1[key], atol=1e-5, rtol=1e-4, msg=key)

    # a two-process run killed after its step-2 checkpoint, resumed by two processes
    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    resumed_dir = tmp_path / "resumed"
    for name in ("final", "metrics.json", "report.md", "plots", "checkpoints/step-4"):
        path = resumed_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    recipe = yaml.safe_load((resumed_dir / "recipe.yaml").read_text())
    recipe["output"]["dir"] = str(resumed_dir)
    (resumed_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    resumed = _launch(_recipe(tmp_path, model, resumed_dir, resume="latest", **GROUPED), 2)
    assert resumed["num_processes"] == 2 and resumed["steps"] == 4
    # history carried over from the checkpoint, then continued to the same values
    assert [s for s, _ in _losses(resumed)] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(_losses(resumed), _losses(two)):
        assert abs(a - b) < 1e-6
    w3 = _weights(resumed_dir)
    for key in w2:
        torch.testing.assert_close(w3[key], w2[key], atol=1e-6, rtol=0, msg=key)

