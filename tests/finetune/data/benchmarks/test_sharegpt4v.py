"""ShareGPT4V reads tiny fixtures in the official format through the registry."""

from __future__ import annotations

import json

import pytest

from finetune.data.protocols import PROTOCOLS, Protocol
from tests.finetune.data.benchmarks.helpers import ids, load
from tests.finetune.data.fixtures import SHAREGPT4V_JSON, long_caption, write_sharegpt4v_fixture

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


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
