"""The ``grm`` objective term: GRM's loss on the model's projected token states, the head as an inference
module (saved, restored), positives of multi-caption data, LAPS's warm-up switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune import load_finetuned, load_model
from finetune.config import ObjectiveConfig
from finetune.data.collate import Collator
from finetune.data.sources import load_source
from finetune.models.adapters import apply_adapter
from finetune.models.finetuned import save_finetuned
from finetune.objectives import build_objective
from finetune.objectives.grm import HEAD_KEY, GRMOptions, GRMTerm, image_key, install_head
from losses import GRMHead, grm_loss
from tests.finetune.data.fixtures import write_flickr30k_fixture


def _objective(base: str = "none", **options):
    return build_objective(ObjectiveConfig(base=base, terms={"grm": options}))


def _scenes(n: int = 8):
    return load_source({"name": "synthetic", "size": n, "seed": 0, "options": {"image_size": 32}}).dataset


def _batch(model, objective, rows):
    return Collator(model, objective)([rows[i] for i in range(len(rows))])


def test_term_installs_the_head_and_computes_grm_loss_on_projected_states() -> None:
    model = load_model("tiny-clip")
    objective = _objective()
    objective.prepare_model(model)
    rows = objective.preprocess(_scenes(), model)
    head = model.inference_modules[HEAD_KEY]
    assert isinstance(head, GRMHead) and head.dim == 32 and head.num_regions == 5
    model.eval()  # deterministic gates and regions: the same values twice
    batch = _batch(model, objective, [rows[i] for i in range(4)])
    feats = objective.encode(model, batch)
    out = objective.loss(model, feats)

    img = model.encode_image(**batch["image_inputs"], states=True)
    txt = model.encode_text(batch["input_ids"], batch["attention_mask"], states=True)
    vm = model.model.vision_model
    tokens = model.model.visual_projection(vm.post_layernorm(img.states))  # CLIP's own norm and projection
    text_tokens = model.model.text_projection(model.model.text_model.final_layer_norm(txt.states))
    want = grm_loss(head.encode_image(tokens), head.encode_text(text_tokens, batch["attention_mask"]))
    for key in ("ori", "key", "unc", "con", "recon", "kl", "ent", "reg", "keep_image", "keep_text"):
        torch.testing.assert_close(out[f"grm/{key}"], want[key])
    # The keep ratios are logged with weight 0: not in the total.
    torch.testing.assert_close(out["loss"], want["con"] + want["recon"] + want["reg"])
    assert "clip" not in out


def test_the_gates_keep_ratios_are_logged_in_the_loss_history() -> None:
    model = load_model("tiny-clip")
    objective = _objective(min_keep=0.3)
    objective.prepare_model(model)
    rows = objective.preprocess(_scenes(), model)
    batch = _batch(model, objective, [rows[i] for i in range(4)])
    model.train()
    out = objective.loss(model, objective.encode(model, batch))
    head = model.inference_modules[HEAD_KEY]
    assert head.min_keep == 0.3
    for key in ("grm/keep_image", "grm/keep_text"):
        assert out[key].shape == () and not out[key].requires_grad
        assert 0.3 <= out[key].item() <= 1.0  # the floor: at least 30 % of the real tokens
    assert objective.term_weights[0]["keep_image"] == objective.term_weights[0]["keep_text"] == 0.0


def test_keep_bias_option_initialises_the_installed_head() -> None:
    model = load_model("tiny-clip")
    head = install_head(model, GRMOptions(num_regions=3, keep_bias=2.5))
    for adapter in (head.vision_adapter, head.text_adapter):
        assert adapter.fc2.bias.tolist() == [0.0, 2.5]
    with pytest.raises(ValueError, match="keep_bias"):
        ObjectiveConfig(base="none", terms={"grm": {"keep_bias": "many"}})


def test_gradients_reach_both_adapters_the_prompts_and_the_towers_and_clip_sits_beside() -> None:
    model = load_model("tiny-clip")
    objective = _objective(base="clip", reg_weight=0.5)
    objective.prepare_model(model)
    rows = objective.preprocess(_scenes(), model)
    model.train()
    out = objective.loss(model, objective.encode(model, _batch(model, objective, [rows[i] for i in range(4)])))
    assert {"clip", "grm/con", "grm/recon", "grm/reg"} <= set(out)
    torch.testing.assert_close(out["loss"], out["clip"] + out["grm/con"] + out["grm/recon"] + 0.5 * out["grm/reg"])
    out["loss"].backward()
    head = model.inference_modules[HEAD_KEY]
    for p in (head.vision_adapter.fc1.weight, head.text_adapter.fc1.weight, head.prompts, head.phi.weight,
              model.model.visual_projection.weight, model.model.text_projection.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_captions_of_one_image_are_positives_not_negatives(tmp_path: Path) -> None:
    folder = write_flickr30k_fixture(tmp_path / "f30k", n_train=3, n_val=0, n_test=0)
    rows = load_source({"name": "flickr30k", "split": "train", "path": str(folder)}).dataset
    model = load_model("tiny-clip")
    objective = _objective(margin=0.5)
    objective.prepare_model(model)
    expanded = objective.preprocess(rows, model)
    assert len(expanded) == 15 and objective.all_terms[0].expanded == (3, 15)
    assert [expanded[i]["caption"] for i in range(5)] == rows[0]["captions"]
    assert {expanded[i]["grm_image"] for i in range(5)} == {rows[0]["id"]}
    # two captions of image 0 and two of image 1 in one batch
    batch = _batch(model, objective, [expanded[0], expanded[1], expanded[5], expanded[6]])
    keys = batch["grm_image_key"]
    assert keys[0] == keys[1] == image_key(rows[0]["id"]) and keys[2] == keys[3] != keys[0]
    model.eval()
    out = objective.loss(model, objective.encode(model, batch))
    head = model.inference_modules[HEAD_KEY]
    feats = objective.encode(model, batch)
    image = head.encode_image(model.project_image_states(feats["image_states"]))
    text = head.encode_text(model.project_text_states(feats["text_states"]), feats["text_mask"])
    same = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    # LAPS's ContrastiveLoss: each example's own pair anchors, the other caption of its image leaves the negatives.
    torch.testing.assert_close(out["grm/ori"], grm_loss(image, text, margin=0.5, positives=same)["ori"])
    diagonal = grm_loss(image, text, margin=0.5)["ori"]
    assert not torch.allclose(out["grm/ori"], diagonal)
    # anchors: positives (every same-image pair an anchor) is the option.
    every = _objective(margin=0.5, anchors="positives")
    every_out = every.loss(model, every.encode(model, batch))
    torch.testing.assert_close(every_out["grm/ori"],
                               grm_loss(image, text, margin=0.5, positives=same, anchors="positives")["ori"])
    assert every_out["grm/ori"] > out["grm/ori"]
    with pytest.raises(ValueError, match="anchors"):
        ObjectiveConfig(base="none", terms={"grm": {"anchors": "every"}})


def test_the_term_loss_reads_nothing_back_to_the_host() -> None:
    """The loss and its backward run without ``.item()``, ``nonzero``, boolean-mask indexing or ``bool()``
    of a tensor (on an accelerator each is a synchronisation per step)."""
    from tests.losses.grm_host_reads import CountHostReads

    model = load_model("tiny-clip")
    objective = _objective(base="clip")
    objective.prepare_model(model)
    rows = objective.preprocess(_scenes(), model)
    model.train()
    batch = _batch(model, objective, [rows[i] for i in range(4)])
    feats = objective.encode(model, batch)
    with CountHostReads() as counter:
        out = objective.loss(model, feats)
        out["loss"].backward()
    assert counter.reads == []
    assert model.inference_modules[HEAD_KEY].vision_adapter.fc1.weight.grad is not None


def test_warmup_sum_epochs_sums_over_negatives_first() -> None:
    term = GRMTerm(GRMOptions(warmup_sum_epochs=1))
    term.set_epoch(0)
    assert term.max_violation is False
    term.set_epoch(1)
    assert term.max_violation is True
    assert GRMTerm(GRMOptions()).max_violation is True
    model = load_model("tiny-clip")
    objective = _objective(warmup_sum_epochs=2)
    objective.prepare_model(model)
    rows = objective.preprocess(_scenes(), model)
    model.eval()
    feats = objective.encode(model, _batch(model, objective, [rows[i] for i in range(6)]))
    term = objective.all_terms[0]
    summed = objective.loss(model, feats)["grm/ori"]
    term.set_epoch(2)
    hardest = objective.loss(model, feats)["grm/ori"]
    assert summed > hardest > 0


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_head_is_saved_with_the_model_and_restored(tmp_path: Path, adapter: str) -> None:
    base = tmp_path / "base"
    load_model("tiny-clip").save_pretrained(str(base))
    model = apply_adapter(load_model(str(base)), {"type": adapter, "r": 2, "alpha": 4})
    objective = _objective(num_regions=3, leaky_slope=0.1, min_keep=0.2)
    objective.prepare_model(model)
    head = model.inference_modules[HEAD_KEY]
    assert head.prompts.requires_grad and head.num_regions == 3
    with torch.no_grad():
        head.prompts.add_(1.0)
    folder = save_finetuned(model, tmp_path / "final")
    assert (folder / "xlipkit_inference.json").is_file()
    loaded = load_finetuned(folder)
    restored = loaded.inference_modules[HEAD_KEY]
    assert isinstance(restored, GRMHead) and restored.num_regions == 3
    for (name, a), (_, b) in zip(head.state_dict().items(), restored.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # the similarity and floor it was trained with travel with it (the scorer reads them)
    assert (restored.leaky_slope, restored.min_keep) == (0.1, 0.2)
    # a second run on the saved model keeps its head (with that run's slope and floor); another K is refused
    assert install_head(loaded, GRMOptions(num_regions=3)) is restored
    assert (restored.leaky_slope, restored.min_keep) == (None, GRMOptions().min_keep)
    with pytest.raises(ValueError, match="set num_regions to the head's K"):
        install_head(loaded, GRMOptions(num_regions=5))


def test_streams_need_one_caption_per_example_and_models_without_a_head_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="set expand_captions: false to train on a stream"):
        GRMTerm().check_stream()
    GRMTerm(GRMOptions(expand_captions=False)).check_stream()
    model = load_model("tiny-clip")
    objective = _objective()
    batch = _batch(model, objective, [_scenes(2)[i] for i in range(2)])
    with pytest.raises(RuntimeError, match="has no GRM head"):
        objective.loss(model, objective.encode(model, batch))


@pytest.mark.slow
def test_grm_trains_on_a_stream_and_saves_its_head(tmp_path: Path, monkeypatch) -> None:
    """On a stream (no whole-dataset preprocessing) the run installs the head before the optimiser: its
    parameters train and are saved in final/."""
    import json

    from finetune.config import load_recipe
    from finetune.models.registry import save_tiny
    from finetune.training import run_recipe
    from tests.finetune.data.test_streams import _scenes as stream_scenes
    from tests.finetune.data.test_streams import write_webdataset
    from tests.recipes.test_recipes import _reset_accelerate

    write_webdataset(tmp_path / "shards", stream_scenes(12), 4)
    tiny = save_tiny("tiny-clip", tmp_path / "tiny-clip")
    out = tmp_path / "run"
    recipe = load_recipe(Path(__file__).resolve().parents[3] / "recipes" / "grm_tiny_synthetic.yaml", [
        f"model.name_or_path={tiny}", "model.init_from=null", "model.max_text_len=null",
        f"data.train={{name: webdataset, urls: '{tmp_path / 'shards'}/shard-{{00000..00002}}.tar'}}",
        "objective.terms.grm.expand_captions=false", "objective.terms.grm.num_regions=3",
        "eval.sets=[]", "eval.compare_with=[]", "train.max_steps=3", "train.epochs=null", "train.batch_size=4",
        "train.warmup_steps=1",
        "train.mixed_precision=no", "train.trackers=[]", f"output.dir={out}"])
    installed = {}
    prepare = GRMTerm.prepare_model

    def recording(self, model):
        prepare(self, model)
        installed["head"] = model.inference_modules[HEAD_KEY]
        installed["prompts"] = installed["head"].prompts.detach().clone()

    monkeypatch.setattr(GRMTerm, "prepare_model", recording)
    _reset_accelerate()
    assert run_recipe(recipe) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 3 and {"grm/con", "grm/reg"} <= set(metrics["final_losses"])
    head_size = sum(p.numel() for p in installed["head"].parameters())
    assert metrics["trainable_parameters"] == metrics["total_parameters"]  # the head is counted and trained
    assert metrics["total_parameters"] == sum(p.numel() for p in load_model(str(tiny)).parameters()) + head_size
    saved = load_finetuned(out / "final").inference_modules[HEAD_KEY]
    assert saved.num_regions == 3
    torch.testing.assert_close(saved.prompts, installed["head"].prompts.detach())  # the trained head was saved
    assert not torch.allclose(saved.prompts, installed["prompts"])  # and the optimiser moved it
