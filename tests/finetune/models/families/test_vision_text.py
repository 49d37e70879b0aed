"""The ``vision_text`` model family (GRM's ViT / Swin + BERT dual encoder): states, projections, spans,
building from two towers saved like hub checkpoints, save / load / adapters, recipe keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from finetune import load_finetuned, load_model
from finetune.config import RecipeError, load_recipe
from finetune.models.adapters import apply_adapter
from finetune.models.finetuned import save_finetuned
from finetune.models.families import detect_family, model_family_names
from finetune.models.registry import save_tiny
from finetune.models.families.vision_text import VisionTextDualEncoder, VisionTextOptions, save_tiny_towers

CAPTIONS = ["A red circle on the left. A blue square above it.", "Two dogs run on the beach."]


def _images(n: int = 2) -> list[Image.Image]:
    colours = [(200, 30, 30), (30, 30, 200), (30, 200, 30)]
    return [Image.new("RGB", (48, 40), colours[i % 3]) for i in range(n)]


@pytest.fixture(scope="module")
def towers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_tiny_towers(tmp_path_factory.mktemp("towers"))


@pytest.mark.parametrize("name, n_tokens", [("tiny-vision-text-vit", 16), ("tiny-vision-text-swin", 64)])
def test_states_project_to_the_towers_outputs_and_embeds_are_the_models(name: str, n_tokens: int) -> None:
    model = load_model(name)
    assert isinstance(model, VisionTextDualEncoder) and model.backend == "vision_text"
    assert "vision_text" in model_family_names()
    assert model.capabilities() >= {"states", "patch_geometry", "gradient_checkpointing"}
    pixels = model.preprocess_images(_images())["pixel_values"]
    feats = model.encode_image(pixels, states=True)
    assert feats.states.shape == (2, n_tokens, 32) and feats.grid[0] * feats.grid[1] == n_tokens
    assert feats.pooled_state is None
    vm = model.model.vision_model
    last = vm(pixel_values=pixels).last_hidden_state  # after the tower's final layernorm
    patches = last[:, 1:] if model.vision_type == "vit" else last
    torch.testing.assert_close(model.project_image_states(feats.states), model.model.visual_projection(patches))
    torch.testing.assert_close(feats.embeds, model.model.get_image_features(pixel_values=pixels).pooler_output)
    assert torch.equal(model.encode_image(pixels).embeds, feats.embeds)

    tok = model.tokenize(CAPTIONS)
    assert tok.input_ids[0, 0] == model.tokenizer.cls_token_id
    text = model.encode_text(tok.input_ids, tok.attention_mask, states=True)
    assert text.states.shape[:2] == tok.input_ids.shape
    want = model.model.get_text_features(input_ids=tok.input_ids, attention_mask=tok.attention_mask).pooler_output
    torch.testing.assert_close(text.embeds, want)
    torch.testing.assert_close(model.project_text_states(text.states),
                               model.model.text_projection(text.states))


def test_sentence_spans_from_offsets() -> None:
    model = load_model("tiny-vision-text-vit")
    spans = model.sentence_spans([CAPTIONS[0]])[0]
    ids = model.tokenize([CAPTIONS[0]]).input_ids[0].tolist()
    assert len(spans) == 2 and spans[0][0] == 1  # [CLS] at 0
    first = model.tokenizer.decode(ids[spans[0][0]:spans[0][1]])
    second = model.tokenizer.decode(ids[spans[1][0]:spans[1][1]])
    assert first == "a red circle on the left." and second == "a blue square above it."


@pytest.mark.parametrize("vision", ["vit", "swin"])
def test_built_from_two_saved_towers_and_round_trips(towers: dict[str, Path], tmp_path: Path, vision: str) -> None:
    model = load_model("unused", family="vision_text",
                       family_options={"vision": str(towers[vision]), "text": str(towers["bert"]),
                                       "projection_dim": 24})
    assert model.model.config.projection_dim == 24 and model.vision_type == vision
    from transformers import BertModel

    bert = BertModel.from_pretrained(towers["bert"])
    tok = model.tokenize(CAPTIONS)
    torch.testing.assert_close(model.encode_text(tok.input_ids, tok.attention_mask, states=True).states,
                               bert(input_ids=tok.input_ids, attention_mask=tok.attention_mask).last_hidden_state)
    model.save_pretrained(str(tmp_path / "saved"))
    assert detect_family(tmp_path / "saved") == "vision_text"
    loaded = load_model(str(tmp_path / "saved"))
    assert isinstance(loaded, VisionTextDualEncoder)
    pixels = model.preprocess_images(_images())["pixel_values"]
    torch.testing.assert_close(loaded.encode_image(pixels).embeds, model.encode_image(pixels).embeds, rtol=0, atol=0)


def test_tower_errors(towers: dict[str, Path]) -> None:
    from finetune.models.families.vision_text import load_vision_text

    with pytest.raises(ValueError, match="give both model.options.vision and model.options.text"):
        load_vision_text("x", vision=str(towers["vit"]))
    with pytest.raises(ValueError, match="model.options.vision .* is a 'bert' model"):
        load_vision_text("x", vision=str(towers["bert"]), text=str(towers["bert"]))
    with pytest.raises(ValueError, match="drop model.options.projection_dim"):
        load_vision_text("tiny-vision-text-vit", projection_dim=8)
    with pytest.raises(ValueError, match="not a VisionTextDualEncoderModel"):
        load_vision_text(str(towers["vit"]))


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_finetuned_model_saves_and_loads(tmp_path: Path, adapter: str) -> None:
    base = save_tiny("tiny-vision-text-vit", tmp_path / "base")
    model = apply_adapter(load_model(str(base)), {"type": adapter, "r": 2, "alpha": 4})
    if adapter == "lora":
        names = [n for n, p in model.named_parameters() if p.requires_grad and "lora_A" in n]
        assert any("vision_model.layers.0.attention.q_proj" in n for n in names)
        assert any("vision_model.layers.1.mlp.fc2" in n for n in names)
        assert any("text_model.encoder.layer.1.attention.self.value" in n for n in names)
        assert any("text_model.encoder.layer.1.intermediate.dense" in n for n in names)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    pixels = model.preprocess_images(_images())["pixel_values"]
    want = model.eval().encode_image(pixels).embeds
    folder = save_finetuned(model, tmp_path / "final")
    loaded = load_finetuned(folder)
    torch.testing.assert_close(loaded.encode_image(pixels).embeds, want, rtol=0, atol=1e-6)


def _recipe(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"# r\nmodel: {model}\n")
    return path


def test_recipe_keys_are_validated(tmp_path: Path) -> None:
    """``model.options`` is validated by the family's VisionTextOptions (issue 25 item 3)."""
    ok = load_recipe(_recipe(tmp_path, "{family: vision_text, options: {vision: a/b, text: c/d, projection_dim: 512}, "
                                       "max_text_len: null}"))
    assert ok.model.options == VisionTextOptions(vision="a/b", text="c/d", projection_dim=512)
    with pytest.raises(RecipeError, match="`model.options` belongs to a model family: set model.family"):
        load_recipe(_recipe(tmp_path, "{options: {vision: a/b, text: c/d}}"))
    with pytest.raises(RecipeError, match="`model.options` is set, but model family 'hf' takes no options"):
        load_recipe(_recipe(tmp_path, "{family: hf, options: {vision: a/b, text: c/d}}"))
    with pytest.raises(RecipeError, match="`model.options` builds a model from two towers: vision is set but text"):
        load_recipe(_recipe(tmp_path, "{family: vision_text, options: {vision: a/b}}"))
    with pytest.raises(RecipeError, match=r"`model.options.projection_dim` must be a positive integer"):
        load_recipe(_recipe(tmp_path, "{family: vision_text, options: {vision: a/b, text: c/d, projection_dim: 0}}"))
    with pytest.raises(RecipeError, match="a saved model keeps its own"):
        load_recipe(_recipe(tmp_path, "{family: vision_text, options: {projection_dim: 64}}"))
    with pytest.raises(RecipeError, match=r"line 2: `model.options.viison` is not a recipe key: did you mean "
                                          r"`model.options.vision`\?"):
        load_recipe(_recipe(tmp_path, "{family: vision_text, options: {viison: a/b, text: c/d}}"))


def test_the_old_top_level_keys_load_with_a_warning_naming_the_new_key(tmp_path: Path) -> None:
    new = load_recipe(_recipe(tmp_path, "{family: vision_text, options: {vision: a/b, text: c/d}}"))
    with pytest.warns(FutureWarning, match=r"line 2: `model.vision` is deprecated: write it as `model.options.vision`"):
        old = load_recipe(_recipe(tmp_path, "{family: vision_text, vision: a/b, text: c/d}"))
    assert old == new
    # null ones, as every recipe.yaml written before model.options holds them, load silently
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_recipe(_recipe(tmp_path, "{vision: null, text: null, projection_dim: null}")).model.options is None
    with pytest.raises(RecipeError, match="`model.vision` and `model.options.vision` are both set"):
        load_recipe(_recipe(tmp_path, "{family: vision_text, vision: a/b, options: {vision: a/b, text: c/d}}"))


def test_the_recipe_options_reach_the_family_loader(tmp_path: Path) -> None:
    from finetune.config.model_options import family_loader_options

    recipe = load_recipe(_recipe(tmp_path, "{family: vision_text, options: {vision: a/b, text: c/d}}"))
    assert family_loader_options(recipe.model) == {"vision": "a/b", "text": "c/d"}
    assert family_loader_options(load_recipe(_recipe(tmp_path, "{family: hf}")).model) == {}