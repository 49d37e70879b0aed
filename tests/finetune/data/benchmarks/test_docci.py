"""DOCCI and DOCCI-FG read tiny fixtures in the official format through the registry."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest

from finetune.data import benchmarks
from finetune.data.download import ChecksumError
from finetune.data.protocols import ids_sha256
from finetune.data.sources import DataError, load_source
from tests.finetune.data.benchmarks.helpers import ids, load, undecoded
from tests.finetune.data.fixtures import long_caption, make_archive, write_docci_fixture

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


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
               for p in loaded.dataset.cast_column("image", undecoded())["image"])


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
