"""The open_clip backend against open_clip itself: same embeddings as the model's own encoders,
folders that plain open_clip reads, Long-CLIP checkpoints, tokenisation."""

from __future__ import annotations

import pytest
import torch

from finetune import load_model
from finetune.models.backends.openclip import OpenCLIPDualEncoder, build_open_clip, load_longclip_checkpoint

OPENCLIP_NAMES = ["tiny-openclip", "tiny-openclip-siglip"]


def _padded(model: OpenCLIPDualEncoder, texts: list[str]) -> torch.Tensor:
    tok = model.tokenize(texts)
    ids = torch.zeros(len(texts), model.max_text_len, dtype=torch.long)
    ids[:, : tok.input_ids.shape[1]] = tok.input_ids
    return ids


@pytest.mark.parametrize("name", OPENCLIP_NAMES)
def test_embeddings_equal_open_clips_own_encoders(name: str, load_tiny, images, captions, tmp_path) -> None:
    import open_clip

    model = load_tiny(name)
    # the reference: the same weights in a model that plain open_clip builds (none of xlipkit's fused
    # MLPs or other changes to the towers), so both halves compare two different implementations
    model.save_pretrained(str(tmp_path / "m"))
    plain = open_clip.create_model(f"local-dir:{tmp_path / 'm'}").eval()
    assert plain is not model.model
    ids = _padded(model, captions)
    pixels = model.preprocess_images(images)["pixel_values"]
    with torch.no_grad():
        assert torch.allclose(model.encode_text(ids).embeds, plain.encode_text(ids), atol=1e-5)
        assert torch.allclose(model.encode_image(pixels).embeds, plain.encode_image(pixels), atol=1e-5)
        tok = model.tokenize(captions)
        # causal CLIP: rows padded only to the longest caption give the same embeddings
        assert torch.allclose(model.encode_text(tok.input_ids).embeds, plain.encode_text(ids), atol=1e-5)


@pytest.mark.parametrize("name", OPENCLIP_NAMES)
def test_tokens_match_open_clips_tokenizer(name: str, load_tiny) -> None:
    model = load_tiny(name)
    texts = ["a red circle at the top left", "Two  BLUE squares!"]
    assert torch.equal(_padded(model, texts), model.tokenizer(texts))


def test_stretched_folder_reads_in_plain_open_clip(load_tiny, tmp_path, captions) -> None:
    import open_clip

    model = load_tiny("tiny-openclip", max_text_len=248)
    model.save_pretrained(str(tmp_path / "m"))
    plain = open_clip.create_model(f"local-dir:{tmp_path / 'm'}")
    assert plain.positional_embedding.shape[0] == 248 and plain.context_length == 248
    assert open_clip.get_tokenizer(f"local-dir:{tmp_path / 'm'}").context_length == 248
    ids = _padded(model, captions)
    assert ids.shape[1] == 248
    with torch.no_grad():
        assert torch.allclose(model.encode_text(ids).embeds, plain.encode_text(ids), atol=1e-5)


def _openai_state_dict(context: int) -> dict[str, torch.Tensor]:
    """A tiny OpenAI-format CLIP state dict (width 64: OpenAI's head width gives 1 head)."""
    from open_clip import CLIP

    cfg = {"embed_dim": 32, "quick_gelu": True,
           "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 8},
           "text_cfg": {"context_length": context, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 1}}
    torch.manual_seed(0)
    return CLIP(**cfg).state_dict()


def test_long_clip_checkpoint_merges_its_two_tables(tmp_path, captions) -> None:
    sd = _openai_state_dict(248)
    res = sd["positional_embedding"] + torch.randn_like(sd["positional_embedding"])
    sd["positional_embedding_res"] = res
    sd.pop("attn_mask", None)
    torch.save(sd, tmp_path / "longclip-tiny.pt")
    model = load_model(str(tmp_path / "longclip-tiny.pt"))
    assert isinstance(model, OpenCLIPDualEncoder) and model.family == "clip"
    assert model.max_text_len == 248 and model.base_text_len == 77
    assert model.kps == {"length": 248, "keep": 20, "ratio": 4, "freeze_kept": True}
    table = model.position_embedding().detach()
    assert torch.equal(table[:20], sd["positional_embedding"][:20]) and torch.equal(table[20:], res[20:])
    tok = model.tokenize(captions)
    assert tok.input_ids.shape[1] > 77 and not tok.truncated[0]
    with torch.no_grad():
        assert torch.isfinite(model.encode_text(tok.input_ids).embeds).all()


def test_openai_checkpoint_without_stretch(tmp_path) -> None:
    torch.save(_openai_state_dict(77), tmp_path / "clip.pth")
    model = load_longclip_checkpoint(tmp_path / "clip.pth")
    assert model.max_text_len == model.base_text_len == 77 and model.kps is None


def test_bad_checkpoints(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_longclip_checkpoint(tmp_path / "missing.pt")
    torch.save({"weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an OpenAI/Long-CLIP ViT checkpoint"):
        load_model(str(tmp_path / "other.pt"))


def test_unsupported_towers_are_named() -> None:
    from open_clip import SimpleTokenizer

    cfg = {"embed_dim": 32,
           "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8,
                          "attentional_pool": True, "attn_pooler_queries": 4, "attn_pooler_heads": 2},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    with pytest.raises(ValueError, match="attention-pooled open_clip ViTs"):
        build_open_clip(cfg, SimpleTokenizer(), name_or_path="coca-like")


def test_transform_params_follow_preprocess_cfg(load_tiny) -> None:
    clip = load_tiny("tiny-openclip").image_transform_params()
    assert clip["mode"] == "shortest_center_crop" and clip["size"] == 32 and clip["crop"] == (32, 32)
    assert clip["resample"] == "bicubic" and clip["mean"][0] == pytest.approx(0.48145466)
    siglip = load_tiny("tiny-openclip-siglip").image_transform_params()
    assert siglip["mode"] == "squash" and siglip["size"] == (32, 32) and siglip["mean"] == [0.5, 0.5, 0.5]
