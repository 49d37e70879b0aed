"""load_model: what it accepts, where it looks, and the errors a user sees."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from finetune import load_model
from finetune.models.hf import HFDualEncoder
from finetune.models.openclip import OpenCLIPDualEncoder


def test_registry_names_build_without_files() -> None:
    model = load_model("tiny-clip")
    assert isinstance(model, HFDualEncoder) and model.name_or_path == "tiny-clip"
    assert isinstance(load_model("TINY-OPENCLIP"), OpenCLIPDualEncoder)


def test_saved_folders_load_in_their_backend(tiny_dir) -> None:
    assert isinstance(load_model(str(tiny_dir("tiny-siglip2"))), HFDualEncoder)
    assert isinstance(load_model(tiny_dir("tiny-openclip"), backend="open_clip"), OpenCLIPDualEncoder)
    assert isinstance(load_model(f"local-dir:{tiny_dir('tiny-openclip')}"), OpenCLIPDualEncoder)


def test_max_text_len_applies_kps_with_settings(tiny_dir) -> None:
    model = load_model(str(tiny_dir("tiny-clip")), max_text_len=248, kps={"keep": 10, "freeze_kept": False})
    assert model.max_text_len == 248
    assert model.kps == {"length": 248, "keep": 10, "ratio": 4, "freeze_kept": False}
    same = load_model(str(tiny_dir("tiny-clip")), max_text_len=77)
    assert same.kps is None and same.max_text_len == 77


def test_max_text_len_below_original_is_an_error(tiny_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="below the original text length 77"):
        load_model(str(tiny_dir("tiny-clip")), max_text_len=64)
    stretched = load_model(str(tiny_dir("tiny-clip")), max_text_len=248)
    stretched.save_pretrained(str(tmp_path / "s"))
    with pytest.raises(ValueError, match="already has 248 text positions"):
        load_model(str(tmp_path / "s"), max_text_len=100)


def test_bad_arguments(tiny_dir) -> None:
    with pytest.raises(ValueError, match="backend 'jax'"):
        load_model("tiny-clip", backend="jax")
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_model("tiny-clip", dtype="float8")
    with pytest.raises(ValueError, match=r"unknown KPS settings \['stretch'\]"):
        load_model("tiny-clip", max_text_len=248, kps={"stretch": 2})


def test_dtype_is_applied(tiny_dir) -> None:
    model = load_model(str(tiny_dir("tiny-siglip")), dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert load_model("tiny-openclip", dtype=torch.float16).dtype == torch.float16


def test_unknown_name_lists_what_was_looked_for() -> None:
    with pytest.raises(ValueError) as err:
        load_model("no-such-model")
    msg = str(err.value)
    assert "'no-such-model'" in msg and "registry name" in msg and "open_clip architecture" in msg
    assert "tiny-clip" in msg and "'hf'" in msg and "'open_clip'" in msg


def test_registry_name_of_another_backend() -> None:
    with pytest.raises(ValueError, match="found 'tiny-clip', but it is a hf model"):
        load_model("tiny-clip", backend="open_clip")


def test_unknown_hub_id_offline() -> None:
    with pytest.raises(ValueError, match="hub repository 'nobody-xlipkit/no-such-repo'"):
        load_model("nobody-xlipkit/no-such-repo")


def test_missing_and_wrong_folders(tiny_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nowhere" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="open_clip_config.json"):
        load_model(str(tiny_dir("tiny-clip")), backend="open_clip")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match=r"'bert' model; supported model types: \['clip', 'siglip', 'siglip2'\]"):
        load_model(str(bert))
    (tmp_path / "weights.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        load_model(str(tmp_path / "weights.npz"))


def test_open_clip_folder_with_broken_config(tiny_dir, tmp_path) -> None:
    folder = tmp_path / "oc"
    shutil.copytree(tiny_dir("tiny-openclip"), folder)
    (folder / "open_clip_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(folder))


def test_open_clip_architecture_name_builds_random_weights() -> None:
    model = load_model("ViT-B-16", backend="open_clip")
    assert isinstance(model, OpenCLIPDualEncoder) and model.family == "clip"
    assert model.max_text_len == 77 and model.patch_size == 16 and model.image_size == 224
    tok = model.tokenize(["a photo of a cat"])
    with torch.no_grad():
        assert model.encode_text(tok.input_ids).embeds.shape == (1, 512)
