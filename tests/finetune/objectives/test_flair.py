"""The ``flair`` objective term: sub-captions from the data pipeline, the loss wiring, the scale clamp, and
training on streamed DreamLIP-style webdataset shards."""

from __future__ import annotations

import json
import math

import pytest
import torch

from finetune.data.collate import Collator
from finetune.data.sources import load_source
from finetune.models.registry import build_model
from finetune.objectives import Objective, build_term
from finetune.objectives.flair import FIELD_IDS, FIELD_MASK, FlairOptions, FlairTerm, join_public_code
from losses import flair_loss


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-flair", seed=0)


def _term(**options) -> FlairTerm:
    term, weights = build_term("flair", FlairOptions(**options))
    assert weights == {"flair": 1.0, "tcs": 0.0, "mps": 0.0}
    return term


SCENE = {"id": "s0", "caption": "A red circle. A blue square. A green star. The scene is busy.",
         "sentences": ["A red circle.", "A blue square.", "A green star.", "The scene is busy."]}


def test_subcaptions_come_from_the_sentences_reproducibly():
    term = _term(k=8)
    first = term.prepare(SCENE)["flair_subcaptions"]
    assert len(first) == 8 and first == term.prepare(dict(SCENE))["flair_subcaptions"]
    for sub in first:  # 1-3 of the scene's sentences, in caption order, joined as the public code
        parts = [s for s in SCENE["sentences"] if s[:-1] in sub]
        assert 1 <= len(parts) <= 3 and ". ".join(p[:-1] for p in parts) == sub
    term.set_epoch(1)
    draws = [term.prepare({**SCENE, "id": f"s{i}"})["flair_subcaptions"] for i in range(5)]
    assert any(d != first for d in draws)


def test_caption_fields_are_concatenated_and_strings_are_refused_by_name():
    term = _term(k=30, caption_fields=["raw_caption", "long_IB_captions"])
    example = {"id": "x", "caption": "ignored", "raw_caption": ["A dog runs."],
               "long_IB_captions": ["It is brown.", "The grass is green."]}
    subs = term.prepare(example)["flair_subcaptions"]
    assert {"A dog runs", "It is brown", "The grass is green"} <= set(subs)
    assert "ignored" not in " ".join(subs)
    with pytest.raises(TypeError, match="'long_IB_captions'"):
        term.prepare({**example, "long_IB_captions": "It is brown. The grass is green."})
    with pytest.raises(ValueError, match="no field 'long_IB_captions'.*options.fields"):
        term.prepare({"id": "x", "raw_caption": ["A dog."]})


def test_pixelprose_captions_are_split_on_the_fly():
    caption = "A chart shows 3.5 percent. It is blue"
    ours = _term(k=40, max_sentences=1).prepare({"id": "p", "caption": caption})["flair_subcaptions"]
    assert set(ours) == {"A chart shows 3.5 percent", "It is blue"}
    public = _term(k=40, max_sentences=1, splitter="flair").prepare({"id": "p", "caption": caption})
    assert set(public["flair_subcaptions"]) == {"A chart shows 3", "5 percent", "It is blue"}


def _batch(model, term, n=4):
    rows = load_source({"name": "synthetic", "size": n, "options": {"image_size": 32}}).dataset
    objective = Objective(None, [(term, {"flair": 1.0, "tcs": 0.0, "mps": 0.0})])
    return objective, Collator(model, objective)([rows[i] for i in range(n)])


def test_loss_is_flair_loss_on_the_class_token_patch_tokens_and_subcaptions(model):
    term = _term(k=3)
    objective, batch = _batch(model, term)
    assert batch[FIELD_IDS].shape[0] == 12 and batch[FIELD_IDS].shape[1] <= 77
    feats = objective.encode(model, batch)
    seed = term.draw_seed()
    out = objective.loss(model, feats)
    assert set(out) == {"flair", "flair/tcs", "flair/mps", "loss"}
    torch.testing.assert_close(out["loss"], out["flair"])
    # by hand: the model's own outputs, texts image-major
    glob, local = model.encode_local(batch["image_inputs"]["pixel_values"])
    texts = model.encode_text(batch[FIELD_IDS], batch[FIELD_MASK]).embeds.view(4, 3, -1)
    expected = flair_loss(texts, local, glob, model.pool, model.logit_scale.exp(), model.logit_bias, seed=seed)
    torch.testing.assert_close(out["flair"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["flair"], (out["flair/tcs"] + out["flair/mps"]) / 2, rtol=1e-5, atol=1e-5)
    model.zero_grad()
    out["loss"].backward()
    assert model.pool.attn.in_proj_weight.grad.abs().sum() > 0 and model.logit_bias.grad is not None
    model.zero_grad()


def test_scale_is_clamped_to_0_and_ln100_after_a_step(model):
    term = _term(k=2)
    objective, batch = _batch(model, term, n=2)
    objective.loss(model, objective.encode(model, batch))
    with torch.no_grad():
        model.logit_scale.fill_(5.0)
    term.after_optimizer_step()
    assert model.logit_scale.item() == pytest.approx(math.log(100))
    with torch.no_grad():
        model.logit_scale.fill_(-1.0)
    term.after_optimizer_step()
    assert model.logit_scale.item() == 0.0
    with torch.no_grad():
        model.logit_scale.fill_(math.log(1 / 0.07))
    assert "logit_scale" not in dict(term.named_parameters())


def test_a_model_without_the_pool_is_refused():
    clip = build_model("tiny-openclip")
    term = _term(k=2)
    objective, batch = _batch(clip, term, n=2)
    feats = objective.encode(clip, batch)
    with pytest.raises(ValueError, match="needs a FLAIR model"):
        objective.loss(clip, feats)


DREAMLIP_FIELDS = ("raw_caption", "shortIB_captions", "longIB_captions", "shortSV_captions", "longSV_captions",
                   "shortLLA_captions", "longLLA_captions")


def write_dreamlip_shards(folder, *, shards: int = 2, per_shard: int = 6, string_field: bool = False,
                          fields: tuple[str, ...] = ("raw_caption", "long_IB_captions")) -> str:
    """Webdataset shards as DreamLIP's re-captioned CC3M after pre-splitting: KEY.jpg + KEY.json with sentence
    lists per caption field (the last field a string with ``string_field``). Returns the brace pattern of
    their urls."""
    import io
    import tarfile

    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    colours = ["red", "green", "blue", "yellow", "white", "black"]
    for s in range(shards):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for j in range(per_shard):
                key = f"{s:05d}{j:04d}"
                colour = colours[(s * per_shard + j) % len(colours)]
                buf = io.BytesIO()
                Image.new("RGB", (40, 40), colour).save(buf, format="JPEG")
                long_ib = f"The {colour} square fills the picture. Nothing else is there."
                meta = {name: [f"A {colour} picture, {name}."] for name in fields[:-1]}
                meta[fields[-1]] = long_ib if string_field else long_ib.replace(". ", ".|").split("|")
                for name, data in ((f"{key}.jpg", buf.getvalue()), (f"{key}.json", json.dumps(meta).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder / ("{00000..%05d}.tar" % (shards - 1)))


def _stream_recipe(urls, out):
    from finetune.config import load_recipe

    return load_recipe("recipes/flair_cc3m_recap.yaml", [
        "model.name_or_path=tiny-flair", "model.dtype=null",
        "data.train=" + json.dumps({"name": "webdataset", "urls": urls, "caption_column": "json.raw_caption",
                                    "options": {"fields": ["json.raw_caption", "json.long_IB_captions"]},
                                    "shuffle_buffer": 0}),
        "data.num_workers=0", "objective.terms.flair.caption_fields=[raw_caption, long_IB_captions]",
        "objective.terms.flair.k=3", "eval.sets=[]", "eval.rerank_top_k=null", "train.max_steps=2",
        "train.batch_size=4", "train.warmup_steps=1", "train.mixed_precision=no", "train.checkpoint_every=0",
        "train.trackers=[]", f"output.dir={out}"])


@pytest.mark.slow
def test_streaming_recipe_trains_on_local_webdataset_shards(tmp_path):
    from tests.recipes.test_recipes import _reset_accelerate

    from finetune.training import run_recipe

    urls = write_dreamlip_shards(tmp_path / "shards")
    recipe = _stream_recipe(urls, tmp_path / "run")
    _reset_accelerate()
    assert run_recipe(recipe) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2 and math.isfinite(metrics["final_losses"]["flair"])
    assert {"flair/tcs", "flair/mps"} <= set(metrics["final_losses"])
    assert (tmp_path / "run" / "final" / "flair_config.json").is_file()


@pytest.mark.slow
def test_a_string_caption_field_in_the_shards_stops_the_run_naming_it(tmp_path):
    from tests.recipes.test_recipes import _reset_accelerate

    from finetune.training import run_recipe

    urls = write_dreamlip_shards(tmp_path / "shards", string_field=True)
    _reset_accelerate()
    with pytest.raises(TypeError, match="long_IB_captions"):
        run_recipe(_stream_recipe(urls, tmp_path / "run"))


def test_class_token_gets_its_gradient_from_l_mps_only(model):
    """The global (class-token) embedding is trained by L_mps (FLAIR eq. 3-4): with add_mps it gets a
    gradient, without it none (L_tcs reads only the local tokens)."""
    term = _term(k=2)
    objective, batch = _batch(model, term, n=3)
    with torch.no_grad():
        glob, local = model.encode_local(batch["image_inputs"]["pixel_values"])
        texts = model.encode_text(batch[FIELD_IDS], batch[FIELD_MASK]).embeds.view(3, 2, -1)
    for add_mps in (True, False):
        leaf = glob.clone().requires_grad_()
        loss = flair_loss(texts, local, leaf, model.pool, model.logit_scale.exp().detach(),
                          model.logit_bias.detach(), seed=term.draw_seed(), add_mps=add_mps)
        loss.backward()
        assert (leaf.grad is not None and leaf.grad.abs().sum() > 0) == add_mps


# --- issue 23 item 8: the public code's sub-caption join, the paper's L_mps --------------------------


def test_subcaptions_are_joined_as_the_public_code_joins_them():
    """The public sampler splits at periods (dropping them) and joins with ". ": DreamLIP lists pre-split
    by its script (no periods) and sentences that kept theirs give the same sub-caption text."""
    assert join_public_code(["a dog on grass", "a man wears a hat"]) == "a dog on grass. a man wears a hat"
    assert join_public_code(["A dog on grass.", "A man wears a hat."]) == "A dog on grass. A man wears a hat"
    assert join_public_code(["Is it raining?", "No."]) == "Is it raining? No"
    assert join_public_code(["One sentence."]) == "One sentence"
    stripped = {"id": "d", "raw_caption": ["a dog on grass", "a man wears a hat", "the sky is blue"]}
    kept = {"id": "d", "raw_caption": ["a dog on grass.", "a man wears a hat.", "the sky is blue."]}
    term = _term(k=16, caption_fields=["raw_caption"])
    subs = term.prepare(stripped)["flair_subcaptions"]
    assert subs == term.prepare(kept)["flair_subcaptions"]
    assert any(". " in s for s in subs) and not any(s.endswith(".") for s in subs)
    spaced = _term(k=16, caption_fields=["raw_caption"], join="space").prepare(stripped)["flair_subcaptions"]
    assert [s.replace(". ", " ") for s in subs] == spaced  # the same draws, joined by a space
    assert term.summary()["join"] == "public_code"


def test_l_mps_takes_the_papers_negatives_by_default_and_the_public_codes_as_an_option(model):
    objective, batch = _batch(model, _term(k=3))
    feats = objective.encode(model, batch)
    glob, local = model.encode_local(batch["image_inputs"]["pixel_values"])
    texts = model.encode_text(batch[FIELD_IDS], batch[FIELD_MASK]).embeds.view(4, 3, -1)
    for form in ("paper", "public_code"):
        term = _term(k=3) if form == "paper" else _term(k=3, mps_negatives=form)
        assert term.summary()["mps_negatives"] == form
        out = Objective(None, [(term, {"flair": 1.0, "tcs": 0.0, "mps": 0.0})]).loss(model, feats)
        from losses import FLAIRLoss

        want = FLAIRLoss(mps_negatives=form)(texts, local, glob, model.pool, model.logit_scale.exp(),
                                             model.logit_bias, seed=term.draw_seed())
        torch.testing.assert_close(out["flair/mps"], want["mps"], rtol=1e-5, atol=1e-5)
    # at initialisation (bias -10) the paper's 1-per-image negatives weigh K times less than all B*K
    paper = _term(k=3)
    public = _term(k=3, mps_negatives="public_code")
    a = Objective(None, [(paper, {"flair": 1.0, "tcs": 0.0, "mps": 0.0})]).loss(model, feats)["flair/mps"]
    b = Objective(None, [(public, {"flair": 1.0, "tcs": 0.0, "mps": 0.0})]).loss(model, feats)["flair/mps"]
    assert not torch.allclose(a, b)


# --- issue 23 item 9 / issue 22: the draws of a step, per process, saved with the run ----------------


def test_micro_batches_of_a_step_share_its_draw_and_the_count_is_in_the_state_dict(model):
    """Gradient accumulation calls the loss once per micro-batch on the step's features: every call of a
    step must draw the same negatives (else the accumulated gradient is no step's gradient); the next step
    draws anew, and the step count travels in the state dict that accelerate checkpoints."""
    term = _term(k=3)
    objective, batch = _batch(model, term)
    feats = objective.encode(model, batch)
    first = objective.loss(model, feats)["flair/tcs"]
    torch.testing.assert_close(objective.loss(model, feats)["flair/tcs"], first, rtol=0, atol=0)
    term.after_optimizer_step()
    assert not torch.allclose(objective.loss(model, feats)["flair/tcs"], first)
    term.after_optimizer_step()
    state = objective.state_dict()
    key = next(k for k in state if k.endswith("draws.steps"))
    assert int(state[key]) == 2
    fresh = _term(k=3)
    fresh_objective = Objective(None, [(fresh, {"flair": 1.0, "tcs": 0.0, "mps": 0.0})])
    assert fresh.draw_seed() != term.draw_seed()
    fresh_objective.load_state_dict(state)
    assert fresh.draws.value == 2 and fresh.draw_seed() == term.draw_seed()
    del state[key]  # a checkpoint from before the counter: loads, the count restarts at 0
    late = _term(k=3)
    Objective(None, [(late, {"flair": 1.0, "tcs": 0.0, "mps": 0.0})]).load_state_dict(state)
    assert late.draws.value == 0


def test_the_term_draws_only_its_processs_rows_and_reads_nothing_back(model, monkeypatch):
    """Issue 22: as rank 3 of 4,096 processes with 2 images each, the term must not build the global
    (8,192 x 8,194) negative-index matrix (537 MB of int64; 67 MB even as bytes) nor read a tensor back to
    the host. What it does hold grows with its own rows (2 x 8,194 conditioned pairs of width 64: 4 MB)."""
    from tests.losses.flair_probes import HostReads, as_rank, largest_cpu_allocation

    term = _term(k=3)
    objective, batch = _batch(model, term, n=2)
    with torch.no_grad():
        feats = objective.encode(model, batch)
    as_rank(monkeypatch, 3, 4096)
    largest = largest_cpu_allocation(lambda: objective.loss(model, feats))
    assert largest < 8192 * 8192 // 2, largest
    with HostReads() as spy:
        objective.loss(model, feats)
    assert spy.reads == []


def _trainer_for(tmp_path, dataset, model, term, **train):
    import yaml
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    from finetune.config import load_recipe
    from finetune.training import TrainModule, build_loop

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"train": {
        "lr": 1e-3, "batch_size": 4, "trackers": [], "log_every": 1, "seed": 0, "warmup_steps": 0, **train}}))
    objective = Objective(None, [(term, 1.0 if term.name == "fcast" else {"flair": 1.0, "tcs": 0.0, "mps": 0.0})])
    return build_loop(acc, TrainModule(model, objective), dataset, load_recipe(tmp_path / "r.yaml").train,
                      tmp_path / "run")


def _train(loop, on_step):
    from finetune.training import FinetuneRecipe

    return FinetuneRecipe.from_loop(loop).train(on_step)


class _Stop(Exception):
    pass


def assert_resume_draws_what_the_straight_run_draws(tmp_path, dataset, make_model, make_term) -> None:
    """Train 5 steps straight; train again, stop after step 3, resume from the step-2 checkpoint (mid-epoch
    of 16 examples in batches of 4) and finish: every step's losses of the resumed run equal the straight
    run's."""
    common = dict(max_steps=5, checkpoint_every=2, keep_checkpoints=3)
    straight: dict[int, dict] = {}
    torch.manual_seed(0)
    _train(_trainer_for(tmp_path / "straight", dataset, make_model(), make_term(), **common),
           lambda step, values: straight.__setitem__(step, dict(values)))

    def stop(step, values):
        if step == 3:
            raise _Stop

    torch.manual_seed(0)
    with pytest.raises(_Stop):
        _train(_trainer_for(tmp_path / "resumed", dataset, make_model(), make_term(), **common), stop)
    resumed: dict[int, dict] = {}
    torch.manual_seed(1)  # whatever the process's RNG, the draws are keyed by the run's seed and step
    trainer = _trainer_for(tmp_path / "resumed", dataset, make_model(), make_term(), **common)
    assert trainer.checkpoints.resume("latest") and trainer.state.step == 2
    _train(trainer, lambda step, values: resumed.__setitem__(step, dict(values)))
    assert sorted(resumed) == [3, 4, 5]
    for step in resumed:
        assert set(resumed[step]) == set(straight[step])
        for key, value in straight[step].items():
            assert resumed[step][key] == pytest.approx(value, rel=1e-6, abs=1e-7), (step, key)


@pytest.mark.slow
def test_a_resumed_flair_run_draws_the_negatives_of_the_uninterrupted_run(tmp_path):
    rows = load_source({"name": "synthetic", "size": 16, "seed": 0, "options": {"image_size": 32}}).dataset
    assert_resume_draws_what_the_straight_run_draws(tmp_path, rows, lambda: build_model("tiny-flair", seed=0),
                                                    lambda: _term(k=3))


def test_a_bad_mps_negatives_or_join_is_refused_naming_the_recipe_key():
    from finetune.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"objective\.terms\.flair\.mps_negatives` must be 'paper'.*'public_code'"):
        load_recipe("recipes/flair_cc3m_recap.yaml", ["objective.terms.flair.mps_negatives=all"])
    with pytest.raises(RecipeError, match=r"objective\.terms\.flair\.join` must be 'public_code'"):
        load_recipe("recipes/flair_cc3m_recap.yaml", ["objective.terms.flair.join=comma"])
