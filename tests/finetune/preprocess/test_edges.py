"""Edge maps (StructXLIP 3.1): Canny equals OpenCV's on the same gray image, LoG, options, errors."""

from __future__ import annotations

import sys

import cv2
import numpy as np
import pytest
from PIL import Image

from finetune.preprocess import edges as edges_module
from finetune.preprocess.edges import EdgeConfig, edge_array, edge_example_fn, edge_map, edge_maps


def _scene(height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    """A small RGB image with shapes and texture: enough edges for every detector."""
    rng = np.random.default_rng(seed)
    img = np.full((height, width, 3), 40, np.uint8)
    cv2.rectangle(img, (5, 5), (30, 25), (200, 30, 30), -1)
    cv2.circle(img, (45, 30), 12, (20, 180, 90), -1)
    img = np.clip(img.astype(np.int16) + rng.integers(-15, 15, img.shape), 0, 255).astype(np.uint8)
    return img


def test_canny_equals_cv2_on_the_same_gray_image():
    rgb = _scene()
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    expected = cv2.Canny(gray, 100, 200, apertureSize=3, L2gradient=False)
    assert expected.any(), "the fixture must have edges"
    out = edge_map(Image.fromarray(rgb))
    arr = np.asarray(out)
    assert out.mode == "RGB" and out.size == (64, 48)
    assert arr.shape == (48, 64, 3) and arr.dtype == np.uint8
    for c in range(3):
        np.testing.assert_array_equal(arr[:, :, c], expected)
    np.testing.assert_array_equal(edge_array(rgb), expected)  # numpy input, RGB order


def test_canny_options_are_passed_to_cv2():
    rgb = _scene(seed=1)
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    cfg = EdgeConfig(low=30, high=90, aperture=5, l2_gradient=True, blur=5)
    expected = cv2.Canny(cv2.GaussianBlur(gray, (5, 5), 0), 30, 90, apertureSize=5, L2gradient=True)
    np.testing.assert_array_equal(edge_array(Image.fromarray(rgb), cfg), expected)
    assert not np.array_equal(expected, cv2.Canny(gray, 100, 200))


def test_gray_and_rgba_inputs_match_rgb():
    rgb = _scene()
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    np.testing.assert_array_equal(edge_array(Image.fromarray(gray)), cv2.Canny(gray, 100, 200))
    rgba = Image.fromarray(rgb).convert("RGBA")
    np.testing.assert_array_equal(edge_array(rgba), edge_array(rgb))


def test_output_is_binary_and_invert_swaps_it():
    rgb = _scene()
    plain = edge_array(rgb)
    inverted = edge_array(rgb, EdgeConfig(invert=True))
    assert set(np.unique(plain)) == {0, 255}
    np.testing.assert_array_equal(inverted, 255 - plain)


def test_log_is_binary_same_size_and_finds_the_shapes():
    rgb = _scene()
    out = np.asarray(edge_map(rgb, EdgeConfig(method="log")))
    assert out.shape == (48, 64, 3)
    assert set(np.unique(out)) <= {0, 255}
    edges = out[:, :, 0] > 0
    assert 0 < edges.mean() < 0.5
    # The rectangle's left border (x = 5) is an edge; the flat inside of the circle is not.
    assert edges[8:22, 3:8].any()
    assert not edges[28:33, 43:48].any()
    # A higher explicit threshold keeps fewer edge pixels.
    strict = edge_array(rgb, EdgeConfig(method="log", log_threshold=50.0)) > 0
    assert strict.sum() < edges.sum()


def test_flat_image_has_no_edges():
    flat = np.full((16, 16, 3), 128, np.uint8)
    assert not edge_array(flat).any()
    assert not edge_array(flat, EdgeConfig(method="log")).any()


def test_edge_maps_in_threads_equal_one_by_one():
    images = [Image.fromarray(_scene(seed=s)) for s in range(4)]
    pooled = edge_maps(images, num_threads=2)
    single = [edge_map(im) for im in images]
    assert len(pooled) == 4
    for a, b in zip(pooled, single):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_edge_example_fn_adds_a_column_for_map_or_collate():
    images = [Image.fromarray(_scene(seed=s)) for s in range(2)]
    fn = edge_example_fn(EdgeConfig(low=50, high=150), image_column="img", output_column="edge")
    out = fn({"img": images, "caption": ["a", "b"]})
    assert list(out) == ["edge"] and len(out["edge"]) == 2
    expected = edge_array(images[1], EdgeConfig(low=50, high=150))
    np.testing.assert_array_equal(np.asarray(out["edge"][1])[:, :, 0], expected)
    with pytest.raises(KeyError, match="'img'"):
        fn({"image": images})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "sobel"}, "edges.method"),
        ({"low": 200, "high": 100}, "low <= high"),
        ({"aperture": 4}, "edges.aperture"),
        ({"blur": 4}, "edges.blur"),
        ({"log_sigma": 0}, "edges.log_sigma"),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EdgeConfig(**kwargs)


def test_from_mapping_names_unknown_keys_and_skips_pipeline_keys():
    cfg = EdgeConfig.from_mapping({"low": 50, "high": 120, "on_the_fly": True})
    assert (cfg.low, cfg.high) == (50, 120)
    assert "on_the_fly" not in cfg.params()
    with pytest.raises(ValueError, match="thresh"):
        EdgeConfig.from_mapping({"thresh": 3})


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="uint8"):
        edge_array(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="shape"):
        edge_array(np.zeros((4, 4, 2), np.uint8))
    with pytest.raises(TypeError, match="PIL.Image"):
        edge_array([[0, 1]])


def test_edge_maps_gives_opencv_back_the_threads_ultralytics_took(monkeypatch):
    before = cv2.getNumThreads()
    monkeypatch.setitem(sys.modules, "ultralytics", sys.modules.get("ultralytics", object()))
    monkeypatch.setattr(edges_module, "CV2_THREADS_AT_IMPORT", 2)
    try:
        cv2.setNumThreads(0)  # what importing ultralytics does
        edge_maps([_scene()])
        assert cv2.getNumThreads() == 2
        # Without ultralytics loaded, a deliberate single-thread setting is left alone.
        monkeypatch.delitem(sys.modules, "ultralytics")
        cv2.setNumThreads(1)
        edge_maps([_scene()])
        assert cv2.getNumThreads() == 1
    finally:
        cv2.setNumThreads(before)
