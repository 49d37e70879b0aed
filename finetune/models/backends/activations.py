"""QuickGELU through PyTorch's fused SiLU kernel, with the stock weights as they are.

OpenAI CLIP's MLP is ``fc2(quick_gelu(fc1(x)))`` with QuickGELU ``h * sigmoid(1.702 h)`` (Radford et al.
2021, the released code; transformers ``CLIPMLP`` with ``QuickGELUActivation``, open_clip's
``mlp = Sequential(c_fc, QuickGELU, c_proj)``). Written that way, autograd records a scalar product, a
sigmoid and a product (three element-wise kernels forwards, four backwards) and keeps two activation-sized
tensors per MLP (``h`` and ``sigmoid(1.702 h)``).

:class:`FastQuickGELU` computes the same function as ``silu(1.702 h) / 1.702`` (``silu(z) = z sigmoid(z)``):
three element-wise kernels forwards (the scale, the fused SiLU, an in-place division) and three backwards, one
saved tensor. Values agree with the stock activation to float rounding (tests compare them at ``atol=1e-6``).

The weights are not touched at any call. An earlier form folded the 1.702 into the linears' weights at every
call (``fc1.weight * 1.702``, ``fc2.weight / 1.702``): three extra element-wise ops per MLP forwards and three
backwards, and under autocast three casts of non-leaf weights that autocast's weight-cast cache (leaf tensors
only) cannot keep, 528 ops per step of a 12 + 12-layer CLIP (issue 29). Folding once per optimiser step instead
would save the activation's scale and division but re-run at every step and needs a cache keyed on the
parameters' versions; the activation form has fewer ops per step than either (``bench/shapes.py``). The
optimiser sees the stock parameters, and the MLPs keep their class, parameter names and configs, so
``state_dict``, ``save_pretrained`` output and adapters stay interchangeable with the stock models; adapters
(LoRA, DoRA) and hooks on the linears work unchanged, since the linears run as modules.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import QuickGELUActivation
from transformers.models.clip.modeling_clip import CLIPMLP

QUICK_GELU_ALPHA = 1.702


class FastQuickGELU(nn.Module):
    """QuickGELU ``h * sigmoid(1.702 h)`` as ``silu(1.702 h) / 1.702``. Any shape in, the same shape out."""

    def forward(self, x: Tensor) -> Tensor:
        # SiLU's backward keeps its input, not its output, so dividing the output in place is safe
        return F.silu(x * QUICK_GELU_ALPHA).div_(QUICK_GELU_ALPHA)


def _open_clip_quick_gelu() -> tuple[type, ...]:
    try:
        from open_clip.transformer import QuickGELU
    except ImportError:  # open_clip is optional for transformers-only models
        return ()
    return (QuickGELU,)


def _is_open_clip_mlp(module: nn.Module) -> bool:
    return type(module) is nn.Sequential and [name for name, _ in module.named_children()] == ["c_fc", "gelu", "c_proj"]


def use_fast_quick_gelu(module: nn.Module, fast: bool = True) -> int:
    """Switch the QuickGELU activations of the MLPs inside ``module`` (transformers ``CLIPMLP``, open_clip's
    ``c_fc/gelu/c_proj`` blocks) to :class:`FastQuickGELU` (``fast=False``: back to the stock activations, e.g.
    to time the stock model). Other MLPs and activations are left alone; the linears and their weights are not
    touched, so it may be called before adapters are applied or after.

    Returns:
        How many activations were switched.
    """
    open_clip_gelu = _open_clip_quick_gelu()
    stock = (QuickGELUActivation, *open_clip_gelu)
    switched = 0
    for m in list(module.modules()):
        if isinstance(m, CLIPMLP):
            name = "activation_fn"
        elif _is_open_clip_mlp(m):
            name = "gelu"
        else:
            continue
        current = type(getattr(m, name))
        if fast and current in stock:
            setattr(m, name, FastQuickGELU())
        elif not fast and current is FastQuickGELU and (isinstance(m, CLIPMLP) or open_clip_gelu):
            setattr(m, name, QuickGELUActivation() if isinstance(m, CLIPMLP) else open_clip_gelu[0]())
        else:
            continue
        switched += 1
    return switched
