"""The scaled-dot-product-attention backend of a training run (``train.attention``), chosen explicitly.

What the towers pass to ``torch.nn.functional.scaled_dot_product_attention``:

- CLIP text tower (transformers, :mod:`finetune.models.backends.pooled_tower`): layers ``1 .. L-1`` with
  ``is_causal=True`` and no mask when the rows are right-padded (the fixed-shape path), the last layer for the
  pooled token with an additive ``(B, 1, 1, L)`` mask; with token states (GRM, FAST-GOAL) every layer with a
  boolean ``(B, 1, L, L)`` causal-and-padding mask;
- image towers: no mask; open_clip / FLAIR / F-CAST towers go through ``nn.MultiheadAttention``, which calls SDPA
  with its additive mask (causal text) or key-padding mask merged into one.

Which backends take which calls (PyTorch's ``sdp_utils.cpp`` / ``sdp_utils_cpp.cpp``, the selection that
torch 2.14 runs): on CUDA, flash attention refuses any ``attn_mask`` (``check_for_attn_mask``) and takes
``is_causal`` for square query/key lengths only; memory-efficient and cuDNN attention take both a mask and
``is_causal``; math takes everything. PyTorch's own order on CUDA is flash, efficient, math, except on sm90 /
sm10x with cuDNN > 9.15, where cuDNN comes first (``check_prefer_cudnn_attention``; the environment variable
``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` turns that off). cuDNN builds an execution graph for every new shape.
On the CPU there are two: flash (``_scaled_dot_product_flash_attention_for_cpu``, which takes a mask and
``is_causal``, not dropout) and math; the CPU ignores a priority order.

``train.attention``:

- ``auto`` (the default): on CUDA flash, then efficient (the masked calls), then cuDNN, then math; elsewhere
  PyTorch's own choice. Flash and efficient need no per-shape graph; with the run's planned shapes cuDNN pays
  its graph builds in the warm-up before the first step only, and whether it is then faster on sm90 is not
  measured here (no GPU in the session that wrote this; ``bench/loop.py`` is where to measure it);
- ``flash`` / ``efficient`` / ``cudnn`` / ``math``: that backend first, then the rest in ``auto``'s order (calls it
  cannot take fall through to the next), ``math`` alone;
- ``torch``: PyTorch's own choice (no context).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ATTENTION_CHOICES", "SdpaCalls", "attention_backends", "attention_context", "describe_attention"]

ATTENTION_CHOICES = ("auto", "torch", "flash", "efficient", "cudnn", "math")
_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
_AUTO_CUDA = ("flash", "efficient", "cudnn", "math")
#: the aten ops of each fused backend (forward); the math backend decomposes into matmuls and a softmax
KERNELS = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_flash_attention_for_cpu": "flash",
           "_scaled_dot_product_efficient_attention": "efficient", "_scaled_dot_product_cudnn_attention": "cudnn",
           "_scaled_dot_product_fused_attention_overrideable": "overrideable"}


def attention_backends(choice: str, device: torch.device | str) -> list[str] | None:
    """The backends ``choice`` enables on ``device``, in priority order, or None for PyTorch's own choice.

    Raises:
        ValueError: an unknown ``choice`` (naming ``train.attention`` and the choices).
    """
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"train.attention: {choice!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    cuda = torch.device(device).type == "cuda"
    if choice == "torch" or (choice == "auto" and not cuda):
        return None
    if choice == "auto":
        return list(_AUTO_CUDA)
    if choice == "math":
        return ["math"]
    return [choice, *(b for b in _AUTO_CUDA if b != choice)] if cuda else [choice, "math"]


def attention_context(choice: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context that runs SDPA with the backends of :func:`attention_backends` (their order as priority)."""
    names = attention_backends(choice, device)
    if names is None:
        return contextlib.nullcontext()
    return sdpa_kernel([_BACKENDS[n] for n in names], set_priority=True)


def describe_attention(choice: str, device: torch.device | str) -> dict[str, Any]:
    """What the log and ``metrics.json`` record: the setting, the device type and the backend order in effect."""
    names = attention_backends(choice, device)
    return {"setting": choice, "device": torch.device(device).type,
            "order": names if names is not None else "pytorch's own choice"}


class SdpaCalls(TorchDispatchMode):
    """Counts the fused SDPA kernels that run while active and the shapes they run at (forward calls):
    ``kernels`` ``{flash: n, ...}`` and ``shapes`` ``[(kernel, query shape, key shape, mask shape or None)]``.
    Calls the math backend runs are not seen (it decomposes before the dispatcher reaches this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter = Counter()
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kernel = KERNELS.get(func.overloadpacket.__name__)
        if kernel is not None:
            mask = kwargs.get("attn_mask")  # flash for CPU: a keyword; efficient / cuDNN: ``attn_bias``, 4th
            if kernel in ("efficient", "cudnn") and len(args) > 3:
                mask = args[3]
            self.kernels[kernel] += 1
            self.shapes.append((kernel, tuple(args[0].shape), tuple(args[1].shape),
                                tuple(mask.shape) if isinstance(mask, torch.Tensor) else None))
        return func(*args, **kwargs)
