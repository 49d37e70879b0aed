"""FLISM's matching (FAST-GOAL III-A steps 3-4): eqs. 1-2, the kept pairs (Table VIII), candidates clipped to the
model's input, the cache, and a trained model's matches."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from finetune.data.text import split_sentences
from finetune.preprocess.flism.detectors import DatasetBoxes
from finetune.preprocess.flism.matcher import FLISMMatcher, compute_flism, match_sentences, select_pairs
from finetune.preprocess.flism.stats import flism_stats
from tests.finetune.preprocess.flism.stubs import CLIP_GEOMETRY, REPO, Colours, scenes, wide_scene

pytestmark = pytest.mark.usefixtures("quiet_datasets")


def test_match_sentences_takes_each_sentences_most_similar_crop():
    sentences = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    crops = torch.tensor([[3.0, 0.0], [1.0, 1.0], [0.0, -1.0]])
    index, sim = match_sentences(sentences, crops)
    assert index.tolist() == [0, 1, 1]
    assert torch.allclose(sim, torch.tensor([1.0, math.sqrt(0.5), 1.0]))
    with pytest.raises(ValueError, match="at least one candidate"):
        match_sentences(sentences, crops[:0])


def test_select_pairs_single_best_and_the_top3_weightings_of_table_viii():
    sentences, candidates, sims = [0, 1, 2, 3], [5, 2, 0, 1], [0.2, 0.6, 0.4, -0.1]
    (best,) = select_pairs(sentences, candidates, sims)
    assert (best.sentence, best.candidate, best.similarity, best.weight) == (1, 2, 0.6, 1.0)
    uniform = select_pairs(sentences, candidates, sims, pairs=3)
    assert [p.sentence for p in uniform] == [1, 2, 0] and [p.weight for p in uniform] == [1 / 3] * 3
    weighted = select_pairs(sentences, candidates, sims, pairs=3, weighting="weighted")
    assert [round(p.weight, 6) for p in weighted] == [0.5, round(0.4 / 1.2, 6), round(0.2 / 1.2, 6)]
    # fewer matched sentences than pairs: the last one repeats with weight 0
    short = select_pairs([4], [1], [0.3], pairs=3, weighting="weighted")
    assert [(p.sentence, p.weight) for p in short] == [(4, 1.0), (4, 0.0), (4, 0.0)]
    # similarities <= 0 only: uniform
    assert [p.weight for p in select_pairs([0, 1], [0, 0], [-0.2, -0.1], pairs=2, weighting="weighted")] == [0.5, 0.5]
    assert select_pairs([], [], []) == []
    with pytest.raises(ValueError, match="weighting"):
        select_pairs([0], [0], [0.1], weighting="softmax")


def test_matcher_matches_every_sentence_to_its_best_crop_and_keeps_the_best_pair():
    enc = Colours()
    matcher = FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub")
    out = matcher(scenes()[:])
    assert out["flism_num_candidates"] == [7, 7]  # 2 dataset boxes + 5 default regions
    assert out["flism_candidate_kinds"][0] == ["found", "found"] + ["default"] * 5
    assert out["flism_sentences"][0] == split_sentences("A plain green picture. There is a blue square at the bottom. "
                                                        "A red square sits at the top.")
    match = out["flism_sentence_match"][0]
    assert match[1] == 1 and match[2] == 0  # the blue sentence -> the blue square's box, the red one -> the red box
    assert out["flism_pair_box"][0][0] in ([40.0, 28.0, 62.0, 46.0], [2.0, 2.0, 22.0, 18.0])
    assert out["flism_pair_sentence"][0][0] in (1, 2)
    best = max(range(3), key=lambda s: out["flism_sentence_similarity"][0][s])
    assert out["flism_pair_sentence"][0] == [best] and out["flism_num_pairs"] == [1, 1]
    # with the dataset's links: a box goes with its own sentence; a sentence without an object is not matched
    linked = FLISMMatcher(DatasetBoxes(links=True), enc.images, enc.texts, model_id="stub")(scenes()[:])
    assert linked["flism_num_candidates"] == [2, 2]
    assert linked["flism_sentence_match"][0] == [-1, 1, 0]
    assert math.isnan(linked["flism_sentence_similarity"][0][0])
    assert linked["flism_sentence_match"][1] == [0]


def test_candidates_the_models_centre_crop_cuts_away_are_dropped_and_the_rest_clipped(tmp_path):
    """FLISM keeps only what TSL can pool: candidates are clipped to the part of the image the model's resize and
    centre crop keep, and those with nothing left there are dropped; both counted per image and in the stats."""
    enc = Colours()
    data = wide_scene()
    # blind to the model's crop, the red object's box wins the red sentence: a pair TSL cannot pool
    blind = FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub")(data[:])
    assert blind["flism_pair_box"][0][0] == [10.0, 100.0, 240.0, 400.0]
    matcher = FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub", geometry=CLIP_GEOMETRY)
    out = matcher(data[:])
    assert out["flism_candidates_dropped"] == [1] and out["flism_candidates_clipped"] == [4]
    assert out["flism_candidates"][0] == [[250.0, 0.0, 500.0, 250.0], [500.0, 0.0, 750.0, 250.0],
                                          [250.0, 250.0, 500.0, 500.0], [500.0, 250.0, 750.0, 500.0],
                                          [250.0, 125.0, 750.0, 375.0]]  # quadrants clipped, the centre box as it was
    assert out["flism_candidate_kinds"][0] == ["default"] * 5
    x1, _, x2, _ = out["flism_pair_box"][0][0]
    assert 250 <= x1 < x2 <= 750
    # the object's own sentence link cannot be kept either: no pair rather than a box without patches
    linked = FLISMMatcher(DatasetBoxes(links=True), enc.images, enc.texts, model_id="stub",
                          geometry=CLIP_GEOMETRY)(data[:])
    assert linked["flism_num_pairs"] == [0] and linked["flism_candidates_dropped"] == [1]
    # no candidate left at all (YOLO only): the part of the image the model sees
    alone = FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub", default=False,
                         geometry=CLIP_GEOMETRY)(data[:])
    assert alone["flism_candidates"][0] == [[250.0, 0.0, 750.0, 500.0]]
    assert alone["flism_candidate_kinds"][0] == ["whole_image"]
    stats = flism_stats(compute_flism(data, matcher, cache_dir=tmp_path))
    counts = (stats["candidates_clipped"], stats["candidates_dropped"], stats["images_with_dropped_candidates"])
    assert counts == (4, 1, 1)
    # the model's geometry is part of the cache key
    assert matcher.params()["geometry"]["crop"] == (224, 224)
    assert FLISMMatcher(None, enc.images, enc.texts, model_id="stub").params()["geometry"] is None


def test_compute_flism_is_cached_and_keyed_by_its_parameters(tmp_path, caplog):
    enc = Colours()
    data = scenes()
    make = lambda pairs: FLISMMatcher(None, enc.images, enc.texts, model_id="stub", pairs=pairs)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        first = compute_flism(data, make(1), cache_dir=tmp_path)
        again = compute_flism(data, make(1), cache_dir=tmp_path)
        other = compute_flism(data, make(3), cache_dir=tmp_path)
    assert caplog.text.count("computing flism") == 2 and "reusing cached flism" in caplog.text
    assert first["flism_pair_box"] == again["flism_pair_box"]
    assert [len(p) for p in other["flism_pair_box"]] == [3, 3] and other["flism_num_pairs"] == [3, 1]
    assert first["flism_candidate_kinds"][0] == ["default"] * 5  # no detector: the default regions only


# -- FLISM with a trained model finds the described object -----------------------------------------
def _iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


#: quickstart_clip.yaml trained for this many steps (of its 248) still learns the scenes: the matched crop overlaps
#: the described object for 37.2 % of the object sentences at 80 steps, 40.4 % at 120, against 10.7 % for a random
#: candidate (2-core CPU, 2026-11-29); fewer steps or batch 32 fell to 2.9x (40 steps), 1.9x (60) and 2.5x (120 at
#: batch 32), too near the 2.5x asserted below
KEY_TEST_STEPS = 80


@pytest.mark.slow
def test_flism_scored_by_a_trained_quickstart_model_picks_the_described_object(tmp_path):
    """recipes/quickstart_clip.yaml (fewer steps), then FLISM on held-out synthetic scenes with the scenes' object
    boxes as the detector's candidates (+ the 5 default regions), matched by the trained model: the crop FLISM
    matches to an object's sentence overlaps that object's true box (IoU > 0.5) far more often than a random
    candidate does. (The real detectors' path is tested above with tiny YOLOS / YOLO checkpoints.)"""
    from accelerate.state import AcceleratorState, GradientState

    from finetune.config import load_recipe
    from finetune.data.sources import load_source
    from finetune.models.finetuned import load_finetuned
    from finetune.preprocess.frozen import FrozenEncoders
    from finetune.training import run_recipe

    out = tmp_path / "run"
    recipe = load_recipe(REPO / "recipes" / "quickstart_clip.yaml", [
        f"train.max_steps={KEY_TEST_STEPS}", "eval.sets=[]", "train.trackers=[]", "train.checkpoint_every=0",
        "data.num_workers=0", f"output.dir={out}", f"data.cache_dir={tmp_path / 'cache'}"])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert run_recipe(recipe) == 0
    model = load_finetuned(str(out / "final")).eval()
    scenes = load_source({"name": "synthetic", "split": "test", "size": 96, "seed": 1}).dataset
    encoders = FrozenEncoders(model)
    matcher = FLISMMatcher(DatasetBoxes(links=False), encoders.images, encoders.texts, model_id="trained")
    hits = chance = n = best_hits = best_n = 0
    for start in range(0, len(scenes), 32):
        batch = scenes[start: start + 32]
        result = matcher(batch)
        for j, objects in enumerate(batch["objects"]):
            candidates = result["flism_candidates"][j]
            for obj in objects:
                s = obj["sentence_index"]
                chosen = candidates[result["flism_sentence_match"][j][s]]
                hits += _iou(chosen, obj["box"]) > 0.5
                chance += sum(_iou(c, obj["box"]) > 0.5 for c in candidates) / len(candidates)
                n += 1
            linked = {o["sentence_index"]: o["box"] for o in objects}
            pair_sentence = result["flism_pair_sentence"][j][0]
            if pair_sentence in linked:  # the single kept pair, when its sentence describes an object
                best_n += 1
                best_hits += _iou(result["flism_pair_box"][j][0], linked[pair_sentence]) > 0.5
    flism_rate, random_rate = hits / n, chance / n
    print(f"\nFLISM (quickstart_clip, {KEY_TEST_STEPS} steps): the matched crop overlaps the described object "
          f"(IoU > 0.5) for {flism_rate:.1%} of {n} object sentences; a random candidate: {random_rate:.1%}; the "
          f"kept pair, when its sentence names an object ({best_n} images): {best_hits / max(1, best_n):.1%}")
    # measured (2-core CPU, seed 0, 80 steps): 37.2 % of the object sentences vs 10.7 % for a random candidate
    # (3.5x); at 120 steps 40.4 % of 411 (3.8x), the kept single pair, when its sentence names an object (77 of 96
    # images): 28.6 %
    assert random_rate < 0.2  # one true box among 3-5 object boxes + 5 default regions
    assert flism_rate > 2.5 * random_rate
