"""The registry: every name builds offline, deterministically, with the declared layout."""

from __future__ import annotations

import pytest
import torch

from finetune.models.registry import TINY_NAMES, build_model, named_config, registry_names, resolve_name, save_tiny
from finetune.plugins import NAMED_CONFIGS


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_models_are_tiny_and_declared(name: str) -> None:
    model = build_model(name)
    entry = named_config(name)
    assert (model.backend, model.family) == (entry.backend, entry.family)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    assert model.image_size == 32 and model.patch_size == 8


def test_same_seed_same_weights_and_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("tiny-siglip", seed=3)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_model("tiny-siglip", seed=3)
    c = build_model("tiny-siglip", seed=4)
    pa, pb, pc = (m.position_embedding().detach() for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_names_aliases_and_errors() -> None:
    assert resolve_name("ViT-B/16") == "clip-vit-base-patch16"
    assert resolve_name(" Tiny-CLIP ") == "tiny-clip"
    assert resolve_name("vit-b-16") is None
    assert "small-clip" in registry_names() and "vit-l/14" in registry_names()
    with pytest.raises(ValueError, match="registry names: .*tiny-clip"):
        build_model("tiny-bert")


def test_every_real_size_config_is_flagged_and_the_family_configs_exist() -> None:
    from finetune.models.families.fcast import FCAST_CONFIGS
    from finetune.models.registry import random_config

    built = {n: e for n, e in NAMED_CONFIGS.items() if e.build is not None}  # what build_model builds
    small = {n for n, e in built.items() if not e.real}
    assert small == {n for n in built if n.startswith(("tiny-", "small-"))}
    assert {n: e.pretrained for n, e in built.items() if e.real and e.backend == "hf"} == {
        "clip-vit-base-patch16": "openai/clip-vit-base-patch16",
        "clip-vit-large-patch14": "openai/clip-vit-large-patch14",
        "siglip2-base-patch16-224": "google/siglip2-base-patch16-224"}
    assert {n for n, e in NAMED_CONFIGS.items() if e.build is None and e.backend == "fcast"} == set(FCAST_CONFIGS)
    assert random_config("random:ViT-B/16").name == "clip-vit-base-patch16"
    assert random_config("tiny-clip", "open_clip") is None and random_config("fcast-b", "hf") is None
    assert build_model("random:tiny-clip").name_or_path == "random:tiny-clip"


def test_save_tiny_writes_native_folders(tmp_path) -> None:
    hf = save_tiny("tiny-clip", tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= {
        p.name for p in hf.iterdir()}
    oc = save_tiny("tiny-openclip-siglip", tmp_path / "oc")
    assert {"open_clip_config.json", "open_clip_model.safetensors", "tokenizer.json"} <= {p.name for p in oc.iterdir()}


def test_small_clip_is_the_quickstart_layout() -> None:
    model = build_model("small-clip")
    text, vision = model.model.config.text_config, model.model.config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, vision.num_hidden_layers, vision.hidden_size) == (4, 128, 4, 128)
    assert (model.image_size, model.patch_size, model.max_text_len) == (64, 8, 77)
    assert model.tokenize(["a photo of a cat"]).input_ids[0].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "params", "family", "patch"),
    [
        ("clip-vit-base-patch16", 149_620_737, "clip", 16),
        ("clip-vit-large-patch14", 427_616_513, "clip", 14),
        ("siglip2-base-patch16-224", 375_187_970, "siglip2", 16),
    ],
)
def test_real_architectures(name: str, params: int, family: str, patch: int) -> None:
    # the parameter counts of openai/clip-vit-base-patch16, openai/clip-vit-large-patch14 and
    # google/siglip2-base-patch16-224
    model = build_model(name)
    assert sum(p.numel() for p in model.parameters()) == params
    assert (model.family, model.patch_size, model.image_size) == (family, patch, 224)
