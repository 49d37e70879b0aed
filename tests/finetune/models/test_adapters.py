"""Full / LoRA / DoRA adapters: what trains, that training changes outputs, save -> load_finetuned
and merge reproduce them, checkpointing keeps adapter gradients, and the errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from finetune import load_finetuned, load_model
from finetune.models import param_groups
from finetune.models.adapters import (AdapterConfig, apply_adapter, enable_gradient_checkpointing, merge_adapter,
                                      peft_model_of)
from finetune.models.finetuned import save_finetuned
from finetune.models.longclip import apply_kps
from finetune.models.registry import TINY_NAMES

CAPTIONS = ["a red circle at the top left of the picture", "two blue squares on the right side"]


def _batch(model, images):
    return model.tokenize(CAPTIONS), model.preprocess_images(images[:2])


def _outputs(model, tok, pixels):
    with torch.no_grad():
        return (model.encode_text(tok.input_ids, tok.attention_mask).embeds,
                model.encode_image(**pixels).embeds)


def _train(model, tok, pixels, steps: int = 2) -> None:
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.01), lr=5e-2)
    model.train()
    for _ in range(steps):
        img, txt = model(input_ids=tok.input_ids, attention_mask=tok.attention_mask, **pixels)
        logits = model.logit_scale.exp() * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
        loss = F.cross_entropy(logits, torch.arange(len(CAPTIONS)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_adapter_config_validates_fields() -> None:
    with pytest.raises(ValueError, match=r"`adapter.type` must be one of 'full', 'lora', 'dora', got 'qlora' "
                                         r"\(did you mean 'lora'\?\)"):
        AdapterConfig(type="qlora")
    with pytest.raises(ValueError, match="adapter.r"):
        AdapterConfig(type="lora", r=0)
    with pytest.raises(ValueError, match="adapter.dropout"):
        AdapterConfig(type="lora", dropout=1.5)
    with pytest.raises(ValueError, match="adapter.targets"):
        AdapterConfig(type="lora", targets="q_proj")


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("name", TINY_NAMES)
def test_adapter_trains_saves_reloads_and_merges(name: str, kind: str, load_tiny, images, tmp_path) -> None:
    model = load_tiny(name, max_text_len=248)
    apply_adapter(model, AdapterConfig(type=kind, r=4, alpha=8, dropout=0.0))
    trainable = model.trainable_parameter_names()
    extra = {n for n in trainable if "lora_" not in n}
    expected = {f"model.{n}" for n, p in model.model.named_parameters()
                if p is model.position_embedding() or p is model.logit_scale or p is model.logit_bias}
    assert extra == expected  # only adapter weights + positions + logit scale (+ bias)
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    if kind == "dora":
        assert any("lora_magnitude_vector" in n for n in trainable)

    tok, pixels = _batch(model, images)
    before = _outputs(model, tok, pixels)
    kept = model.position_embedding().detach()[:20].clone()
    _train(model, tok, pixels)
    after = _outputs(model, tok, pixels)
    assert not torch.allclose(before[0], after[0], atol=1e-6)
    assert not torch.allclose(before[1], after[1], atol=1e-6)
    assert torch.equal(model.position_embedding().detach()[:20], kept)

    folder = save_finetuned(model, tmp_path / "adapter", recipe={"adapter": {"type": kind}})
    names = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "xlipkit.json", "xlipkit_extra.safetensors"} <= names
    info = json.loads((folder / "xlipkit.json").read_text())
    assert info["kind"] == "adapter" and info["kps"]["length"] == 248 and info["recipe"] == {"adapter": {"type": kind}}

    loaded = load_finetuned(folder)
    assert loaded.max_text_len == 248 and loaded.adapter.type == kind
    for a, b in zip(after, _outputs(loaded, tok, pixels)):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.equal(loaded.logit_scale.detach(), model.logit_scale.detach())

    merge_adapter(loaded)
    assert peft_model_of(loaded) is None and loaded.adapter is None
    assert not any("lora_" in n for n, _ in loaded.named_parameters())
    for a, b in zip(after, _outputs(loaded, tok, pixels)):
        assert torch.allclose(a, b, atol=1e-5)


def test_full_finetune_save_and_reload(load_tiny, images, tmp_path) -> None:
    model = load_tiny("tiny-clip", max_text_len=248)
    apply_adapter(model, {"type": "full"})
    assert len(model.trainable_parameter_names()) == len(list(model.parameters()))
    tok, pixels = _batch(model, images)
    _train(model, tok, pixels)
    expected = _outputs(model, tok, pixels)
    folder = save_finetuned(model, tmp_path / "full")
    assert (folder / "config.json").is_file() and (folder / "xlipkit.json").is_file()
    loaded = load_finetuned(folder)
    assert loaded.max_text_len == 248 and loaded.kps == model.kps
    for a, b in zip(expected, _outputs(loaded, tok, pixels)):
        assert torch.allclose(a, b, atol=1e-6)


def test_merged_adapter_saves_as_full_model(load_tiny, images, tmp_path) -> None:
    model = load_tiny("tiny-openclip")
    apply_adapter(model, AdapterConfig(type="lora", r=2, dropout=0.0))
    tok, pixels = _batch(model, images)
    _train(model, tok, pixels)
    merge_adapter(model)
    expected = _outputs(model, tok, pixels)
    folder = save_finetuned(model, tmp_path / "merged")
    assert json.loads((folder / "xlipkit.json").read_text())["kind"] == "full"
    for a, b in zip(expected, _outputs(load_model(str(folder)), tok, pixels)):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-openclip", "tiny-openclip-siglip"])
def test_gradient_checkpointing_keeps_adapter_gradients(name: str, load_tiny, images) -> None:
    model = load_tiny(name)
    apply_adapter(model, AdapterConfig(type="lora", r=2, dropout=0.0))
    enable_gradient_checkpointing(model)
    if model.backend == "hf":
        assert model.model.text_model.encoder.layers[0].gradient_checkpointing
    else:
        tower = getattr(model.model, "text", model.model)
        assert tower.transformer.grad_checkpointing
    model.train()
    tok, pixels = _batch(model, images)
    img, txt = model(input_ids=tok.input_ids, attention_mask=tok.attention_mask, **pixels)
    (img.sum() + txt.sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_custom_and_extra_targets(load_tiny) -> None:
    model = load_tiny("tiny-clip")
    apply_adapter(model, AdapterConfig(type="lora", targets=["q_proj"], extra_targets=["text_projection"],
                                       train_extra=["logit_scale", "text_model.final_layer_norm.*"]))
    lora = {n.split(".lora_")[0] for n in model.trainable_parameter_names() if "lora_" in n}
    assert lora and all(n.endswith(("q_proj", "text_projection")) for n in lora)
    assert "model.text_projection" in lora
    plain = {n for n in model.trainable_parameter_names() if "lora_" not in n}
    assert plain == {"model.logit_scale", "model.text_model.final_layer_norm.weight",
                     "model.text_model.final_layer_norm.bias"}


def test_adapter_errors(load_tiny) -> None:
    model = load_tiny("tiny-clip")
    with pytest.raises(ValueError, match="matches no parameter"):
        apply_adapter(model, AdapterConfig(type="lora", train_extra=["no_such_param*"]))
    with pytest.raises(ValueError, match="do not fit"):
        apply_adapter(model, AdapterConfig(type="lora", targets=["no_such_layer"]))
    apply_adapter(load_tiny("tiny-clip"), AdapterConfig(type="full"))
    adapted = apply_adapter(load_tiny("tiny-clip"), AdapterConfig(type="lora"))
    with pytest.raises(ValueError, match="already has an adapter"):
        apply_adapter(adapted, AdapterConfig(type="lora"))
    with pytest.raises(ValueError, match="before a LoRA/DoRA adapter"):
        apply_kps(adapted, 248)
    with pytest.raises(ValueError, match="save_finetuned"):
        adapted.save_pretrained("unused")
    with pytest.raises(ValueError, match="no LoRA/DoRA adapter"):
        merge_adapter(load_tiny("tiny-clip"))


def test_load_finetuned_rejects_a_different_base(load_tiny, tiny_dir, tmp_path) -> None:
    model = load_tiny("tiny-clip")
    apply_adapter(model, AdapterConfig(type="lora", r=2))
    folder = save_finetuned(model, tmp_path / "adapter")
    with pytest.raises(ValueError, match="does not match"):
        load_finetuned(folder, base=load_model("small-clip"))
    info = json.loads((folder / "xlipkit.json").read_text())
    info["base_model"] = str(tiny_dir("tiny-openclip"))
    (folder / "xlipkit.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="trained on base model .* does not match"):
        load_finetuned(folder, base=str(tiny_dir("tiny-openclip")))


def test_load_finetuned_needs_an_xlipkit_folder(tiny_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="xlipkit.json"):
        load_finetuned(tiny_dir("tiny-clip"))
    with pytest.raises(FileNotFoundError, match="not a folder written by save_finetuned"):
        load_finetuned(tmp_path / "missing")


def test_load_model_on_an_adapter_folder_loads_it(load_tiny, images, tmp_path) -> None:
    model = load_tiny("tiny-siglip")
    apply_adapter(model, AdapterConfig(type="lora", r=2, dropout=0.0))
    tok, pixels = _batch(model, images)
    _train(model, tok, pixels, steps=1)
    folder = save_finetuned(model, tmp_path / "a")
    loaded = load_model(str(folder))
    assert loaded.adapter.type == "lora"
    for a, b in zip(_outputs(model, tok, pixels), _outputs(loaded, tok, pixels)):
        assert torch.allclose(a, b, atol=1e-6)


def test_load_finetuned_downloads_hub_ids(load_tiny, tmp_path, monkeypatch) -> None:
    import huggingface_hub

    model = load_tiny("tiny-clip")
    apply_adapter(model, AdapterConfig(type="lora", r=2))
    folder = save_finetuned(model, tmp_path / "snapshot")
    calls = []

    def fake_snapshot_download(repo_id: str, revision: str | None = None) -> str:
        calls.append((repo_id, revision))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = load_finetuned("me/tiny-clip-lora", revision="v1")
    assert calls == [("me/tiny-clip-lora", "v1")] and loaded.adapter.type == "lora"
