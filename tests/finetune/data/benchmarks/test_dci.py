"""DCI reads tiny fixtures in the official format through the registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.data.sources import DataError
from tests.finetune.data.benchmarks.helpers import ids, load
from tests.finetune.data.fixtures import long_caption, write_dci_fixture

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


@pytest.fixture()
def dci(tmp_path: Path) -> Path:
    return write_dci_fixture(tmp_path / "dci", 3, 1, 2)


def test_dci_all_protocol_joins_short_and_extra_captions(dci):
    with pytest.warns(UserWarning, match="dci:all has 6 images"):
        loaded = load("dci", dci)
    assert loaded.protocol == "all"
    assert ids(loaded) == [f"sa_{1000 + k}" for k in range(6)]
    assert loaded.dataset[4]["caption"] == "Short caption 4. " + long_caption("dci", 4)


def test_dci_splits_and_caption_modes(dci):
    assert ids(load("dci", dci, split="test")) == ["sa_1004", "sa_1005"]
    assert ids(load("dci", dci, split="valid")) == ["sa_1003"]
    short = load("dci", dci, split="valid", options={"caption": "short"})
    assert short.dataset[0]["caption"] == "Short caption 3."
    extra = load("dci", dci, split="valid", options={"caption": "extra"})
    assert extra.dataset[0]["caption"] == long_caption("dci", 3)
    # path may also point at densely_captioned_images itself
    inner = dci / "densely_captioned_images"
    assert ids(load("dci", inner, split="test")) == ["sa_1004", "sa_1005"]


def test_dci_goal_needs_an_ids_file_and_reads_goal_json(dci, tmp_path):
    with pytest.raises(DataError, match="options.ids_file"):
        load("dci", dci, protocol="goal")
    goal_json = tmp_path / "DCI_test.json"
    goal_json.write_text(json.dumps([{"filename": "sa_1001.jpg", "caption": "x"},
                                     {"filename": "sa_1005.jpg", "caption": "y"}]))
    with pytest.warns(UserWarning, match="dci:goal has 2 images here, the papers evaluate on 1999"):
        loaded = load("dci", dci, protocol="goal", options={"ids_file": str(goal_json)})
    assert ids(loaded) == ["sa_1001", "sa_1005"]
    assert loaded.skipped == 0


def test_dci_unreadable_annotation_is_a_counted_skip(dci):
    (dci / "densely_captioned_images" / "annotations" / "sa_1002.json").write_text("{not json")
    loaded = load("dci", dci)
    assert "sa_1002" not in ids(loaded) and loaded.skipped == 1
    assert "annotations/sa_1002.json (not valid JSON" in loaded.skipped_examples[0]["id"]
    with pytest.raises(DataError, match="sa_1002.json"):
        load("dci", dci, on_error="raise")


@pytest.fixture()
def dci_masks(tmp_path: Path) -> Path:
    return write_dci_fixture(tmp_path / "dci_masks", 2, 1, 1, masks=True)


def _complete(loaded, index: int) -> dict:
    (row,) = [r for r in loaded.dataset if r["id"] == f"sa_{1000 + index}"]
    return row


def test_dci_complete_caption_is_dcis_complete_description(dci_masks):
    """DCI's get_formatted_description_min_size: short, extra, the intro line, then one line per
    mask by idx: "label: caption" (quality 0), the label (quality 1); quality 2 and masks under
    224 x 224 are left out."""
    row = _complete(load("dci", dci_masks, split="valid", options={"caption": "complete"}), 2)
    assert row["caption"] == (
        "Short caption 2.\n" + long_caption("dci", 2) + "\n"
        "The following can also be seen in the image:\n"
        "A wooden table: Its legs are thin. It holds a cup.\n"
        "Chair"
    )
    assert row["sentences"] == [
        "Short caption 2.", "A blue dci scene number 2.", "There are 4 small objects near the centre.",
        "The background of image 2 is plain.", "The following can also be seen in the image:",
        "A wooden table: Its legs are thin.", "It holds a cup.", "Chair"]
    assert " ".join(row["sentences"]) == row["caption"].replace("\n", " ")
    objects = row["objects"]
    assert [o["label"] for o in objects] == ["A wooden table", "Chair"]
    assert [o["box"] for o in objects] == [[10, 20, 310, 280], [150, 50, 400, 290]]
    assert [o["sentence_index"] for o in objects] == [5, 7]
    for obj in objects:
        assert row["sentences"][obj["sentence_index"]].startswith(obj["label"])


def test_dci_complete_mask_min_size_zero_keeps_the_small_mask_and_both_sides_count(dci_masks):
    row = _complete(load("dci", dci_masks, split="test",
                         options={"caption": "complete", "mask_min_size": 0}), 3)
    assert row["caption"].endswith("A wooden table: Its legs are thin. It holds a cup.\nChair\n"
                                   "Small cup: It is white.")
    assert [o["label"] for o in row["objects"]] == ["A wooden table", "Chair", "Small cup"]
    small = row["objects"][2]
    assert small["box"] == [100, 100, 150, 140]
    assert row["sentences"][small["sentence_index"]] == "Small cup: It is white."

    def labels(size: int) -> list[str]:
        row = _complete(load("dci", dci_masks, split="test",
                             options={"caption": "complete", "mask_min_size": size}), 3)
        return [o["label"] for o in row["objects"]]

    # both sides count, and a side equal to the size is kept (DCI: width >= min_width and
    # height >= min_height); the chair is 250 x 240, the table 300 x 260
    assert labels(240) == ["A wooden table", "Chair"]
    assert labels(250) == ["A wooden table"]


def test_dci_complete_columns_follow_a_pinned_id_list(dci_masks, tmp_path):
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("sa_1001\nsa_1003\n")
    with pytest.warns(UserWarning, match="dci:goal has 2 images"):
        loaded = load("dci", dci_masks, protocol="goal",
                      options={"ids_file": str(ids_file), "caption": "complete"})
    assert ids(loaded) == ["sa_1001", "sa_1003"]
    for row in loaded.dataset:
        assert row["sentences"][0] == f"Short caption {int(row['id'][3:]) - 1000}."
        assert [o["label"] for o in row["objects"]] == ["A wooden table", "Chair"]


def test_dci_complete_without_mask_lines_is_short_and_extra_on_two_lines(dci):
    loaded = load("dci", dci, split="valid", options={"caption": "complete"})
    row = loaded.dataset[0]
    assert row["caption"] == "Short caption 3.\n" + long_caption("dci", 3)
    assert row["objects"] == [] and len(row["sentences"]) == 4
    # the other caption modes keep their columns
    assert "objects" not in load("dci", dci, split="valid").dataset.column_names


def test_dci_malformed_mask_is_a_problem_record_naming_file_and_key(dci_masks):
    path = dci_masks / "densely_captioned_images" / "annotations" / "sa_1001.json"
    annotation = json.loads(path.read_text())
    del annotation["mask_data"]["1"]["bounds"]
    path.write_text(json.dumps(annotation))
    loaded = load("dci", dci_masks, split="train", options={"caption": "complete"})
    assert ids(loaded) == ["sa_1000"] and loaded.skipped == 1
    problem = loaded.skipped_examples[0]["id"]
    assert "annotations/sa_1001.json" in problem and "mask_data['1']" in problem and "bounds" in problem
    with pytest.raises(DataError, match=r"sa_1001.json.*mask_data\['1'\]"):
        load("dci", dci_masks, split="train", options={"caption": "complete"}, on_error="raise")
    # the other caption modes do not read the masks
    assert ids(load("dci", dci_masks, split="train")) == ["sa_1000", "sa_1001"]


def test_dci_kept_mask_without_area_is_a_problem_record(dci_masks):
    path = dci_masks / "densely_captioned_images" / "annotations" / "sa_1000.json"
    annotation = json.loads(path.read_text())
    annotation["mask_data"]["3"]["bounds"]["bottomRight"]["x"] = 100  # zero width
    path.write_text(json.dumps(annotation))
    # too small for the default 224: left out, as DCI leaves it out
    assert ids(load("dci", dci_masks, split="train", options={"caption": "complete"})) == [
        "sa_1000", "sa_1001"]
    loaded = load("dci", dci_masks, split="train", options={"caption": "complete", "mask_min_size": 0})
    assert ids(loaded) == ["sa_1001"]
    assert "annotations/sa_1000.json" in loaded.skipped_examples[0]["id"]
    assert "mask_data['3']" in loaded.skipped_examples[0]["id"]


def test_dci_mask_options_are_checked(dci):
    with pytest.raises(DataError, match="options.caption must be one of .*complete"):
        load("dci", dci, options={"caption": "masks"})
    with pytest.raises(DataError, match="mask_min_size must be an integer >= 0"):
        load("dci", dci, options={"caption": "complete", "mask_min_size": -1})
    with pytest.raises(DataError, match="mask_min_size applies to caption: complete only"):
        load("dci", dci, options={"mask_min_size": 0})


def test_dci_without_path_explains_where_the_files_come_from():
    with pytest.raises(DataError, match="needs `path:`.*SA-1B"):
        load("dci", None)
