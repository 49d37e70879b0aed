"""Atomic folder writes: the old content stays on error, the new one replaces it on success."""

from __future__ import annotations

import pytest

from finetune.files import atomic_dir


def test_new_folder_replaces_old_one(tmp_path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_dir(target) as tmp:
        assert tmp != target and tmp.parent == tmp_path
        (tmp / "new.txt").write_text("new")
        assert (target / "old.txt").exists()  # readers still see the old folder while writing
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_error_keeps_old_folder_and_cleans_up(tmp_path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(target) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (target / "old.txt").read_text() == "old"


def test_file_in_the_way(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        with atomic_dir(tmp_path / "f"):
            pass
