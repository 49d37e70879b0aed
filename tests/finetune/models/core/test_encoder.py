"""The DualEncoder contract on every backend, with models saved and reloaded through load_model:
shapes of embeds and states, projections of the pooled token, tokenisation, image inputs."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.models.core.encoder import DualEncoder, ImageFeatures, TextFeatures, TokenizedText

EXPECTED = {  # name -> (backend, family, embed dim, width, patch grid of a 32 px image)
    "tiny-clip": ("hf", "clip", 32, 32, (4, 4)),
    "tiny-siglip": ("hf", "siglip", 32, 32, (4, 4)),
    "tiny-siglip2": ("hf", "siglip2", 32, 32, (4, 4)),
    "tiny-openclip": ("open_clip", "clip", 32, 32, (4, 4)),
    "tiny-openclip-siglip": ("open_clip", "siglip", 32, 32, (4, 4)),
}


def _name(model: DualEncoder) -> str:
    return model.name_or_path.rstrip("/").rsplit("/", 1)[-1]


def test_identity_and_attributes(tiny: DualEncoder) -> None:
    backend, family, _, _, _ = EXPECTED[_name(tiny)]
    assert isinstance(tiny, DualEncoder)
    assert (tiny.backend, tiny.family) == (backend, family)
    assert tiny.patch_size == 8 and tiny.image_size == 32
    assert tiny.max_text_len == tiny.base_text_len == (77 if family == "clip" else 64)
    assert tiny.kps is None and tiny.adapter is None
    assert isinstance(tiny.logit_scale, torch.nn.Parameter) and tiny.logit_scale.numel() == 1
    assert (tiny.logit_bias is None) is (family == "clip")
    json.dumps(tiny.config_dict())


def test_text_shapes_and_projection_of_pooled_token(tiny: DualEncoder, captions: list[str]) -> None:
    _, _, dim, width, _ = EXPECTED[_name(tiny)]
    tok = tiny.tokenize(captions)
    assert isinstance(tok, TokenizedText)
    b, length = tok.input_ids.shape
    with torch.no_grad():
        plain = tiny.encode_text(tok.input_ids, tok.attention_mask)
        full = tiny.encode_text(tok.input_ids, tok.attention_mask, states=True)
    assert isinstance(full, TextFeatures)
    assert plain.embeds.shape == (b, dim) and plain.states is None
    assert full.states.shape == (b, length, width)
    assert torch.equal(full.attention_mask, tok.attention_mask)
    assert torch.allclose(plain.embeds, full.embeds, atol=1e-5)
    pooled = full.states[torch.arange(b), full.pool_positions]
    with torch.no_grad():
        assert torch.allclose(tiny.project_text_states(pooled), full.embeds, atol=1e-5)
        assert tiny.project_text_states(full.states).shape == (b, length, dim)
    if tiny.family == "clip":  # CLIP pools the end token, SigLIP the last position
        assert torch.equal(tok.input_ids[torch.arange(b), full.pool_positions], torch.full((b,), 49407))
    else:
        assert (full.pool_positions == length - 1).all()


def test_image_shapes_and_projection(tiny: DualEncoder, images) -> None:
    _, _, dim, width, grid = EXPECTED[_name(tiny)]
    inputs = tiny.preprocess_images(images[1:2] * 2)
    with torch.no_grad():
        plain = tiny.encode_image(**inputs)
        full = tiny.encode_image(**inputs, states=True)
    assert isinstance(full, ImageFeatures)
    assert plain.embeds.shape == (2, dim) and plain.states is None
    assert full.states.shape == (2, grid[0] * grid[1], width)
    assert full.grid == grid
    assert torch.allclose(plain.embeds, full.embeds, atol=1e-5)
    with torch.no_grad():
        per_token = tiny.project_image_states(full.states)
    assert per_token.shape == (2, grid[0] * grid[1], dim)
    if tiny.family == "clip":
        # CLIP towers pool the CLS token: projecting its state gives the embedding
        with torch.no_grad():
            assert torch.allclose(tiny.project_image_states(full.pooled_state), full.embeds, atol=1e-5)
    else:
        # attention-pooled towers: the embedding is the MAP head over all tokens; a token's
        # projection is the head over that token alone, i.e. over any number of copies of it
        assert full.pooled_state is None
        state = full.states[:, :1]
        with torch.no_grad():
            copies = _attention_pool(tiny, state.expand(-1, 5, -1))
            assert torch.allclose(tiny.project_image_states(state[:, 0]), copies, atol=1e-5)


def _attention_pool(model: DualEncoder, states: torch.Tensor) -> torch.Tensor:
    """The backend's own pooling path from pre-norm states ``(B, N, W)`` to embeddings."""
    if model.backend == "hf":
        vm = model.model.vision_model
        return vm.head(vm.post_layernorm(states))
    visual = model.model.visual
    return visual.head(visual.trunk.forward_head(visual.trunk.norm(states)))


def test_forward_returns_both_embeddings(tiny: DualEncoder, images, captions) -> None:
    tok = tiny.tokenize(captions)
    with torch.no_grad():
        img, txt = tiny(**tiny.preprocess_images(images), input_ids=tok.input_ids, attention_mask=tok.attention_mask)
        ref = tiny.encode_text(tok.input_ids, tok.attention_mask).embeds
    assert img.shape[0] == len(images) and txt.shape[0] == len(captions)
    assert torch.allclose(txt, ref)


def test_tokenize_truncates_keeping_end_token_and_counts(tiny: DualEncoder, captions) -> None:
    tok = tiny.tokenize(captions)
    assert tok.truncated.tolist() == [True, False, False]
    assert tok.input_ids.shape[1] == tiny.max_text_len  # the long caption fills the table
    assert tiny.truncation_stats == {"captions": 3, "truncated": 1}
    short = tiny.tokenize(captions, max_length=6)
    assert short.input_ids.shape[1] == 6 and short.truncated.tolist() == [True, True, False]
    end = short.input_ids[0, short.attention_mask[0].bool()][-1]
    full_end = tiny.tokenize(captions[2:]).input_ids[0, tiny.tokenize(captions[2:]).attention_mask[0].bool()][-1]
    assert int(end) == int(full_end)  # the end token survives truncation
    with pytest.raises(ValueError, match="exceeds"):
        tiny.tokenize(captions, max_length=tiny.max_text_len + 1)
    with pytest.raises(TypeError, match="list of strings"):
        tiny.tokenize("one caption")


def test_preprocess_matches_transform_params(tiny: DualEncoder, images) -> None:
    params = tiny.image_transform_params()
    assert {"mode", "size", "crop", "resample", "mean", "std", "patch_size"} <= set(params)
    assert len(params["mean"]) == len(params["std"]) == 3
    inputs = tiny.preprocess_images([images[0].convert("L"), images[2]])
    if params["mode"] == "naflex":
        assert params["max_num_patches"] == 16
        assert inputs["pixel_values"].shape == (2, 16, 3 * 8 * 8)
        assert set(inputs) == {"pixel_values", "pixel_attention_mask", "spatial_shapes"}
        assert (inputs["spatial_shapes"].prod(-1) <= 16).all()
    else:
        crop = params["crop"] or params["size"]
        assert inputs["pixel_values"].shape == (2, 3, *crop)
        assert set(inputs) == {"pixel_values"}


def test_trainable_and_device_helpers(tiny: DualEncoder) -> None:
    assert tiny.device.type == "cpu" and tiny.dtype == torch.float32
    assert len(tiny.trainable_parameter_names()) == len(list(tiny.parameters()))
