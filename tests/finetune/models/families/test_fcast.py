"""The fcast model family (finetune/models/families/fcast.py): tokenisation, encoders, save / load round trip."""

from __future__ import annotations

import pytest
import torch

from finetune import load_model
from finetune.data.synthetic import synthetic_scenes
from finetune.models.families import detect_family, model_family_names


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("fcast-tiny", family="fcast").eval()


@pytest.fixture(scope="module")
def scenes():
    return synthetic_scenes(3, image_size=64)


def test_family_is_builtin(model):
    assert "fcast" in model_family_names()
    assert model.backend == "fcast" and model.logit_scale.exp().item() == pytest.approx(1 / 0.07)
    assert model.logit_bias.item() == model.model.part_logit_bias.item() == -4.0  # the toy's (see FCAST_CONFIGS)
    from finetune.models.families.fcast import FCAST_CONFIGS

    for name in ("fcast-b", "fcast-s"):  # the paper's init: 1/0.07 and -10 at both levels
        cfg = FCAST_CONFIGS[name]()
        assert cfg.init_logit_scale == pytest.approx(1 / 0.07) and cfg.init_logit_bias == -10.0


def test_tokenize_packs_balanced_chunks(model):
    caption = "One. Two. Three. Four. Five. Six."
    tok = model.tokenize([caption, "Only one sentence."])
    assert tok.input_ids.shape == (2, 4 * 77)
    rows = tok.input_ids.reshape(2, 4, 77)
    mask = tok.attention_mask.reshape(2, 4, 77)
    expected = model.tokenize_chunks(["One. Two.", "Three. Four.", "Five.", "Six."])
    assert torch.equal(rows[0], expected.input_ids)
    assert mask[1].sum(-1).gt(0).tolist() == [True, False, False, False]


def test_text_embedding_is_stage2_over_the_chunks(model):
    tok = model.tokenize(["A red ball. A blue cube. A green star. A cat.", "One dog."])
    out = model.encode_text(tok.input_ids, tok.attention_mask).embeds
    ids, mask = tok.input_ids.reshape(8, 77), tok.attention_mask.reshape(8, 77)
    sub = model.encode_subcaptions(ids, mask).reshape(2, 4, -1)
    torch.testing.assert_close(out[0], model.encode_long(sub[:1])[0])
    valid = torch.tensor([[True, False, False, False]])
    torch.testing.assert_close(out[1], model.encode_long(sub[1:], valid)[0])
    # an empty chunk's content does not matter
    other = sub[1:].clone()
    other[:, 2] = 5.0
    torch.testing.assert_close(model.encode_long(other, valid)[0], out[1])
    with pytest.raises(ValueError, match="balanced chunks"):
        model.encode_text(tok.input_ids[:, :77])


def test_images_need_superpixels_and_embed_the_class_token(model, scenes):
    inputs = model.preprocess_images([e["image"] for e in scenes])
    assert inputs["pixel_values"].shape == (3, 3, 64, 64) and inputs["superpixels"].shape == (3, 64, 64)
    feats = model.encode_image(**inputs)
    hier = model.encode_image_hierarchy(inputs["pixel_values"], inputs["superpixels"])
    torch.testing.assert_close(feats.embeds, hier.coarse)
    assert hier.fine.shape == (3, 16, 64)
    with pytest.raises(ValueError, match="superpixels"):
        model.encode_image(inputs["pixel_values"])


def test_save_load_round_trip_and_detection(model, scenes, tmp_path):
    from finetune.models.finetuned import save_finetuned

    inputs = model.preprocess_images([e["image"] for e in scenes])
    tok = model.tokenize([e["caption"] for e in scenes])
    with torch.no_grad():
        model.model.part_logit_scale.fill_(3.0)
    folder = save_finetuned(model, tmp_path / "final")
    assert detect_family(folder) == "fcast" and (folder / "model.safetensors").is_file()
    loaded = load_model(str(folder)).eval()
    assert loaded.backend == "fcast"
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_image(**inputs).embeds, model.encode_image(**inputs).embeds)
        torch.testing.assert_close(loaded.encode_text(tok.input_ids, tok.attention_mask).embeds,
                                   model.encode_text(tok.input_ids, tok.attention_mask).embeds)
    assert loaded.model.part_logit_scale.item() == 3.0
    (folder / "fcast_config.json").write_text('{"nonsense": 1}')
    with pytest.raises(ValueError, match="unknown keys"):
        load_model(str(folder))


def test_push_stages_the_safetensors_folder_that_loads_back(model, scenes, tmp_path):
    from finetune.hub import stage_upload
    from finetune.models.finetuned import load_finetuned, save_finetuned

    folder = save_finetuned(model, tmp_path / "final")
    out = stage_upload(folder, tmp_path / "upload", repo_id="me/fcast-tiny")
    names = {p.name for p in out.iterdir()}
    assert {"fcast_config.json", "model.safetensors", "xlipkit.json", "README.md"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)
    tok = model.tokenize([e["caption"] for e in scenes])
    with torch.no_grad():
        torch.testing.assert_close(load_finetuned(str(out)).eval().encode_text(tok.input_ids, tok.attention_mask).embeds,
                                   model.encode_text(tok.input_ids, tok.attention_mask).embeds)
