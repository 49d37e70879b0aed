"""DevicePrefetcher: batches leave the workers unpinned and reach the device whole (nested dicts, lists, host
metadata with a ``to`` method), one after the other, their uint8 pixels normalised there; the training loader neither
pins nor places batches."""

from __future__ import annotations

import torch

from finetune.data.prefetch import DevicePrefetcher, record_stream
from finetune.objectives.planning import MicroPlans


def _batch(i: int) -> dict:
    plan = MicroPlans([torch.tensor([1, 0]), 2])  # host metadata holding a tensor, moved with the batch
    return {"ids": [f"a{i}", f"b{i}"], "input_ids": torch.full((2, 3), i), "image_inputs": {"pixel_values":
            torch.zeros(2, 3, 4, 4, dtype=torch.uint8)}, "plan": plan}


def test_every_batch_reaches_the_device_whole_and_in_order():
    out = list(DevicePrefetcher([_batch(0), _batch(1), _batch(2)], "meta"))
    assert [b["ids"] for b in out] == [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]]
    for b in out:
        assert b["input_ids"].device.type == "meta"
        assert b["image_inputs"]["pixel_values"].device.type == "meta"
        assert b["image_inputs"]["pixel_values"].dtype == torch.uint8  # no PixelNorm given: left as it is
        assert b["plan"].plans[0].device.type == "meta" and b["plan"].plans[1] == 2


def test_uint8_pixels_reach_the_step_normalised_on_the_device():
    """The tensor path's uint8 pixels (with their PixelNorm) are normalised where the batch lands, so the step gets
    the model's float pixels: the values the processor would give, and the norm metadata gone."""
    from finetune.data.collate import PIXEL_NORM
    from finetune.data.images import PixelNorm

    norm = PixelNorm(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    pixels = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    [out] = list(DevicePrefetcher([{**_batch(0), "image_inputs": {"pixel_values": pixels}, PIXEL_NORM: norm}], "cpu"))
    mean, std = torch.tensor(norm.mean).view(3, 1, 1), torch.tensor(norm.std).view(3, 1, 1)
    assert PIXEL_NORM not in out and out["image_inputs"]["pixel_values"].dtype == torch.float32
    torch.testing.assert_close(out["image_inputs"]["pixel_values"], (pixels / 255.0 - mean) / std)


class _Placed(torch.Tensor):
    """A tensor that says it is on CUDA (or not) and records the streams it is marked as used on: the caching
    allocator's bookkeeping that :func:`record_stream` must reach for every CUDA tensor of a batch."""

    def __new__(cls, cuda: bool) -> "_Placed":
        tensor = torch.Tensor._make_subclass(cls, torch.zeros(2))
        tensor.cuda_, tensor.streams = cuda, []
        return tensor

    @property
    def is_cuda(self) -> bool:
        return self.cuda_

    def record_stream(self, stream) -> None:
        if not self.cuda_:  # torch refuses a host tensor: record_stream must never call it on one
            raise RuntimeError("record_stream on a host tensor")
        self.streams.append(stream)


def test_record_stream_marks_every_cuda_tensor_of_a_batch_and_no_host_tensor():
    """A CUDA tensor left unmarked could have its memory handed out again while the step still reads it: every one
    is marked, in nested dicts, lists, tuples and the dataclasses of host metadata (the plans)."""
    stream = object()
    on_device = [_Placed(True) for _ in range(5)]
    on_host = [_Placed(False) for _ in range(3)]
    batch = {"input_ids": on_device[0], "image_inputs": {"pixel_values": on_device[1], "sizes": on_host[0]},
             "regions": [on_device[2], (on_host[1], on_device[3])], "plan": MicroPlans([on_device[4], on_host[2], 2]),
             "ids": ["a", "b"]}
    record_stream(batch, stream)
    assert [t.streams for t in on_device] == [[stream]] * 5
    assert [t.streams for t in on_host] == [[]] * 3


def test_the_training_loader_neither_pins_nor_places_batches(tmp_path):
    """Pinned batches cost a cudaHostAlloc per batch in flight on a GPU (finetune.data.prefetch); the loop moves
    host batches itself."""
    from tests.finetune.training.test_trainer import _counting_trainer

    loop = _counting_trainer(tmp_path, {"base": "clip"}, size=16)
    assert loop.batches.loader.pin_memory is False
    assert loop.batches.loader.device is None  # accelerate does not move the batches: DevicePrefetcher does
