"""DevicePrefetcher: batches leave the workers unpinned and reach the device whole (nested dicts, lists, host
metadata with a ``to`` method), one after the other; the training loader neither pins nor places batches."""

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
        assert b["image_inputs"]["pixel_values"].dtype == torch.uint8  # normalised on the device, in the step
        assert b["plan"].plans[0].device.type == "meta" and b["plan"].plans[1] == 2


def test_record_stream_leaves_host_tensors_and_walks_dataclasses():
    # no CUDA here: record_stream must walk the batch and touch only CUDA tensors (none), without failing
    record_stream(_batch(0), None)


def test_the_training_loader_neither_pins_nor_places_batches(tmp_path):
    """Pinned batches cost a cudaHostAlloc per batch in flight on a GPU (finetune.data.prefetch); the loop moves
    host batches itself."""
    from tests.finetune.test_train import _counting_trainer

    trainer = _counting_trainer(tmp_path, {"base": "clip"}, size=16)
    assert trainer.loader.pin_memory is False
    assert trainer.loader.device is None  # accelerate does not move the batches: DevicePrefetcher does
