"""Broken symbolic links in image folders are listed, counted and reported, never dropped in silence (issue 31
item 8): ``Path.is_file()`` is False for a link whose target is missing, and the listings that filtered on it
passed such images over without a count."""

from __future__ import annotations

import io
import os

import PIL.Image
import pytest

from finetune.data.images import ImageReadError, image_files, probe_image
from finetune.data.sources import DataError, load_source
from finetune.evaluation.zeroshot import folder_classes
from tests.finetune.data.benchmarks.helpers import load
from tests.finetune.data.fixtures import write_urban1k_fixture

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


def _png(path, colour=(200, 10, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (6, 4), colour).save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue())


def _folder(root):
    """Three captioned images, two of them real, and ``gone.png``, a link to a file that was moved away."""
    for name in ("a", "b"):
        _png(root / f"{name}.png")
        (root / f"{name}.txt").write_text(f"Image {name}.")
    os.symlink(root / "moved" / "gone.png", root / "gone.png")
    (root / "gone.txt").write_text("An image whose file was moved.")
    return root


def test_imagefolder_counts_and_names_a_broken_link(tmp_path):
    root = _folder(tmp_path / "images")
    loaded = load_source({"name": "imagefolder", "path": str(root)})
    assert loaded.dataset["id"] == ["a", "b"]
    assert loaded.info["num_read"] == 3 and loaded.skipped == 1 and loaded.skipped_ids == ["gone"]
    skipped = loaded.skipped_examples[0]
    assert skipped["path"] == str(root / "gone.png")
    assert skipped["reason"].startswith("broken symbolic link") and "moved/gone.png" in skipped["reason"]
    with pytest.raises(DataError, match=r"id='gone'.*broken symbolic link.*data.on_error: skip"):
        load_source({"name": "imagefolder", "path": str(root)}, on_error="raise")


def test_imagefolder_counts_a_broken_caption_link(tmp_path):
    root = tmp_path / "images"
    _png(root / "a.png")
    (root / "a.txt").write_text("Image a.")
    _png(root / "b.png")
    os.symlink(root / "elsewhere.txt", root / "b.txt")
    loaded = load_source({"name": "imagefolder", "path": str(root)})
    assert loaded.dataset["id"] == ["a"] and loaded.skipped == 1 and loaded.skipped_ids == ["b"]
    assert loaded.skipped_examples[0]["reason"].startswith("caption file: broken symbolic link")


def test_a_link_loop_is_a_broken_link_too(tmp_path):
    os.symlink(tmp_path / "y.png", tmp_path / "x.png")
    os.symlink(tmp_path / "x.png", tmp_path / "y.png")
    assert image_files(tmp_path) == [tmp_path / "x.png", tmp_path / "y.png"]
    with pytest.raises(ImageReadError, match="broken symbolic link"):
        probe_image(str(tmp_path / "x.png"))


def test_a_broken_data_file_link_is_an_error_naming_it(tmp_path):
    (tmp_path / "part-0.jsonl").write_text('{"image": "a.png", "caption": "A."}\n')
    os.symlink(tmp_path / "old" / "part-1.jsonl", tmp_path / "part-1.jsonl")
    with pytest.raises(DataError, match=r"part-1.jsonl.*broken symbolic link.*fix the link"):
        load_source({"name": "jsonl", "path": str(tmp_path)})


def test_urban1k_counts_a_broken_caption_link(tmp_path):
    folder = write_urban1k_fixture(tmp_path / "Urban1k", 3)
    (folder / "caption" / "2.txt").unlink()
    os.symlink(folder / "nowhere.txt", folder / "caption" / "2.txt")
    loaded = load("urban1k", folder)
    assert loaded.dataset["id"] == ["1", "3"] and loaded.skipped == 1
    assert "broken symbolic link" in loaded.skipped_ids[0]


def test_zeroshot_refuses_a_class_folder_with_a_broken_link(tmp_path):
    for name in ("cat", "dog"):
        _png(tmp_path / name / "0.png")
    os.symlink(tmp_path / "gone.png", tmp_path / "dog" / "1.png")
    with pytest.raises(ValueError, match=r"1 image\(s\) cannot be read \(dog/1.png: broken symbolic link"):
        folder_classes(tmp_path)
