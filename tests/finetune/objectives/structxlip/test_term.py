"""The ``structxlip`` objective term: options, preprocessing and its cache, collate, encoding, the three losses
(crop and pool modes, compat official), accumulation merging, the report section, and a run end to end."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from finetune import load_model
from finetune.config import RecipeError, load_recipe
from finetune.data.collate import Collator
from finetune.data.sources import load_source
from finetune.models.registry import save_tiny
from finetune.objectives import Objective, build_objective, merge_features
from finetune.objectives.contrastive import ClipTerm
from finetune.objectives.structxlip import (
    EdgeOptions,
    LexiconOptions,
    RegionOptions,
    StructXLIPOptions,
    StructXLIPTerm,
    StructXLIPWeights,
    official_chunks,
    select_regions,
)
from finetune.preprocess.edges import edge_array
from finetune.preprocess.geometry import box_patch_mask
from finetune.preprocess.regions import split_chunks
from finetune.objectives.planning import split_batch
from losses import clip_loss, local_structure_loss

REPO = Path(__file__).resolve().parents[4]
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black", "grey", "pink", "cyan")


ROOT = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.usefixtures("quiet_datasets")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny-clip saved with save_pretrained and loaded like a hub id, stretched to 248 positions."""
    folder = save_tiny("tiny-clip", tmp_path_factory.mktemp("models") / "tiny-clip")
    return load_model(str(folder), max_text_len=248)


@pytest.fixture(scope="module")
def scenes():
    return load_source({"name": "synthetic", "size": 6, "seed": 0}).dataset


def _options(compat: str = "paper", encode: str = "crop", **regions) -> StructXLIPOptions:
    return StructXLIPOptions(compat=compat, regions=RegionOptions(encode=encode, **regions))


def _objective(term: StructXLIPTerm) -> Objective:
    return Objective(ClipTerm(), [(term, term.weights)])


@pytest.fixture(scope="module")
def crop_setup(model, scenes, tmp_path_factory):
    term = StructXLIPTerm(_options())
    cache = tmp_path_factory.mktemp("cache")
    data = term.preprocess(scenes, model, cache_dir=str(cache))
    return term, data


def _batch(term: StructXLIPTerm, model, data, rows=(0, 1, 2, 3)) -> dict:
    return Collator(model, _objective(term))([data[i] for i in rows])


def _unpadded(feats: dict) -> dict:
    """``feats`` with only the chunk and region rows that are not padding (the batch's own rows, in order)."""
    out = dict(feats)
    for prefix, keep in (("chunk", feats["chunk_valid"]), ("region", feats["region_valid"])):
        for key in (prefix, f"{prefix}_owner", f"{prefix}_valid", "chunk_topk" if prefix == "chunk" else "region_slot"):
            out[key] = feats[key][keep]
    return out


# -- options ------------------------------------------------------------------------------------------
def _write_recipe(tmp_path: Path, terms: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"# test\nmodel: {{name_or_path: tiny-clip}}\nobjective:\n  base: clip\n  terms:\n{terms}")
    return path


def test_recipe_section_is_validated_and_builds_the_term(tmp_path):
    path = _write_recipe(tmp_path,
                         "    structxlip:\n      weights: {local: 0.2}\n      regions: {encode: pool, k: 2}\n")
    recipe = load_recipe(path)
    options = recipe.objective.terms["structxlip"]
    assert isinstance(options, StructXLIPOptions)
    assert (options.regions.encode, options.regions.k, options.weights.local) == ("pool", 2, 0.2)
    objective = build_objective(recipe.objective)
    (term,) = objective.terms
    assert isinstance(term, StructXLIPTerm)
    assert objective.term_weights[0] == {"structure": 0.25, "consistency": 0.1, "local": 0.2}
    assert objective.term_weights[0] is term.weights  # set_epoch updates what the Objective applies

    with pytest.raises(RecipeError, match="encode"):
        load_recipe(_write_recipe(tmp_path, "    structxlip:\n      regions: {encode: mask}\n"))
    with pytest.raises(RecipeError, match="k.*must be >= 1"):
        load_recipe(_write_recipe(tmp_path, "    structxlip:\n      regions: {k: 0}\n"))
    with pytest.raises(RecipeError, match="per_imag"):
        load_recipe(_write_recipe(tmp_path, "    structxlip:\n      regions: {per_imag: 2}\n"))


def test_missing_fastsam_checkpoint_and_bad_edges_fail_at_build(tmp_path):
    if importlib.util.find_spec("ultralytics") is not None:  # without the `regions` extra: tests/test_extras.py
        with pytest.raises(FileNotFoundError, match="regions.checkpoint.*FastSAM-s.pt or FastSAM-x.pt"):
            StructXLIPTerm(_options(checkpoint=str(tmp_path / "FastSAM-x.pt")))
    with pytest.raises(ValueError, match="low <= high"):
        StructXLIPTerm(StructXLIPOptions(edges=EdgeOptions(low=200, high=100)))
    with pytest.raises(FileNotFoundError, match="lexicon"):
        StructXLIPTerm(StructXLIPOptions(lexicon=LexiconOptions(file=str(tmp_path / "none.txt"))))


def test_compat_defaults_and_per_epoch_decay():
    paper = StructXLIPTerm(StructXLIPOptions())
    assert paper.weights == {"structure": 0.25, "consistency": 0.1, "local": 0.1}
    assert paper.structure_logit_scale is not None
    assert paper.structure_logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    paper.set_epoch(9)
    assert paper.weights == {"structure": 0.25, "consistency": 0.1, "local": 0.1}

    official = StructXLIPTerm(StructXLIPOptions(compat="official"))
    assert official.weights == {"structure": 0.25, "consistency": 0.001, "local": 0.001}
    assert official.structure_logit_scale is None
    assert list(official.parameters()) == []
    official.set_epoch(0)
    assert official.weights == {"structure": 0.25, "consistency": 0.001, "local": 0.001}
    official.set_epoch(8)  # the public code's decay reaches its floors 0.7 / 0.5 / 0.4 at epoch 8
    assert official.weights == pytest.approx({"structure": 0.175, "consistency": 0.0005, "local": 0.0004})

    explicit = StructXLIPTerm(StructXLIPOptions(compat="official", weights=StructXLIPWeights(consistency=0.2)))
    assert explicit.weights["consistency"] == 0.2


def test_compat_sets_the_lexicon_defaults():
    caption = "A red leather bag. A blue and white pattern."
    # paper: every category, revert only when no content word is left (B.2's example stands)
    assert StructXLIPTerm(StructXLIPOptions()).lexicon(caption) == "A bag. A pattern."
    # official: colours only (--remove_colors), revert below 2 content words (min_content_tokens)
    official = StructXLIPTerm(StructXLIPOptions(compat="official")).lexicon
    assert official(caption) == "A leather bag. A pattern."
    assert official.filter("A blue and white pattern.").reverted
    mine = StructXLIPTerm(StructXLIPOptions(compat="official", lexicon=LexiconOptions(min_content_words=1,
                                                                                    categories=["material"])))
    assert mine.lexicon(caption) == "A red bag. A blue and white pattern."


def test_compat_sets_k_and_the_regions_per_image():
    """The paper names no K (3.2): paper mode takes 3 (the public train.py's default); official takes the 2
    that the public scripts/finetune.sh passes (--chunk_top_k 2), with as many regions encoded per image."""
    paper = StructXLIPTerm(StructXLIPOptions()).options.regions
    assert (paper.k, paper.per_image) == (3, 3)
    official = StructXLIPTerm(StructXLIPOptions(compat="official")).options.regions
    assert (official.k, official.per_image) == (2, 2)
    given = StructXLIPTerm(_options(compat="official", k=5, per_image="all")).options.regions
    assert (given.k, given.per_image) == (5, "all")
    assert StructXLIPTerm(_options(compat="official", per_image=4)).options.regions.per_image == 4


@pytest.mark.parametrize("name", ["structxlip_docci", "structxlip_dci", "structxlip_lora_docci",
                                  "structxlip_dora_docci", "structxlip_siglip2_docci",
                                  "fastgoal_structxlip_docci"])
def test_shipped_recipes_switch_to_the_public_scripts_values_with_compat_official(name):
    """`compat=official` on a shipped recipe gives every value the public code runs with (the notes on
    intelligolabs/StructXLIP): K = 2 regions per image, each a positive of every chunk, weights 0.25 / 0.001 /
    0.001 decayed per epoch, the main scale detached for L_I'T', the local scale min(s / 0.07, 100), word-window
    chunks, colours only with a revert threshold of 2; and the paper's values without it."""
    recipe_path = ROOT / "recipes" / f"{name}.yaml"
    overrides = ["objective.terms.structxlip.regions.checkpoint=null"]  # FastSAM-x.pt is not here
    paper = build_objective(load_recipe(recipe_path, overrides).objective)
    (sx,) = [t for t in paper.terms if isinstance(t, StructXLIPTerm)]
    assert (sx.options.regions.k, sx.options.regions.per_image) == (3, 3)
    assert sx.weights == {"structure": 0.25, "consistency": 0.1, "local": 0.1}

    official = build_objective(load_recipe(recipe_path, [*overrides, "objective.terms.structxlip.compat=official"])
                               .objective)
    (sx,) = [t for t in official.terms if isinstance(t, StructXLIPTerm)]
    assert (sx.options.regions.k, sx.options.regions.per_image) == (2, 2)
    assert sx.weights == {"structure": 0.25, "consistency": 0.001, "local": 0.001}
    assert sx.structure_logit_scale is None
    assert sx.chunker() is official_chunks
    assert (sx.lexicon.min_content_words, sx.lexicon.categories) == (2, ("colour",))
    feats = {"chunk_owner": torch.tensor([0, 0, 1]), "region_owner": torch.tensor([0, 1, 1]),
             "chunk_valid": torch.tensor([True, True, True]), "region_valid": torch.tensor([True, True, False]),
             "chunk_topk": torch.tensor([[5, -1], [6, -1], [7, -1]]), "region_slot": torch.tensor([0, 1, -2])}
    # every valid kept region of the chunk's image, whatever the chunk's top-K lists
    assert torch.equal(sx.positives(feats), torch.tensor([[True, False, False], [True, False, False],
                                                          [False, True, False]]))
    sx.set_epoch(8)
    assert sx.weights == pytest.approx({"structure": 0.175, "consistency": 0.0005, "local": 0.0004})


def test_structure_scale_is_clamped_after_a_step():
    term = StructXLIPTerm(StructXLIPOptions())
    with torch.no_grad():
        term.structure_logit_scale.fill_(4.0)
    term.after_optimizer_step()
    assert term.structure_logit_scale.item() == pytest.approx(3.5)


# -- helpers ------------------------------------------------------------------------------------------
def test_official_chunks_are_sliding_windows_over_clauses():
    assert official_chunks("A tall tree, a bench.") == ["A tall", "tall tree", "a bench"]
    # 7 words -> window 3, stride 1 -> 5 windows; a 1-word clause is one chunk
    text = "one two three four five six seven; Eight"
    assert official_chunks(text) == ["one two three", "two three four", "three four five", "four five six",
                                     "five six seven", "Eight"]
    assert official_chunks("") == []
    assert len(official_chunks(" ".join(f"w{i}" for i in range(200)))) == 64


def test_select_regions_ranks_by_votes_then_score():
    topk = [[2, 0, 1], [2, 3, 0], [4, 2, 1]]
    scores = [[0.9, 0.5, 0.1], [0.8, 0.7, 0.2], [0.95, 0.3, 0.0]]
    # votes: 2 -> 3, 0 -> 2, 1 -> 2 (best 0.1), 3 -> 1 (0.7), 4 -> 1 (0.95)
    assert select_regions(topk, scores, 3) == [2, 0, 1]
    assert select_regions(topk, scores, None) == [2, 0, 1, 4, 3]
    assert select_regions([], [], 3) == []


# -- preprocessing --------------------------------------------------------------------------------
def test_preprocess_adds_filtered_captions_edges_and_regions(crop_setup, scenes):
    term, data = crop_setup
    for column in ("filtered_caption", "lexicon_removed", "edges", "region_boxes", "chunks", "chunk_topk"):
        assert column in data.column_names
    assert len(data) == len(scenes)
    row = data[0]
    for colour in COLOURS:
        assert not re.search(rf"\b{colour}\b", row["filtered_caption"], re.IGNORECASE)
    assert row["lexicon_removed"] and set(row["lexicon_removed"]) <= set(COLOURS)
    assert row["chunks"] == split_chunks(row["filtered_caption"])
    assert len(row["chunk_topk"]) == len(row["chunks"])
    assert all(len(t) == 3 and max(t) < len(row["region_boxes"]) for t in row["chunk_topk"])
    assert row["region_fallback"] and len(row["region_boxes"]) == 5  # no FastSAM checkpoint: default regions
    assert row["edges"].mode == "L" and row["edges"].size == row["image"].size
    assert (torch.tensor(list(row["edges"].getdata())) == torch.from_numpy(edge_array(row["image"])).flatten()).all()
    lex = term.stats["lexicon"]
    assert lex["captions"] == 6 and lex["modified"] == 6 and lex["category_share"] == {"colour": 1.0}
    assert term.stats["regions"]["fallback_images"] == 6


def _comparable(value):
    """A value of a preprocessed column in a form ``==`` compares exactly (PIL images as bytes)."""
    if hasattr(value, "tobytes") and hasattr(value, "mode"):
        return (value.mode, value.size, value.tobytes())
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    return value


def test_cached_preprocessing_is_reused_and_invalidated_by_a_parameter(model, scenes, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="xlipkit")
    term = StructXLIPTerm(_options())
    term.preprocess(scenes, model, cache_dir=str(tmp_path))
    assert "reusing cached" not in caplog.text
    caplog.clear()
    again = term.preprocess(scenes, model, cache_dir=str(tmp_path))
    for step in ("lexicon", "edges", "regions"):
        assert f"reusing cached {step}" in caplog.text
    computed = StructXLIPTerm(_options()).preprocess(scenes, model, cache_dir=str(tmp_path / "fresh"))
    assert "computing edges" in caplog.text  # a fresh cache folder: computed, not reused
    assert again.column_names == computed.column_names and len(again) == len(computed)
    added = [c for c in computed.column_names if c not in scenes.column_names]
    assert {"chunks", "edges"} <= set(added)
    for column in added:  # the cached result is what a computation gives, column by column
        assert [_comparable(v) for v in again[column]] == [_comparable(v) for v in computed[column]], column
    # and what the steps give without any cache: edge maps and the lexicon filter, example by example
    for i in range(len(scenes)):
        assert (np.asarray(again[i]["edges"]) == edge_array(scenes[i]["image"], term.edge_cfg)).all(), i
        assert again[i]["filtered_caption"] == term.lexicon.filter(scenes[i]["caption"]).text, i
    caplog.clear()
    changed = StructXLIPTerm(StructXLIPOptions(edges=EdgeOptions(low=20, high=60)))
    edges = changed.preprocess(scenes, model, cache_dir=str(tmp_path))
    assert "reusing cached lexicon" in caplog.text
    assert "computing edges" in caplog.text and "computing regions" in caplog.text
    assert (torch.tensor(list(edges[0]["edges"].getdata())) > 0).sum() >= (
        torch.tensor(list(again[0]["edges"].getdata())) > 0).sum()


def test_on_the_fly_edges_are_not_cached_and_match(model, scenes, tmp_path):
    term = StructXLIPTerm(StructXLIPOptions(edges=EdgeOptions(on_the_fly=True)))
    data = term.preprocess(scenes, model, cache_dir=str(tmp_path))
    assert "edges" not in data.column_names
    assert not list((tmp_path / "preprocess").glob("edges-*"))
    prepared = term.prepare(data[0])
    assert (torch.from_numpy(edge_array(data[0]["image"])) == torch.tensor(
        list(prepared["sx_edges"].getdata())).view(64, 64)).all()


# -- collate and encoding -----------------------------------------------------------------------------
def test_collate_gives_every_sample_the_same_rows_padded_to_the_longest_chunk(crop_setup, model):
    """Without fixed shapes: C = the batch's most chunks and P its most kept regions per sample, padded rows invalid
    (a sample without chunks has only padded rows); chunk columns the longest chunk of the batch, not 248."""
    term, data = crop_setup
    rows = [dict(data[i]) for i in range(4)]
    rows[2].update(filtered_caption="", chunks=[], chunk_topk=[], chunk_topk_scores=[])
    batch = Collator(model, _objective(term))(rows)
    sx = batch["structxlip"]
    assert sx["edge_inputs"]["pixel_values"].shape == (4, 3, 32, 32)
    assert sx["filtered_input_ids"].shape[0] == 4
    chunks = [c for r in rows for c in r["chunks"]]
    longest = max(int(model.tokenize([c]).attention_mask.sum()) for c in chunks)
    assert longest < 248
    counts = [len(r["chunks"]) for r in rows]
    kept = [term.kept_regions(r) if r["chunks"] else [] for r in rows]
    c, p = max(counts), max(len(k) for k in kept)
    assert counts[2] == 0 and kept[2] == [] and p > 0
    assert sx["chunk_input_ids"].shape == (4, c, longest) and sx["chunk_topk"].shape == (4, c, 3)
    assert sx["chunk_valid"].sum(dim=1).tolist() == counts
    assert sx["region_inputs"]["pixel_values"].shape == (4, p, 3, 32, 32)
    for i in range(4):
        assert sx["region_slot"][i].tolist() == kept[i] + [-2] * (p - len(kept[i]))
        assert sx["region_valid"][i].tolist() == [True] * len(kept[i]) + [False] * (p - len(kept[i]))
    text = term.text_inputs(batch)
    assert text["chunk"].input_ids.shape == (4 * c, longest) and text["chunk"].short
    assert text["filtered_text"].input_ids.shape[0] == 4 and not text["filtered_text"].short


@pytest.fixture
def fixed(crop_setup, model):
    """The crop setup's objective with the run's fixed shapes planned from its training set (and taken back after:
    the term is shared by the module's tests)."""
    from finetune.objectives.shapes import plan_shapes

    term, data = crop_setup
    objective = _objective(term)
    objective.set_shapes(plan_shapes(objective, model, data))
    yield objective, term, data
    objective.set_shapes(None)


def test_text_passes_embed_like_each_request_alone(fixed, model):
    """Under planned shapes, captions and filtered captions go through the text tower in one pass at the bucket of
    the longest of them and the chunks in a second at the bucket of the longest chunk, and each embeds as it does
    encoded on its own."""
    from finetune.objectives.shapes import SHORT, TEXT

    objective, term, data = fixed
    shapes = objective.shapes
    rows = [0, 1, 2, 3]
    chunk = max(int(model.tokenize([c]).attention_mask.sum()) for i in rows for c in data[i]["chunks"])
    caption = max(int(model.tokenize([data[i][k]]).attention_mask.sum()) for i in rows
                  for k in ("caption", "filtered_caption"))
    assert shapes.text_length == 248 and chunk <= 32 < caption < 248
    lengths = {TEXT: shapes.length(TEXT, caption), SHORT: shapes.length(SHORT, chunk)}
    assert lengths[TEXT] >= caption and lengths[SHORT] >= chunk
    most = max(len(data[i]["chunks"]) for i in range(len(data)))
    assert shapes.capacities == {"structxlip/chunks": most, "structxlip/regions": 3}
    batch = Collator(model, objective)([data[i] for i in (0, 1, 2, 3)])
    calls = _counting(counting := copy.deepcopy(model))
    with torch.no_grad():
        feats = objective.encode(counting, batch)
    sx = batch["structxlip"]
    assert sx["chunk_input_ids"].shape[:2] == (4, most) and sx["region_inputs"]["pixel_values"].shape[:2] == (4, 3)
    assert sorted(calls["text"]) == sorted([(8, lengths[TEXT]), (4 * most, lengths[SHORT])])
    with torch.no_grad():
        width = sx["chunk_input_ids"].shape[-1]
        for key, ids, mask in (("chunk", sx["chunk_input_ids"].reshape(-1, width),
                                sx["chunk_attention_mask"].reshape(-1, width)),
                               ("filtered_text", sx["filtered_input_ids"], sx["filtered_attention_mask"]),
                               ("text", batch["input_ids"], batch["attention_mask"])):
            assert torch.allclose(feats[key], model.encode_text(ids, mask).embeds, atol=1e-5), key


def _counting(model):
    """Record the rows of every image and text encoder call."""
    calls = {"image": [], "text": []}
    encode_image, encode_text, encode_groups = model.encode_image, model.encode_text, model.encode_text_groups

    def image(pixel_values, **kwargs):
        calls["image"].append(pixel_values.shape[0])
        return encode_image(pixel_values, **kwargs)

    def text(input_ids, *args, **kwargs):
        calls["text"].append(tuple(input_ids.shape))
        return encode_text(input_ids, *args, **kwargs)

    def groups(pairs, **kwargs):  # one tower pass per group, without going through encode_text on the fast path
        calls["text"].extend(tuple(ids.shape) for ids, _ in pairs)
        model.encode_text = encode_text
        try:
            return encode_groups(pairs, **kwargs)
        finally:
            model.encode_text = text

    model.encode_image, model.encode_text, model.encode_text_groups = image, text, groups
    return calls


def test_samples_without_chunks_get_padded_rows_that_change_no_loss(crop_setup, model):
    """Samples without chunks (and so without regions) still get the batch's C chunk and P region rows, all
    invalid: the image pass keeps its shape, and the losses equal those of the unpadded rows."""
    term, data = crop_setup
    rows = [dict(data[i]) for i in range(3)]
    for row in rows[1:]:  # only the first sample keeps chunks (and so regions)
        row.update(filtered_caption="", chunks=[], chunk_topk=[], chunk_topk_scores=[])
    objective = _objective(term)
    batch = Collator(model, objective)(rows)
    counting = copy.deepcopy(model)
    calls = _counting(counting)
    with torch.no_grad():
        feats = objective.encode(counting, batch)
        values = objective.loss(counting, feats)
    kept, c = len(term.kept_regions(rows[0])), len(rows[0]["chunks"])
    assert calls["image"] == [3 + 3 + 3 * kept]  # colour + edge + P = kept crops per sample, one pass
    assert feats["region"].shape[0] == 3 * kept and feats["chunk"].shape[0] == 3 * c
    assert feats["region_valid"].tolist() == [True] * kept + [False] * 2 * kept
    own = _unpadded(feats)
    assert own["region_owner"].tolist() == [0] * kept and own["chunk_owner"].tolist() == [0] * c
    with torch.no_grad():
        expected = local_structure_loss(own["chunk"], own["chunk_owner"], own["region"], own["region_owner"],
                                        positives=term.positives(own))
    assert float(values["structxlip/local"]) == pytest.approx(float(expected), rel=1e-5)

    # a batch without any chunk has no chunk and no region row, and still returns a (zero) local loss
    empty = Collator(model, objective)(rows[1:])
    calls = _counting(counting)
    with torch.no_grad():
        feats = objective.encode(counting, empty)
    assert calls["image"] == [4]
    assert feats["chunk"].shape == (0, 32) and feats["region"].shape == (0, 32)
    assert float(objective.loss(counting, feats)["structxlip/local"]) == 0.0


def _direct_local(chunks, chunk_owner, chunk_topk, regions, region_owner, region_slot, temperature):
    """Eqs. 1-2 written out: per chunk -log(sum_pos exp(cos/T) / sum_all exp(cos/T)), mean per sample, mean."""
    c, r = F.normalize(chunks, dim=-1), F.normalize(regions, dim=-1)
    per_sample: dict[int, list[torch.Tensor]] = {}
    for i in range(c.shape[0]):
        logits = (c[i] @ r.T) / temperature
        pos = [j for j in range(r.shape[0]) if int(region_owner[j]) == int(chunk_owner[i])
               and int(region_slot[j]) in chunk_topk[i].tolist()]
        if not pos:
            continue
        value = -torch.log(torch.exp(logits[pos]).sum() / torch.exp(logits).sum())
        per_sample.setdefault(int(chunk_owner[i]), []).append(value)
    return torch.stack([torch.stack(v).mean() for v in per_sample.values()]).mean()


def test_losses_match_the_papers_equations(crop_setup, model):
    term, data = crop_setup
    batch = _batch(term, model, data)
    objective = _objective(term)
    with torch.no_grad():
        feats = objective.encode(model, batch)
        values = objective.loss(model, feats)
    scale = term.structure_logit_scale.detach().exp()
    expected = float(clip_loss(feats["edge"], feats["filtered_text"], scale))
    assert values["structxlip/structure"] == pytest.approx(expected, rel=1e-5)
    cos = F.cosine_similarity(feats["image"], feats["edge"], dim=-1)
    assert values["structxlip/consistency"] == pytest.approx(float((1 - cos).mean()), rel=1e-5)
    own = _unpadded(feats)
    local = _direct_local(own["chunk"], own["chunk_owner"], own["chunk_topk"], own["region"], own["region_owner"],
                          own["region_slot"], 0.07)
    assert values["structxlip/local"] == pytest.approx(float(local), rel=1e-4)
    expected_total = (values["clip"] + 0.25 * values["structxlip/structure"]
                      + 0.1 * values["structxlip/consistency"] + 0.1 * values["structxlip/local"])
    assert values["loss"] == pytest.approx(float(expected_total), rel=1e-6)


@pytest.mark.parametrize("encode", ["crop", "pool"])
def test_crop_and_pool_give_finite_losses_and_gradients_with_checkpointing(model, scenes, tmp_path, encode):
    term = StructXLIPTerm(_options(encode=encode))
    data = term.preprocess(scenes, model, cache_dir=str(tmp_path))
    batch = _batch(term, model, data)
    trained = copy.deepcopy(model).train()
    trained.set_gradient_checkpointing(True)
    objective = _objective(term)
    values = objective.loss(trained, objective.encode(trained, batch))
    assert set(values) == {"clip", "structxlip/structure", "structxlip/consistency", "structxlip/local", "loss"}
    assert all(math.isfinite(float(v.detach())) for v in values.values())
    values["loss"].backward()
    vision = trained.model.vision_model.encoder.layers[0].self_attn.q_proj.weight.grad
    text = trained.model.text_model.encoder.layers[0].self_attn.q_proj.weight.grad
    assert vision is not None and vision.abs().sum() > 0
    assert text is not None and text.abs().sum() > 0
    assert term.structure_logit_scale.grad is not None and term.structure_logit_scale.grad != 0


def test_pool_mode_pools_edge_patch_states_inside_the_box(model, scenes, tmp_path):
    term = StructXLIPTerm(_options(encode="pool"))
    data = term.preprocess(scenes, model, cache_dir=str(tmp_path))
    batch = _batch(term, model, data, rows=(0, 1))
    calls = _counting(counting := copy.deepcopy(model))
    with torch.no_grad():
        feats = _objective(term).encode(counting, batch)
        assert calls["image"] == [4]  # colour + edge maps only: no region forward
        assert "edge_states" not in feats
        sx = batch["structxlip"]
        states = model.encode_image(**sx["edge_inputs"], states=True).states
        mask = sx["region_patch_mask"][1][0]
        expected = model.project_image_states(states[1][mask].mean(dim=0))
    first_of_sample_1 = int((feats["region_owner"] == 1).nonzero()[0])
    assert torch.allclose(feats["region"][first_of_sample_1], expected, atol=1e-5)
    box = data[1]["region_boxes"][int(sx["region_slot"][1][0])]
    assert torch.equal(mask, box_patch_mask(box, data[1]["image"].size, model.image_transform_params()))


def test_compat_official_reproduces_the_public_code(model, scenes, tmp_path):
    term = StructXLIPTerm(_options(compat="official"))
    data = term.preprocess(scenes, model, cache_dir=str(tmp_path))
    assert data[0]["chunks"] == official_chunks(data[0]["filtered_caption"])
    batch = _batch(term, model, data)
    trained = copy.deepcopy(model)
    objective = _objective(term)
    feats = objective.encode(trained, batch)
    values = objective.loss(trained, feats)
    s = trained.logit_scale.detach().exp()
    own = _unpadded(feats)
    with torch.no_grad():
        structure = clip_loss(feats["edge"], feats["filtered_text"], s)
        every_region = local_structure_loss(own["chunk"], own["chunk_owner"], own["region"],
                                            own["region_owner"], temperature=1 / min(float(s) / 0.07, 100.0))
    assert values["structxlip/structure"].item() == pytest.approx(structure.item(), rel=1e-5)
    assert values["structxlip/local"].item() == pytest.approx(every_region.item(), rel=1e-5)
    # the structure loss reads the main scale detached: no gradient reaches it from there
    values["structxlip/structure"].backward()
    assert trained.logit_scale.grad is None or float(trained.logit_scale.grad) == 0.0


@pytest.mark.parametrize("encode", ["crop", "pool"])
def test_merged_micro_batches_give_the_loss_of_one_batch(model, scenes, tmp_path, encode):
    term = StructXLIPTerm(_options(encode=encode))
    data = term.preprocess(scenes, model, cache_dir=str(tmp_path))
    rows = [dict(data[i]) for i in range(4)]
    rows[2].update(filtered_caption="", chunks=[], chunk_topk=[], chunk_topk_scores=[])  # one part has a gap
    objective = _objective(term)
    batch = Collator(model, objective)(rows)
    with torch.no_grad():
        whole = objective.loss(model, objective.encode(model, batch))
        parts = [objective.encode(model, mb) for mb in split_batch(batch, 2)]
        merged = objective.loss(model, merge_features(parts))
    assert set(whole) == set(merged)
    for key in whole:
        assert float(merged[key]) == pytest.approx(float(whole[key]), rel=1e-4, abs=1e-6), key


def test_report_sections_have_the_lexicon_statistics_and_the_preview(crop_setup, tmp_path):
    term, data = crop_setup
    (section,) = term.report_sections(tmp_path, data, n=2)
    assert "Lexicon filter (paper Supp. Mat. B.3)" in section
    assert "| modified | 6 (100.0%) |" in section
    assert "removed words by category | colour 100.0%" in section
    assert "![StructXLIP preview" in section and "(plots/structxlip_preview.png)" in section
    from PIL import Image

    with Image.open(tmp_path / "plots" / "structxlip_preview.png") as png:
        assert png.width > 1000 and png.height > 400
    summary = term.summary()
    assert summary["lexicon"]["captions"] == 6 and summary["weights"]["local"] == 0.1


# -- end to end -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_structxlip_docci_recipe_runs_offline_and_reuses_its_preprocessing(tmp_path):
    pytest.importorskip("ultralytics")  # the `regions` extra
    from ultralytics import YOLO

    from tests.finetune.data.fixtures import write_dci_fixture, write_docci_fixture, write_urban1k_fixture

    docci = write_docci_fixture(tmp_path / "docci", 8, 4, n_qual_test=2)
    urban = write_urban1k_fixture(tmp_path / "urban", 4)
    dci = write_dci_fixture(tmp_path / "dci", 2, 1, 2)
    tiny = save_tiny("tiny-clip", tmp_path / "tiny-clip")
    checkpoint = tmp_path / "fastsam-random.pt"
    torch.manual_seed(0)
    YOLO("yolov8n-seg.yaml").save(str(checkpoint))
    accelerate = Path(sys.executable).parent / "accelerate"
    overrides = [
        f"model.name_or_path={tiny}", f"data.train.path={docci}", f"data.cache_dir={tmp_path / 'cache'}",
        "data.num_workers=0",
        f"eval.sets=[{{name: docci, path: {docci}, protocol: goal}}, {{name: urban1k, path: {urban}}}, "
        f"{{name: dci, path: {dci}}}]",
        "eval.batch_size=8", "train.max_steps=2", "train.batch_size=4", "train.mixed_precision=no",
        "train.trackers=[]", "train.log_every=1", "train.checkpoint_every=0",
        f"objective.terms.structxlip.regions.checkpoint={checkpoint}", "objective.terms.structxlip.regions.imgsz=64",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "YOLO_OFFLINE": "1", "PYTHONPATH": str(REPO)}

    def run(launcher: list[str], out: Path, *more: str) -> subprocess.CompletedProcess:
        cmd = [*launcher, "finetune/run.py", "recipes/structxlip_docci.yaml", *overrides, *more, f"output.dir={out}"]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return done

    first = run([str(accelerate), "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                 "--dynamo_backend", "no", "--cpu"], tmp_path / "run1")
    assert "computing regions" in first.stderr
    metrics = json.loads((tmp_path / "run1" / "metrics.json").read_text())
    for key in ("clip", "structxlip/structure", "structxlip/consistency", "structxlip/local", "loss"):
        assert math.isfinite(metrics["final_losses"][key]), key
    assert metrics["steps"] == 2 and len(metrics["after"]) == 3, sorted(metrics["after"])
    assert (tmp_path / "run1" / "report.md").is_file()

    # the reuse is the preprocessing's, before any evaluation: the second run needs no launcher and no eval sets
    second = run([sys.executable], tmp_path / "run2", "eval.sets=[]")
    for step in ("lexicon", "edges", "regions"):
        assert f"reusing cached {step}" in second.stderr, step
    assert "computing regions" not in second.stderr


def test_naflex_siglip2_model_in_crop_and_pool_modes(scenes, tmp_path):
    """SigLIP2 NaFlex: edge maps and crops are patch sequences, region boxes map through spatial_shapes."""
    model = load_model(str(save_tiny("tiny-siglip2", tmp_path / "tiny-siglip2")), max_text_len=248)
    for encode in ("crop", "pool"):
        term = StructXLIPTerm(_options(encode=encode))
        data = term.preprocess(scenes, model, cache_dir=str(tmp_path / "cache"))
        batch = _batch(term, model, data)
        chunks = batch["structxlip"]["chunk_input_ids"]
        assert chunks.shape[-1] == 248  # SigLIP keeps its fixed-length context for chunks
        trained = copy.deepcopy(model)
        values = _objective(term).loss(trained, _objective(term).encode(trained, batch))
        assert all(math.isfinite(v.item()) for v in values.values()), (encode, values)
        values["loss"].backward()
        assert trained.model.vision_model.encoder.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def run_fixtures(tmp_path_factory):
    pytest.importorskip("ultralytics")  # the `regions` extra
    from ultralytics import YOLO

    from tests.finetune.data.fixtures import write_dci_fixture, write_docci_fixture, write_urban1k_fixture

    root = tmp_path_factory.mktemp("run-fixtures")
    checkpoint = root / "fastsam-random.pt"
    torch.manual_seed(0)
    YOLO("yolov8n-seg.yaml").save(str(checkpoint))
    return {
        "tiny-clip": save_tiny("tiny-clip", root / "tiny-clip"),
        "tiny-siglip": save_tiny("tiny-siglip", root / "tiny-siglip"),
        "docci": write_docci_fixture(root / "docci", 8, 4, n_qual_test=2),
        "dci": write_dci_fixture(root / "dci", 4, 1, 2),
        "urban1k": write_urban1k_fixture(root / "urban1k", 4),
        "checkpoint": checkpoint,
        "cache": root / "cache",
    }


def _tiny_overrides(path: Path, fx: dict, out: Path) -> list[str]:
    """Keep the recipe's method, objective and adapter; swap in a tiny saved model, fixtures, two steps."""
    import yaml

    raw = yaml.safe_load(path.read_text())
    tiny = fx["tiny-siglip"] if "siglip" in raw["model"]["name_or_path"] else fx["tiny-clip"]
    regions = raw["objective"]["terms"]["structxlip"].get("regions") or {}

    def local(entry: dict) -> dict:
        entry = dict(entry)
        if entry["name"] in ("docci", "dci", "urban1k"):
            entry["path"] = str(fx[entry["name"]])
        else:
            entry.update(size=8, options={"image_size": 32})
        return entry

    sets = [local(s) for s in raw["eval"]["sets"]]
    return [
        f"model.name_or_path={tiny}", f"data.train={json.dumps(local(raw['data']['train']))}",
        f"eval.sets={json.dumps(sets)}", f"data.cache_dir={fx['cache']}", "data.num_workers=0",
        "eval.batch_size=8", "train.max_steps=2", "train.batch_size=4", "train.mixed_precision=no",
        "train.checkpoint_every=0", "train.trackers=[]", f"output.dir={out}",
        "model.init_from=null", "eval.compare_with=[]",  # the start and comparisons: tests/finetune/training/test_upstream.py
    ] + ([] if regions.get("source") == "dataset" else [  # the dataset's regions need no FastSAM
        f"objective.terms.structxlip.regions.checkpoint={fx['checkpoint']}",
        "objective.terms.structxlip.regions.imgsz=64",
    ])


STRUCTXLIP_RECIPES = sorted((REPO / "recipes").glob("structxlip_*.yaml")) + [REPO / "recipes" / "quickstart.yaml"]


@pytest.mark.slow
@pytest.mark.parametrize("path", STRUCTXLIP_RECIPES, ids=lambda p: p.stem)
def test_every_structxlip_recipe_runs_on_tiny_models(path, run_fixtures, tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    from finetune.training import run_recipe

    out = tmp_path / "run"
    recipe = load_recipe(path, _tiny_overrides(path, run_fixtures, out))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert run_recipe(recipe) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2
    for key in ("structxlip/structure", "structxlip/consistency", "structxlip/local", "loss"):
        assert math.isfinite(metrics["final_losses"][key]), key
    assert metrics["terms"]["structxlip"]["lexicon"]["captions"] == metrics["train_examples"]
    report = (out / "report.md").read_text()
    assert "Lexicon filter (paper Supp. Mat. B.3)" in report and "plots/structxlip_preview.png" in report
    assert (out / "plots" / "structxlip_preview.png").is_file()
    if recipe.eval.compare_base_length:
        assert set(metrics["after_at_base_length"]) == set(metrics["after"])
        assert "What reading past 77 tokens buys" in report


def test_structxlip_alone_with_base_none_encodes_the_colour_images_itself(model, crop_setup):
    term, data = crop_setup
    batch = Collator(model, Objective(None, [(term, term.weights)]))([data[i] for i in (0, 1, 2, 3)])
    objective = Objective(None, [(term, term.weights)])
    with torch.no_grad():
        feats = objective.encode(model, batch)
        values = objective.loss(model, feats)
    assert feats["image"].shape[0] == 4  # the consistency loss's colour images, asked by the term itself
    assert set(values) == {"structxlip/structure", "structxlip/consistency", "structxlip/local", "loss"}
    expected = (0.25 * values["structxlip/structure"] + 0.1 * values["structxlip/consistency"]
                + 0.1 * values["structxlip/local"])
    assert float(values["loss"]) == pytest.approx(float(expected), rel=1e-6)


# -- regions.source: dataset ---------------------------------------------------------------------------
@pytest.mark.parametrize("encode", ["pool", "crop"])
def test_dataset_regions_make_the_ground_truth_links_the_positives(model, scenes, tmp_path, encode):
    """regions.source: dataset on the synthetic scenes: the regions are the objects' boxes and each chunk's
    positives are exactly the object its sentence describes (no segmenter, no frozen matching)."""
    term = StructXLIPTerm(_options(encode=encode, source="dataset", per_image="all"))
    data = term.preprocess(scenes, model, cache_dir=str(tmp_path))
    assert term.stats["regions"]["source"] == "dataset"
    rows = (0, 1, 2, 3)
    batch = _batch(term, model, data, rows)
    objective = _objective(term)
    with torch.no_grad():
        feats = objective.encode(model, batch)
    positives = term.positives(_unpadded(feats))

    expected_rows, chunk_texts = [], []
    region_index = {}  # (sample, object) -> column of the batch's regions
    for i, row in enumerate(rows):
        for j, _ in enumerate(scenes[row]["objects"]):
            region_index[(i, j)] = len(region_index)
    for i, row in enumerate(rows):
        scene = scenes[row]
        for j, obj in sorted(enumerate(scene["objects"]), key=lambda t: t[1]["sentence_index"]):
            line = torch.zeros(len(region_index), dtype=torch.bool)
            line[region_index[(i, j)]] = True
            expected_rows.append(line)
            # the chunk is the object's own sentence, lexicon-filtered
            chunk_texts.append(split_chunks(term.lexicon.filter(scene["sentences"][obj["sentence_index"]]).text)[0])
    assert torch.equal(positives, torch.stack(expected_rows))
    assert [c for i in rows for c in data[i]["chunks"]] == chunk_texts
    boxes = [list(map(float, o["box"])) for i in rows for o in scenes[i]["objects"]]
    assert [list(b) for i in rows for b in data[i]["region_boxes"]] == boxes
    assert _unpadded(feats)["region"].shape == (len(boxes), feats["image"].shape[1])
    with torch.no_grad():
        values = objective.loss(model, feats)
    assert math.isfinite(float(values["structxlip/local"]))


def test_dci_masks_are_the_ground_truth_regions_of_their_chunks(model, tmp_path):
    """DCI with caption: complete under regions.source: dataset: each mask line's chunk has that mask's
    box (from DCI's bounds) as its one positive; the short and extra caption's chunks have none."""
    from tests.finetune.data.fixtures import DCI_MASKS, write_dci_fixture

    folder = write_dci_fixture(tmp_path / "dci", 2, 0, 0, masks=True)
    dci = load_source({"name": "dci", "path": str(folder), "split": "train",
                       "options": {"caption": "complete", "mask_min_size": 0}}).dataset
    term = StructXLIPTerm(_options(encode="pool", source="dataset", per_image="all"))
    data = term.preprocess(dci, model, cache_dir=str(tmp_path / "cache"))
    bounds = {m["label"]: m["bounds"] for m in DCI_MASKS.values()}
    for row in data:
        boxes = [[float(b["topLeft"]["x"]), float(b["topLeft"]["y"]), float(b["bottomRight"]["x"]),
                  float(b["bottomRight"]["y"])] for b in (bounds[o["label"]] for o in row["objects"])]
        assert [list(b) for b in row["region_boxes"]] == boxes
        linked = {chunk: [list(row["region_boxes"][r]) for r in regions]
                  for chunk, regions in zip(row["chunks"], row["chunk_topk"])}
        # the lexicon filter takes colour words ("white") away; each mask line's first sentence is one chunk
        assert linked == {"A wooden table: Its legs are thin": [boxes[0]], "Chair": [boxes[1]],
                          "Small cup: It is": [boxes[2]]}
    batch = _batch(term, model, data, rows=(0, 1))
    with torch.no_grad():
        feats = _objective(term).encode(model, batch)
    assert torch.equal(term.positives(feats), torch.eye(6, dtype=torch.bool))


def test_dataset_regions_need_the_dataset_columns_and_no_checkpoint(model, tmp_path):
    plain = datasets.Dataset.from_dict({"image": load_source({"name": "synthetic", "size": 2}).dataset["image"],
                                        "caption": ["A red cat.", "A dog."]})
    term = StructXLIPTerm(_options(encode="pool", source="dataset"))
    with pytest.raises(ValueError, match=r"regions.source: dataset needs the columns 'sentences' .* 'objects'"):
        term.preprocess(plain, model, cache_dir=str(tmp_path))
    fake = tmp_path / "FastSAM-s.pt"
    fake.write_bytes(b"x")
    with pytest.raises(ValueError, match="checkpoint .* is not used with source: dataset"):
        StructXLIPTerm(_options(encode="pool", source="dataset", checkpoint=str(fake)))


def test_dataset_regions_are_reported(model, scenes, tmp_path):
    term = StructXLIPTerm(_options(encode="pool", source="dataset"))
    data = term.preprocess(scenes, model, cache_dir=str(tmp_path))
    (section,) = term.report_sections(tmp_path, data, n=0)
    assert "Regions from the dataset (`regions.source: dataset`" in section
    assert "FastSAM" not in term.summary()["regions"]["segmenter"] and term.summary()["regions"]["source"] == "dataset"
