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


# -- batches, entries, the cache's batch path (issue 29, item 4) ------------------------------------------------
def _photos(side: int = 224) -> list[np.ndarray]:
    """Real photographs that scikit-image ships (astronaut, coffee, chelsea, rocket), as the encoder sees them."""
    import PIL.Image
    import skimage.data

    return [sp.encoder_view(PIL.Image.fromarray(getattr(skimage.data, name)()), side)
            for name in ("astronaut", "coffee", "chelsea", "rocket")]


def _sfcn(tmp_path, seed: int = 0) -> str:
    from safetensors.torch import save_file

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        save_file(sp.SpixelNet().state_dict(), str(tmp_path / "sfcn.safetensors"))
    return str(tmp_path / "sfcn.safetensors")


def test_sfcn_in_one_batch_gives_each_image_the_labels_it_gets_alone(tmp_path):
    photos = _photos()
    settings = sp.SuperpixelSettings("sfcn", n_segments=196, checkpoint=_sfcn(tmp_path))
    batch = sp.compute_superpixels_batch(photos, settings)
    assert batch.shape == (4, 224, 224) and batch.dtype == np.int64
    for photo, labels in zip(photos, batch):
        alone = sp.compute_superpixels(photo, settings)
        np.testing.assert_array_equal(labels, alone)
        assert set(np.unique(labels)) == set(range(labels.max() + 1)) and 100 < labels.max() + 1 <= 196
    # the per-image path is the authors' recipe: Q of the network, each pixel to its most associated cell
    net = sp.load_spixelnet(settings.checkpoint)
    x = torch.from_numpy(np.array(photos[1])).permute(2, 0, 1).float()[None] / 255.0
    x = x - torch.tensor(sp.SFCN_MEAN)[None, :, None, None]
    with torch.no_grad():
        raw = sp.sfcn_labels(net(x), 196)[0].numpy()
    np.testing.assert_array_equal(batch[1], sp.relabel(raw))


def test_relabel_batch_renumbers_each_row_as_relabel_does():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 40, (3, 9, 11), generator=g)
    labels[1] = labels[1] // 4 * 4  # gaps: only multiples of 4
    out = sp.relabel_batch(labels, 40)
    for row, expected in zip(out, labels):
        np.testing.assert_array_equal(row.numpy(), sp.relabel(expected.numpy()))


def test_slic_batches_loop_on_the_cpu_and_refuse_a_gpu():
    photos = _photos(64)[:2]
    settings = sp.SuperpixelSettings("slic", n_segments=16)
    np.testing.assert_array_equal(sp.compute_superpixels_batch(photos, settings),
                                  np.stack([sp.compute_superpixels(p, settings) for p in photos]))
    with pytest.raises(ValueError, match="only sfcn"):
        sp.compute_superpixels_batch(photos, settings, device="cuda")


def test_an_entry_holds_the_labels_exactly_with_the_settings_that_made_them(tmp_path):
    from finetune.data.images import DataError

    small = sp.compute_superpixels(_photos(64)[0], sp.SuperpixelSettings("slic", n_segments=16))
    wide = np.arange(300 * 4, dtype=np.int64).reshape(30, 40) % 300  # past 256 segments: a 16-bit PNG
    stamp = sp.settings_stamp(sp.SuperpixelSettings("slic", n_segments=16), 64)
    for labels in (small, wide):
        data = sp.encode_entry(labels, stamp)
        back = sp.decode_entry({"bytes": data, "path": "k.superpixels.png"}, stamp)
        assert back.dtype == np.int64
        np.testing.assert_array_equal(back, labels)
    other = sp.settings_stamp(sp.SuperpixelSettings("slic", n_segments=16, compactness=20.0), 64)
    assert other != stamp and sp.settings_stamp(sp.SuperpixelSettings("slic", n_segments=16), 224) != stamp
    with pytest.raises(DataError, match=r"sample 'k' of a\.tar: the precomputed superpixels were made with .*"
                                        r"compactness.*10\.0.*xlipkit superpixels"):
        sp.decode_entry(sp.encode_entry(small, stamp), other, where="sample 'k' of a.tar")
    with pytest.raises(DataError, match="not a PNG"):
        sp.decode_entry(b"not an image", stamp)
    import io

    import PIL.Image

    plain = io.BytesIO()
    PIL.Image.fromarray(small.astype(np.uint8)).save(plain, "PNG")
    with pytest.raises(DataError, match="no 'xlipkit-superpixels' stamp"):
        sp.decode_entry(plain.getvalue(), stamp)
    # SFCN's stamp names the weights by content: a copy elsewhere has the same stamp, other weights another
    first = sp.SuperpixelSettings("sfcn", n_segments=196, checkpoint=_sfcn(tmp_path))
    (tmp_path / "copy").mkdir()
    import shutil

    shutil.copy(first.checkpoint, tmp_path / "copy" / "sfcn.safetensors")
    copy = sp.SuperpixelSettings("sfcn", n_segments=196, checkpoint=str(tmp_path / "copy" / "sfcn.safetensors"))
    (tmp_path / "other").mkdir()
    retrained = sp.SuperpixelSettings("sfcn", n_segments=196, checkpoint=_sfcn(tmp_path / "other", seed=1))
    assert sp.settings_stamp(first, 224) == sp.settings_stamp(copy, 224) != sp.settings_stamp(retrained, 224)


def test_cache_batches_read_cached_images_and_compute_the_others_together(tmp_path, monkeypatch):
    photos = _photos(64)[:3]
    settings = sp.SuperpixelSettings("slic", n_segments=16)
    cache = sp.SuperpixelCache(tmp_path, settings)
    first = cache.get(photos[0])
    calls = []
    original = sp.compute_superpixels_batch
    monkeypatch.setattr(sp, "compute_superpixels_batch", lambda images, s, **kw: calls.append(len(images)) or
                        original(images, s, **kw))
    labels = cache.get_batch(photos)
    assert calls == [2]  # the two missing ones, together
    np.testing.assert_array_equal(labels[0], first)
    for photo, row in zip(photos, labels):
        np.testing.assert_array_equal(row, sp.compute_superpixels(photo, settings))
    assert cache.get_batch(photos).shape == (3, 64, 64) and calls == [2]  # all cached now
