"""The preprocessing cache: computed once, reused, invalidated by a parameter, written atomically."""

from __future__ import annotations

import json
import logging

import datasets
import pytest

from finetune.preprocess.cache import cache_key, cached_map, default_cache_dir


pytestmark = pytest.mark.usefixtures("quiet_datasets")


def _dataset() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"id": ["a", "b", "c"], "caption": ["one", "two words", "three more words"]})


class CountingWordCount:
    """A map function that records how many examples it computed."""

    def __init__(self, factor: int = 1) -> None:
        self.factor = factor
        self.calls = 0

    def __call__(self, example: dict) -> dict:
        self.calls += 1
        return {"n_words": len(example["caption"].split()) * self.factor}


def test_computes_once_then_reuses_in_a_fresh_dataset(tmp_path, caplog):
    fn = CountingWordCount()
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        first = cached_map(_dataset(), fn, params={"factor": 1}, name="words", cache_dir=tmp_path)
    assert fn.calls == 3
    assert first.column_names == ["id", "caption", "n_words"]
    assert first["n_words"] == [1, 2, 3]
    assert "computing words" in caplog.text

    caplog.clear()
    again = CountingWordCount()
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        second = cached_map(_dataset(), again, params={"factor": 1}, name="words", cache_dir=tmp_path)
    assert again.calls == 0
    assert second["n_words"] == [1, 2, 3] and second["id"] == ["a", "b", "c"]
    key = cache_key(_dataset(), name="words", params={"factor": 1}, code_version="1")
    assert f"reusing cached words ({key})" in caplog.text


def test_a_parameter_change_invalidates_the_cache(tmp_path):
    cached_map(_dataset(), CountingWordCount(1), params={"factor": 1}, name="words", cache_dir=tmp_path)
    fn = CountingWordCount(2)
    out = cached_map(_dataset(), fn, params={"factor": 2}, name="words", cache_dir=tmp_path)
    assert fn.calls == 3 and out["n_words"] == [2, 4, 6]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("words-")]) == 2
    # Other data, other code version: other keys too.
    other = datasets.Dataset.from_dict({"id": ["a"], "caption": ["x"]})
    base = cache_key(_dataset(), name="words", params={"factor": 1}, code_version="1")
    assert cache_key(other, name="words", params={"factor": 1}, code_version="1") != base
    assert cache_key(_dataset(), name="words", params={"factor": 1}, code_version="2") != base
    assert cache_key(_dataset(), name="words", params={"factor": 1}, code_version="1") == base


def test_meta_records_the_step(tmp_path):
    cached_map(_dataset(), CountingWordCount(), params={"factor": 1, "mode": "x"}, name="words", cache_dir=tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("words-")]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["params"] == {"factor": 1, "mode": "x"}
    assert meta["num_rows"] == 3 and meta["columns"] == ["n_words"]
    assert folder.name == f"words-{meta['key']}"


def test_a_failing_step_leaves_nothing_behind_and_can_be_rerun(tmp_path):
    def broken(example: dict) -> dict:
        if example["id"] == "c":
            raise RuntimeError("boom")
        return {"n_words": 1}

    with pytest.raises(RuntimeError, match="boom"):
        cached_map(_dataset(), broken, params={}, name="words", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    out = cached_map(_dataset(), CountingWordCount(), params={}, name="words", cache_dir=tmp_path)
    assert out["n_words"] == [1, 2, 3]


def test_batched_multi_process_and_replacing_a_column(tmp_path):
    def upper(batch: dict) -> dict:
        return {"caption": [c.upper() for c in batch["caption"]]}

    out = cached_map(_dataset(), upper, params={}, name="upper", cache_dir=tmp_path, batched=True, num_proc=2)
    assert out.column_names == ["id", "caption"]
    assert out["caption"] == ["ONE", "TWO WORDS", "THREE MORE WORDS"]
    reused = cached_map(_dataset(), upper, params={}, name="upper", cache_dir=tmp_path, batched=True, num_proc=2)
    assert reused["caption"] == out["caption"]


def test_shuffled_dataset_keeps_rows_aligned(tmp_path):
    shuffled = _dataset().shuffle(seed=3)
    out = cached_map(shuffled, CountingWordCount(), params={}, name="words", cache_dir=tmp_path)
    assert out["id"] == shuffled["id"]
    assert out["n_words"] == [len(c.split()) for c in shuffled["caption"]]


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XLIPKIT_CACHE", str(tmp_path / "xk"))
    assert default_cache_dir() == tmp_path / "xk" / "preprocess"
    cached_map(_dataset(), CountingWordCount(), params={}, name="words")
    assert any(p.name.startswith("words-") for p in (tmp_path / "xk" / "preprocess").iterdir())


def test_bad_step_name_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="step name"):
        cached_map(_dataset(), CountingWordCount(), params={}, name="../up", cache_dir=tmp_path)
