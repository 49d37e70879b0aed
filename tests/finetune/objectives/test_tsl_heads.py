"""finetune.objectives.tsl_heads: FAST-GOAL's TSL glue to the model (paper III-B): sentence spans in a model's
tokens (eq. 7), box pooling through the processor's geometry (eq. 9, appendix C) and the TSL heads (eqs. 8, 10),
saved and restored with the model, against hand-worked values."""

from __future__ import annotations

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from finetune import load_model
from finetune.models.longclip import apply_kps
from finetune.objectives.tsl_heads import (
    BoxGeometry,
    attach_tsl_heads,
    box_patch_masks,
    tsl_heads_from_model,
    tsl_sentence_spans,
)
from losses.tsl import TSLHeads, pool_box_states, pool_patch_states, pool_span_states

CAPTION = "The pole is 3.5 m tall, e.g. taller than a man. A bird sings."
# CLIP BPE: <sot> the pole is 3 . 5 m tall , e . g . taller than a man . | a bird sings . <eot>
#           0     1   2    3  4 5 6 7 8    9 10 11 12 13 14   15   16 17 18  19 20  21    22 23
CAPTION_SPANS = [(1, 19), (19, 23)]
SENTENCE = "A red circle is here."  # 6 CLIP tokens: a red circle is here .


def _ramp_states(batch: int, length: int, width: int = 3) -> torch.Tensor:
    """states[b, l, w] = 100 b + l + w / 10: the mean over positions is read off by hand."""
    b = torch.arange(batch, dtype=torch.float64)[:, None, None]
    pos = torch.arange(length, dtype=torch.float64)[None, :, None]
    w = torch.arange(width, dtype=torch.float64)[None, None, :]
    return 100 * b + pos + w / 10


# --- spans (eq. 7) -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-openclip"])  # HF fast tokenizer / open_clip's own BPE
def test_spans_of_a_caption_with_a_decimal_and_an_abbreviation(tiny_dir, name):
    model = load_model(str(tiny_dir(name)))
    captions = [CAPTION, CAPTION, "Only one sentence."]
    selected = tsl_sentence_spans(model, captions, [0, 1, 0])
    assert selected.spans.tolist() == [[1, 19], [19, 23], [1, 5]]  # only one sentence .
    assert selected.valid.tolist() == [True, True, True] and selected.truncated == 0
    ids = model.tokenize(captions).input_ids
    assert ids.shape[1] == 24 and int(ids[0, 23]) == 49407  # the spans index these rows
    pooled = pool_span_states(_ramp_states(3, 24), selected.spans)
    # mean of positions 1..18 = 9.5, of 19..22 = 20.5, of 1..4 = 2.5 (plus 100 b + w / 10)
    torch.testing.assert_close(pooled, torch.tensor([[9.5, 9.6, 9.7], [120.5, 120.6, 120.7], [202.5, 202.6, 202.7]],
                                                    dtype=torch.float64))


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-openclip"])
def test_a_sentence_past_token_248_is_dropped_and_counted(tiny_dir, name):
    model = apply_kps(load_model(str(tiny_dir(name))), 248, keep=20)
    # "a dog ." sits at 1-3, repeat k of SENTENCE at 4 + 6k .. 10 + 6k: repeat 39 (sentence 40) ends at 244,
    # repeat 40 (sentence 41) would cover 244-249 and is cut (position 247 holds the end token).
    straddles = "A dog. " + " ".join([SENTENCE] * 41)
    captions = [straddles, straddles, straddles, CAPTION]
    selected = tsl_sentence_spans(model, captions, [40, 41, 0, 1])
    assert selected.spans.tolist() == [[238, 244], [0, 0], [1, 4], [19, 23]]
    assert selected.valid.tolist() == [True, False, True, True]
    assert selected.truncated == 1
    states = _ramp_states(4, 248)
    pooled = pool_span_states(states, selected.spans, valid=selected.valid)
    assert pooled[0, 0].item() == pytest.approx(240.5)  # mean of 238..243
    assert pooled[1].abs().sum().item() == 0  # dropped row: not pooled
    assert pooled[2, 0].item() == pytest.approx(202.0) and pooled[3, 0].item() == pytest.approx(320.5)
    with pytest.raises(ValueError, match="sample 1 has span \\(0, 0\\)"):
        pool_span_states(states, selected.spans)  # without valid, the dropped row is an error


# --- boxes (eq. 9, appendix C) -------------------------------------------------------------------------


def _real_geometry_clip(config_name: str) -> tuple:
    """A tiny transformers CLIP whose vision tower has the patch and image size of open_clip's real
    config ``config_name`` (width 32, one layer), its processor as the hub checkpoint's."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from finetune.models.backends.hf import HFDualEncoder
    from finetune.models.offline_tokenizers import clip_tokenizer

    vision_cfg = open_clip.get_model_config(config_name)["vision_cfg"]
    size, patch = vision_cfg["image_size"], vision_cfg["patch_size"]
    text = {"vocab_size": 49408, "max_position_embeddings": 77, "bos_token_id": 49406, "eos_token_id": 49407,
            "pad_token_id": 49407, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    vision = {"image_size": size, "patch_size": patch, "hidden_size": 32, "intermediate_size": 37,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    torch.manual_seed(0)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return HFDualEncoder(CLIPModel(config).eval(), clip_tokenizer(77), processor, name_or_path=config_name), patch


@pytest.fixture(scope="module")
def real_geometry_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ViT-B/16 and ViT-L/14 geometry (224 px, patch 16 / 14), saved and loaded back like a hub model."""
    out = {}
    for name in ("ViT-B-16", "ViT-L-14"):
        model, patch = _real_geometry_clip(name)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(folder))
        out[name] = load_model(str(folder))
    return out


def _image_with_dark_rectangle(width: int, height: int, box: tuple[int, int, int, int]) -> Image.Image:
    pixels = np.full((height, width, 3), 255, dtype=np.uint8)
    x1, y1, x2, y2 = box
    pixels[y1:y2, x1:x2] = 0
    return Image.fromarray(pixels)


def _patches(rows: range, cols: range, grid: int) -> list[int]:
    return [r * grid + c for r in rows for c in cols]


# 640 x 480 -> shortest side 224: 298 x 224 (int(224 * 640 / 480)); centre crop 224 cuts 37 px on the left.
# Box (100, 60, 300, 200) -> x: 100 * 298/640 - 37 = 9.5625 .. 300 * 298/640 - 37 = 102.6875,
#                            y: 60 * 224/480 = 28 .. 200 * 224/480 = 93.33.
# ViT-B/16 (grid 14): columns floor(9.5625/16)=0 .. ceil(102.6875/16)=7, rows floor(28/16)=1 .. ceil(93.33/16)=6.
# ViT-L/14 (grid 16): columns 0 .. ceil(102.6875/14)=8, rows floor(28/14)=2 .. ceil(93.33/14)=7.
BOX = (100, 60, 300, 200)
EXPECTED = {"ViT-B-16": (14, range(1, 6), range(0, 7)), "ViT-L-14": (16, range(2, 7), range(0, 8))}


@pytest.mark.parametrize("name", ["ViT-B-16", "ViT-L-14"])
def test_box_pooling_through_the_real_resize_and_centre_crop(real_geometry_models, name):
    model = real_geometry_models[name]
    grid, rows, cols = EXPECTED[name]
    params = model.image_transform_params()
    assert (params["mode"], params["size"], params["crop"]) == ("shortest_center_crop", 224, (224, 224))
    assert params["patch_size"] == {"ViT-B-16": 16, "ViT-L-14": 14}[name]
    images = [_image_with_dark_rectangle(640, 480, BOX), _image_with_dark_rectangle(300, 300, (0, 0, 10, 10))]
    inputs = model.preprocess_images(images)
    # the processor really puts the rectangle where the geometry says: x 9.56-102.69, y 28-93.33 of the input
    dark = inputs["pixel_values"][0].mean(dim=0) < 0
    assert bool(dark[30:92, 11:101].all()) and not bool(dark[:, 105:].any()) and not bool(dark[96:].any())
    assert not bool(dark[:26].any())
    with torch.no_grad():
        feats = model.encode_image(**inputs, states=True)
    assert feats.states.shape[1] == grid * grid
    geometry = BoxGeometry.from_model(model, [im.size for im in images])
    boxes = torch.tensor([BOX, (150, 150, 300, 300)], dtype=torch.float32)
    masks = box_patch_masks(boxes, geometry, grid * grid)
    assert masks[0].nonzero().flatten().tolist() == _patches(rows, cols, grid)
    # 300 x 300 -> 224 x 224, scale 224/300: (112, 112) .. (224, 224) is the bottom-right quarter of the patches
    half = grid // 2 if name == "ViT-B-16" else 8  # 112 / 16 = 7, 112 / 14 = 8
    assert masks[1].nonzero().flatten().tolist() == _patches(range(half, grid), range(half, grid), grid)
    pooled = pool_box_states(feats.states, boxes, geometry)
    expected = torch.stack([feats.states[0, _patches(rows, cols, grid)].mean(dim=0),
                            feats.states[1, _patches(range(half, grid), range(half, grid), grid)].mean(dim=0)])
    torch.testing.assert_close(pooled, expected)


def test_small_boxes_and_boxes_cut_by_the_crop():
    params = {"mode": "shortest_center_crop", "size": 224, "crop": (224, 224), "patch_size": 16}
    geometry = BoxGeometry([(640, 480)] * 4, params)
    # input x = 0.465625 x - 37, y = 0.4667 y (see EXPECTED)
    boxes = [
        (120, 70, 125, 75),  # -> (18.9, 32.7)-(21.2, 35): inside patch row 2, col 1 -> that patch
        (100, 60, 110, 65),  # -> (9.56, 28)-(14.2, 30.3): inside row 1, col 0
        (140, 60, 150, 65),  # -> (28.2, 28)-(32.8, 30.3): straddles columns 1 and 2 -> both (overlap)
        (0, 0, 100, 50),  # -> x -37 .. 9.56 clipped to 0 .. 9.56, y 0 .. 23.3 -> column 0, rows 0-1
    ]
    masks = box_patch_masks(boxes, geometry, 196)
    assert [m.nonzero().flatten().tolist() for m in masks] == [[29], [14], [15, 16], [0, 14]]
    centre = box_patch_masks(boxes, BoxGeometry([(640, 480)] * 4, params, cover="centre"), 196)
    assert centre[2].nonzero().flatten().tolist() == [15]  # StructXLIP's rule: the patch under the box centre
    with pytest.raises(ValueError, match="cover must be 'overlap' .* or 'centre', got 'center'"):
        BoxGeometry([(640, 480)], params, cover="center")


def test_empty_boxes_are_errors_naming_the_sample():
    params = {"mode": "shortest_center_crop", "size": 224, "crop": (224, 224), "patch_size": 16}
    geometry = BoxGeometry([(640, 480)] * 2, params)
    states = torch.zeros(2, 196, 4)
    with pytest.raises(ValueError, match="sample 1: box \\(10, 10, 10, 50\\) has zero area"):
        pool_box_states(states, [(0, 0, 100, 100), (10, 10, 10, 50)], geometry)
    with pytest.raises(ValueError, match="sample 1: box .* has zero area"):
        pool_box_states(states, [(0, 0, 100, 100), (10, 50, 30, 40)], geometry)
    # x 0..70 -> -37 .. -4.4: all in the 37 px the centre crop cuts away
    with pytest.raises(ValueError, match="sample 0: box \\(0, 0, 70, 50\\) lies entirely outside .* 640x480 image"):
        pool_box_states(states, [(0, 0, 70, 50), (0, 0, 100, 100)], geometry)
    # a row without a local pair is not checked and pools to zeros
    pooled = pool_box_states(states + 1, [(0, 0, 70, 50), (200, 200, 300, 300)], geometry,
                             valid=torch.tensor([False, True]))
    assert pooled[0].abs().sum() == 0 and torch.equal(pooled[1], torch.ones(4))


def test_geometry_must_fit_the_states():
    params = {"mode": "shortest_center_crop", "size": 224, "crop": (224, 224), "patch_size": 14}
    with pytest.raises(ValueError, match="hold 196 patches per image but .* has 256 \\(patch size 14\\)"):
        pool_box_states(torch.zeros(1, 196, 4), [(0, 0, 10, 10)], BoxGeometry([(224, 224)], params))
    with pytest.raises(ValueError, match="2 image sizes for 1 boxes"):
        box_patch_masks([(0, 0, 10, 10)], BoxGeometry([(224, 224)] * 2, params), 256)
    naflex = {"mode": "naflex", "size": None, "crop": None, "patch_size": 8}
    with pytest.raises(ValueError, match="NaFlex .*spatial_shapes"):
        box_patch_masks([(0, 0, 10, 10)], BoxGeometry([(50, 30)], naflex), 16)
    with pytest.raises(ValueError, match="sample 0 selects no patch"):
        pool_patch_states(torch.zeros(1, 4, 2), torch.zeros(1, 4, dtype=torch.bool))


def test_a_box_the_centre_crop_cuts_away_can_be_dropped_instead_of_raising():
    """Issue 23 item 4: on a 1000 x 500 image CLIP's 224 centre crop keeps x 250-750, so a detector box
    (10, 100, 240, 400) has no patch. ``outside="drop"`` leaves its row empty (what a collate function does before
    the training step) instead of raising; a box partly inside is clipped to the crop."""
    params = {"mode": "shortest_center_crop", "size": 224, "crop": (224, 224), "patch_size": 16}
    geometry = BoxGeometry([(1000, 500)] * 3, params)
    boxes = [(10, 100, 240, 400), (200, 100, 300, 400), (300, 300, 300, 400)]  # outside, half inside, no area
    with pytest.raises(ValueError, match="sample 0: box \\(10, 100, 240, 400\\) lies entirely outside"):
        box_patch_masks(boxes[:1], BoxGeometry([(1000, 500)], params), 196)
    masks = box_patch_masks(boxes, geometry, 196, outside="drop")
    assert masks.any(dim=1).tolist() == [False, True, False]
    # (200, 300) -> input x (200 * 0.448 - 112, 300 * 0.448 - 112) = (-22.4, 22.4): columns 0-1; y 100-400 -> 44.8-179.2
    cols = sorted({int(i) % 14 for i in masks[1].nonzero().flatten()})
    rows = sorted({int(i) // 14 for i in masks[1].nonzero().flatten()})
    assert cols == [0, 1] and rows == list(range(2, 12))
    with pytest.raises(ValueError, match="outside must be 'raise' or 'drop'"):
        box_patch_masks(boxes, geometry, 196, outside="skip")


def test_naflex_boxes_follow_each_images_grid(tiny_dir):
    model = load_model(str(tiny_dir("tiny-siglip2")))  # NaFlex, at most 16 patches of 8 px
    rng = np.random.RandomState(0)
    images = [Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in [(50, 30), (40, 40)]]
    inputs = model.preprocess_images(images)
    with torch.no_grad():
        feats = model.encode_image(**inputs, states=True)
    assert feats.spatial_shapes.tolist() == [[3, 5], [4, 4]]  # 15 real patches + 1 padding, 16
    geometry = BoxGeometry.from_model(model, [im.size for im in images], spatial_shapes=feats.spatial_shapes)
    # 50 x 30 -> 40 x 24 (scale 0.8): (10, 5, 30, 20) -> (8, 4, 24, 16): columns 1-2, rows 0-1 of a 3 x 5 grid
    # 40 x 40 -> 32 x 32 (scale 0.8): (30, 30, 40, 40) -> (24, 24, 32, 32): the last patch of the 4 x 4 grid
    boxes = [(10, 5, 30, 20), (30, 30, 40, 40)]
    masks = box_patch_masks(boxes, geometry, feats.states.shape[1])
    assert [m.nonzero().flatten().tolist() for m in masks] == [[1, 2, 6, 7], [15]]
    assert feats.patch_mask[0].tolist() == [1] * 15 + [0]  # the padding patch is never selected
    assert not bool((masks & ~feats.patch_mask.bool()).any())
    pooled = pool_box_states(feats.states, boxes, geometry)
    torch.testing.assert_close(pooled, torch.stack([feats.states[0, [1, 2, 6, 7]].mean(0), feats.states[1, 15]]))


# --- heads psi_v, psi_t (eqs. 8, 10) --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-openclip"])
def test_new_heads_start_as_the_models_own_projections(tiny_dir, name):
    model = load_model(str(tiny_dir(name)))
    torch.manual_seed(1)
    with torch.no_grad():  # as after training: norms that are not the identity, projections with a bias
        for key, p in model.named_parameters():
            if any(k in key for k in ("post_layernorm", "final_layer_norm", "ln_post", "ln_final")):
                p.add_(torch.randn_like(p) * 0.5)
    heads = tsl_heads_from_model(model)
    image_states, text_states = torch.randn(5, 32) * 3 + 1, torch.randn(2, 7, 32) * 2
    with torch.no_grad():
        torch.testing.assert_close(heads.project_image_states(image_states), model.project_image_states(image_states))
        torch.testing.assert_close(heads.project_text_states(text_states), model.project_text_states(text_states))
    # separate parameters: training the heads leaves the model's projections alone
    assert not {id(p) for p in heads.parameters()} & {id(p) for p in model.parameters()}
    heads.project_image_states(image_states).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_new_heads_need_a_norm_and_linear_head(tiny_dir):
    model = load_model(str(tiny_dir("tiny-siglip2")))  # SigLIP2's image head is attention pooling
    with pytest.raises(ValueError, match="image head is not one .*\\(heads: own\\)"):
        tsl_heads_from_model(model)


def test_attached_heads_are_saved_and_restored_with_the_model(tiny_dir, tmp_path):
    from finetune.models.finetuned import load_finetuned, save_finetuned

    model = load_model(str(tiny_dir("tiny-clip")))
    heads = attach_tsl_heads(model)
    assert attach_tsl_heads(model) is heads and model.inference_modules["tsl_heads"] is heads
    with torch.no_grad():
        heads.image.proj.weight.mul_(2)  # trained heads differ from the model's projection
        heads.text.norm.bias.add_(0.25)
    save_finetuned(model, tmp_path / "final")
    loaded = load_finetuned(str(tmp_path / "final"))
    restored = loaded.inference_modules["tsl_heads"]
    assert isinstance(restored, TSLHeads)
    for (key, a), (_, b) in zip(heads.state_dict().items(), restored.state_dict().items()):
        torch.testing.assert_close(a, b, msg=key)
    assert attach_tsl_heads(loaded) is restored  # a resumed or reloaded model keeps its trained heads


@pytest.mark.slow
def test_a_model_with_heads_loads_in_a_fresh_process_without_importing_losses(tiny_dir, tmp_path):
    import subprocess
    import sys

    from finetune.models.finetuned import save_finetuned

    model = load_model(str(tiny_dir("tiny-clip")))
    with torch.no_grad():
        attach_tsl_heads(model).image.proj.weight.mul_(3)
    save_finetuned(model, tmp_path / "final")
    torch.save(model.inference_modules["tsl_heads"].state_dict(), tmp_path / "heads.pt")
    script = (
        "import sys, torch\n"
        "from finetune.models.finetuned import load_finetuned\n"
        f"model = load_finetuned({str(tmp_path / 'final')!r})\n"
        "assert 'losses.tsl' in sys.modules\n"
        f"saved = torch.load({str(tmp_path / 'heads.pt')!r}, weights_only=True)\n"
        "for k, v in model.inference_modules['tsl_heads'].state_dict().items():\n"
        "    assert torch.equal(v, saved[k]), k\n"
        "print('restored', type(model.inference_modules['tsl_heads']).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "restored TSLHeads" in out.stdout
