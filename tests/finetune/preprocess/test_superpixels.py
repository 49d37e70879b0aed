"""Superpixels for CAST (finetune/preprocess/superpixels.py): SLIC, SEEDS's error, SFCN, the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from finetune.preprocess import superpixels as sp


def _scene() -> np.ndarray:
    img = np.zeros((64, 64, 3), dtype=np.uint8)
    img[:32, :32] = (255, 0, 0)
    img[32:, 32:] = (0, 0, 255)
    img[10:20, 40:60] = (0, 255, 0)
    return img


def test_slic_labels_are_contiguous_and_follow_colour_edges():
    labels = sp.compute_superpixels(_scene(), sp.SuperpixelSettings("slic", n_segments=16))
    assert labels.shape == (64, 64) and labels.dtype == np.int64
    assert set(np.unique(labels)) == set(range(labels.max() + 1)) and labels.max() + 1 >= 4
    # no superpixel straddles the red / black edge at column 32 in the top rows
    assert not set(np.unique(labels[:30, :31])) & set(np.unique(labels[:30, 33:38]))


def test_seeds_without_contrib_opencv_names_the_package(monkeypatch):
    cv2 = pytest.importorskip("cv2")
    if hasattr(cv2, "ximgproc"):
        labels = sp.seeds_superpixels(_scene(), 16)
        assert labels.shape == (64, 64)
        return
    with pytest.raises(ImportError, match="opencv-contrib-python-headless"):
        sp.compute_superpixels(_scene(), sp.SuperpixelSettings("seeds"))


def test_sfcn_needs_a_checkpoint_and_loads_safetensors(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="superpixels.checkpoint"):
        sp.SuperpixelSettings("sfcn")
    torch.manual_seed(0)
    save_file(sp.SpixelNet().state_dict(), str(tmp_path / "sfcn.safetensors"))
    settings = sp.SuperpixelSettings("sfcn", n_segments=16, checkpoint=str(tmp_path / "sfcn.safetensors"))
    labels = sp.compute_superpixels(_scene(), settings)
    assert labels.shape == (64, 64) and labels.max() < 16
    save_file({"conv0a.0.weight": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="not an SFCN"):
        sp.load_spixelnet(tmp_path / "bad.safetensors")


def test_sfcn_labels_pick_the_most_associated_neighbour_cell():
    # 32 px, 4 cells of 16 px (n_segments=4): all mass on the "right" neighbour (offset (0, +1), index 5)
    assoc = torch.zeros(1, 9, 32, 32)
    assoc[:, 5] = 1.0
    labels = sp.sfcn_labels(assoc, 4)[0]
    assert labels[0, 0] == 1 and labels[20, 0] == 3  # cell (0,0) -> (0,1); (1,0) -> (1,1)
    # (0,1) has no right neighbour: off-grid is never chosen; of the valid cells (all 0) the first wins, (0,0)
    assert labels[0, 20] == 0
    assoc[:, 4] = 0.5
    assert sp.sfcn_labels(assoc, 4)[0][0, 20] == 1


def test_cache_computes_once_and_reads_back(tmp_path, monkeypatch):
    cache = sp.SuperpixelCache(tmp_path, sp.SuperpixelSettings("slic", n_segments=16))
    first = cache.get(_scene())
    assert cache.path(_scene()).is_file()
    monkeypatch.setattr(sp, "compute_superpixels", lambda *a: pytest.fail("recomputed a cached image"))
    np.testing.assert_array_equal(cache.get(_scene()), first)
    other = sp.SuperpixelCache(tmp_path, sp.SuperpixelSettings("slic", n_segments=25))
    assert other.path(_scene()) != cache.path(_scene())


def test_settings_errors_name_the_key():
    with pytest.raises(ValueError, match="superpixels.method"):
        sp.SuperpixelSettings("watershed")
    with pytest.raises(ValueError, match="unknown keys"):
        sp.settings_from({"method": "slic", "segments": 3})
