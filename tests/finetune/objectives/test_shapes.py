"""Batch shapes by length buckets (issues 29 and 37, finetune.objectives.shapes): each text pass is padded to the
smallest planned bucket length that holds its longest row; the buckets are planned before training from the model
and the training set; padding to any bucket changes no loss and no gradient (to 1e-5, every method, GRM's Gumbel
noise and F-CAST's dropout included); the warm-up runs every planned length before the first step, so that no
later step brings a new attention shape; evaluation encodes in passes of a few shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from finetune import load_model
from finetune.config import load_recipe
from finetune.data.collate import Collator
from finetune.data.sources import load_source
from finetune.models.backends.attention import SdpaCalls
from finetune.objectives import build_objective
from finetune.objectives.base import TERM_PLANS, TEXT_PLAN, Term
from finetune.objectives.encoders import TextPlan, text_passes
from finetune.objectives.planning import PlannedCollate
from finetune.objectives.shapes import (SHORT, TEXT, BatchShapes, ShapeScan, bucket_of, default_buckets,
                                        grouped_buckets, pad_rows, plan_shapes, round_up, run_buckets)

RECIPES = Path(__file__).resolve().parents[3] / "recipes"

pytestmark = pytest.mark.usefixtures("quiet_datasets")


def _objective(section: dict, tmp_path: Path):
    path = tmp_path / "objective.yaml"
    path.write_text(yaml.safe_dump({"objective": section}))
    return build_objective(load_recipe(path).objective)


def _shipped(name: str) -> dict:
    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())


def _scenes(size: int = 8, **options):
    return load_source({"name": "synthetic", "size": size, "seed": 0, "options": {"image_size": 48, **options}}).dataset


def _tokens(model, text: str) -> int:
    return int(model.tokenize([text]).attention_mask.sum())


# -- the bucket lengths -------------------------------------------------------------------------------------------
def test_the_default_buckets_are_multiples_of_32_and_the_models_length():
    assert default_buckets(248) == (32, 64, 96, 128, 160, 192, 224, 248)
    assert default_buckets(77) == (32, 64, 77) and default_buckets(64) == (32, 64) and default_buckets(20) == (20,)
    assert run_buckets(512) == tuple(range(32, 513, 32))
    assert run_buckets(248, [16, 48]) == (16, 48, 248)  # the model's length is always the last
    assert run_buckets(77, [40, 77]) == (40, 77)
    assert [bucket_of(n, (32, 64, 77)) for n in (1, 32, 33, 70, 77)] == [32, 32, 64, 77, 77]


@pytest.mark.parametrize("setting,message", [
    ([], "train.text_buckets: an empty list"),
    ([0, 32], "train.text_buckets: 0 is not a whole number of tokens >= 1"),
    ([64, 32], r"train.text_buckets: \[64, 32\] must be strictly increasing"),
    ([32, 300], "train.text_buckets: 300 is above the model's 248 text positions"),
])
def test_a_bad_bucket_list_is_a_clear_error(setting, message):
    with pytest.raises(ValueError, match=message) as info:
        run_buckets(248, setting)
    assert "e.g. train.text_buckets: [32, 64, 96, 128, 160, 192, 224, 248]" in str(info.value)


def test_a_recipes_bucket_list_is_checked_when_it_is_read(tmp_path):
    from finetune.config import RecipeError

    assert load_recipe(RECIPES / "quickstart.yaml", ["train.text_buckets=[64, 128]"]).train.text_buckets == [64, 128]
    for bad, message in (("[64, 32]", "must be strictly increasing"), ("[32, 249]", "above `model.max_text_len`"),
                         ("[]", "is an empty list")):
        with pytest.raises(RecipeError, match=message):
            load_recipe(RECIPES / "quickstart.yaml", [f"train.text_buckets={bad}"])


# -- planning -----------------------------------------------------------------------------------------------------
class _Extra(Term):
    """A term whose requests tokenise one more text per example (``extra``), in the caption kind."""

    name = "extra"

    def shape_scan(self, dataset, model):
        return ShapeScan(texts={TEXT: [[row["extra"]] for row in dataset]})


def test_a_kind_plans_the_buckets_of_its_examples_longest_texts(tmp_path):
    """Captions and first sentences of a training set: each kind plans the bucket of each example's longest text of
    that kind (an example's extra text in the caption kind counts with its caption), and no other; the scan is not
    counted in the model's truncation statistics."""
    from finetune.objectives import Objective
    from finetune.objectives.contrastive import LongClipTerm

    model = load_model("tiny-clip", max_text_len=248)
    long = " ".join(["Two small green triangles beside a large blue house."] * 10)
    rows = [{"caption": "A red circle. A square below it.", "extra": "A dog."},
            {"caption": "A dog", "extra": " ".join(["A red square on a white background."] * 6)},
            {"caption": long, "extra": "x"}]
    counts = {"short": _tokens(model, rows[0]["caption"]), "extra": _tokens(model, rows[1]["extra"]),
              "long": _tokens(model, long), "sentence": _tokens(model, "Two small green triangles beside a large "
                                                                     "blue house.")}
    assert counts["short"] <= 32 and 32 < counts["extra"] <= 64 and 96 < counts["long"] <= 128
    objective = Objective(LongClipTerm(), [(_Extra(), 1.0)])
    model.truncation_stats = {"captions": 0, "truncated": 0}
    shapes = plan_shapes(objective, model, rows)
    assert model.truncation_stats == {"captions": 0, "truncated": 0}
    # the buckets 32, 64 and 128 are reached (96 and 160-248 are not), each cut to its longest text, rounded up to 8
    tight = tuple(round_up(counts[k], 8) for k in ("short", "extra", "long"))
    assert shapes.planned[TEXT] == tight and tight[0] <= 32 and 32 < tight[1] <= 64 and 96 < tight[2] <= 128
    assert shapes.planned[SHORT] == (round_up(counts["sentence"], 8),)  # the longest first sentence
    assert shapes.buckets == default_buckets(248) and shapes.text_length == 248
    # a pass takes the smallest planned length that holds its longest row, else the next bucket (a new shape)
    assert [shapes.length(TEXT, n) for n in (5, 33, 65, tight[2] + 1, 129)] == [*tight, 128, 160]
    custom = plan_shapes(objective, model, rows, buckets=[48, 96])
    assert custom.buckets == (48, 96, 248) and custom.planned[TEXT] == tight  # 16 of 48, 56 of 96, 112 of 248
    # train.group_by_length groups by each example's longest text of the caption kind, measured by this scan
    assert shapes.text_lengths == (counts["short"], counts["extra"], counts["long"])
    grouped = plan_shapes(objective, model, rows, grouped=True)  # the finer ladder, each bucket cut to its longest
    assert grouped.buckets == grouped_buckets(248) and grouped.text_lengths == shapes.text_lengths
    assert grouped.planned[TEXT] == tuple(min(bucket_of(n, grouped.buckets), round_up(n, 8))
                                          for n in (counts["short"], counts["extra"], counts["long"]))
    assert plan_shapes(objective, model, rows, buckets=[48, 96], grouped=True).buckets == (48, 96, 248)


def test_the_grouped_ladder_has_four_lengths_per_doubling():
    assert grouped_buckets(248) == (8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 248)
    assert grouped_buckets(512)[-6:] == (224, 256, 320, 384, 448, 512) and grouped_buckets(77)[-3:] == (56, 64, 77)
    assert grouped_buckets(8) == (8,) and grouped_buckets(5) == (5,)


def test_towers_that_read_their_padding_and_streams(tmp_path):
    """SigLIP pools the last position of captions padded to its full length: every pass keeps it. A stream (nothing
    to scan before training) plans every bucket."""
    objective = _objective({"base": "longclip"}, tmp_path)
    siglip = load_model("tiny-siglip")
    shapes = plan_shapes(objective, siglip, _scenes())
    assert shapes.lengths(TEXT) == shapes.lengths(SHORT) == (siglip.max_text_len,)
    clip = load_model("tiny-clip", max_text_len=248)
    assert plan_shapes(objective, clip, None).lengths(TEXT) == default_buckets(248)

    class Stream(torch.utils.data.IterableDataset):  # a stream may have a length; its rows are not read
        def __len__(self):
            return 3

        def __iter__(self):
            raise AssertionError("a stream is not read before training")

    planned = plan_shapes(objective, clip, Stream())
    assert planned.lengths(TEXT) == planned.lengths(SHORT) == default_buckets(248)


def test_the_text_plan_is_made_on_the_host_one_pass_per_kind(tmp_path):
    """Objective.plan (run where the batch is collated) gives each kind's length and the real and computed text
    tokens; the step then runs one pass per kind at those lengths."""
    model = load_model("tiny-clip", max_text_len=248)
    objective = _objective({"base": "longclip"}, tmp_path)
    rows = [dict(r) for r in _scenes(4)]
    objective.set_shapes(plan_shapes(objective, model, rows))
    batch = Collator(model, objective)(rows)
    plan = objective.plan(model, batch)
    longest = int(batch["attention_mask"].sum(-1).max())
    short = int(batch["short_attention_mask"].sum(-1).max())
    shapes = objective.shapes
    assert plan.right_padded
    assert plan.lengths == {TEXT: shapes.length(TEXT, longest), SHORT: shapes.length(SHORT, short)}
    assert longest <= plan.lengths[TEXT] < longest + 8 + 32 and short <= plan.lengths[SHORT] <= 32
    assert plan.real_tokens == int(batch["attention_mask"].sum() + batch["short_attention_mask"].sum())
    assert plan.computed_tokens == 4 * plan.lengths[TEXT] + 4 * plan.lengths[SHORT]
    _, reqs, _ = objective.requests(batch)
    passes = text_passes(model, reqs, objective.shapes, plan)
    assert [(p.keys, p.length) for p in passes] == [(("text",), plan.lengths[TEXT]),
                                                     (("short_text",), plan.lengths[SHORT])]


def test_a_sample_beyond_the_planned_capacity_is_a_clear_error(tmp_path):
    objective = _objective(_shipped("quickstart")["objective"], tmp_path)
    model = load_model("tiny-clip", max_text_len=248)
    rows = objective.preprocess(_scenes(), model, cache_dir=str(tmp_path / "cache"))
    shapes = plan_shapes(objective, model, rows)
    most = max(len(c) for c in rows["chunks"])
    assert shapes.capacities == {"structxlip/chunks": most, "structxlip/regions": most}  # one object per sentence
    objective.set_shapes(BatchShapes(shapes.buckets, shapes.planned,
                                     {**shapes.capacities, "structxlip/chunks": most - 1}))
    with pytest.raises(ValueError, match=f"has {most} chunks, more than the {most - 1} per sample planned"):
        Collator(model, objective)([rows[i] for i in range(len(rows))])
    with pytest.raises(ValueError, match="3 rows exceed the planned capacity of 2"):
        pad_rows(torch.zeros(3, 4), 2)


# -- padding changes nothing ----------------------------------------------------------------------------------------
def _recipe_objective(name: str):
    return lambda: _shipped(name)["objective"]


#: method -> (objective section, model): each method's shipped objective on a tiny model of its family
LOSS_CASES = {
    "clip": ({"base": "clip"}, "tiny-clip"),
    "siglip": ({"base": "siglip"}, "tiny-siglip"),
    "longclip": (_recipe_objective("longclip_docci"), "tiny-clip"),
    "structxlip-pool": (_recipe_objective("quickstart"), "tiny-clip"),
    "structxlip-crop": ({"base": "clip", "terms": {"structxlip": {"regions": {
        "source": "dataset", "k": 3, "per_image": "all", "encode": "crop"}}}}, "tiny-clip"),
    "structxlip-official": ({"base": "clip", "terms": {"structxlip": {"compat": "official", "regions": {
        "source": "segmenter", "k": 3, "per_image": "all", "encode": "crop"}}}}, "tiny-clip"),
    "fastgoal": (_recipe_objective("fastgoal_tiny_synthetic"), "tiny-clip"),
    "grm": (_recipe_objective("grm_tiny_synthetic"), "tiny-clip"),
    "grm-bert": (_recipe_objective("grm_coco"), "tiny-vision-text-vit"),
    "flair": (_recipe_objective("flair_tiny_synthetic"), "tiny-flair"),
    "fcast": (_recipe_objective("fcast_tiny_synthetic"), "fcast-tiny"),
}
#: cases over ~2 s on the shared 2-core CPU (preprocessing, several buckets)
SLOW_LOSS_CASES = {"structxlip-crop", "structxlip-official", "fastgoal", "fcast"}


def _load(name: str):
    if name == "tiny-clip":
        return load_model(name, max_text_len=248)
    return load_model(name, family="fcast") if name == "fcast-tiny" else load_model(name)


def _train_mode(model) -> None:
    """Training mode (GRM's Gumbel noise, F-CAST's GraphPool dropout) with BERT's own dropout off: BERT draws its
    dropout over the padded (n, L, W) states inside transformers, which no bucket choice can make padding-free."""
    model.train()
    text_model = getattr(model.model, "text_model", None)
    if model.backend == "vision_text" and text_model is not None:
        text_model.eval()


def _losses_and_grads(objective, model, batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    params = [(n, p) for n, p in [*model.named_parameters(), *objective.named_parameters()] if p.requires_grad]
    for _, p in params:
        p.grad = None
    torch.manual_seed(1234)
    values = objective.loss(model, objective.encode(model, batch))
    values["loss"].backward()
    grads = {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
    return {k: float(v.detach()) for k, v in values.items()}, grads


def loose_plan_segments(objective, model, examples) -> int:
    """The CAST segments of ``examples`` as counted without planned shapes."""
    shapes = objective.shapes
    objective.set_shapes(None)
    try:
        return PlannedCollate(Collator(model, objective), objective, model)([dict(e) for e in examples])[
            TERM_PLANS]["fcast"]["segments"]
    finally:
        objective.set_shapes(shapes)


def _bucket_plans(objective, plan: TextPlan) -> list[dict[str, int]]:
    """Every planned bucket that holds each kind's rows, the i-th of every kind together (a kind with fewer repeats
    its last)."""
    fits = {k: [n for n in objective.shapes.buckets if n >= length] for k, length in plan.lengths.items()}
    count = max(len(v) for v in fits.values())
    return [{k: v[min(i, len(v) - 1)] for k, v in fits.items()} for i in range(count)]


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_LOSS_CASES else m
                                    for m in LOSS_CASES])
def test_every_bucket_gives_the_same_losses_and_gradients(method, tmp_path):
    """The same examples collated as they come (no planned shapes: each pass at its own widths and rows) and padded
    to every bucket that holds them (rows to the planned capacities) give every loss value and every gradient to
    1e-5 (of each gradient's largest entry), in training mode: GRM's Gumbel noise is drawn for max_text_len positions and F-CAST's GraphPool dropout
    for the planned segment capacity, so padding does not decide which noise lands on a real token. The scenes
    with the fewest objects (4 of 4-5) make StructXLIP's batch as it comes free of padded rows."""
    from dataclasses import replace

    section, name = LOSS_CASES[method]
    objective = _objective(section() if callable(section) else section, tmp_path)
    torch.manual_seed(0)
    model = _load(name)
    objective.prepare_model(model)
    scenes = _scenes(image_size=64 if name == "fcast-tiny" else 48)
    if method == "grm-bert":  # COCO-like captions (two sentences) within the tiny BERT's 128 positions
        scenes = scenes.map(lambda r: {"caption": " ".join(r["sentences"][:2])})
    rows = objective.preprocess(scenes, model, cache_dir=str(tmp_path / "cache"))
    examples = [rows[i] for i in range(len(rows)) if len(rows[i]["objects"]) == 4]
    assert len(examples) == 3
    for term in objective.all_terms:
        term.set_epoch(0)
    _train_mode(model)
    loose, loose_grads = _losses_and_grads(objective, model, PlannedCollate(Collator(model, objective), objective,
                                                                            model)([dict(e) for e in examples]))
    objective.set_shapes(plan_shapes(objective, model, rows))
    batch = PlannedCollate(Collator(model, objective), objective, model)([dict(e) for e in examples])
    plan = batch[TEXT_PLAN]
    plans = _bucket_plans(objective, plan)
    if method == "fcast":  # the segments too: the batch's own count, then the planned capacity
        assert loose_plan_segments(objective, model, examples) < batch[TERM_PLANS]["fcast"]["segments"] == 48
    assert plan.lengths and (len(plans) > 1 or name == "tiny-siglip")
    for lengths in plans:
        values, grads = _losses_and_grads(objective, model, {**batch, TEXT_PLAN: replace(plan, lengths=lengths)})
        assert set(values) == set(loose), lengths
        for key in loose:
            assert values[key] == pytest.approx(loose[key], rel=1e-5, abs=1e-5), (lengths, key)
        assert grads.keys() == loose_grads.keys()
        for key, grad in loose_grads.items():
            # 1e-5 of the tensor's own scale: float32 sums over other shapes round differently (a visual
            # cls_token gradient of 45 moved by 3e-4 on one CPU), a padding-dependent draw moves it by O(1)
            scale = max(1.0, float(grad.abs().max()))
            torch.testing.assert_close(grads[key], grad, rtol=0, atol=1e-5 * scale, msg=f"{lengths}: {key}")


# -- the warm-up: no new shape after it -----------------------------------------------------------------------------
def varied_scenes(size: int = 12):
    """Synthetic scenes whose captions keep their first 1-6 sentences: 20-100 tokens, so that batches of two take
    different bucket lengths from step to step."""
    return _scenes(size, image_size=32).map(
        lambda r, i: {"caption": " ".join(r["sentences"][: i % 6 + 1])}, with_indices=True)


def _trainer(tmp_path, objective: dict, rows, **train):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    from finetune.training import TrainModule, build_loop

    recipe = {"objective": objective, "train": {"lr": 1e-4, "batch_size": 2, "max_steps": 6, "trackers": [],
                                                "log_every": 1, "seed": 0, **train}}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    loaded = load_recipe(path)
    objective = build_objective(loaded.objective)
    torch.manual_seed(0)
    model = load_model("tiny-clip", max_text_len=248)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    return build_loop(acc, TrainModule(model, objective), rows, loaded.train, tmp_path / "run")


def _recorded_run(loop, monkeypatch) -> dict:
    """Train, noting the SDPA shapes of the warm-up and of every step, and the text passes of every step."""
    from finetune.training import FinetuneRecipe, TrainStep

    seen: dict = {"warmup": set(), "steps": [], "passes": [], "lengths": []}
    phase = {"now": "warmup"}
    step, block = loop.step.forward_backward, loop.module.model.model.text_model.encoder.layers[0]
    handle = block.register_forward_pre_hook(lambda *_: seen["passes"].__setitem__(-1, seen["passes"][-1] + 1)
                                             if phase["now"] == "step" else None)

    def recorded(batch):
        with SdpaCalls() as calls:
            out = step(batch)
        if phase["now"] == "warmup":
            seen["warmup"] |= set(calls.shapes)
        else:
            seen["steps"][-1] |= set(calls.shapes)
        return out

    original = TrainStep.__call__

    def counted(self, batch, n):
        phase["now"] = "step"
        seen["steps"].append(set())
        seen["passes"].append(0)
        seen["lengths"].append(dict(batch[TEXT_PLAN].lengths))
        original(self, batch, n)

    loop.step.forward_backward = recorded
    try:
        with monkeypatch.context() as patch:
            patch.setattr(TrainStep, "__call__", counted)
            seen["result"] = FinetuneRecipe.from_loop(loop).train()
    finally:
        handle.remove()
    return seen


@pytest.mark.slow
def test_after_the_warm_up_no_step_brings_a_new_attention_shape(tmp_path, monkeypatch):
    """Long-CLIP on captions of 20-100 tokens, batches of two: the steps take different caption lengths, and every
    attention shape a step runs was run by the warm-up or the first step; each step runs one text pass per kind.
    Without the warm-up the same run meets new shapes after its first step; with it the losses are the same (the
    warm-up updates nothing and restores the RNG state)."""
    from finetune.training.step_setup import StepSetup

    rows = varied_scenes()
    warm = _trainer(tmp_path / "warm", {"base": "longclip"}, rows)
    assert not warm.setup.warms_up  # a CPU without compiled blocks: a new shape costs nothing there
    monkeypatch.setattr(StepSetup, "warms_up", True)  # as on a GPU
    run = _recorded_run(warm, monkeypatch)
    lengths = run["lengths"]
    assert len({tuple(sorted(x.items())) for x in lengths}) > 1, lengths  # the steps do take different lengths
    known = run["warmup"] | run["steps"][0]
    for i, shapes in enumerate(run["steps"][1:], start=2):
        assert shapes <= known, f"step {i}: new attention shapes {shapes - known}"
    assert run["passes"] == [2] * 6  # captions and first sentences: one pass each
    assert run["result"].throughput["shapes"]["warmup_passes"] >= 1

    monkeypatch.setattr(StepSetup, "warms_up", False)
    cold = _recorded_run(_trainer(tmp_path / "cold", {"base": "longclip"}, rows), monkeypatch)
    assert cold["lengths"] == lengths
    assert any(not s <= cold["steps"][0] for s in cold["steps"][1:])  # the check above can fail
    for warm, plain in zip(run["result"].history, cold["result"].history):
        assert warm["loss"] == pytest.approx(plain["loss"], rel=1e-6), warm["step"]


@pytest.mark.slow
def test_a_compiled_run_compiles_once_per_planned_length_and_never_after_the_warm_up(tmp_path, monkeypatch):
    """train.compile on the varied captions: dynamo compiles the blocks once per shape the warm-up and the first
    step run (the image pass, each planned caption length) and never afterwards, although the steps take different
    lengths; the recompile limit is raised for the planned shapes. aot_eager (dynamo and AOT autograd, no code
    generation) keeps it within seconds; dynamo's guards and recompilations are the same with any backend."""
    import finetune.training.step_setup as step_setup
    from finetune.models.compile import compiled_graphs
    from finetune.training import FinetuneRecipe, TrainStep

    monkeypatch.setattr(step_setup, "compile_options",
                        lambda setting: {"backend": "aot_eager", "dynamic": False} if setting else None)
    torch._dynamo.reset()
    before = compiled_graphs()
    loop = _trainer(tmp_path, {"base": "clip"}, varied_scenes(), compile=True)
    planned = loop.setup.shapes.lengths(TEXT)
    assert len(planned) >= 3 and torch._dynamo.config.recompile_limit >= 2 * (len(planned) + 1)
    graphs, step = [], TrainStep.__call__

    def counted(self, batch, n):
        step(self, batch, n)
        graphs.append(compiled_graphs() - before)

    monkeypatch.setattr(TrainStep, "__call__", counted)
    seen = []
    original_step = loop.step.forward_backward
    loop.step.forward_backward = lambda batch: seen.append(batch[TEXT_PLAN].lengths[TEXT]) or original_step(batch)
    result = FinetuneRecipe.from_loop(loop).train()
    assert result.steps == 6 and len(set(seen[-6:])) > 1  # the steps take different caption lengths
    assert set(seen) == set(planned)  # warm-up and steps together ran every planned length
    assert graphs == [graphs[0]] * 6, graphs  # nothing compiled after the warm-up and the first step
    assert 0 < graphs[0] <= len(planned) + 1  # at most one graph per planned text length, and the image pass
    assert result.throughput["compile"]["recompile_limit"] == torch._dynamo.config.recompile_limit


# -- runs of every method's shipped recipe: shapes per step, text passes: in tests/finetune/training/test_trainer.py
# (test_a_run_brings_no_new_attention_shape_after_its_warm_up), which checks them on the runs its host-reads test
# makes, one run per method


# -- evaluation ------------------------------------------------------------------------------------------------
def test_evaluation_encodes_in_passes_of_bucket_lengths():
    """encode_for_retrieval: every image pass and every text pass has batch_size rows (the last ones filled), each
    text pass padded to the smallest default bucket that holds its longest caption; the embeddings are those of each
    row encoded alone."""
    from finetune.evaluation.encode import encode_for_retrieval

    model = load_model("tiny-clip", max_text_len=248).eval()
    rows = [{"id": str(i), "image": r["image"], "captions": [r["caption"], r["caption"].split(".")[0]]}
            for i, r in enumerate(_scenes(5))]
    captions = [c for r in rows for c in r["captions"]]
    longest = [max(_tokens(model, c) for c in captions[i:i + 4]) for i in range(0, 10, 4)]
    seen = {"image": set(), "text": []}
    encode_image, encode_text = model.encode_image, model.encode_text

    def image(pixel_values, **kwargs):
        seen["image"].add(tuple(pixel_values.shape))
        return encode_image(pixel_values, **kwargs)

    def text(input_ids, attention_mask=None, **kwargs):
        seen["text"].append(tuple(input_ids.shape))
        return encode_text(input_ids, attention_mask, **kwargs)

    model.encode_image, model.encode_text = image, text
    out = encode_for_retrieval(model, rows, batch_size=4)
    assert seen["image"] == {(4, 3, 32, 32)}
    assert seen["text"] == [(4, bucket_of(n, default_buckets(248))) for n in longest] and max(longest) < 248
    assert out.image_embeds.shape[0] == 5 and out.text_embeds.shape[0] == 10
    assert out.text_to_image.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    with torch.no_grad():
        for j in (0, 9):
            tok = model.tokenize([captions[j]])
            alone = encode_text(tok.input_ids, tok.attention_mask).embeds[0].float()
            torch.testing.assert_close(out.text_embeds[j], alone, atol=1e-5, rtol=1e-5)
        pixels = model.preprocess_images([rows[4]["image"]])["pixel_values"]
        torch.testing.assert_close(out.image_embeds[4], encode_image(pixels).embeds[0].float(), atol=1e-5, rtol=1e-5)
