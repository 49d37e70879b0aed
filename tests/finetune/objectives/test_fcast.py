"""The fcast objective term (finetune/objectives/fcast.py): batch construction, features, loss, clamps, report."""

from __future__ import annotations

import math

import pytest
import torch

from finetune import load_model
from finetune.data.synthetic import synthetic_scenes
from finetune.data.text import split_sentences
from finetune.objectives.base import Objective
from finetune.objectives.fcast import FCastOptions, FCastTerm
from finetune.objectives.registry import build_term
from losses import fcast_loss


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("fcast-tiny", family="fcast")


@pytest.fixture(scope="module")
def scenes():
    return synthetic_scenes(4, image_size=64)


def _term(**options) -> FCastTerm:
    term, weights = build_term("fcast", FCastOptions(**options))
    assert weights == 1.0
    return term


def test_subcaptions_first_n_are_random_chunks_of_the_caption():
    term = _term(k=8)
    caption = " ".join(f"Sentence number {i} is here." for i in range(9))
    sentences = split_sentences(caption)
    subs = term.subcaptions(caption, "id-1")
    assert len(subs) == 8
    joined = " ".join(subs[:4])
    assert joined == " ".join(sentences[: len(split_sentences(joined))])  # consecutive from the start
    assert all(1 <= len(split_sentences(s)) <= 3 for s in subs)
    assert all(s in caption for s in subs[4:]) or all(
        set(split_sentences(s)) <= set(sentences) for s in subs[4:])
    assert term.subcaptions(caption, "id-1") == subs  # reproducible per (seed, epoch, id)
    term.set_epoch(1)
    assert any(term.subcaptions(caption, "id-1") != subs for _ in range(1))


def test_caption_fields_chunk_a_long_field_and_sample_all(model):
    term = _term(caption_fields=["short", "long"], long_fields=["long"], k=6)
    example = {"id": "x", "caption": "ignored.", "short": "A dog.",
               "long": ["One.", "Two.", "Three.", "Four.", "Five."]}
    subs = term.prepare(example)["fcast_subcaptions"]
    assert " ".join(subs[:4]).split() == ["One.", "Two.", "Three.", "Four.", "Five."]
    with pytest.raises(ValueError, match="no field 'long'"):
        term.prepare({"id": "y", "caption": "c.", "short": "s."})
    with pytest.raises(ValueError, match="long_fields"):
        _term(caption_fields=["a"], long_fields=["b"])


def test_collate_features_and_loss(model, scenes):
    term = _term()
    objective = Objective(None, [(term, 1.0)])
    prepared = [objective.prepare(dict(e)) for e in scenes]
    batch = objective.collate(prepared, model)
    assert batch["fcast_sub_ids"].shape == (4, 8, 77)
    batch.update(image_inputs=model.preprocess_images([e["image"] for e in scenes]),
                 input_ids=model.tokenize([e["caption"] for e in scenes]).input_ids)
    feats = objective.encode(model, batch)
    assert feats["fcast_fine"].shape == (4, 16, 64) and feats["fcast_sub"].shape == (4, 8, 64)
    ids, mask = batch["fcast_sub_ids"][:, :4], batch["fcast_sub_mask"][:, :4]
    sub = model.encode_subcaptions(ids.reshape(16, 77), mask.reshape(16, 77)).reshape(4, 4, -1)
    torch.testing.assert_close(feats["fcast_long"], model.encode_long(sub))  # t_long from the first N only
    out = objective.loss(model, feats)
    heads = model.model
    ref = fcast_loss(feats["fcast_sub"], feats["fcast_fine"], feats["fcast_coarse"], feats["fcast_long"],
                     heads.part_pool, heads.part_logit_scale.exp(), heads.part_logit_bias, heads.logit_scale.exp(),
                     heads.logit_bias, seed=term.draw_seed())
    torch.testing.assert_close(out["fcast/part"], ref["part"])
    torch.testing.assert_close(out["fcast/whole"], ref["whole"])
    torch.testing.assert_close(out["loss"], ref["part"] + ref["whole"])
    out["loss"].backward()
    for p in (heads.part_logit_scale, heads.part_logit_bias, heads.logit_scale, heads.logit_bias,
              heads.part_pool.attn.in_proj_weight, heads.caption.adapter.fc[0].weight, heads.visual.stem.proj[0].weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    model.zero_grad()


def test_clamp_after_step_and_wrong_model(model, tmp_path):
    term = _term()
    term.preprocess([], model, cache_dir=str(tmp_path))
    assert model.superpixel_cache_dir == str(tmp_path / "preprocess" / "superpixels")
    with torch.no_grad():
        model.model.part_logit_scale.fill_(7.0)
        model.model.logit_scale.fill_(-1.0)
    term.after_optimizer_step()
    assert model.model.part_logit_scale.item() == pytest.approx(math.log(100))
    assert model.model.logit_scale.item() == 0.0
    with torch.no_grad():
        model.model.part_logit_scale.fill_(math.log(1 / 0.07))
        model.model.logit_scale.fill_(math.log(1 / 0.07))
    model.superpixel_cache_dir = None
    with pytest.raises(ValueError, match="model.family: fcast"):
        term.preprocess([], load_model("tiny-clip"))


def test_report_draws_the_hierarchy_and_attention(model, scenes, tmp_path):
    term = _term(report_images=2)
    term.preprocess([], model)
    model.superpixel_cache_dir = None
    sections = term.report_sections(tmp_path, scenes)
    assert "plots/fcast_hierarchy.png" in sections[0] and "plots/fcast_attention.png" in sections[0]
    for name in ("fcast_hierarchy.png", "fcast_attention.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_superpixel_overrides_are_applied_and_saved(tmp_path):
    model = load_model("fcast-tiny", family="fcast")
    term = _term(superpixels={"n_segments": 25, "compactness": 20.0})
    term.preprocess([], model, cache_dir=str(tmp_path))
    assert model.superpixels.n_segments == 25 and model.superpixels.method == "slic"
    streamed = load_model("fcast-tiny", family="fcast")  # a stream has no preprocess: the run's prepare_model
    assert streamed.superpixels.n_segments == 36  # fcast-tiny's own
    _term(superpixels={"n_segments": 49}).prepare_model(streamed)
    assert streamed.superpixels.n_segments == 49 and streamed.superpixel_cache_dir is None
    model.save_pretrained(str(tmp_path / "m"))
    assert load_model(str(tmp_path / "m")).superpixels.compactness == 20.0
    with pytest.raises(ValueError, match="objective.terms.fcast.superpixels"):
        _term(superpixels={"method": "sfcn"})


# --- issue 23 item 9 / issue 22: the part level's draws, per step and per process ---------------------


def _features(model, scenes, term):
    objective = Objective(None, [(term, 1.0)])
    batch = objective.collate([objective.prepare(dict(e)) for e in scenes], model)
    batch.update(image_inputs=model.preprocess_images([e["image"] for e in scenes]),
                 input_ids=model.tokenize([e["caption"] for e in scenes]).input_ids)
    with torch.no_grad():
        return objective, objective.encode(model, batch)


def test_part_level_draws_are_keyed_by_the_step_and_saved_in_the_state_dict(model, scenes):
    term = _term()
    objective, feats = _features(model, scenes, term)
    first = objective.loss(model, feats)["fcast/part"]
    torch.manual_seed(123)  # the process's RNG does not choose the negatives
    torch.testing.assert_close(objective.loss(model, feats)["fcast/part"], first, rtol=0, atol=0)
    heads = model.model
    want = fcast_loss(feats["fcast_sub"], feats["fcast_fine"], feats["fcast_coarse"], feats["fcast_long"],
                      heads.part_pool, heads.part_logit_scale.exp(), heads.part_logit_bias, heads.logit_scale.exp(),
                      heads.logit_bias, seed=term.draw_seed())
    torch.testing.assert_close(first, want["part"])
    term.after_optimizer_step()
    assert not torch.allclose(objective.loss(model, feats)["fcast/part"], first)
    state = objective.state_dict()
    fresh = _term()
    Objective(None, [(fresh, 1.0)]).load_state_dict(state)
    assert fresh.draws.value == 1 and fresh.draw_seed() == term.draw_seed()
    with torch.no_grad():  # after_optimizer_step clamped the scales: put them back for the other tests
        model.model.part_logit_scale.fill_(math.log(1 / 0.07))
        model.model.logit_scale.fill_(math.log(1 / 0.07))


def test_the_part_level_draws_only_its_processs_rows(model, scenes, monkeypatch):
    """Issue 22: as rank 3 of 2,048 processes (4 images each), no allocation of the global batch's square
    size (8,192 x 8,192 picks: 67 MB as bytes); what a process does hold grows with its own rows only
    (its 4 x 8,195 conditioned pairs of width 64: 8 MB as float32)."""
    from tests.losses.flair_probes import HostReads, as_rank, largest_cpu_allocation

    term = _term()
    objective, feats = _features(model, scenes, term)
    import losses.contrastive as contrastive

    as_rank(monkeypatch, 3, 2048)
    monkeypatch.setattr(contrastive, "should_gather", lambda gather: False)  # the whole level on its own
    largest = largest_cpu_allocation(lambda: objective.loss(model, feats))
    assert largest < 8192 * 8192 // 2, largest
    with HostReads() as spy:
        objective.loss(model, feats)
    assert spy.reads == []


@pytest.mark.slow
def test_a_resumed_fcast_run_draws_the_negatives_of_the_uninterrupted_run(tmp_path):
    from tests.finetune.objectives.test_flair import assert_resume_draws_what_the_straight_run_draws

    rows = synthetic_scenes(16, image_size=64)

    def make_model():
        torch.manual_seed(0)
        return load_model("fcast-tiny", family="fcast")

    assert_resume_draws_what_the_straight_run_draws(tmp_path, rows, make_model, lambda: _term(cache_superpixels=False))


@pytest.mark.parametrize("micro_batches,fixed", [(1, False), (2, False), (2, True)])
def test_the_step_uses_the_segment_count_and_cut_planned_on_the_cpu(model, scenes, micro_batches, fixed):
    """PlannedCollate counts each micro-batch's CAST segments (Term.plan) and the sub-captions' columns (the text
    plan) on the CPU: the features are those the step computes when it counts them on the device itself, and
    encoding a planned batch reads nothing back to the host. Under the run's planned shapes the plan is the planned
    segment capacity and the bucket (32, 64 or 77) of the longest sub-caption, and the features agree with the
    counted ones to 1e-5 (padded segments and columns are masked)."""
    from accelerate.utils import send_to_device

    from finetune.data.collate import Collator
    from finetune.models.cast import resize_labels
    from finetune.objectives.base import TERM_PLANS, TEXT_PLAN
    from finetune.objectives.fcast import CHUNK_KIND
    from finetune.objectives.planning import PlannedCollate, split_batch
    from finetune.objectives.shapes import plan_shapes
    from tests.finetune.host_reads import HostReads

    term = _term()
    objective = Objective(None, [(term, 1.0)])
    objective.prepare_model(model)
    if fixed:
        objective.set_shapes(plan_shapes(objective, model, scenes))
        assert objective.shapes.capacities == {"fcast/segments": 48}  # 36 superpixels x 1.25, rounded up to 16
    batch = PlannedCollate(Collator(model, objective), objective, model, micro_batches=micro_batches)(
        [dict(e) for e in scenes])
    batch = send_to_device(batch, torch.device("cpu"), non_blocking=True)  # as the loader hands it to the step
    parts = split_batch(batch, micro_batches)
    model.eval()  # no dropout: the two encodings must agree
    for part in parts:
        plan = part[TERM_PLANS]["fcast"]
        sp = part["image_inputs"]["superpixels"]
        labels = resize_labels(sp, model.model.visual.token_grid(*part["image_inputs"]["pixel_values"].shape[-2:]))
        assert plan["segments"] == (48 if fixed else int(labels.max()) + 1)
        longest = int(batch["fcast_sub_mask"].sum(-1).max())  # the text plan is the whole batch's, for every part
        assert part[TEXT_PLAN].lengths == {CHUNK_KIND: (32 if longest <= 32 else 64) if fixed else longest}
        assert plan["capacity"] == 48  # GraphPool's dropout is drawn for the capacity, planned or not
        with torch.no_grad(), HostReads() as reads:
            planned = objective.encode(model, part)
        assert not reads.events, reads.report()
        with torch.no_grad():
            counted = objective.encode(model, {k: v for k, v in part.items() if k != TERM_PLANS})
        for key in ("fcast_fine", "fcast_coarse", "fcast_sub", "fcast_long"):
            torch.testing.assert_close(planned[key], counted[key], atol=1e-5, rtol=1e-5, msg=key)
    model.train()


def test_batches_over_the_segment_capacity_warn_once_and_are_counted(model, scenes, caplog):
    """A batch whose superpixels have more segments than planned runs at the next multiple of 16 (a new shape): the
    step warns the first time and counts every such batch in the term's summary (metrics.json); a warm-up pass is
    not counted."""
    from dataclasses import replace

    from finetune.data.collate import Collator
    from finetune.objectives.base import TEXT_PLAN
    from finetune.objectives.planning import PlannedCollate
    from finetune.objectives.shapes import plan_shapes

    term = _term()
    objective = Objective(None, [(term, 1.0)])
    objective.prepare_model(model)
    shapes = plan_shapes(objective, model, scenes)
    objective.set_shapes(replace(shapes, capacities={"fcast/segments": 16}))
    batch = PlannedCollate(Collator(model, objective), objective, model)([dict(e) for e in scenes])
    plan = batch["_term_plans"]["fcast"]
    assert plan["over_capacity"] > 16 and plan["segments"] % 16 == 0 and plan["segments"] >= plan["over_capacity"]
    with torch.no_grad(), caplog.at_level("WARNING", logger="xlipkit"):
        for _ in range(2):
            objective.encode(model, batch)
        objective.encode(model, {**batch, TEXT_PLAN: replace(batch[TEXT_PLAN], warmup=True)})
    warned = [r for r in caplog.records if "more than the 16 planned per image" in r.getMessage()]
    assert len(warned) == 1 and term.summary()["over_capacity_batches"] == 2
    objective.set_shapes(None)


def test_segment_count_refuses_negative_labels(model):
    pixels = torch.zeros(1, 3, 64, 64)
    with pytest.raises(ValueError, match="labels >= 0"):
        model.segment_count(pixels, torch.full((1, 64, 64), -1))
    assert model.segment_count(pixels, torch.arange(64 * 64).reshape(1, 64, 64) % 5) == 5
