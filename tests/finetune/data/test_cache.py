"""The preprocessing cache: computed once, reused, invalidated by a parameter, written atomically."""

from __future__ import annotations

import json
import logging

import datasets
import pytest

from finetune.data.cache import cache_key, cached_map, default_cache_dir


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


# -- damaged caches and what killed writers leave ------------------------------------------------


def _cache_folder(tmp_path):
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("words-")]
    return folder


def _arrow(folder):
    (file,) = folder.glob("data*.arrow")
    return file


@pytest.mark.parametrize("damage", ["truncated", "bit flip", "no fingerprint (older version)"])
def test_a_damaged_cache_is_named_and_rebuilt(tmp_path, caplog, damage):
    cached_map(_dataset(), CountingWordCount(), params={}, name="words", cache_dir=tmp_path)
    folder = _cache_folder(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    file = _arrow(folder)
    assert meta["files"] == {file.name: {"size": file.stat().st_size, "sha256": meta["files"][file.name]["sha256"]}}
    data = bytearray(file.read_bytes())
    if damage == "truncated":
        file.write_bytes(bytes(data[: len(data) // 2]))
        why = rf"{file.name} has {len(data) // 2} bytes, {len(data)} were written \(truncated\?\)"
    elif damage == "bit flip":
        data[len(data) // 2] ^= 0x10  # same size: only the hash sees it
        file.write_bytes(bytes(data))
        why = rf"{file.name} does not match its sha256 \(damaged on disk\)"
    else:
        del meta["files"]
        (folder / "meta.json").write_text(json.dumps(meta))
        why = r"meta.json records no fingerprint of its files \(an older xlipkit wrote it\)"
    fn = CountingWordCount()
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        out = cached_map(_dataset(), fn, params={}, name="words", cache_dir=tmp_path)
    assert fn.calls == 3 and out["n_words"] == [1, 2, 3]
    import re

    assert re.search(rf"the cached words in {re.escape(str(folder))} is damaged \({why}\): rebuilding it", caplog.text)
    again = CountingWordCount()
    assert cached_map(_dataset(), again, params={}, name="words", cache_dir=tmp_path)["n_words"] == [1, 2, 3]
    assert again.calls == 0  # the rebuilt cache verifies
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_temporary_folders_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    from finetune.files import process_tag

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = process_tag().split("@")[1]
    dead = tmp_path / f".edges-0123456789abcdef.tmp-{gone.pid}@{host}.1a2b3c4d"
    legacy = tmp_path / f".regions-0123456789abcdef.tmp-{gone.pid}-1a2b3c4d"  # an older version's name
    live = tmp_path / f".edges-fedcba9876543210.tmp-{os.getpid()}@{host}.5e6f7a8b"  # being written now
    other = tmp_path / f".edges-fedcba9876543210.tmp-{gone.pid}@another-host.5e6f7a8b"  # cannot tell from here
    for folder in (dead, legacy, live, other):
        folder.mkdir()
        (folder / "data.arrow").write_bytes(b"partial")
    cached_map(_dataset(), CountingWordCount(), params={}, name="words", cache_dir=tmp_path)
    assert not dead.exists() and not legacy.exists()
    assert live.exists() and other.exists()
