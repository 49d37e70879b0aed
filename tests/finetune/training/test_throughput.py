"""Throughput bookkeeping: FLOPs counted from shapes, the steady window of the loop's marks, and what a run
reports."""

from __future__ import annotations

import pytest
import torch

from finetune.training.throughput import LoopClock, Mark, count_flops, peak_tflops


def test_flops_of_a_linear_layer_forward_and_backward():
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)

    def step():
        layer(x).sum().backward()

    _, flops = count_flops(step)
    # forward 2*16*64*32; backward: the input gradient and the weight gradient, the same again each
    assert flops == 3 * 2 * 16 * 64 * 32


def test_steady_window_starts_at_the_first_mark_after_the_skipped_steps():
    clock = LoopClock(skip_steps=3)
    clock.marks = [Mark(0, 0, 0.0, 0.0, 0.0), Mark(1, 8, 5.0, 4.0, 0.0), Mark(10, 80, 6.0, 4.2, 0.0),
                   Mark(20, 160, 8.5, 4.4, 0.5), Mark(30, 240, 10.5, 4.6, 0.5)]
    steady = clock.steady()
    # steps 10-30: 160 samples in 4.5 s minus 0.5 s of checkpoint; 0.4 s waiting for data
    assert steady["first_step"] == 10 and steady["steps"] == 20
    assert steady["samples_per_s"] == pytest.approx(160 / 4.0)
    assert steady["data_wait_share"] == pytest.approx(0.4 / 4.0)
    assert LoopClock(skip_steps=40, marks=clock.marks).steady() is None


def test_no_peak_is_claimed_for_a_cpu():
    assert peak_tflops("cpu") is None


def test_a_cpu_run_logs_its_flop_rate_in_a_unit_that_shows_it(caplog):
    """A small model on a CPU does about 0.02 TFLOP/s: the log says "20.0 GFLOP/s", never "0.0 TFLOP/s"."""
    from finetune.training.throughput import flop_rate, throughput_summary

    assert [flop_rate(t) for t in (312.04, 0.02, 4e-5, 3e-10)] == ["312.0 TFLOP/s", "20.0 GFLOP/s", "40.0 MFLOP/s",
                                                                   "300 FLOP/s"]
    clock = LoopClock(skip_steps=1, marks=[Mark(1, 16, 1.0, 0.0, 0.0), Mark(11, 176, 11.0, 0.0, 0.0)])
    with caplog.at_level("INFO", logger="xlipkit"):
        out = throughput_summary(clock, 20_000_000_000, batch_size=16, world_size=1, device=torch.device("cpu"),
                                 last_step=11)
    assert out["tflops_per_device"] == pytest.approx(0.02) and out["mfu"] is None
    assert "20.0 GFLOP/s per device" in caplog.text and "TFLOP/s" not in caplog.text
