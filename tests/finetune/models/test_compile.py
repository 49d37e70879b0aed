"""train.compile (finetune.models.compile): the towers' blocks compiled once with static shapes; with the run's fixed
batch shapes a compiled run compiles in its first steps and never again (torch._dynamo's counters)."""

from __future__ import annotations

import pytest
import torch
import yaml
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState

from finetune import load_model
from finetune.config import load_recipe
from finetune.data.sources import load_source
from finetune.models.compile import COMPILE_MODES, compile_options, compiled_graphs, transformer_blocks
from finetune.objectives import build_objective
from finetune.training import FinetuneRecipe, TrainModule, TrainStep, build_loop

pytestmark = pytest.mark.usefixtures("quiet_datasets")


def test_compile_settings_are_static_shapes_and_known_modes():
    assert compile_options(False) is None
    assert compile_options(True) == {"mode": "default", "dynamic": False}
    assert compile_options("reduce-overhead") == {"mode": "reduce-overhead", "dynamic": False}
    assert set(COMPILE_MODES) >= {"default", "reduce-overhead", "max-autotune"}
    with pytest.raises(ValueError, match="train.compile: 'fast' is not true, false or one of"):
        compile_options("fast")


def _trainer(tmp_path, objective: dict, **train):
    recipe = {"objective": objective, "train": {"lr": 1e-4, "batch_size": 4, "max_steps": 6, "trackers": [],
                                                "log_every": 3, "seed": 0, "compile": True, **train}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    loaded = load_recipe(path)
    objective = build_objective(loaded.objective)
    torch.manual_seed(0)
    model = load_model("tiny-clip", max_text_len=248)
    rows = load_source({"name": "synthetic", "size": 24, "seed": 0, "options": {"image_size": 32}}).dataset
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    return build_loop(acc, TrainModule(model, objective), rows, loaded.train, tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_compiled_run_does_not_recompile_after_its_first_steps(tmp_path, monkeypatch, accumulation):
    """Long-CLIP (captions at 248 tokens, first sentences at the short length: two text passes and one image pass per
    step), 6 steps with the blocks compiled: every graph is compiled by the end of step 2 (step 1 runs under the FLOP
    counter's dispatch mode), none after. dynamo's guards and recompilations are the same with any backend; aot_eager
    (dynamo and AOT autograd, no code generation) keeps the test within seconds on 2 cores."""
    import finetune.training.step_setup as step_setup

    monkeypatch.setattr(step_setup, "compile_options",
                        lambda setting: {"backend": "aot_eager", "dynamic": False} if setting else None)
    torch._dynamo.reset()
    loop = _trainer(tmp_path, {"base": "longclip"}, accumulation_steps=accumulation)
    blocks = transformer_blocks(loop.module.model)
    assert len(blocks) == 4 and all(b._compiled_call_impl is not None for b in blocks)
    graphs, step, before = [], TrainStep.__call__, compiled_graphs()

    def counted(self, batch, n):
        step(self, batch, n)
        graphs.append(compiled_graphs() - before)

    monkeypatch.setattr(TrainStep, "__call__", counted)
    result = FinetuneRecipe.from_loop(loop).train()
    assert result.steps == 6 and graphs[1] > 0
    assert graphs[1:] == [graphs[1]] * 5, graphs  # nothing compiled after step 2
    assert result.throughput["compile"]["graphs_compiled"] == graphs[-1] + before
