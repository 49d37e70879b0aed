"""Urban-1k reads a tiny fixture in the official format through the registry."""

from __future__ import annotations

import pytest

from tests.finetune.data.benchmarks.helpers import ids, load
from tests.finetune.data.fixtures import long_caption, write_urban1k_fixture

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


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
