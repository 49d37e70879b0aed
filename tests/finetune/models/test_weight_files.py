"""Damaged weight files are named, with what to do (issue 31 item 11): a truncated, empty or oversized-header
``model.safetensors`` gave ``xlipkit eval`` a 14-frame traceback ending in ``SafetensorError: Error while
deserializing header: header too small``, naming neither the file nor a fix."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import yaml

from finetune import load_model
from finetune.config import AdapterConfig
from finetune.models.adapters import apply_adapter
from finetune.models.finetuned import load_finetuned, save_finetuned
from finetune.models.weight_files import DamagedWeightsError, safetensors_problem

#: how a file gets damaged -> (its new bytes from the good ones, what the message says)
DAMAGES = {
    "empty": (lambda good: b"", "the file is empty (0 bytes)"),
    "4 bytes": (lambda good: good[:4], "truncated: 4 bytes, fewer than the 8"),
    "cut in its header": (lambda good: good[:20], "truncated or is not a safetensors file: it says its header takes"),
    "cut in its tensors": (lambda good: good[: len(good) // 2], "the file is truncated, or has bytes after its tensors"),
    "oversized header": (lambda good: struct.pack("<Q", 10**12) + good[8:],
                         "it says its header takes 1,000,000,000,000 bytes"),
    "a Git LFS pointer": (lambda good: b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n",
                          "it is a Git LFS pointer, not the weights"),
    "an HTML page": (lambda good: b"<!DOCTYPE html><html><body>502 Bad Gateway</body></html>",
                     "it is an HTML page, not a safetensors file"),
}


def _damage(file: Path, how: str) -> None:
    file.write_bytes(DAMAGES[how][0](file.read_bytes()))


@pytest.fixture
def copy_of(tiny_dir, tmp_path):
    def copy(name: str) -> Path:
        return Path(shutil.copytree(tiny_dir(name), tmp_path / name))

    return copy


@pytest.mark.parametrize("how", list(DAMAGES))
def test_a_damaged_model_safetensors_is_named_with_the_fix(copy_of, how):
    folder = copy_of("tiny-clip")
    weights = folder / "model.safetensors"
    assert safetensors_problem(weights) is None
    _damage(weights, how)
    with pytest.raises(DamagedWeightsError) as caught:
        load_model(str(folder))
    message = str(caught.value)
    assert message.startswith(f"cannot load the model weights {weights}: ")
    assert DAMAGES[how][1] in message
    assert "copy or download it again, or write it again" in message
    assert isinstance(caught.value, OSError) and isinstance(caught.value, ValueError)  # what the commands report


@pytest.mark.parametrize("name,weights", [("tiny-openclip", "open_clip_model.safetensors"),
                                          ("tiny-siglip", "model.safetensors")])
def test_every_backend_folder_names_its_damaged_weights(copy_of, name, weights):
    folder = copy_of(name)
    _damage(folder / weights, "cut in its tensors")
    with pytest.raises(DamagedWeightsError, match=f"cannot load the model weights {folder / weights}: the file is "
                                                  "truncated"):
        load_model(str(folder))


@pytest.mark.parametrize("name,weights", [("tiny-flair", "flair_model.safetensors"),
                                          ("fcast-tiny", "model.safetensors")])
def test_the_registered_families_name_their_damaged_weights(tmp_path, name, weights):
    folder = tmp_path / name
    load_model(f"random:{name}").save_pretrained(str(folder))
    _damage(folder / weights, "4 bytes")
    with pytest.raises(DamagedWeightsError, match=f"{folder / weights}: the file is truncated"):
        load_model(str(folder))


@pytest.mark.parametrize("file", ["adapter_model.safetensors", "xlipkit_extra.safetensors"])
def test_an_adapter_folder_names_its_damaged_file(load_tiny, tmp_path, file):
    model = load_tiny("tiny-clip")
    apply_adapter(model, AdapterConfig(type="lora", r=2))
    folder = save_finetuned(model, tmp_path / "adapter")
    _damage(folder / file, "empty")
    for load in (load_finetuned, load_model):
        with pytest.raises(DamagedWeightsError, match=f"{folder / file}: the file is empty"):
            load(str(folder))


def test_a_damaged_hub_snapshot_is_named_with_the_cache_to_delete(tiny_dir, tmp_path, monkeypatch):
    """A hub id loads from the hub cache's snapshot (offline here); its damaged file is named, and the fix is to
    delete the cached repository and load again."""
    import huggingface_hub

    repo = tmp_path / "hub" / "models--me--tiny-clip"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_dir("tiny-clip"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_model("me/tiny-clip").name_or_path == "me/tiny-clip"  # the path a hub id takes
    _damage(snapshot / "model.safetensors", "cut in its header")
    with pytest.raises(DamagedWeightsError) as caught:
        load_model("me/tiny-clip")
    assert str(caught.value).startswith(f"cannot load the model weights {snapshot / 'model.safetensors'}: the file "
                                        "is truncated")
    assert f"delete {repo} and load me/tiny-clip again" in str(caught.value)


def test_xlipkit_eval_names_the_file_without_a_traceback(copy_of, capsys):
    from finetune.cli.evaluate import main

    folder = copy_of("tiny-clip")
    _damage(folder / "model.safetensors", "4 bytes")
    assert main([str(folder), "--sets", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the model weights {folder / 'model.safetensors'}: the file is truncated" in err
    assert "Traceback" not in err and "SafetensorError" not in err


def test_xlipkit_export_names_the_file_without_a_traceback(load_tiny, tmp_path, capsys):
    from finetune.cli.hub import main

    model = load_tiny("tiny-clip")
    apply_adapter(model, AdapterConfig(type="lora", r=2))
    folder = save_finetuned(model, tmp_path / "adapter")
    _damage(folder / "adapter_model.safetensors", "cut in its tensors")
    assert main(["export", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the model weights {folder / 'adapter_model.safetensors'}: the file is truncated" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_training_from_damaged_weights_is_an_error_naming_the_file(copy_of, tmp_path, capsys, monkeypatch):
    import logging

    from finetune.cli.train import main

    monkeypatch.setattr(logging.getLogger("xlipkit"), "handlers", [])
    folder = copy_of("tiny-clip")
    _damage(folder / "model.safetensors", "empty")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(folder)},
        "data": {"train": {"name": "synthetic", "size": 8, "seed": 0, "options": {"image_size": 32}}},
        "train": {"batch_size": 4, "max_steps": 1, "trackers": []},
        "eval": {"sets": []},
        "output": {"dir": str(tmp_path / "run")},
    }))
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the model weights {folder / 'model.safetensors'}: the file is empty" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # no half-started run left behind


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-siglip2"])
def test_saving_a_model_draws_no_shard_bar_and_keeps_the_users_setting(name, tmp_path, capfd):
    """A one-shard save drew transformers' "Writing model shards" bar (a 0 % and a 100 % line per saved model in
    every run's log); the user's progress-bar setting stands after the save."""
    from transformers.utils import logging as hf_logging

    from finetune.models.registry import build_model

    model = build_model(name)
    hf_logging.enable_progress_bar()
    capfd.readouterr()
    model.save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(tmp_path / "again"))
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def _with_nan(folder: Path) -> str:
    """Write a NaN into the first floating-point 2-D tensor of the folder's weights; returns its name."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    name = next(k for k, t in tensors.items() if t.is_floating_point() and t.ndim == 2)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return name


def test_xlipkit_eval_of_weights_holding_nan_is_exit_2_naming_them(copy_of, capsys):
    """Issue 40: a model whose weights hold NaN gave a traceback (exit 1) from the retrieval."""
    from finetune.cli.evaluate import main

    folder = copy_of("tiny-clip")
    _with_nan(folder)
    assert main([str(folder), "--sets", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert f"cannot evaluate {folder}: its weights hold NaN or inf (" in err and "the model is broken" in err
    assert "Traceback" not in err


def test_a_max_text_len_below_the_model_is_exit_2_and_leaves_no_run(copy_of, tmp_path, capsys, monkeypatch):
    """Issue 40: ``model.max_text_len=1`` gave a traceback (exit 1) and left recipe.yaml behind."""
    import logging

    from finetune.cli.train import main

    monkeypatch.setattr(logging.getLogger("xlipkit"), "handlers", [])
    folder = copy_of("tiny-clip")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(folder), "max_text_len": 1},
        "data": {"train": {"name": "synthetic", "size": 8, "seed": 0, "options": {"image_size": 32}}},
        "train": {"batch_size": 4, "max_steps": 1, "trackers": []},
        "eval": {"sets": []},
        "output": {"dir": str(tmp_path / "run")},
    }))
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "recipe error: model.max_text_len: max_text_len=1 is below the original text length" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
