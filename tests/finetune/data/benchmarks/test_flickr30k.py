"""Flickr30k reads tiny fixtures in the official format through the registry."""

from __future__ import annotations

import pytest

from tests.finetune.data.benchmarks.helpers import ids, load
from tests.finetune.data.fixtures import five_captions, write_flickr30k_fixture

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


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
