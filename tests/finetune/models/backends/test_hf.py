"""The transformers backend: pooling rules, tokenizer handling, NaFlex inputs, families, saving."""

from __future__ import annotations

import shutil

import pytest
import torch

from finetune import load_model
from finetune.models.backends.hf import HFDualEncoder, patchify


def test_clip_pools_the_eos_token_with_both_eos_conventions(load_tiny) -> None:
    model = load_tiny("tiny-clip")
    ids = torch.tensor([[49406, 320, 1125, 49407, 49407], [49406, 320, 49407, 49407, 49407]])
    assert model.text_pool_positions(ids).tolist() == [3, 2]
    model.model.text_model.eos_token_id = 2  # legacy configs: the largest id is the end token
    assert model.text_pool_positions(ids).tolist() == [3, 2]


def test_padding_per_family(load_tiny) -> None:
    clip = load_tiny("tiny-clip").tokenize(["a cat", "a red cat"])
    assert clip.input_ids.shape == (2, 5)  # CLIP: padded to the longest caption
    siglip = load_tiny("tiny-siglip").tokenize(["a cat", "a red cat"])
    assert siglip.input_ids.shape == (2, 64)  # SigLIP: padded to the full length it was trained on
    assert siglip.attention_mask.sum(1).tolist() == [3, 4]


def test_siglip_text_ignores_the_padding_mask_like_its_training(load_tiny) -> None:
    model = load_tiny("tiny-siglip")
    tok = model.tokenize(["a red circle"])
    with torch.no_grad():
        ours = model.encode_text(tok.input_ids, tok.attention_mask).embeds
        unmasked = model.model.get_text_features(input_ids=tok.input_ids).pooler_output
    assert torch.allclose(ours, unmasked, atol=1e-6)


def test_clip_folder_without_tokenizer_gets_the_offline_clip_tokenizer(tiny_dir, tmp_path) -> None:
    folder = tmp_path / "clip"
    shutil.copytree(tiny_dir("tiny-clip"), folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    model = load_model(str(folder))
    assert model.tokenize(["a photo of a cat"]).input_ids[0].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_siglip_folder_without_tokenizer_is_an_error(tiny_dir, tmp_path) -> None:
    folder = tmp_path / "siglip"
    shutil.copytree(tiny_dir("tiny-siglip"), folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_model(str(folder))


def test_gemma_sized_siglip_is_the_siglip2_family() -> None:
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    from finetune.models.offline_tokenizers import word_tokenizer

    text = {"vocab_size": 256000, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": 1,
            "bos_token_id": 1}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 16, "patch_size": 8}
    model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
    enc = HFDualEncoder(model, word_tokenizer(), SiglipImageProcessor(), name_or_path="fixres-siglip2")
    assert enc.family == "siglip2" and enc.naflex is False


def test_patchify_orders_patches_like_the_siglip2_processor() -> None:
    from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches

    images = torch.randn(2, 3, 16, 24)
    patches, mask, shapes = patchify(images, 8)
    assert patches.shape == (2, 6, 192) and mask.shape == (2, 6) and shapes.tolist() == [[2, 3], [2, 3]]
    for i in range(2):
        assert torch.equal(patches[i], convert_image_to_patches(images[i], 8))


def test_naflex_images_of_different_grids(load_tiny, images) -> None:
    model = load_tiny("tiny-siglip2")
    wide = images[2].resize((96, 24))
    inputs = model.preprocess_images([images[1], wide])
    shapes = inputs["spatial_shapes"].tolist()
    assert shapes[0] != shapes[1]
    with torch.no_grad():
        out = model.encode_image(**inputs, states=True)
        single = model.encode_image(**model.preprocess_images([wide])).embeds
        square = model.encode_image(torch.randn(1, 3, 32, 32), states=True)
    assert out.grid == (0, 0) and out.spatial_shapes.tolist() == shapes
    assert out.patch_mask.sum(1).tolist() == [r * c for r, c in shapes]
    assert torch.allclose(out.embeds[1], single[0], atol=1e-5)  # padding patches are masked out
    assert square.grid == (4, 4) and square.states.shape == (1, 16, 32)


def test_transform_params_of_each_processor(load_tiny) -> None:
    clip = load_tiny("tiny-clip").image_transform_params()
    assert (clip["mode"], clip["size"], clip["crop"], clip["resample"]) == ("shortest_center_crop", 32, (32, 32),
                                                                            "bicubic")
    siglip = load_tiny("tiny-siglip").image_transform_params()
    assert (siglip["mode"], siglip["size"], siglip["crop"]) == ("squash", (32, 32), None)
    naflex = load_tiny("tiny-siglip2").image_transform_params()
    assert (naflex["mode"], naflex["max_num_patches"], naflex["patch_size"]) == ("naflex", 16, 8)


def test_gradient_checkpointing_switches(load_tiny) -> None:
    model = load_tiny("tiny-siglip")
    model.set_gradient_checkpointing(True)
    assert all(layer.gradient_checkpointing for layer in model.model.vision_model.encoder.layers)
    model.set_gradient_checkpointing(False)
    assert not any(layer.gradient_checkpointing for layer in model.model.text_model.encoder.layers)


def test_save_pretrained_replaces_a_folder_atomically(load_tiny, tmp_path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    load_tiny("tiny-clip").save_pretrained(str(target))
    assert not (target / "stale.txt").exists() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
