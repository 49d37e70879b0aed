"""Box -> patch geometry through the processor's resize and crop (``finetune.preprocess.geometry``)."""

from __future__ import annotations

import pytest

from finetune.preprocess.geometry import (
    box_patch_mask,
    input_geometry,
    naflex_grid,
    patch_count,
    resize_shortest,
    visible_box,
)


def test_box_patch_mask_follows_resize_and_centre_crop():
    params = {"mode": "shortest_center_crop", "size": 32, "crop": (32, 32), "patch_size": 8}
    # 128 x 64 -> resized to 64 x 32, centre crop cuts 16 px on the left and right
    everything = box_patch_mask((32, 0, 96, 64), (128, 64), params)
    assert everything.shape == (16,) and bool(everything.all())
    assert box_patch_mask((0, 0, 32, 64), (128, 64), params) is None  # cut away by the crop
    one = box_patch_mask((64, 16, 80, 32), (128, 64), params)  # -> (16, 8, 24, 16): the patch at row 1, col 2
    assert one.nonzero().flatten().tolist() == [6]
    tiny = box_patch_mask((64, 16, 65, 17), (128, 64), params)  # smaller than a patch: the patch under its centre
    assert tiny.nonzero().flatten().tolist() == [6]
    squash = {"mode": "squash", "size": (32, 32), "crop": None, "patch_size": 8}
    left = box_patch_mask((0, 0, 32, 32), (64, 32), squash)  # left half of the image = columns 0-1
    assert left.view(4, 4)[:, :2].all() and not left.view(4, 4)[:, 2:].any()
    naflex = {"mode": "naflex", "size": None, "crop": None, "patch_size": 8}
    mask = box_patch_mask((0, 0, 32, 32), (64, 32), naflex, n_patches=16, spatial_shape=(2, 4))
    assert mask.nonzero().flatten().tolist() == [0, 1, 4, 5]


def test_resize_shortest_keeps_aspect_and_truncates():
    assert resize_shortest(128, 64, 32) == (64, 32)
    assert resize_shortest(50, 75, 32) == (32, 48)
    assert resize_shortest(75, 50, 32) == (48, 32)  # 32 * 75 / 50 = 48
    assert resize_shortest(100, 33, 10) == (30, 10)  # 10 * 100 / 33 = 30.3 -> 30


def test_input_geometry_of_longest_pad_centres_the_image():
    params = {"mode": "longest_pad", "size": 32, "crop": None, "patch_size": 8}
    sx, sy, ox, oy, in_w, in_h = input_geometry(64, 32, params)
    assert (sx, sy, in_w, in_h) == (0.5, 0.5, 32, 32)
    assert (ox, oy) == (0.0, -8.0)  # 32 x 16 pasted 8 px down in a 32 x 32 input
    with pytest.raises(ValueError, match="unknown image transform mode 'tiles'"):
        input_geometry(64, 32, {"mode": "tiles", "size": 32, "patch_size": 8})


def test_patch_count_of_fixed_inputs():
    assert patch_count({"mode": "shortest_center_crop", "size": 224, "crop": (224, 224), "patch_size": 16}) == 196
    assert patch_count({"mode": "squash", "size": 64, "crop": None, "patch_size": 8}) == 64


def test_box_patch_mask_overlap_takes_every_patch_the_box_touches():
    """FAST-GOAL appendix C: floor of the top-left corner, ceil of the bottom-right one, in patch units."""
    params = {"mode": "shortest_center_crop", "size": 32, "crop": (32, 32), "patch_size": 8}
    # 128 x 64 -> 64 x 32, crop offset 16: (60, 16, 70, 20) -> (14, 8)-(19, 10): columns 1-2 of row 1
    straddles = (60, 16, 70, 20)
    assert box_patch_mask(straddles, (128, 64), params, cover="overlap").nonzero().flatten().tolist() == [5, 6]
    assert box_patch_mask(straddles, (128, 64), params).nonzero().flatten().tolist() == [6]  # centre rule
    inside = (64, 16, 80, 32)  # -> (16, 8)-(24, 16): exactly the patch at row 1, col 2
    assert box_patch_mask(inside, (128, 64), params, cover="overlap").nonzero().flatten().tolist() == [6]
    # partly cut by the crop: (0, 0, 40, 20) -> (-16, 0)-(4, 10), clipped to (0, 0)-(4, 10): column 0, rows 0-1
    assert box_patch_mask((0, 0, 40, 20), (128, 64), params, cover="overlap").nonzero().flatten().tolist() == [0, 4]
    assert box_patch_mask((0, 0, 32, 64), (128, 64), params, cover="overlap") is None  # all cut away
    # 200 px -> 224: x = 100 lands on 112.00000000000001, the boundary of column 7, which it must not take
    squash = {"mode": "squash", "size": (224, 224), "crop": None, "patch_size": 16}
    left = box_patch_mask((0, 0, 100, 200), (200, 200), squash, cover="overlap").view(14, 14)
    assert left[:, :7].all() and not left[:, 7:].any()
    with pytest.raises(ValueError, match="cover must be 'centre' or 'overlap'"):
        box_patch_mask(inside, (128, 64), params, cover="any")


def test_crop_offset_floors_or_rounds_the_cut_half():
    floor = {"mode": "shortest_center_crop", "size": 32, "crop": (32, 32), "patch_size": 8}
    # 67 x 32: nothing to resize, the crop cuts 35 columns: 17 before the kept part (floor), 18 (round)
    assert input_geometry(67, 32, floor)[2] == 17.0
    assert input_geometry(67, 32, {**floor, "crop_offset": "round"})[2] == 18.0
    assert input_geometry(69, 32, {**floor, "crop_offset": "round"})[2] == 18.0  # round(18.5): half to even
    with pytest.raises(ValueError, match="crop_offset must be 'floor' or 'round'"):
        input_geometry(67, 32, {**floor, "crop_offset": "ceil"})


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-openclip"])  # transformers floors, torchvision rounds
@pytest.mark.parametrize("width", [67, 69])
def test_geometry_matches_the_processors_own_centre_crop(name, width):
    import numpy as np
    from PIL import Image

    from finetune.models.registry import build_model

    model = build_model(name)
    pixels = np.full((32, width, 3), 255, dtype=np.uint8)
    pixels[:, :40] = 0  # dark up to x = 40 of the original image
    row = model.preprocess_images([Image.fromarray(pixels)])["pixel_values"][0].mean(dim=0)[16]
    dark_until = int((row < 0).nonzero().max()) + 1
    sx, _, ox, _, _, _ = input_geometry(width, 32, model.image_transform_params())
    assert dark_until == 40 * sx - ox


def test_visible_box_is_what_the_resize_and_centre_crop_keep():
    clip = {"mode": "shortest_center_crop", "size": 224, "crop": (224, 224), "patch_size": 16}
    # 1000 x 500 -> 448 x 224, the crop cuts 112 px on each side: x 250-750 of the original image
    assert visible_box(1000, 500, clip) == (250.0, 0.0, 750.0, 500.0)
    assert visible_box(500, 1000, clip) == (0.0, 250.0, 500.0, 750.0)
    assert visible_box(640, 640, clip) == (0.0, 0.0, 640.0, 640.0)
    # a box outside the visible part has no patch, one inside it has
    assert box_patch_mask((10, 100, 240, 400), (1000, 500), clip, cover="overlap") is None
    assert box_patch_mask((260, 100, 400, 400), (1000, 500), clip, cover="overlap") is not None
    squash = {"mode": "squash", "size": (32, 32), "crop": None, "patch_size": 8}
    assert visible_box(64, 32, squash) == (0.0, 0.0, 64.0, 32.0)
    naflex = {"mode": "naflex", "size": None, "crop": None, "patch_size": 8, "max_num_patches": 16}
    assert visible_box(50, 30, naflex) == (0.0, 0.0, 50.0, 30.0)


def test_naflex_grid_is_the_processors_own(tiny_dir):
    """The NaFlex patch grid computed from the image size alone (FAST-GOAL's collate maps boxes before the processor
    runs) equals the grid SigLIP2's processor produces."""
    import numpy as np
    from PIL import Image

    from finetune import load_model

    model = load_model(str(tiny_dir("tiny-siglip2")))
    params = model.image_transform_params()
    sizes = [(50, 30), (40, 40), (17, 90), (300, 20)]
    images = [Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)) for w, h in sizes]
    shapes = model.preprocess_images(images)["spatial_shapes"].tolist()
    assert [list(naflex_grid(w, h, params)) for w, h in sizes] == shapes
