"""The benchmark sources read tiny fixtures in the official formats through the registry."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest

from finetune.data import benchmarks
from finetune.data.download import ChecksumError
from finetune.data.protocols import PROTOCOLS, Protocol, available_protocols, ids_sha256
from finetune.data.sources import DataError, available_sources, load_source
from tests.finetune.data.fixtures import (
    SHAREGPT4V_JSON,
    five_captions,
    long_caption,
    make_archive,
    write_coco_fixture,
    write_dci_fixture,
    write_docci_fixture,
    write_flickr30k_fixture,
    write_sharegpt4v_fixture,
    write_urban1k_fixture,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


def load(name: str, path: Path | None, *, on_error: str = "skip", **spec):
    """``load_source`` of benchmark ``name`` read from ``path``."""
    spec = {"name": name, "path": str(path) if path else None, **spec}
    return load_source(spec, on_error=on_error)


def ids(loaded) -> list[str]:
    return list(loaded.dataset["id"])


# --------------------------------------------------------------------------- registry


def test_every_benchmark_is_registered_with_its_protocols():
    sources = available_sources()
    for name in ("docci", "docci_fg", "dci", "urban1k", "sharegpt4v", "flickr30k", "coco"):
        assert name in sources
    assert available_protocols("docci") == ["test", "goal"]
    assert available_protocols("dci") == ["all", "goal"]
    assert available_protocols("sharegpt4v") == ["1k", "10k"]
    assert available_protocols("flickr30k") == ["test", "full"]
    assert available_protocols("coco") == ["val2017", "karpathy", "karpathy_1k"]
    assert benchmarks.available_protocols is available_protocols


# --------------------------------------------------------------------------- DOCCI


@pytest.fixture()
def docci(tmp_path: Path) -> Path:
    return write_docci_fixture(tmp_path / "docci", 3, 4, n_qual_dev=1, n_qual_test=2)


def test_docci_default_protocol_is_the_test_split(docci):
    with pytest.warns(UserWarning, match=r"docci:test has 4 images here, .* evaluate on 5000"):
        loaded = load("docci", docci)
    assert loaded.protocol == "test"
    assert ids(loaded) == [f"test_{k:05d}" for k in range(4)]
    first = loaded.dataset[0]
    assert first["caption"] == long_caption("docci", 3)  # train has 3 examples, test comes next
    assert first["image"].mode == "RGB" and first["image"].size == (16, 16)
    assert loaded.info["ids_sha256"] == ids_sha256(ids(loaded))
    record = benchmarks.protocol_record(loaded)
    assert record["protocol"] == "test" and record["protocol_expected"] == 5000
    assert record["num_images"] == 4 and record["complete"] is False
    assert record["ids_sha256"] == ids_sha256(ids(loaded))


def test_docci_goal_protocol_adds_qual_test(docci):
    loaded = load("docci", docci, protocol="goal")
    assert loaded.protocol == "goal"
    test_ids = [f"test_{k:05d}" for k in range(4)]
    assert ids(loaded) == ["qual_test_00000", "qual_test_00001", *test_ids]


def test_docci_split_is_a_plain_split_without_protocol_checks(docci):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load("docci", docci, split="train")
    assert ids(loaded) == ["train_00000", "train_00001", "train_00002"]
    assert list(loaded.dataset["caption"]) == [long_caption("docci", k) for k in range(3)]
    assert benchmarks.protocol_record(loaded)["protocol"] is None
    assert ids(load("docci", docci, split="qual_dev")) == ["qual_dev_00000"]


def test_docci_split_and_another_protocol_together_are_refused(docci):
    with pytest.raises(DataError, match="drop one of them"):
        load("docci", docci, split="train", protocol="goal")
    with pytest.raises(DataError, match="no protocol 'nope'"):
        load("docci", docci, protocol="nope")
    with pytest.raises(DataError, match="no split 'dev'"):
        load("docci", docci, split="dev")


def test_docci_without_descriptions_file_names_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="docci_descriptions.jsonlines"):
        load("docci", tmp_path / "empty")
    with pytest.raises(DataError, match="does not exist"):
        load("docci", tmp_path / "nowhere")


def _append_bad_line(docci: Path) -> None:
    file = docci / "docci_descriptions.jsonlines"
    lines = file.read_text().splitlines()
    lines.insert(4, '{"example_id": "test_00099", "split": "test", ')  # truncated record: line 5
    file.write_text("\n".join(lines) + "\n")


def test_docci_unreadable_line_is_a_counted_skip_or_an_error(docci):
    _append_bad_line(docci)
    loaded = load("docci", docci)
    assert ids(loaded) == [f"test_{k:05d}" for k in range(4)]
    assert loaded.skipped == 1
    assert "docci_descriptions.jsonlines line 5" in loaded.skipped_examples[0]["id"]
    assert "not valid JSON" in loaded.skipped_examples[0]["id"]
    with pytest.raises(DataError, match=r"line 5 \(not valid JSON"):
        load("docci", docci, on_error="raise")


def test_docci_record_without_description_is_skipped(docci):
    file = docci / "docci_descriptions.jsonlines"
    incomplete = {"example_id": "test_00050", "split": "test"}
    file.write_text(file.read_text() + json.dumps(incomplete) + "\n")
    loaded = load("docci", docci)
    assert loaded.skipped == 1 and "no image_file, description" in loaded.skipped_examples[0]["id"]


def test_docci_missing_image_is_a_counted_skip_or_an_error(docci):
    (docci / "images" / "test_00002.jpg").unlink()
    loaded = load("docci", docci)
    assert ids(loaded) == ["test_00000", "test_00001", "test_00003"]
    assert loaded.skipped == 1
    assert loaded.skipped_examples[0]["id"] == "test_00002"
    assert loaded.skipped_examples[0]["path"].endswith("images/test_00002.jpg")
    with pytest.raises(DataError, match="test_00002"):
        load("docci", docci, on_error="raise")


def test_docci_pinned_ids_file_selects_and_reports_absent_ids(docci, tmp_path):
    ids_file = tmp_path / "pinned.txt"
    ids_file.write_text("# GOAL-style list\ntest_00001\nqual_test_00000.jpg\ntest_00077\n")
    with pytest.warns(UserWarning, match=r"1 of 3 ids listed in .*pinned.txt are not in the files"):
        loaded = load("docci", docci, protocol="goal", options={"ids_file": str(ids_file)})
    assert ids(loaded) == ["qual_test_00000", "test_00001"]
    assert loaded.skipped == 1
    assert loaded.skipped_examples[0]["id"].startswith("test_00077 (listed in")
    with pytest.raises(DataError, match="test_00077"), pytest.warns(UserWarning, match="1 of 3"):
        load("docci", docci, protocol="goal", options={"ids_file": str(ids_file)}, on_error="raise")


def test_docci_downloads_from_file_urls_into_the_cache(docci, tmp_path, monkeypatch):
    archive = make_archive(docci, tmp_path / "docci_images.tar.gz")  # holds images/ (+ the jsonl)
    descriptions = docci / "docci_descriptions.jsonlines"

    def sha(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    monkeypatch.setitem(benchmarks.OFFICIAL_FILES, "docci_descriptions",
                        (descriptions.as_uri(), sha(descriptions)))
    monkeypatch.setitem(benchmarks.OFFICIAL_FILES, "docci_images", (archive.as_uri(), sha(archive)))
    cache = tmp_path / "datasets-cache"
    loaded = load_source({"name": "docci", "split": "test"}, cache_dir=str(cache))
    assert ids(loaded) == [f"test_{k:05d}" for k in range(4)]
    assert all(Path(p["path"]).is_relative_to(cache / "xlipkit")
               for p in loaded.dataset.cast_column("image", _undecoded())["image"])


def test_docci_download_checksum_mismatch_leaves_nothing(docci, tmp_path, monkeypatch):
    descriptions = docci / "docci_descriptions.jsonlines"
    monkeypatch.setitem(benchmarks.OFFICIAL_FILES, "docci_descriptions",
                        (descriptions.as_uri(), "0" * 64))
    cache = tmp_path / "datasets-cache"
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        load_source({"name": "docci"}, cache_dir=str(cache))
    leftovers = [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert leftovers == []


def test_docci_without_path_offline_says_to_set_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConnectionError, match="storage.googleapis.com/docci.*`path:`"):
        load_source({"name": "docci"}, cache_dir=str(tmp_path / "cache"))


def _undecoded():
    import datasets

    return datasets.Image(decode=False)


# --------------------------------------------------------------------------- DOCCI-FG


def test_docci_fg_captions_are_the_sentences_of_each_test_description(docci):
    loaded = load("docci_fg", docci)
    assert loaded.protocol == "test"
    assert ids(loaded) == [f"test_{k:05d}" for k in range(4)]
    row = loaded.dataset[1]
    assert row["caption"] == long_caption("docci", 4)
    assert row["captions"] == [
        "A purple docci scene number 4.",
        "There are 6 small objects near the centre.",
        "The background of image 4 is plain.",
    ]


def test_docci_fg_flair_splitter_cuts_at_every_period(tmp_path):
    folder = tmp_path / "docci"
    (folder / "images").mkdir(parents=True)
    write_docci_fixture(tmp_path / "src", 0, 1)
    (tmp_path / "src" / "images" / "test_00000.jpg").rename(folder / "images" / "test_00000.jpg")
    record = {"example_id": "test_00000", "split": "test", "image_file": "test_00000.jpg",
              "description": "A cup 3.5 cm tall. Next to it, e.g. a spoon.\nA plate."}
    (folder / "docci_descriptions.jsonlines").write_text(json.dumps(record) + "\n")
    sentences = load("docci_fg", folder).dataset[0]["captions"]
    assert sentences == ["A cup 3.5 cm tall.", "Next to it, e.g. a spoon.", "A plate."]
    flair = load("docci_fg", folder, options={"splitter": "flair"}).dataset[0]["captions"]
    assert flair == ["A cup 3", "5 cm tall", "Next to it, e", "g", "a spoon", "A plate"]
    with pytest.raises(DataError, match="options.splitter"):
        load("docci_fg", folder, options={"splitter": "words"})


# --------------------------------------------------------------------------- DCI


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


# --------------------------------------------------------------------------- Urban-1k


def test_urban1k_reads_image_and_caption_folders(tmp_path):
    folder = write_urban1k_fixture(tmp_path / "Urban1k", 3)
    with pytest.warns(UserWarning, match="urban1k:all has 3 images"):
        loaded = load("urban1k", tmp_path)  # the zip's wrapping folder is found
    assert loaded.protocol == "all"
    assert ids(loaded) == ["1", "2", "3"]
    assert loaded.dataset[1]["caption"] == long_caption("urban", 2)
    (folder / "image" / "3.jpg").unlink()
    loaded = load("urban1k", folder)
    assert ids(loaded) == ["1", "2"] and loaded.skipped_examples[0]["id"] == "3"


# --------------------------------------------------------------------------- ShareGPT4V


def test_sharegpt4v_protocol_is_the_first_rows_and_caption_the_second_turn(tmp_path, monkeypatch):
    folder = write_sharegpt4v_fixture(tmp_path / "share4v", 5)
    monkeypatch.setitem(PROTOCOLS, "sharegpt4v", (
        Protocol("sharegpt4v", "1k", 3, "first 3 rows (test stand-in)", "test"),
        Protocol("sharegpt4v", "10k", 4, "first 4 rows (test stand-in)", "test"),
    ))
    loaded = load("sharegpt4v", folder)
    assert ids(loaded) == ["000000000000", "000000000002", "sa_1"]
    # the caption is the gpt turn, its line break flattened as Long-CLIP does
    assert loaded.dataset[0]["caption"] == long_caption("sharegpt4v", 0)
    assert ids(load("sharegpt4v", folder, protocol="10k")) == [
        "000000000000", "000000000002", "sa_1", "sa_3"]


def test_sharegpt4v_train_split_holds_out_the_test_rows(tmp_path):
    folder = write_sharegpt4v_fixture(tmp_path / "share4v", 5)
    train = load("sharegpt4v", folder, split="train", options={"holdout": 2})
    assert ids(train) == ["000000000002", "000000000004", "sa_3"]
    test = load("sharegpt4v", folder, split="test", options={"holdout": 2})
    assert ids(test) == ["000000000000", "sa_1"]
    # the JSON file itself may be the path; images are then found next to it
    assert ids(load("sharegpt4v", folder / SHAREGPT4V_JSON, split="test",
                    options={"holdout": 2})) == ["000000000000", "sa_1"]


def test_sharegpt4v_row_without_answer_is_a_counted_skip(tmp_path):
    folder = write_sharegpt4v_fixture(tmp_path / "share4v", 3)
    rows = json.loads((folder / SHAREGPT4V_JSON).read_text())
    rows[1]["conversations"] = rows[1]["conversations"][:1]
    (folder / SHAREGPT4V_JSON).write_text(json.dumps(rows))
    loaded = load("sharegpt4v", folder)
    assert ids(loaded) == ["000000000000", "000000000002"]
    assert loaded.skipped == 1
    assert "row 1 (no second conversation turn" in loaded.skipped_examples[0]["id"]


# --------------------------------------------------------------------------- Flickr30k


def test_flickr30k_karpathy_test_has_five_captions_per_image(tmp_path):
    folder = write_flickr30k_fixture(tmp_path / "flickr", 2, 1, 2)
    with pytest.warns(UserWarning, match="flickr30k:test has 2 images"):
        loaded = load("flickr30k", folder)
    assert ids(loaded) == ["1000003", "1000004"]
    assert loaded.dataset[0]["captions"] == five_captions("flickr", 3)
    assert loaded.dataset[0]["caption"] == five_captions("flickr", 3)[0]
    assert ids(load("flickr30k", folder, split="train")) == ["1000000", "1000001"]


def test_flickr30k_full_reads_the_token_file_or_falls_back_with_a_warning(tmp_path):
    folder = write_flickr30k_fixture(tmp_path / "flickr", 2, 1, 2, token_file=True)
    loaded = load("flickr30k", folder, protocol="full")
    assert ids(loaded) == [str(1000000 + k) for k in range(5)]
    assert loaded.dataset[2]["captions"] == five_captions("flickr", 2)
    (folder / "results_20130124.token").unlink()
    with pytest.warns(UserWarning, match="flickr30k:full has 5 images here, .* on 31783"):
        fallback = load("flickr30k", folder, protocol="full")
    assert ids(fallback) == ids(loaded)


# --------------------------------------------------------------------------- COCO


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
