"""How busy the training loop keeps the accelerator: steady samples/s, the share of time spent waiting for
data, and estimated FLOP/s and MFU, as torchtune and nanoGPT report tokens/s and MFU.

The loop reads its device tensors only at logging steps (:mod:`finetune.training.progress`), so a wall-clock
mark taken there is honest (the read waits for the device); :class:`LoopClock` keeps those marks and the
time the host spent waiting for the next batch, and gives the rates over the steady part of the run.

FLOPs are counted, not modelled: :func:`count_flops` runs one training step under
``torch.utils.flop_counter.FlopCounterMode``, which counts matrix products, convolutions and attention
(SDPA) forward and backward from their shapes; element-wise work (norms, activations, the optimiser) is
not counted, so the estimate is a slight under-count, as the usual ``6 N`` per token rule is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger("xlipkit")

__all__ = ["LoopClock", "Mark", "count_flops", "flop_rate", "peak_tflops", "throughput_summary", "PEAK_BF16_TFLOPS"]

#: dense bf16 tensor-core peak (TFLOP/s, no sparsity) of accelerators by a substring of
#: ``torch.cuda.get_device_name()``; vendor data sheets (H100/H200 SXM 989.4; H100 PCIe 756; A100 312)
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "GH200": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "RTX 4090": 165.2,
}


def peak_tflops(device: torch.device | str | None = None) -> float | None:
    """The dense bf16 peak of ``device`` in TFLOP/s (:data:`PEAK_BF16_TFLOPS`), or None when unknown (a CPU,
    an unlisted GPU)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():  # the more specific names first (H100 PCIe before H100)
        if key in name:
            return value
    return None


def count_flops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` once under ``FlopCounterMode`` and return ``(its result, FLOPs)`` (forward and backward of
    every matrix product, convolution and SDPA call it makes; one multiply-add = 2 FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, int(counter.get_total_flops())


@dataclass
class Mark:
    """The loop's state at one read: the step, the samples trained so far, the wall clock and the seconds
    spent waiting for data and outside training (checkpoints) so far."""

    step: int
    samples: int
    time_s: float
    wait_s: float
    excluded_s: float


@dataclass
class LoopClock:
    """Marks taken at the loop's reads and the time spent waiting for batches.

    Args:
        skip_steps: steps at the start that the steady rate leaves out (model warm-up, first compilations,
            the data loader's first batches): the steady window starts at the first mark at or after it.
        before_s: seconds the earlier parts of a resumed run trained.
    """

    skip_steps: int = 1
    marks: list[Mark] = field(default_factory=list)
    wait_s: float = 0.0
    excluded_s: float = 0.0
    before_s: float = 0.0
    _start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def trained_s(self) -> float:
        """Seconds spent training so far, over every part of the run: the earlier parts', then this part's wall clock
        without the time outside training (checkpoints)."""
        return self.before_s + self.elapsed() - self.excluded_s

    def mark(self, step: int, samples: int) -> None:
        """Record a read (call it after the device tensors were read, so that the device is done)."""
        self.marks.append(Mark(step, samples, self.elapsed(), self.wait_s, self.excluded_s))

    def steady(self) -> dict[str, float] | None:
        """``{"samples_per_s", "steps_per_s", "data_wait_share", "steps"}`` between the first mark at or after
        ``skip_steps`` and the last mark, time outside training (checkpoints) removed; None when that window
        holds no step."""
        first = next((m for m in self.marks if m.step >= self.skip_steps), None)
        if first is None or not self.marks or self.marks[-1].step <= first.step:
            return None
        last = self.marks[-1]
        seconds = (last.time_s - first.time_s) - (last.excluded_s - first.excluded_s)
        if seconds <= 0:
            return None
        waited = last.wait_s - first.wait_s
        return {"samples_per_s": (last.samples - first.samples) / seconds,
                "steps_per_s": (last.step - first.step) / seconds,
                "data_wait_share": min(1.0, waited / seconds),
                "steps": last.step - first.step,
                "first_step": first.step}


def flop_rate(tflops: float) -> str:
    """A FLOP rate with the unit that keeps its digits: ``"12.3 TFLOP/s"``, ``"45.6 GFLOP/s"`` (a CPU's small model,
    which ``"0.0 TFLOP/s"`` would hide), ``"7.8 MFLOP/s"``."""
    for unit, scale in (("TFLOP/s", 1.0), ("GFLOP/s", 1e-3), ("MFLOP/s", 1e-6)):
        if tflops >= scale:
            return f"{tflops / scale:.1f} {unit}"
    return f"{tflops * 1e12:.0f} FLOP/s"


def throughput_summary(clock: LoopClock, flops_per_step: int | None, *, batch_size: int, world_size: int,
                       device: torch.device, last_step: int) -> dict[str, Any]:
    """``TrainResult.throughput``: the steady rates of a run part (:meth:`LoopClock.steady`), FLOPs per sample,
    TFLOP/s per device and MFU where the device's peak is known (:func:`peak_tflops`); logged once.

    Args:
        clock: the loop's marks.
        flops_per_step: FLOPs of one step on one process (:func:`count_flops` of the first step), or None.
        batch_size: the global batch (``train.batch_size``); each device takes ``batch_size // world_size``.
        world_size: the number of processes.
        device: the training device.
        last_step: the last step trained (for the log line).
    """
    steady = clock.steady()
    out: dict[str, Any] = {"steady_samples_per_s": None, "data_wait_share": None, "steady_steps": 0,
                           "flops_per_sample": None, "tflops_per_device": None, "mfu": None,
                           "flops_counted_by": "torch.utils.flop_counter on the first step (matmul, conv, "
                                               "SDPA forward and backward)"}
    if flops_per_step:
        out["flops_per_sample"] = flops_per_step / (batch_size // world_size)
    if steady is not None:
        out.update(steady_samples_per_s=steady["samples_per_s"], data_wait_share=steady["data_wait_share"],
                   steady_steps=steady["steps"], steady_from_step=steady["first_step"])
        if flops_per_step:
            tflops = flops_per_step * steady["steps_per_s"] / 1e12
            out["tflops_per_device"] = tflops
            peak = peak_tflops(device)
            out["mfu"] = tflops / peak if peak else None
        log.info("steady throughput (steps %d-%d): %.1f samples/s, %.0f%% of the time waiting for data%s",
                 steady["first_step"], last_step, steady["samples_per_s"], 100 * steady["data_wait_share"],
                 f", {flop_rate(out['tflops_per_device'])} per device" if out["tflops_per_device"] else "")
    return out
