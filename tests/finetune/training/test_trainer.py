"""The training loop on a tiny CLIP and tiny synthetic data: steps, accumulation, resume, non-finite stops."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState

from finetune import load_model
from finetune.config import load_recipe
from finetune.data.collate import Collator
from finetune.data.sources import load_source
from finetune.models import param_groups
from finetune.models.adapters import AdapterConfig, apply_adapter
from finetune.objectives import ClipTerm, Objective, build_objective
from finetune.objectives.base import Term
from finetune.training import FinetuneRecipe, NonFiniteLossError, TrainModule, build_loop, list_checkpoints, lr_lambda


@pytest.fixture(scope="module")
def scenes():
    return load_source({"name": "synthetic", "size": 32, "seed": 0, "options": {"image_size": 32}}).dataset


def _accelerator() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))


def _train_cfg(tmp_path: Path, **train) -> object:
    recipe = {"train": {"lr": 1e-3, "batch_size": 8, "max_steps": 4, "trackers": [], "log_every": 1,
                        "seed": 0, "warmup_steps": 0, **train}}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return load_recipe(path).train


def _trainer(tmp_path, scenes, *, adapter="full", objective=None, num_workers=0, **train):
    """The loop's parts (:func:`build_loop`) of tiny-clip on ``scenes`` with the run's collate stack."""
    torch.manual_seed(0)
    model = load_model("tiny-clip", max_text_len=248)
    model = apply_adapter(model, AdapterConfig(type=adapter, r=4, alpha=8, dropout=0.1))
    objective = objective or Objective(ClipTerm())
    module = TrainModule(model, objective)
    acc = _accelerator()
    cfg = _train_cfg(tmp_path, **train)
    return build_loop(acc, module, scenes, cfg, tmp_path / "run", num_workers=num_workers)


def train(loop, on_step=None):
    """The run's loop (:meth:`FinetuneRecipe.train`) over ``loop``."""
    return FinetuneRecipe.from_loop(loop).train(on_step)


def _weights(loop) -> dict[str, torch.Tensor]:
    module = loop.accelerator.unwrap_model(loop.wrapped)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_loop_runs_and_logs_every_term(tmp_path, scenes):
    trainer = _trainer(tmp_path, scenes, max_steps=4, checkpoint_every=2, keep_checkpoints=1)
    before = _weights(trainer)
    result = train(trainer)
    assert result.steps == 4
    assert [h["step"] for h in result.history] == [1, 2, 3, 4]
    for h in result.history:
        assert set(h) >= {"step", "loss", "clip", "lr", "logit_scale"}
        assert torch.isfinite(torch.tensor(h["loss"]))
    after = _weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # keep_checkpoints=1: only the newest complete checkpoint remains, no temp folder
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in ckpts] == ["step-4"]
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))
    state = json.loads((ckpts[0] / "train_state.json").read_text())
    assert state["step"] == 4


def test_history_holds_each_interval_mean_and_a_resume_logs_the_same(tmp_path, scenes):
    steps: list[dict[str, float]] = []
    straight = _trainer(tmp_path / "a", scenes, max_steps=6, log_every=4, checkpoint_every=3, keep_checkpoints=2)
    result = train(straight, on_step=lambda step, values: steps.append(dict(values)))
    assert [h["step"] for h in result.history] == [1, 4, 6]
    # every step counts: step 1 alone, then steps 2-4, 5-6; lr and logit_scale are the logging step's
    for entry, members in zip(result.history, ([0], [1, 2, 3], [4, 5])):
        for key in ("loss", "clip"):
            assert entry[key] == pytest.approx(sum(steps[i][key] for i in members) / len(members), rel=1e-6)
        assert entry["lr"] == steps[members[-1]]["lr"]
        assert entry["logit_scale"] == steps[members[-1]]["logit_scale"]
    assert result.final_losses["loss"] == steps[-1]["loss"] != result.history[-1]["loss"]
    checkpoints = tmp_path / "a" / "run" / "checkpoints"
    # resumed from step 3 (mid-interval): the interval's sums travel in the checkpoint
    resumed = _trainer(tmp_path / "b", scenes, max_steps=6, log_every=4, checkpoint_every=3)
    shutil.copytree(checkpoints / "step-3", tmp_path / "b" / "run" / "checkpoints" / "step-3")
    assert resumed.checkpoints.resume("latest")
    again = train(resumed)
    assert [h["step"] for h in again.history] == [1, 4, 6]
    for a, b in zip(result.history, again.history):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    # resumed at the end: no step runs, the final losses are the last step's, not the last interval's mean
    done = _trainer(tmp_path / "c", scenes, max_steps=6, log_every=4, checkpoint_every=3)
    shutil.copytree(checkpoints / "step-6", tmp_path / "c" / "run" / "checkpoints" / "step-6")
    assert done.checkpoints.resume("latest")
    assert train(done).final_losses["loss"] == steps[-1]["loss"]


def test_parameter_groups_exclude_norms_biases_positions_and_scale():
    model = load_model("tiny-clip", max_text_len=248)
    groups = param_groups(TrainModule(model, Objective(ClipTerm())), 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    names = {n: p for n, p in model.named_parameters()}
    assert id(model.logit_scale) not in decayed
    assert id(model.position_embedding()) not in decayed
    assert all(id(p) not in decayed for n, p in names.items() if n.endswith(".bias") or "norm" in n)
    assert any(id(p) in decayed for n, p in names.items() if n.endswith("q_proj.weight"))
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0


def test_cosine_schedule_with_warmup():
    f = lr_lambda("cosine", warmup=2, total=10, min_ratio=0.0)
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0)
    assert f(2) == pytest.approx(1.0)
    assert f(6) == pytest.approx(0.5)
    assert f(10) == pytest.approx(0.0, abs=1e-12)
    assert lr_lambda("constant", 0, 10, 0.0)(7) == 1.0


def _grads(loop, batch) -> dict[str, torch.Tensor]:
    loop.optimizer.zero_grad(set_to_none=True)
    out = loop.step.forward_backward(batch)
    module = loop.accelerator.unwrap_model(loop.wrapped)
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, out


def test_accumulation_with_cached_features_equals_one_big_batch(tmp_path, scenes):
    one = _trainer(tmp_path / "a", scenes, accumulation_steps=1)
    two = _trainer(tmp_path / "b", scenes, accumulation_steps=2)
    two.accelerator.unwrap_model(two.wrapped).load_state_dict(one.accelerator.unwrap_model(one.wrapped).state_dict())
    batch = Collator(one.module.model, one.module.objective)([scenes[i] for i in range(8)])
    g1, out1 = _grads(one, batch)
    g2, out2 = _grads(two, batch)
    assert torch.allclose(out1["loss"], out2["loss"], atol=1e-6)
    assert set(g1) == set(g2)
    assert "model.model.logit_scale" in g1
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6, rtol=1e-4), name


def test_naive_micro_batch_losses_would_differ(tmp_path, scenes):
    """The check above is not vacuous: two independent micro-batch losses give another gradient."""
    one = _trainer(tmp_path, scenes)
    module = one.accelerator.unwrap_model(one.wrapped)
    batch = Collator(module.model, module.objective)([scenes[i] for i in range(8)])
    g_big, _ = _grads(one, batch)
    from finetune.objectives.planning import split_batch

    one.optimizer.zero_grad(set_to_none=True)
    for mb in split_batch(batch, 2):
        one.wrapped(mb)["loss"].backward()
    g_naive = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    name = "model.model.visual_projection.weight"
    assert not torch.allclose(g_big[name], g_naive[name], atol=1e-6)


class _NaNAtStep(Term):
    """A term that turns non-finite on its third call."""

    name = "probe"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def loss(self, model, feats, *, detach_params=False):
        self.calls += 1
        # NaN times the features: the NaN reaches every gradient of the image tower, so a skip branch
        # that still stepped the optimiser would change (and poison) the weights
        return {"probe": feats["image"].sum() * (float("nan") if self.calls == 3 else 0.0)}


def test_nonfinite_term_stops_the_run_naming_step_and_term(tmp_path, scenes):
    objective = Objective(ClipTerm(), [(_NaNAtStep(), 1.0)])
    trainer = _trainer(tmp_path, scenes, objective=objective, max_steps=5)
    with pytest.raises(NonFiniteLossError, match=r"step 3: term 'probe' = nan"):
        train(trainer)


def test_nonfinite_skip_drops_the_step(tmp_path, scenes):
    objective = Objective(ClipTerm(), [(_NaNAtStep(), 1.0)])
    trainer = _trainer(tmp_path, scenes, objective=objective, max_steps=3, on_nonfinite="skip")
    after_step = {}

    def snapshot(step, values):
        after_step[step] = _weights(trainer)

    result = train(trainer, on_step=snapshot)
    assert result.steps == 3 and result.skipped_steps == 1
    assert sorted(after_step) == [1, 2]  # step 3 was skipped
    got = _weights(trainer)
    for k, v in after_step[2].items():  # the skipped step left every weight as it was
        assert torch.equal(got[k], v), k
    assert not all(torch.equal(after_step[1][k], v) for k, v in after_step[2].items())  # step 2 did train
    for p in trainer.accelerator.unwrap_model(trainer.wrapped).parameters():
        assert torch.isfinite(p).all()


class _NaNGradientAtStep(Term):
    """A term whose loss is finite (0) on its third call but whose gradient is NaN (``sqrt`` at 0: an infinite slope
    times 0): the step is applied and poisons the image tower's weights; every later loss is NaN."""

    name = "probe"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def loss(self, model, feats, *, detach_params=False):
        self.calls += 1
        x = feats["image"]
        if self.calls == 3:
            return {"probe": torch.sqrt((x * 0.0).pow(2).sum())}
        return {"probe": x.sum() * 0.0}


def test_weights_that_diverge_under_skip_stop_the_run_and_are_never_saved(tmp_path, scenes):
    """on_nonfinite: skip after the weights themselves became NaN would skip every remaining step (and crash in the
    evaluation): the run stops at the next logging step naming the steps and the last good checkpoint, and no
    checkpoint holds the NaN weights."""
    from finetune.training import DivergedError

    objective = Objective(ClipTerm(), [(_NaNGradientAtStep(), 1.0)])
    trainer = _trainer(tmp_path, scenes, objective=objective, max_steps=8, on_nonfinite="skip", log_every=2,
                       checkpoint_every=2, keep_checkpoints=5)
    with pytest.raises(DivergedError, match=r"the trainable weights became NaN or infinite between step 2 and step 4 "
                                            r"\(checked at each logging step, train\.log_every\); the first non-finite "
                                            r"loss was at step 4 \(term 'clip' = nan\)\. With train\.on_nonfinite: skip "
                                            r"every later step would be skipped; the run stops here and saves nothing of "
                                            r"these weights\. The newest checkpoint, .*step-2, was saved with finite "
                                            r"weights.*lower train\.lr, set train\.grad_clip"):
        train(trainer)
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in ckpts] == ["step-2"]
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(ckpts[0] / "model.safetensors").values())


class _Stop(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_resume_reaches_bit_identical_weights(tmp_path, scenes, adapter):
    # 4 steps per epoch: the resume at step 6 is mid-epoch, so the batches already used are skipped
    common = dict(adapter=adapter, max_steps=8, checkpoint_every=3, keep_checkpoints=3)
    straight = _trainer(tmp_path / "straight", scenes, **common)
    train(straight)
    expected = _weights(straight)

    interrupted = _trainer(tmp_path / "resumed", scenes, **common)

    def stop(step, values):
        if step == 6:
            raise _Stop

    with pytest.raises(_Stop):
        train(interrupted, on_step=stop)
    assert [p.name for p in list_checkpoints(tmp_path / "resumed" / "run" / "checkpoints")] == ["step-3", "step-6"]

    resumed = _trainer(tmp_path / "resumed", scenes, **common)
    assert resumed.batches.steps_per_epoch == 4
    assert resumed.checkpoints.resume("latest")
    assert resumed.state.step == 6
    train(resumed)
    got = _weights(resumed)
    assert set(got) == set(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_resume_path_that_is_not_a_checkpoint_is_a_clear_error(tmp_path, scenes):
    trainer = _trainer(tmp_path, scenes)
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        trainer.checkpoints.resume(str(tmp_path))


def test_batch_must_split_over_accumulation(tmp_path, scenes):
    with pytest.raises(ValueError, match="accumulation_steps"):
        _trainer(tmp_path, scenes, batch_size=8, accumulation_steps=3)


def test_build_objective_from_recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"objective": {"base": "longclip"}}))
    obj = build_objective(load_recipe(path).objective)
    assert obj.base.name == "longclip" and obj.base.label_smoothing == 0.1
    assert "short_caption" in obj.needs
    copy.deepcopy(obj)


def _counting_trainer(tmp_path, objective_section: dict, *, size: int = 48):
    """A loop built as a run builds it (recipe objective, cached preprocessing, the run's collate stack: skipping
    dataset, tensor-path collator, in one data-loader worker) on tiny-clip at 248 tokens and synthetic scenes."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"objective": objective_section}))
    objective = build_objective(load_recipe(path).objective)
    torch.manual_seed(0)
    model = load_model("tiny-clip", max_text_len=248)
    objective.prepare_model(model)
    rows = load_source({"name": "synthetic", "size": size, "seed": 0, "options": {"image_size": 32}}).dataset
    rows = objective.preprocess(rows, model, cache_dir=str(tmp_path / "cache"))
    cfg = _train_cfg(tmp_path, max_steps=6, log_every=3, batch_size=8, grad_clip=1.0, logit_scale_max=4.6)
    return build_loop(_accelerator(), TrainModule(model, objective), rows, cfg, tmp_path / "run", num_workers=1)


def _reads_between_logging_steps(loop, run=None) -> list:
    """Train with a :class:`HostReads` counter active from the end of each read of the meter to the start of the
    next (the steps between logging steps: the log step's own read is the one the loop is allowed); ``run`` runs the
    loop (default :func:`train`)."""
    from tests.finetune.host_reads import HostReads

    progress = loop.progress
    read = progress.values
    windows: list[HostReads] = []

    def counted_read(*args, **kwargs):
        if windows and windows[-1]._saved:
            windows[-1].__exit__(None, None, None)
        values = read(*args, **kwargs)
        if loop.state.step < loop.batches.total_steps:
            windows.append(HostReads())
            windows[-1].__enter__()
        return values

    progress.values = counted_read
    try:
        result = (run or (lambda: train(loop)))()
    finally:
        del progress.values  # no cycle (progress -> counted_read -> loop): the run frees its loader's workers
    assert [h["step"] for h in result.history] == [1, 3, 6]
    assert len(windows) == 2  # steps 2-3 and 4-6 (the windows end where the reads of steps 3 and 6 start)
    return [e for w in windows for e in w.events]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A stand-in checkout for runs of shipped recipes (tests/recipes/shipped.py): fixtures in each dataset's format,
    tiny models and the tiny stand-ins of the files recipes name, made on first use."""
    from tests.recipes.shipped import Project

    root = tmp_path_factory.mktemp("project")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLIPKIT_CACHE", str(root / "cache"))
        yield Project(root)


#: every method, as ``(recipe, overrides beyond the as-shipped ones)``: its shipped recipe run by
#: ``finetune/run.py`` as shipped (tests/recipes/shipped.py: fixtures in its dataset's format, its family's tiny
#: model, tiny random-weight FastSAM / YOLOS / SFCN where it names them), and for every case the loop's cadence
#: (6 steps, a read at steps 1, 3 and 6), a CPU batch of 8 and no evaluation sets. The variants bench/loop.py
#: measures change the model's text length (clip-77) or StructXLIP's region encoding (pool); the NaFlex case runs
#: the SigLIP2 recipe on the NaFlex architecture of the family.
METHODS = {
    "clip-77": ("longclip_docci", ["model.max_text_len=77"]),
    "clip-248": ("longclip_docci", []),
    "lora": ("structxlip_lora_docci", []),
    "dora": ("structxlip_dora_docci", []),
    "structxlip-crop": ("structxlip_docci", []),
    "structxlip-pool": ("structxlip_docci", ["objective.terms.structxlip.regions.encode=pool"]),
    "fastgoal": ("fastgoal_docci", []),
    "grm": ("grm_clip_lora_docci", []),
    "flair": ("flair_cc3m_recap", []),
    "fcast": ("fcast_cc3m_recap", []),
    "siglip2": ("structxlip_siglip2_docci", []),
}
#: the runs whose attention shapes are checked (test_a_run_brings_no_new_attention_shape_after_its_warm_up): the
#: methods but clip-77 and dora (the shapes of clip-248 and lora), and GRM's own setting
SHAPE_RUNS = [m for m in METHODS if m not in ("clip-77", "dora")] + ["grm-coco"]
RUNS = {**METHODS, "grm-coco": ("grm_coco", [])}
_RUNS_DONE: dict[str, dict] = {}


def _first_text_block(model):
    inner = model.model
    if hasattr(inner, "text_model"):
        text = inner.text_model
        return (text.encoder.layer if hasattr(text.encoder, "layer") else text.encoder.layers)[0]
    if hasattr(inner, "transformer"):
        return inner.transformer.resblocks[0]
    return inner.text.blocks[0]  # F-CAST's chunk encoder


def shipped_run(method: str, project, capsys) -> dict:
    """``method``'s shipped recipe run by ``finetune/run.py`` (:data:`RUNS`) for 6 steps with the warm-up a GPU run
    has, once per module: what the tests that check different things of that run read. ``reads``: the host reads
    between logging steps (:func:`_reads_between_logging_steps`); ``warm``: the attention shapes of the warm-up;
    ``steps``: per step its attention shapes, text-tower passes and text kinds; ``metrics``: the run's metrics."""
    if method in _RUNS_DONE:
        return _RUNS_DONE[method]
    import logging

    from finetune.cli.train import main
    from finetune.models.backends.attention import SdpaCalls
    from finetune.training import TrainStep
    from finetune.training.step_setup import StepSetup
    from tests.recipes.shipped import RECIPES_DIR, as_shipped_overrides, clear_run, output_dir, \
        prerequisites_as_shipped

    name, extra = RUNS[method]
    path = RECIPES_DIR / f"{name}.yaml"
    overrides = [*as_shipped_overrides(path, project), "train.log_every=3", "train.batch_size=8", "eval.sets=[]",
                 *extra]
    original, original_step, original_warm = FinetuneRecipe.train, TrainStep.__call__, TrainStep.warm_up
    record: dict = {"reads": [], "warm": set(), "steps": []}
    passes = [0]

    def counted(self, on_step=None):
        loop = self.ctx.loop
        loop.batches.total_steps = min(loop.batches.total_steps, 6)  # after the schedule was made from the recipe
        handle = _first_text_block(loop.trained_model()).register_forward_pre_hook(
            lambda *_: passes.__setitem__(0, passes[0] + 1))
        result = []
        try:
            record["reads"].extend(_reads_between_logging_steps(
                loop, lambda: result.append(original(self, on_step)) or result[0]))
        finally:
            handle.remove()
        return result[0]

    def counted_warm(self, batch):
        with SdpaCalls() as calls:
            original_warm(self, batch)
        record["warm"].update(calls.shapes)

    def counted_step(self, batch, step):
        passes[0] = 0
        with SdpaCalls() as calls:
            original_step(self, batch, step)
        record["steps"].append({"shapes": set(calls.shapes), "passes": passes[0], "calls": len(calls.shapes),
                                "kinds": len(batch["_text_plan"].lengths)})

    out = output_dir(path, project)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logging.getLogger("xlipkit"), "handlers", [])
        mp.chdir(project.root)
        prerequisites_as_shipped(mp, project)
        mp.setattr(StepSetup, "warms_up", True)  # as on a GPU
        mp.setattr(FinetuneRecipe, "train", counted)
        mp.setattr(TrainStep, "warm_up", counted_warm)
        mp.setattr(TrainStep, "__call__", counted_step)
        clear_run(out)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        try:
            assert main([f"recipes/{path.name}", *overrides]) == 0, capsys.readouterr().err[-3000:]
        finally:  # the recipe's mixed precision must not stay in accelerate's state for the next test's Accelerator
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    record["metrics"] = json.loads((out / "metrics.json").read_text())
    _RUNS_DONE[method] = record
    return record


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_the_loop_reads_no_tensor_between_logging_steps(method, project, capsys):
    """Every method's shipped recipe, run by ``finetune/run.py``, reads no tensor back to the host between two
    logging steps (``train.log_every``): no ``.item()`` / ``.tolist()`` / ``.cpu()``, no ``nonzero``, boolean-mask
    indexing or other op whose size depends on values (tests/finetune/host_reads.py), in forward, backward or the
    optimiser step, counted in the training process (the data-loader workers work on the CPU)."""
    run = shipped_run(method, project, capsys)
    assert run["metrics"]["steps"] == 6
    assert not run["reads"], f"{method}: host reads between logging steps:\n" + "\n".join(
        f"{e.what}: {e.where}" for e in run["reads"])


@pytest.mark.parametrize("method", [m if m == "structxlip-pool" else pytest.param(m, marks=pytest.mark.slow)
                                    for m in SHAPE_RUNS])  # structxlip-pool's run takes under ~20 s alone
def test_a_run_brings_no_new_attention_shape_after_its_warm_up(method, project, capsys):
    """Every method's shipped recipe, run by finetune/run.py for 6 steps (batch 8, the project's fixtures and tiny
    towers) with the warm-up a GPU run has: every attention shape a step runs was run by the warm-up or the first
    step, every step runs the text tower once per text kind, and the run's metrics record the planned lengths and
    the attention backend (the same runs as the host-reads test above)."""
    from finetune.objectives.shapes import TEXT

    run = shipped_run(method, project, capsys)
    steps = run["steps"]
    assert len(steps) == 6 and all(s["calls"] for s in steps)
    known = run["warm"] | steps[0]["shapes"]
    for i, s in enumerate(steps[1:], start=2):
        assert s["shapes"] <= known, f"{method}: step {i}: new attention shapes {s['shapes'] - known}"
    assert all(s["passes"] == s["kinds"] >= 1 for s in steps), [(s["passes"], s["kinds"]) for s in steps]
    throughput = run["metrics"]["throughput"]
    assert throughput["shapes"]["buckets"][-1] == throughput["shapes"]["text_length"]
    assert TEXT in throughput["shapes"]["planned"]
    if method.startswith("structxlip"):  # planned from the run's (wrapped) training set
        assert set(throughput["shapes"]["capacities"]) == {"structxlip/chunks", "structxlip/regions"}
    assert throughput["attention"]["setting"] == "auto" and throughput["attention"]["first_step_kernels"]


@pytest.mark.slow
def test_compile_gives_the_losses_of_eager(tmp_path, scenes):
    """train.compile: the towers' blocks compiled (static shapes, the run's fixed batch shapes) train to the same
    losses as eager, step for step."""
    from finetune.models.compile import transformer_blocks

    eager = _trainer(tmp_path / "eager", scenes, max_steps=3, log_every=1)
    compiled = _trainer(tmp_path / "compiled", scenes, max_steps=3, log_every=1, compile=True)
    blocks = transformer_blocks(compiled.module.model)
    assert len(blocks) == 4 and all(b._compiled_call_impl is not None for b in blocks)  # 2 + 2 CLIP layers
    a, b = train(eager), train(compiled)
    assert [h["step"] for h in b.history] == [1, 2, 3]
    for x, y in zip(a.history, b.history):
        for key in ("loss", "clip"):
            assert y[key] == pytest.approx(x[key], abs=1e-3), (x["step"], key)


class _EpochProbe(Term):
    """Writes the epoch its copy of the term was told into every example (``prepare`` runs where the batch is
    collated: in the data-loader worker)."""

    name = "probe"
    produces = frozenset({"probe_epoch"})

    def __init__(self) -> None:
        super().__init__()
        self.epoch = -1

    def set_epoch(self, epoch):
        self.epoch = epoch

    def prepare(self, example):
        return {"probe_epoch": self.epoch}

    def collate(self, examples, model):
        return {"probe_epoch": torch.tensor([e["probe_epoch"] for e in examples])}

    def loss(self, model, feats, *, detach_params=False):
        return {"probe": feats["image"].sum() * 0.0}


def test_persistent_workers_prepare_each_batch_for_its_epoch(tmp_path, scenes):
    """32 scenes, batch 8: 4 steps per epoch; one persistent worker collates steps 1-6 ahead of time and still
    prepares steps 5-6 for epoch 1, with the same batches as one shuffled pass per epoch."""
    objective = Objective(ClipTerm(), [(_EpochProbe(), 0.0)])
    trainer = _trainer(tmp_path, scenes, objective=objective, max_steps=6, num_workers=1)
    seen = []
    step = trainer.step.forward_backward
    trainer.step.forward_backward = lambda batch: (seen.append((batch["probe_epoch"].tolist(), batch["ids"])),
                                                   step(batch))[1]
    train(trainer)
    assert [epochs for epochs, _ in seen] == [[0] * 8] * 4 + [[1] * 8] * 2
    ids = [i for _, batch_ids in seen for i in batch_ids]
    order = [torch.randperm(32, generator=torch.Generator().manual_seed(epoch)).tolist() for epoch in (0, 1)]
    assert ids == [scenes[i]["id"] for i in order[0] + order[1][:16]]


class _LoopProbe(Term):
    """Notes, in the training process, the epoch its loss sees at each step and how often the loop calls its
    per-step work (``after_optimizer_step``)."""

    name = "probe"

    def __init__(self) -> None:
        super().__init__()
        self.epoch, self.seen, self.after = -1, [], 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def after_optimizer_step(self):
        self.after += 1

    def loss(self, model, feats, *, detach_params=False):
        self.seen.append(self.epoch)
        return {"probe": feats["image"].sum() * 0.0}


def test_the_loop_tells_the_terms_each_epoch_before_its_steps_and_calls_their_step_work(tmp_path, scenes):
    """32 scenes, batch 8: the terms in the training process (the data-loader worker has its own copy) compute the
    losses of steps 1-4 in epoch 0 and of steps 5-6 in epoch 1 (per-epoch schedules: StructXLIP's official decay,
    GRM's sum-then-max), and their clamps run after each of the 6 optimiser steps."""
    probe = _LoopProbe()
    trainer = _trainer(tmp_path, scenes, objective=Objective(ClipTerm(), [(probe, 0.0)]), max_steps=6, num_workers=1)
    train(trainer)
    assert probe.seen == [0] * 4 + [1] * 2
    assert probe.after == 6


@pytest.mark.slow
def test_a_run_reports_its_steady_throughput_and_flops(tmp_path, scenes):
    trainer = _trainer(tmp_path, scenes, max_steps=4, log_every=2)
    result = train(trainer)
    t = result.throughput
    # marks at steps 1, 2, 4: the steady window is steps 1-4 (the first step, with its warm-up, left out)
    assert t["steady_steps"] == 3 and t["steady_samples_per_s"] > 0 and 0 <= t["data_wait_share"] <= 1
    # the first step's FLOPs: ViT and text tower forward and backward of tiny-clip on 8 samples, more than the
    # image tower's patch projection alone
    patches = 8 * 16 * (3 * 8 * 8) * 32 * 2 * 3
    assert t["flops_per_sample"] * 8 > patches and t["tflops_per_device"] > 0
    assert t["mfu"] is None  # no known peak on a CPU
    assert trainer.state.flops_per_step == t["flops_per_sample"] * 8


class _TokenizeInWorker(torch.utils.data.Dataset):
    """Batch-encodes long captions with a Hugging Face fast tokenizer in the worker, as the collators do."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> tuple[int, int, str | None]:
        import os

        from transformers import CLIPTokenizerFast

        tok = CLIPTokenizerFast.from_pretrained(self.folder)
        before = len(os.listdir(f"/proc/{os.getpid()}/task"))
        tok(["a long caption about a red car beside a blue house with many windows " * 4] * 512, max_length=248,
            truncation=True, padding="max_length")
        return before, len(os.listdir(f"/proc/{os.getpid()}/task")), os.environ.get("TOKENIZERS_PARALLELISM")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_training_workers_tokenize_on_one_thread(tmp_path, monkeypatch):
    """A fast tokenizer in a data-loader worker would start a thread pool as wide as the machine (8 workers on 16
    cores: ~130 threads starving the training process's kernel launches); the trainer's workers stay on one."""
    import subprocess
    import sys

    from finetune.training import worker_signals

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    folder = tmp_path / "tiny-clip"  # written by another process: tokenizers disables the pool in a fork of a
    # process that already used it, and here the training process has not (it only loaded the tokenizer)
    subprocess.run([sys.executable, "-c", "import sys; from finetune.models.registry import save_tiny; "
                    "save_tiny('tiny-clip', sys.argv[1])", str(folder)], check=True, capture_output=True)
    [(before, after, env)] = list(torch.utils.data.DataLoader(_TokenizeInWorker(str(folder)), batch_size=None, num_workers=1,
                                             worker_init_fn=worker_signals()))
    assert env == "false" and after <= before, (before, after)
