"""The training collator's fast paths: the uint8 tensor image path against each model's own processor, and the
datasets that decode images in the workers (the planning around the collator: tests/finetune/objectives/
test_planning.py)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from finetune.data.collate import PIXEL_NORM, Collator, normalize_pixels
from finetune.data.images import TENSOR_PATH_MEAN_TOLERANCE, TENSOR_PATH_TOLERANCE, TensorImages
from finetune.data.sources import load_source
from finetune.models.registry import build_model


@pytest.fixture(scope="module")
def scenes():
    return load_source({"name": "synthetic", "size": 8, "seed": 0, "options": {"image_size": 48}}).dataset


def _photos() -> list[PIL.Image.Image]:
    """Images of other sizes than the probes: a landscape, a portrait, a grey one converted to RGB."""
    rng = np.random.default_rng(3)
    out = [PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((90, 160), (200, 71))]
    out.append(PIL.Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8)).convert("RGB"))
    return out


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-siglip", "tiny-openclip", "tiny-openclip-siglip",
                                  "tiny-vision-text-vit", "tiny-flair"])
def test_tensor_images_match_the_models_own_processor(name):
    model = build_model(name)
    path = TensorImages.for_model(model)
    assert path is not None
    images = _photos()
    pixels = path(images)
    assert pixels.dtype == torch.uint8 and pixels.is_contiguous()
    got = path.norm.apply(pixels)
    want = model.preprocess_images(images)["pixel_values"]
    assert got.shape == want.shape and got.dtype == torch.float32
    levels = (got - want).abs() * torch.tensor(path.norm.std).view(1, 3, 1, 1) * 255
    assert float(levels.max()) <= TENSOR_PATH_TOLERANCE + 1e-3 and float(levels.mean()) <= TENSOR_PATH_MEAN_TOLERANCE
    if model.backend in ("hf", "vision_text"):  # the transformers torchvision processors: the same values
        assert float(levels.max()) < 1e-3


@pytest.mark.parametrize("name", ["tiny-siglip2", "fcast-tiny"])
def test_processors_the_tensor_path_does_not_cover_stay_in_use(name):
    if name == "fcast-tiny":  # superpixels beside the pixels
        from finetune.models.families.fcast import build_fcast

        model = build_fcast(name)
    else:  # NaFlex patches
        model = build_model(name)
    assert TensorImages.for_model(model) is None
    assert Collator(model, tensor_images=True).images is None


def test_a_processor_that_disagrees_is_not_replaced():
    model = build_model("tiny-clip")
    model.image_processor.image_mean = [0.0, 0.0, 0.0]  # the processor changed, the geometry read from params did too
    reference = TensorImages.for_model(model)
    assert reference is not None  # consistent: params are read from the processor
    original = model.preprocess_images
    model.preprocess_images = lambda images: {"pixel_values": original(images)["pixel_values"] + 0.1}
    assert TensorImages.for_model(model) is None


def test_collator_gives_uint8_pixels_normalised_on_the_device(scenes):
    model = build_model("tiny-clip")
    examples = [scenes[i] for i in range(4)]
    fast = Collator(model, tensor_images=True)(examples)
    slow = Collator(model)(examples)
    assert fast["image_inputs"]["pixel_values"].dtype == torch.uint8 and PIXEL_NORM in fast
    assert PIXEL_NORM not in slow
    ready = normalize_pixels(fast)
    assert PIXEL_NORM not in ready and ready["input_ids"] is fast["input_ids"]
    torch.testing.assert_close(ready["image_inputs"]["pixel_values"], slow["image_inputs"]["pixel_values"],
                               atol=1e-4, rtol=0)
    assert normalize_pixels(slow) is slow


def test_tensor_decoding_dataset_skips_a_bad_jpeg_and_reports_it(tmp_path):
    import io

    from finetune.data.skipping import SKIPPED_KEY, SkippingDataset

    rng = np.random.default_rng(0)
    rows = []
    for i in range(3):
        buffer = io.BytesIO()
        PIL.Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        path = tmp_path / f"{i}.jpg"
        data = buffer.getvalue()
        path.write_bytes(data if i != 1 else data[: len(data) // 2])
        rows.append({"id": str(i), "image": {"bytes": None, "path": str(path)}, "caption": "a picture"})
    dataset = SkippingDataset(rows, "skip", decode="tensor")
    assert dataset[0]["image"].dtype == torch.uint8 and dataset[0]["image"].shape == (3, 40, 40)
    row = dataset[1]
    assert row["id"] == "2" and row[SKIPPED_KEY][0]["id"] == "1" and row[SKIPPED_KEY][0]["path"].endswith("1.jpg")


def test_a_batch_of_rows_is_read_at_once_and_a_bad_one_still_skipped(tmp_path):
    import io

    import datasets

    from finetune.data.skipping import SKIPPED_KEY, SkippingDataset

    rng = np.random.default_rng(0)
    rows = []
    for i in range(4):
        buffer = io.BytesIO()
        PIL.Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        data = buffer.getvalue()
        rows.append({"id": str(i), "image": {"bytes": data if i != 2 else data[:40], "path": None}, "caption": "x"})
    table = datasets.Dataset.from_list(rows)
    for decode in ("pil", "tensor"):
        dataset = SkippingDataset(table, "skip", decode=decode)
        batch = dataset.__getitems__([0, 1, 2, 3])
        assert [r["id"] for r in batch] == ["0", "1", "3", "3"] and batch[2][SKIPPED_KEY][0]["id"] == "2"
        one = [dataset[i] for i in range(4)]
        for a, b in zip(batch, one):
            assert a["id"] == b["id"] and np.array_equal(np.asarray(a["image"]), np.asarray(b["image"]))
