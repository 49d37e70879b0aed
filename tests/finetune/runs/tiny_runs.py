"""What the run-folder tests build: recipes as ``recipe_to_dict`` gives them, finished runs and checkpoints on disk,
tiny runs in this process or in another one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from accelerate.state import AcceleratorState, GradientState

from finetune.config import Recipe, load_recipe

REPO = Path(__file__).resolve().parents[3]


def recipe_dict(**train) -> dict:
    """A recipe as ``recipe_to_dict`` gives it, with ``train`` keys set."""
    return {"model": {"name_or_path": "tiny-clip"}, "adapter": {"type": "full"}, "objective": {"base": "clip"},
            "data": {"train": {"name": "synthetic", "size": 16}, "num_workers": 0},
            "train": {"lr": 1e-3, "max_steps": 4, "resume": None, "log_every": 1, **train},
            "eval": {"sets": []}, "output": {"dir": "x"}}


def finished(folder: Path, recipe: dict) -> Path:
    """A folder that holds a finished run of ``recipe`` (``recipe.yaml``, ``metrics.json``, ``final/``)."""
    folder.mkdir(parents=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (folder / "metrics.json").write_text("{}")
    (folder / "final").mkdir()
    return folder


def checkpoint(folder: Path, step: int) -> Path:
    """A complete checkpoint as finetune.runs.checkpoints.checkpoint_problem sees it: weights, process 0's RNG state
    (as accelerate saves it) and the manifest of both."""
    import torch
    from safetensors.torch import save_file

    from finetune.runs.checkpoints import STATE_NAME, file_manifest, rng_state_name

    path = folder / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    torch.save({"torch_manual_seed": torch.get_rng_state()}, path / rng_state_name(0))
    (path / STATE_NAME).write_text(json.dumps({"step": step, "files": file_manifest(path)}))
    return path


def tiny_recipe(tmp_path: Path, model: Path, out: Path, *extra: str) -> Recipe:
    """A run of 2 steps of ``model`` on 8 synthetic examples into ``out``, evaluated on 4, no checkpoint."""
    path = tmp_path / "recipe.yaml"
    path.write_text("# a tiny run\nmodel: {name_or_path: x}\n")
    return load_recipe(path, [
        f"model.name_or_path={model}", "model.dtype=null",
        'data.train={"name": "synthetic", "size": 8, "options": {"image_size": 32}}',
        'eval.sets=[{"name": "synthetic", "split": "test", "size": 4, "options": {"image_size": 32}}]',
        "eval.batch_size=4", "eval.before=false", "train.max_steps=2", "train.batch_size=4", "train.trackers=[]",
        "train.checkpoint_every=0", f"output.dir={out}", *extra])


def run(recipe: Recipe) -> int:
    """``run_recipe`` in this process, from a fresh accelerate state; its exit status."""
    from finetune.training import run_recipe

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return run_recipe(recipe)


def env() -> dict[str, str]:
    """The environment of a run started in another process."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def tiny_recipe_file(tmp_path: Path, model: Path, out: Path, name: str, **train) -> Path:
    """A recipe file ``NAME.yaml`` of a run that trains until killed (checkpoints every 5 steps, one kept)."""
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


def start(recipe: Path) -> subprocess.Popen:
    """``finetune/run.py RECIPE`` started in another process."""
    return subprocess.Popen([sys.executable, str(REPO / "finetune" / "run.py"), str(recipe)], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
