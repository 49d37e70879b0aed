"""COCO reads tiny fixtures in the official format through the registry."""

from __future__ import annotations

import json

import pytest

from tests.finetune.data.benchmarks.helpers import ids, load
from tests.finetune.data.fixtures import five_captions, write_coco_fixture

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


def test_coco_val2017_keeps_the_first_five_captions_in_file_order(tmp_path):
    folder = write_coco_fixture(tmp_path / "coco", 3, extra_captions=1)
    with pytest.warns(UserWarning, match="coco:val2017 has 3 images"):
        loaded = load("coco", folder)
    assert ids(loaded) == ["100", "101", "102"]
    # the fixture interleaves annotations: image 0's file order is captions 0, 2, 4, 1, 3, extra 0
    expected = [five_captions("coco", 0)[k] for k in (0, 2, 4, 1, 3)]
    assert loaded.dataset[0]["captions"] == expected
    every = load("coco", folder, split="val2017").dataset[0]["captions"]
    assert len(every) == 6 and every[:5] == expected


def test_coco_karpathy_test_uses_filepath_and_cocoid(tmp_path):
    folder = write_coco_fixture(tmp_path / "coco", 1, karpathy=(1, 1, 2))
    loaded = load("coco", folder, protocol="karpathy")
    assert ids(loaded) == ["500002", "500003"]
    assert loaded.dataset[1]["captions"] == five_captions("karpathy", 3)
    assert ids(load("coco", folder, split="train")) == ["500000"]


def test_coco_image_without_captions_is_a_counted_skip(tmp_path):
    folder = write_coco_fixture(tmp_path / "coco", 2)
    file = folder / "annotations" / "captions_val2017.json"
    data = json.loads(file.read_text())
    data["annotations"] = [a for a in data["annotations"] if a["image_id"] != 101]
    file.write_text(json.dumps(data))
    loaded = load("coco", folder)
    assert ids(loaded) == ["100"] and loaded.skipped_examples[0]["id"] == "101"
