"""Pinned evaluation protocols: the table, id fingerprints, id lists and count checks."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest

from finetune.data import protocols
from finetune.data.protocols import (
    PROTOCOLS,
    available_protocols,
    check_count,
    get_protocol,
    ids_sha256,
    normalise_id,
    pinned_ids,
    read_ids_file,
)
from finetune.data.sources import DataError


def test_protocol_sizes_are_the_published_ones():
    sizes = {(p.benchmark, p.name): p.expected for group in PROTOCOLS.values() for p in group}
    assert sizes == {
        ("docci", "test"): 5000, ("docci", "goal"): 5100,
        ("dci", "all"): 7805, ("dci", "goal"): 1999,
        ("urban1k", "all"): 1000,
        ("sharegpt4v", "1k"): 1000, ("sharegpt4v", "10k"): 10000,
        ("flickr30k", "test"): 1000, ("flickr30k", "full"): 31783,
        ("coco", "val2017"): 5000, ("coco", "karpathy"): 5000, ("coco", "karpathy_1k"): 5000,
        ("docci_fg", "test"): 5000,
    }
    assert get_protocol("coco", "karpathy").captions_per_image == 5
    assert get_protocol("dci", "goal").needs_ids_file


def test_default_protocol_is_the_first_and_unknown_names_are_listed():
    assert get_protocol("docci").name == "test"
    assert available_protocols("docci") == ["test", "goal"]
    assert available_protocols("jsonl") == []
    with pytest.raises(DataError, match="choose one of test, goal"):
        get_protocol("docci", "5k")
    with pytest.raises(DataError, match="has no evaluation protocols"):
        get_protocol("imagefolder")


def test_ids_sha256_is_the_hash_of_the_sorted_ids():
    expected = hashlib.sha256(b"a\nb\nc").hexdigest()
    assert ids_sha256(["c", "a", "b"]) == expected == ids_sha256(["a", "b", "c"])


def test_normalise_id_drops_folders_and_extensions():
    assert normalise_id("images/test_00012.jpg") == "test_00012"
    assert normalise_id("sa_1234.jpg") == "sa_1234"
    assert normalise_id(" test_00012 ") == "test_00012"
    assert normalise_id(139) == "139"


def test_read_ids_file_text_and_json_forms(tmp_path):
    text = tmp_path / "ids.txt"
    text.write_text("# header\ntest_00001\n\ntest_00002.jpg  # trailing comment\n")
    assert read_ids_file(text) == ["test_00001", "test_00002"]
    plain = tmp_path / "ids.json"
    plain.write_text(json.dumps(["a.jpg", "b"]))
    assert read_ids_file(plain) == ["a", "b"]
    goal = tmp_path / "DCI_test.json"
    goal.write_text(json.dumps([{"filename": "sa_1.jpg", "caption": "x"}, {"id": 7}]))
    assert read_ids_file(goal) == ["sa_1", "7"]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"images": [{"image": "photos/sa_2.jpg"}]}))
    assert read_ids_file(wrapped) == ["sa_2"]


def test_read_ids_file_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="options.ids_file"):
        read_ids_file(tmp_path / "missing.txt")
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2")
    with pytest.raises(DataError, match="broken.json is not valid JSON"):
        read_ids_file(broken)
    keyless = tmp_path / "keyless.json"
    keyless.write_text(json.dumps([{"caption": "x"}]))
    with pytest.raises(DataError, match=r"keyless.json, entry 0: none of the keys"):
        read_ids_file(keyless)
    scalar = tmp_path / "scalar.json"
    scalar.write_text("3")
    with pytest.raises(DataError, match="JSON list"):
        read_ids_file(scalar)


def test_pinned_ids_prefer_the_user_file_then_a_shipped_list(tmp_path, monkeypatch):
    protocol = get_protocol("docci", "goal")
    assert pinned_ids(protocol) is None  # nothing shipped: derived from the split files
    monkeypatch.setattr(protocols, "PROTOCOL_DIR", tmp_path)
    (tmp_path / "docci-goal.txt").write_text("test_00000\nqual_test_00000\n")
    assert pinned_ids(protocol) == (["test_00000", "qual_test_00000"], "shipped docci-goal.txt")
    user = tmp_path / "mine.txt"
    user.write_text("test_00003\n")
    assert pinned_ids(protocol, user) == (["test_00003"], str(user))


def test_protocol_defined_only_by_a_list_requires_it():
    with pytest.raises(DataError, match=r"dci:goal \(1999 images\).*options.ids_file.*'all'"):
        pinned_ids(get_protocol("dci", "goal"))


def test_check_count_warns_only_on_a_different_size():
    protocol = get_protocol("urban1k")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_count(protocol, 1000) is True
    with pytest.warns(UserWarning, match="urban1k:all has 999 images here, .* evaluate on 1000"):
        assert check_count(protocol, 999) is False
