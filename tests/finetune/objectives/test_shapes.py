"""Fixed batch shapes (issue 29 item 1, finetune.objectives.shapes): the shapes are planned before training from the
model and the training set; padding to them changes no loss (to 1e-5, every method); a run of every method brings
no new attention shape after its first step and runs its text tower in at most two passes per step; evaluation
encodes in passes of one shape."""

from __future__ import annotations

import json
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
from finetune.objectives.encoders import text_passes
from finetune.objectives.shapes import BatchShapes, pad_rows, plan_shapes, round_up

RECIPES = Path(__file__).resolve().parents[3] / "recipes"

pytestmark = pytest.mark.usefixtures("quiet_datasets")


def _objective(section: dict, tmp_path: Path):
    path = tmp_path / "objective.yaml"
    path.write_text(yaml.safe_dump({"objective": section}))
    return build_objective(load_recipe(path).objective)


def _shipped_objective(name: str) -> dict:
    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())["objective"]


def _scenes(size: int = 8, **options):
    return load_source({"name": "synthetic", "size": size, "seed": 0, "options": {"image_size": 48, **options}}).dataset


# -- planning -----------------------------------------------------------------------------------------------
def test_short_texts_take_the_training_sets_longest_rounded_up(tmp_path):
    """Long-CLIP's first sentences: the short length is the longest one of the training set (here 13 tokens),
    rounded up to 8; the captions keep the model's 248."""
    model = load_model("tiny-clip", max_text_len=248)
    objective = _objective({"base": "longclip"}, tmp_path)
    rows = [{"caption": "A red circle. A square below it."},
            {"caption": "Two small green triangles beside a large blue house. A tree."},
            {"caption": "A dog"}]
    shapes = plan_shapes(objective, model, rows)
    assert model.truncation_stats == {"captions": 0, "truncated": 0}  # the scan is not counted as training captions
    longest = int(model.tokenize(["Two small green triangles beside a large blue house."])
                  .attention_mask.sum())
    assert longest == 13 and shapes == BatchShapes(248, 16, {})


def test_towers_that_read_their_padding_and_streams_keep_one_length(tmp_path):
    """SigLIP pools the last position of captions padded to its full length: its short texts take it too; a stream
    (nothing to scan before training) gives short texts the captions' length."""
    objective = _objective({"base": "longclip"}, tmp_path)
    siglip = load_model("tiny-siglip")
    assert plan_shapes(objective, siglip, _scenes()).short_length == siglip.max_text_len
    clip = load_model("tiny-clip", max_text_len=248)
    assert plan_shapes(objective, clip, None) == BatchShapes(248, 248, {})

    class Stream(torch.utils.data.IterableDataset):  # a stream may have a length; its rows are not read
        def __len__(self):
            return 3

        def __iter__(self):
            raise AssertionError("a stream is not read before training")

    assert plan_shapes(objective, clip, Stream()) == BatchShapes(248, 248, {})


def test_a_sample_beyond_the_planned_capacity_is_a_clear_error(tmp_path):
    objective = _objective(_shipped_objective("quickstart"), tmp_path)
    model = load_model("tiny-clip", max_text_len=248)
    rows = objective.preprocess(_scenes(), model, cache_dir=str(tmp_path / "cache"))
    shapes = plan_shapes(objective, model, rows)
    most = max(len(c) for c in rows["chunks"])
    assert shapes.capacities == {"structxlip/chunks": most, "structxlip/regions": most}  # one object per sentence
    objective.set_shapes(BatchShapes(248, shapes.short_length, {**shapes.capacities, "structxlip/chunks": most - 1}))
    with pytest.raises(ValueError, match=f"has {most} chunks, more than the {most - 1} per sample planned"):
        Collator(model, objective)([rows[i] for i in range(len(rows))])
    with pytest.raises(ValueError, match="3 rows exceed the planned capacity of 2"):
        pad_rows(torch.zeros(3, 4), 2)


# -- padding changes no loss -----------------------------------------------------------------------------------
#: method -> (objective section, model): each method's shipped objective on a tiny model of its family
LOSS_CASES = {
    "clip": ({"base": "clip"}, "tiny-clip"),
    "longclip": (lambda: _shipped_objective("longclip_docci"), "tiny-clip"),
    "structxlip-pool": (lambda: _shipped_objective("quickstart"), "tiny-clip"),
    "structxlip-crop": ({"base": "clip", "terms": {"structxlip": {"regions": {
        "source": "dataset", "k": 3, "per_image": "all", "encode": "crop"}}}}, "tiny-clip"),
    "structxlip-official": ({"base": "clip", "terms": {"structxlip": {"compat": "official", "regions": {
        "source": "segmenter", "k": 3, "per_image": "all", "encode": "crop"}}}}, "tiny-clip"),
    "fastgoal": (lambda: _shipped_objective("fastgoal_tiny_synthetic"), "tiny-clip"),
    "grm": (lambda: _shipped_objective("grm_tiny_synthetic"), "tiny-clip"),
    "flair": (lambda: _shipped_objective("flair_tiny_synthetic"), "tiny-flair"),
}


def _values(objective, model, rows) -> tuple[dict[str, float], list, dict]:
    batch = Collator(model, objective)(rows)
    batch["_text_plan"] = objective.plan(model, batch)
    _, text_reqs, _ = objective.requests(batch)
    passes = text_passes(model, text_reqs, objective.shapes)
    shapes = [(sum(text_reqs[k].input_ids.shape[0] for k in p.keys), p.length) for p in passes]
    with torch.no_grad():
        values = objective.loss(model, objective.encode(model, batch))
    return {k: float(v) for k, v in values.items()}, shapes, batch


@pytest.mark.parametrize("method", list(LOSS_CASES))
def test_padding_to_the_fixed_shapes_changes_no_loss(method, tmp_path):
    """The same examples collated as they come (each batch its own widths and rows) and padded to the run's fixed
    shapes give every loss value to 1e-5; the fixed passes are really wider (or have more rows). The examples are the
    scenes with the fewest objects (4 of 4-5, 7 sentences each), so that StructXLIP's batch as it comes has no padded
    row at all and the fixed one pads every sample to the training set's 5 regions and 8 chunks."""
    section, name = LOSS_CASES[method]
    objective = _objective(section() if callable(section) else section, tmp_path)
    torch.manual_seed(0)
    model = load_model(name, max_text_len=248) if name == "tiny-clip" else load_model(name)
    objective.prepare_model(model)
    rows = objective.preprocess(_scenes(), model, cache_dir=str(tmp_path / "cache"))
    model.eval()  # no dropout
    examples = [rows[i] for i in range(len(rows)) if len(rows[i]["objects"]) == 4]
    assert len(examples) == 3
    for term in objective.all_terms:
        term.set_epoch(0)
    loose, loose_shapes, loose_batch = _values(objective, model, examples)
    objective.set_shapes(plan_shapes(objective, model, rows))
    fixed, fixed_shapes, fixed_batch = _values(objective, model, examples)
    assert set(fixed) == set(loose)
    for key in loose:
        assert fixed[key] == pytest.approx(loose[key], rel=1e-5, abs=1e-5), key
    assert len(fixed_shapes) <= 2
    assert sum(r * c for r, c in fixed_shapes) > sum(r * c for r, c in loose_shapes)  # padding did happen
    regions = (section() if callable(section) else section).get("terms", {}).get("structxlip", {}).get("regions", {})
    if regions.get("source") == "dataset":
        assert loose_batch["structxlip"]["chunk_valid"].all() and loose_batch["structxlip"]["region_valid"].all()
        assert not fixed_batch["structxlip"]["region_valid"].all() and not fixed_batch["structxlip"][
            "chunk_valid"].all()


# -- runs of every method: shapes per step, text passes ---------------------------------------------------------
from tests.finetune.training.test_trainer import METHODS, project  # noqa: E402,F401  (the shipped-recipe runs and fixture)

RUNS = ["clip-248", "structxlip-crop", "structxlip-pool", "fastgoal", "flair"]
#: runs that take more than ~20 s on the shared 2-core CPU (preprocessing and the workers' start included)
SLOW_RUNS = {"clip-248", "structxlip-crop", "fastgoal", "flair"}


def _first_text_block(model):
    inner = model.model
    if hasattr(inner, "text_model"):
        return inner.text_model.encoder.layers[0]
    return inner.transformer.resblocks[0]


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_RUNS else m for m in RUNS])
def test_a_run_brings_no_new_attention_shape_after_its_first_step(method, project, monkeypatch, capsys):
    """Every method's shipped recipe, run by finetune/run.py for 6 steps (batch 8, the project's fixtures): after
    step 1 no step calls scaled-dot-product attention at a shape not seen before, every step runs the text tower in
    at most two passes, and the run's metrics record the shapes and the attention backend."""
    import logging

    from accelerate.state import AcceleratorState, GradientState

    from finetune.training import trainer as train
    from finetune.cli.train import main
    from tests.recipes.shipped import RECIPES_DIR, as_shipped_overrides, clear_run, output_dir, \
        prerequisites_as_shipped

    name, extra = METHODS[method]
    path = RECIPES_DIR / f"{name}.yaml"
    overrides = [*as_shipped_overrides(path, project), "train.log_every=3", "train.batch_size=8", "eval.sets=[]",
                 *extra]
    monkeypatch.setattr(logging.getLogger("xlipkit"), "handlers", [])
    monkeypatch.chdir(project.root)
    prerequisites_as_shipped(monkeypatch, project)
    steps: list[dict] = []
    original_train, original_step = train.Trainer.train, train.Trainer.train_step

    def counted_train(self):
        self.total_steps = min(self.total_steps, 6)
        block = _first_text_block(self._model)
        self._passes = 0

        def count(*_):
            self._passes += 1
        handle = block.register_forward_pre_hook(count)
        try:
            return original_train(self)
        finally:
            handle.remove()

    def counted_step(self, batch, step):
        self._passes = 0
        with SdpaCalls() as calls:
            original_step(self, batch, step)
        steps.append({"shapes": set(calls.shapes), "passes": self._passes, "calls": len(calls.shapes)})

    monkeypatch.setattr(train.Trainer, "train", counted_train)
    monkeypatch.setattr(train.Trainer, "train_step", counted_step)
    out = output_dir(path, project)
    clear_run(out)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        assert main([f"recipes/{path.name}", *overrides]) == 0, capsys.readouterr().err[-3000:]
    finally:  # the recipe's mixed precision must not stay in accelerate's state for the next test's Accelerator
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert len(steps) == 6 and all(s["calls"] for s in steps)
    seen = set(steps[0]["shapes"])
    for i, s in enumerate(steps[1:], start=2):
        assert s["shapes"] <= seen, f"{method}: step {i}: new attention shapes {s['shapes'] - seen} (step 1: {seen})"
    assert all(1 <= s["passes"] <= 2 for s in steps), [s["passes"] for s in steps]
    throughput = json.loads((out / "metrics.json").read_text())["throughput"]
    assert throughput["shapes"]["text_length"] >= throughput["shapes"]["short_length"]
    if method.startswith("structxlip"):  # planned from the run's (wrapped) training set
        assert set(throughput["shapes"]["capacities"]) == {"structxlip/chunks", "structxlip/regions"}
    assert throughput["attention"]["setting"] == "auto" and throughput["attention"]["first_step_kernels"]


# -- evaluation ----------------------------------------------------------------------------------------------
def test_evaluation_encodes_in_passes_of_one_shape():
    """encode_for_retrieval: every image pass and every text pass has batch_size rows (the last ones filled), texts
    at the model's fixed length; the embeddings are those of each row encoded alone."""
    from finetune.evaluation.encode import encode_for_retrieval

    model = load_model("tiny-clip", max_text_len=248).eval()
    rows = [{"id": str(i), "image": r["image"], "captions": [r["caption"], r["caption"].split(".")[0]]}
            for i, r in enumerate(_scenes(5))]
    seen = {"image": set(), "text": set()}
    encode_image, encode_text = model.encode_image, model.encode_text

    def image(pixel_values, **kwargs):
        seen["image"].add(tuple(pixel_values.shape))
        return encode_image(pixel_values, **kwargs)

    def text(input_ids, attention_mask=None, **kwargs):
        seen["text"].add(tuple(input_ids.shape))
        return encode_text(input_ids, attention_mask, **kwargs)

    model.encode_image, model.encode_text = image, text
    out = encode_for_retrieval(model, rows, batch_size=4)
    assert seen["image"] == {(4, 3, 32, 32)} and seen["text"] == {(4, 248)}
    assert out.image_embeds.shape[0] == 5 and out.text_embeds.shape[0] == 10
    assert out.text_to_image.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    captions = [c for r in rows for c in r["captions"]]
    with torch.no_grad():
        for j in (0, 9):
            tok = model.tokenize([captions[j]])
            alone = encode_text(tok.input_ids, tok.attention_mask).embeds[0].float()
            torch.testing.assert_close(out.text_embeds[j], alone, atol=1e-5, rtol=1e-5)
        pixels = model.preprocess_images([rows[4]["image"]])["pixel_values"]
        torch.testing.assert_close(out.image_embeds[4], encode_image(pixels).embeds[0].float(), atol=1e-5, rtol=1e-5)
