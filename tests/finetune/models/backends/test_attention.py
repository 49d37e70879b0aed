"""train.attention (finetune.models.backends.attention): the backends each setting enables, in order, per device; the
context restricts what SDPA runs; the run logs the setting and records it with the first step's kernels."""

from __future__ import annotations

import pytest
import torch

from finetune.models.backends.attention import SdpaCalls, attention_backends, attention_context, describe_attention


def test_each_setting_enables_its_backends_in_order():
    assert attention_backends("auto", "cuda") == ["flash", "efficient", "cudnn", "math"]
    assert attention_backends("cudnn", "cuda") == ["cudnn", "flash", "efficient", "math"]
    assert attention_backends("efficient", "cuda:0") == ["efficient", "flash", "cudnn", "math"]
    assert attention_backends("math", "cuda") == ["math"]
    assert attention_backends("auto", "cpu") is None and attention_backends("torch", "cuda") is None
    assert attention_backends("flash", "cpu") == ["flash", "math"]
    assert describe_attention("auto", "cpu") == {"setting": "auto", "device": "cpu", "order": "pytorch's own choice"}
    with pytest.raises(ValueError, match="train.attention: 'fast' is not one of auto, torch, flash"):
        attention_backends("fast", "cpu")


def _causal_call() -> tuple:
    q = torch.randn(2, 2, 5, 8)
    return q, q.clone(), q.clone()


@pytest.mark.parametrize("choice,kernel", [("auto", "flash"), ("flash", "flash"), ("math", None)])
def test_the_context_decides_what_sdpa_runs_on_the_cpu(choice, kernel):
    """On the CPU: flash for masked and causal calls alike unless math is asked for (math decomposes into matrix
    products and a softmax: no fused kernel is seen); values the same either way."""
    q, k, v = _causal_call()
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    with attention_context(choice, "cpu"), SdpaCalls() as calls:
        causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert dict(calls.kernels) == ({kernel: 2} if kernel else {})
    if kernel:
        assert calls.shapes == [(kernel, (2, 2, 5, 8), (2, 2, 5, 8), None), (kernel, (2, 2, 5, 8), (2, 2, 5, 8),
                                                                            (2, 1, 5, 5))]
    torch.testing.assert_close(causal, masked)


def test_a_run_logs_and_records_its_attention_backend(tmp_path, caplog):
    from tests.finetune.training.test_trainer import _trainer, scenes, train  # noqa: F401

    from finetune.data.sources import load_source

    rows = load_source({"name": "synthetic", "size": 16, "seed": 0, "options": {"image_size": 32}}).dataset
    with caplog.at_level("INFO", logger="xlipkit"):
        loop = _trainer(tmp_path, rows, max_steps=2, attention="math")
    assert "train.attention: math on cpu (backends in order: math)" in caplog.text
    result = train(loop)
    attention = result.throughput["attention"]
    assert attention["setting"] == "math" and attention["order"] == ["math"]
    assert attention["first_step_kernels"] == "math (or none fused)"  # the context held during the step
    default = train(_trainer(tmp_path / "auto", rows, max_steps=1)).throughput["attention"]
    assert default["setting"] == "auto" and default["first_step_kernels"]["flash"] > 0
