"""load_model: what it accepts, where it looks, and the errors a user sees."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from finetune import load_model
from finetune.models.backends.hf import HFDualEncoder
from finetune.models.backends.openclip import OpenCLIPDualEncoder


def test_registry_names_build_without_files(caplog) -> None:
    with caplog.at_level("WARNING", logger="xlipkit"):
        model = load_model("random:tiny-clip")
    assert not caplog.records  # said explicitly: no warning
    # the model records the explicit name: an adapter trained on it reloads its base from xlipkit.json
    assert isinstance(model, HFDualEncoder) and model.name_or_path == "random:tiny-clip"
    assert isinstance(load_model("random:TINY-OPENCLIP"), OpenCLIPDualEncoder)


def test_a_bare_small_registry_name_builds_with_a_warning(caplog) -> None:
    with caplog.at_level("WARNING", logger="xlipkit"):
        model = load_model("tiny-clip")
    assert model.name_or_path == "random:tiny-clip"
    assert "RANDOM weights" in caplog.text and "'random:tiny-clip'" in caplog.text


@pytest.mark.parametrize(("name", "meant", "spelled"), [
    ("clip-vit-base-patch16", "openai/clip-vit-base-patch16", "random:clip-vit-base-patch16"),
    ("ViT-L/14", "openai/clip-vit-large-patch14", "random:clip-vit-large-patch14"),
    ("siglip2-base-patch16-224", "google/siglip2-base-patch16-224", "random:siglip2-base-patch16-224"),
])
def test_a_bare_real_architecture_name_is_refused_naming_the_pretrained_model(name, meant, spelled) -> None:
    from finetune.models.finetuned import ModelNotFoundError, RandomWeightsNameError

    with pytest.raises(RandomWeightsNameError) as err:  # a ModelNotFoundError: run.py's clean recipe error
        load_model(name)
    assert isinstance(err.value, ModelNotFoundError)
    assert f"For the pretrained model write {meant!r}" in str(err.value)
    assert f"write {spelled!r}" in str(err.value) and "RANDOM weights" in str(err.value)


def test_registry_configs_of_other_families_take_the_prefix(caplog) -> None:
    from finetune.models.finetuned import RandomWeightsNameError

    with caplog.at_level("WARNING", logger="xlipkit"):
        fcast = load_model("random:fcast-tiny", family="fcast")
        flair = load_model("random:tiny-flair")
    assert not caplog.records
    assert (fcast.backend, fcast.name_or_path) == ("fcast", "random:fcast-tiny")
    assert (flair.backend, flair.name_or_path) == ("flair", "random:tiny-flair")
    with pytest.raises(RandomWeightsNameError, match="write 'random:fcast-b'"):
        load_model("fcast-b", family="fcast")  # the paper's CAST-B: real size, its recipe says random:fcast-b
    with pytest.raises(RandomWeightsNameError, match="write 'random:flair-vit-b-16'"):
        load_model("flair-vit-b-16", family="flair")


def test_the_prefix_on_a_name_that_is_no_registry_config() -> None:
    from finetune.models.finetuned import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match=r"'random:openai/clip-vit-base-patch16': 'random:' builds a registry "
                                                 r"config .* Registry names: .*tiny-clip"):
        load_model("random:openai/clip-vit-base-patch16")
    with pytest.raises(ModelNotFoundError, match="none for family 'open_clip'"):
        load_model("random:tiny-clip", family="open_clip")


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


@pytest.mark.slow
def test_open_clip_architecture_name_builds_random_weights() -> None:
    assert load_model("random:ViT-B-32").name_or_path == "random:ViT-B-32"
    model = load_model("ViT-B-16", backend="open_clip")
    assert isinstance(model, OpenCLIPDualEncoder) and model.family == "clip"
    assert model.max_text_len == 77 and model.patch_size == 16 and model.image_size == 224
    tok = model.tokenize(["a photo of a cat"])
    with torch.no_grad():
        assert model.encode_text(tok.input_ids).embeds.shape == (1, 512)
