"""The ``flair`` model family: structure, the authors' checkpoints, saving and weight decay."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from finetune import load_finetuned, load_model
from finetune.models.adapters import apply_adapter
from finetune.models.finetuned import save_finetuned
from finetune.models.families import detect_family, model_family_names
from finetune.models.families.flair import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    FlairDualEncoder,
    from_author_names,
    load_flair_checkpoint,
    to_author_names,
)
from finetune.models.registry import build_model
from finetune.models.weight_decay import param_groups


@pytest.fixture(scope="module")
def tiny() -> FlairDualEncoder:
    return build_model("tiny-flair", seed=1).eval()


def _outputs(model: FlairDualEncoder) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    pixels = torch.randn(3, 3, 32, 32)
    tok = model.tokenize(["a red circle on the left.", "a small blue square", "three stars"])
    with torch.no_grad():
        glob, local = model.encode_local(pixels)
        text = model.encode_text(tok.input_ids, tok.attention_mask).embeds
        tc = model.conditioned(text[None].expand(3, -1, -1), local)
    return {"global": glob, "local": local, "text": text, "tc": tc}


def _assert_same(a: dict, b: dict) -> None:
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def test_family_is_registered_and_registry_builds_flair(tiny):
    assert "flair" in model_family_names()
    assert isinstance(tiny, FlairDualEncoder) and tiny.backend == "flair" and tiny.family == "clip"
    assert tiny.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert tiny.logit_bias.item() == -10.0
    # the CPU recipe's model starts its bias at -4 (a documented choice); configs without the key keep -10
    from finetune.models.families.flair import SMALL_INIT_LOGIT_BIAS, flair_vit_b16_config

    assert build_model("small-flair").logit_bias.item() == SMALL_INIT_LOGIT_BIAS == -4.0
    assert "init_logit_bias" not in flair_vit_b16_config()
    assert tiny.pool.attn.embed_dim == 64 and tiny.pool.attn.num_heads == 8
    assert {"attn", "ln_q", "ln_k", "ln_v"} <= set(dict(tiny.pool.named_children()))


def test_global_is_the_class_token_and_local_tokens_share_its_projection(tiny):
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = tiny.encode_image(pixels, states=True)
        glob, local = tiny.encode_local(pixels)
        visual = tiny.model.visual
        # by hand: every token through ln_post, then the one projection
        tokens = torch.cat([feats.pooled_state[:, None], feats.states], 1)
        by_hand = visual.ln_post(tokens) @ visual.proj
    assert local.shape == (2, 16, 64) and glob.shape == (2, 64)
    torch.testing.assert_close(glob, by_hand[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(local, by_hand[:, 1:], rtol=0, atol=1e-5)
    torch.testing.assert_close(feats.embeds, glob)


def test_authors_checkpoint_loads_with_the_same_embeddings(tiny, tmp_path):
    """A checkpoint with the authors' names (as their .pt: state_dict wrapper, DDP prefix), written from the
    tiny model by the inverse mapping, loads from a file and gives the same embeddings."""
    state = to_author_names(tiny.model.state_dict())
    assert {"image_post.proj", "text_post.proj", "token_embedding.weight", "visual_proj.ln_q.weight",
            "logit_scale", "logit_bias"} <= set(state)
    assert "visual.proj" not in state and "text_projection" not in state
    path = tmp_path / "flair-tiny.pt"
    torch.save({"epoch": 32, "name": "tiny", "state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
    loaded = load_model(str(path), family="flair")
    assert isinstance(loaded, FlairDualEncoder) and loaded.pool_heads == 8
    _assert_same(_outputs(tiny), _outputs(loaded))
    # the same as safetensors, auto-detected through the family when named
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "flair-tiny.safetensors"))
    _assert_same(_outputs(tiny), _outputs(load_flair_checkpoint(tmp_path / "flair-tiny.safetensors")))


def test_authors_checkpoint_from_the_hub(tiny, tmp_path, monkeypatch):
    import huggingface_hub

    path = tmp_path / "flair-cc3m-recap.pt"
    torch.save(to_author_names(tiny.model.state_dict()), path)
    calls = []

    def fake_download(repo_id, filename, revision=None, **_):
        calls.append((repo_id, filename))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    loaded = load_model("xiaorui638/flair/flair-cc3m-recap.pt", family="flair")
    assert calls == [("xiaorui638/flair", "flair-cc3m-recap.pt")]
    _assert_same(_outputs(tiny), _outputs(loaded))


def test_a_checkpoint_that_is_not_flair_is_refused_by_name(tiny, tmp_path):
    state = to_author_names(tiny.model.state_dict())
    del state["visual_proj.attn.in_proj_weight"]
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"bad.pt.*visual_proj.attn.in_proj_weight"):
        load_model(str(tmp_path / "bad.pt"), family="flair")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "none.pt"), family="flair")


def test_name_mapping_is_an_inverse_pair(tiny):
    ours = tiny.model.state_dict()
    back = from_author_names(to_author_names(ours))
    assert list(back) == list(ours)


def test_save_pretrained_and_save_finetuned_keep_the_pool(tiny, tmp_path):
    model = build_model("tiny-flair", seed=2)
    with torch.no_grad():
        model.pool.ln_q.weight.mul_(1.5)  # a trained pool differs from a fresh one
    model.save_pretrained(str(tmp_path / "native"))
    assert {CONFIG_NAME, WEIGHTS_NAME} <= {p.name for p in (tmp_path / "native").iterdir()}
    assert "visual_proj.ln_q.weight" in load_file(str(tmp_path / "native" / WEIGHTS_NAME))
    assert detect_family(tmp_path / "native") == "flair"
    _assert_same(_outputs(model.eval()), _outputs(load_model(str(tmp_path / "native"))))

    full = apply_adapter(build_model("tiny-flair", seed=2), {"type": "full"})
    with torch.no_grad():
        full.pool.ln_q.weight.mul_(1.5)
    save_finetuned(full, tmp_path / "final", recipe={"model": {"family": "flair"}})
    restored = load_finetuned(tmp_path / "final")
    assert isinstance(restored, FlairDualEncoder)
    _assert_same(_outputs(full.eval()), _outputs(restored))


def test_no_weight_decay_on_1d_parameters_logit_scale_and_bias(tiny):
    names = {id(p): n for n, p in tiny.named_parameters()}
    decay, rest = param_groups(tiny, 0.5)
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in rest["params"]}
    assert {"model.logit_scale", "model.logit_bias", "model.visual_proj.ln_q.weight",
            "model.visual_proj.attn.in_proj_bias"} <= kept
    assert {"model.visual_proj.attn.in_proj_weight", "model.visual.proj", "model.text_projection"} <= decayed
    assert all(p.ndim >= 2 for p in decay["params"])


@pytest.mark.slow
def test_flair_vit_b16_has_the_papers_size():
    model = build_model("flair-vit-b-16")
    n = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in model.pool.parameters()) == 1_053_696
    assert round(n / 1e6, 2) == 150.67
    assert (model.image_size, model.patch_size, model.max_text_len, model.embed_dim) == (224, 16, 77, 512)
