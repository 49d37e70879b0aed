"""The training collator's fast paths: the uint8 tensor image path against each model's own processor, text
plans made on the CPU against the tower's own buckets, and the epoch handed to the workers' terms."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from finetune.data.collate import (
    EPOCH_KEY,
    PIXEL_NORM,
    Collator,
    MicroPlans,
    PlannedCollate,
    compile_lengths,
    normalize_pixels,
    split_batch,
)
from finetune.data.images import TENSOR_PATH_MEAN_TOLERANCE, TENSOR_PATH_TOLERANCE, TensorImages
from finetune.data.sources import load_source
from finetune.models.registry import build_model
from finetune.objectives import ClipTerm, Objective
from finetune.objectives.base import TEXT_PLAN, Term, TextPlan, _encode_texts


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


def test_text_plan_gives_the_embeddings_of_the_device_buckets(scenes):
    """The plan made on the CPU (buckets, order) encodes like the tower's own on-device bucketing, and its padded
    variant (train.compile) too."""
    model = build_model("tiny-clip").eval()
    objective = Objective(ClipTerm())
    collate = PlannedCollate(Collator(model, objective), objective, model)
    words = scenes[0]["caption"].split()
    captions = [" ".join(words[:n]) for n in (3, 40, 5, 12, 2, 60, 25, 8)]  # from 4 to 77 tokens
    batch = collate([{**scenes[i], "caption": c} for i, c in enumerate(captions)])
    plan = batch[TEXT_PLAN]
    assert isinstance(plan, TextPlan) and plan.keys == ("text",) and plan.counts == (8,) and len(plan.sizes) > 2
    assert sorted(plan.order.tolist()) == list(range(8)) and sum(plan.sizes) == 8
    lengths = batch["attention_mask"].sum(1)
    start = 0
    for size, length in zip(plan.sizes, plan.lengths):  # each bucket is cut to its longest row
        assert int(lengths[plan.order[start:start + size]].max()) == length
        start += size
    _, reqs, _ = objective.requests(batch)
    with torch.no_grad():
        planned = _encode_texts(model, reqs, plan)["text"]
        unplanned = _encode_texts(model, reqs, None)["text"]
        padded = _encode_texts(model, reqs, objective.plan(model, batch, pad_lengths=compile_lengths(77)))["text"]
    torch.testing.assert_close(planned, unplanned, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, unplanned, atol=1e-5, rtol=1e-5)


def test_compile_lengths_pad_captions_to_a_fixed_set(scenes):
    model = build_model("tiny-clip")
    objective = Objective(ClipTerm())
    assert compile_lengths(77) == (32, 64, 77) and compile_lengths(248)[-2:] == (224, 248)
    batch = PlannedCollate(Collator(model, objective), objective, model, pad_lengths=(32, 64, 77))(
        [scenes[i] for i in range(4)])
    assert batch["input_ids"].shape[1] in (32, 64, 77)
    assert all(length in (32, 64, 77) for length in batch[TEXT_PLAN].lengths)


def test_left_padded_requests_get_no_plan(scenes):
    model = build_model("tiny-clip")
    objective = Objective(ClipTerm())
    captions = ["a red circle", "a blue square on the left of a green star", "a dog", "two cats"]
    batch = Collator(model, objective)([{**scenes[i], "caption": c} for i, c in enumerate(captions)])
    assert objective.plan(model, batch) is not None
    batch["attention_mask"] = batch["attention_mask"].flip(1)
    assert objective.plan(model, batch) is None


def test_micro_batches_get_their_own_plans(scenes):
    model = build_model("tiny-clip")
    objective = Objective(ClipTerm())
    batch = PlannedCollate(Collator(model, objective), objective, model, micro_batches=2)(
        [scenes[i] for i in range(8)])
    plans = batch[TEXT_PLAN]
    assert isinstance(plans, MicroPlans) and len(plans.plans) == 2
    parts = split_batch(batch, 2)
    for part, plan in zip(parts, plans.plans):
        assert part[TEXT_PLAN] is plan and plan.counts == (4,)
        assert plan.matches(objective.requests(part)[1])


class _EpochProbe(Term):
    name = "probe"
    produces = frozenset({"probe_epoch"})

    def __init__(self) -> None:
        super().__init__()
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def prepare(self, example):
        return {"probe_epoch": self.epoch}

    def collate(self, examples, model):
        return {"probe_epoch": torch.tensor([e["probe_epoch"] for e in examples])}


def test_the_epoch_reaches_the_terms_where_the_batch_is_collated(scenes):
    model = build_model("tiny-clip")
    probe = _EpochProbe()
    objective = Objective(ClipTerm(), [(probe, 0.0)])
    collate = PlannedCollate(Collator(model, objective), objective, model)
    batch = collate([{**scenes[i], EPOCH_KEY: 3} for i in range(2)])
    assert batch["probe_epoch"].tolist() == [3, 3] and probe.epoch == 3
    assert EPOCH_KEY not in batch


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
