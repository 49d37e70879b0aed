"""Moving batches to the accelerator without stalling the step (DESIGN 6: the loop never waits on the host).

``DataLoader(pin_memory=True)`` page-locks every batch in flight with its own ``cudaHostAlloc`` (38 MB of uint8
pixels per batch of 256 at 224 px; 8 workers x 4 prefetched batches in flight). Measured on an H200 (torch 2.11,
``bench/loop.py`` CLIP ViT-B/16, batch 256): 70 ``cudaHostAlloc`` calls of about 7 ms each in four steps, each
holding the driver's lock while the training thread tried to launch kernels, so that the loop's steps took
0.4-1.2 s against 0.19-0.21 s for the same step on batches already on the device.

:class:`DevicePrefetcher` instead copies each batch from pageable memory on a side CUDA stream (the pattern of
timm's ``PrefetchLoader`` and NVIDIA's data prefetcher): a copy from pageable memory first waits for its own
stream, which is idle, not for the step the device is running; the host then stages the bytes (milliseconds)
while the device computes, and the training stream waits for the copy on the device (``wait_stream``), not on
the host. Off CUDA the batch is moved as it is. Either way its ``uint8`` pixels are then normalised where they
are (:func:`~finetune.data.collate.normalize_pixels`): what reaches the step is ready for the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .collate import normalize_pixels

__all__ = ["DevicePrefetcher", "record_stream"]


def record_stream(obj: Any, stream: torch.cuda.Stream) -> None:
    """Mark every CUDA tensor in ``obj`` (nested dicts, lists, tuples, dataclasses with tensor fields) as used on
    ``stream``, so that the caching allocator does not hand its memory out again before ``stream`` is done with it
    (the tensors were allocated on the copy stream)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, dict):
        for value in obj.values():
            record_stream(value, stream)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            record_stream(value, stream)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            record_stream(getattr(obj, name), stream)


class DevicePrefetcher:
    """Iterate ``batches`` (CPU batches of a data loader) as batches on ``device``, ready for the model.

    On CUDA each batch is copied with ``non_blocking`` on a side stream from pageable memory; the current stream
    waits for that copy on the device before the batch is yielded, and the batch's tensors are recorded on it.
    On any other device the batch is moved with :func:`accelerate.utils.send_to_device`. Its ``uint8`` pixels are
    normalised on the device (:func:`~finetune.data.collate.normalize_pixels`).

    Args:
        batches: an iterable of batches (dicts of tensors, lists, host metadata with a ``to`` method); empty when
            the caller moves batches one by one (:meth:`move`).
        device: where the step runs.
    """

    def __init__(self, batches: Iterable[dict[str, Any]], device: torch.device | str) -> None:
        self.batches = batches
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def move(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One batch on the device (the class docstring)."""
        from accelerate.utils import send_to_device

        if self.stream is None:
            return normalize_pixels(send_to_device(batch, self.device))
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            moved = send_to_device(batch, self.device, non_blocking=True)
        main.wait_stream(self.stream)
        record_stream(moved, main)
        return normalize_pixels(moved)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.batches:
            yield self.move(batch)
