"""QuickGELU MLPs through PyTorch's fused SiLU kernels.

OpenAI CLIP's MLP is ``fc2(quick_gelu(fc1(x)))`` with QuickGELU ``h * sigmoid(1.702 h)`` (Radford et al.
2021, the released code; transformers ``CLIPMLP`` with ``QuickGELUActivation``, open_clip's
``mlp = Sequential(c_fc, QuickGELU, c_proj)``). Written that way, autograd records a scalar product, a
sigmoid and a product: three element-wise passes forwards, four or five backwards, and two activation-sized
tensors kept per MLP (``h`` and ``sigmoid(1.702 h)``). On a CPU those passes are bound by memory bandwidth
and cost as much as a sixth of a CLIP step (``bench/structxlip.py``).

The same MLP is ``fc2'(silu(fc1'(x)))`` with ``fc1' = 1.702 * fc1`` (weight and bias) and
``fc2' = fc2 / 1.702`` (weight only): the scalings move onto the small weight matrices, and the activation
is one fused SiLU kernel each way with one saved tensor. :func:`use_fast_quick_gelu` switches the MLPs of a
model to that form when their linears are plain ``nn.Linear`` modules without hooks; with adapters (LoRA,
DoRA), quantised linears or hooks (DeepSpeed ZeRO-3 gathers weights in module hooks) the MLP runs its
linears as modules and only the activation changes, to ``silu(1.702 h) / 1.702``. Values agree with the
stock modules to float rounding (tests compare them at ``atol=1e-5``).

Nothing a user saves changes: the MLPs keep their class hierarchy (``isinstance(m, CLIPMLP)`` holds; the
swap is a subclass, as ``torch.nn.utils.parametrize`` does it), their parameter names and their configs, so
``state_dict``, ``save_pretrained`` output and adapters stay interchangeable with the stock models.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import QuickGELUActivation
from transformers.models.clip.modeling_clip import CLIPMLP

from finetune.models.backends.pooled_tower import hooked

QUICK_GELU_ALPHA = 1.702


class FastQuickGELU(nn.Module):
    """QuickGELU ``h * sigmoid(1.702 h)`` as ``silu(1.702 h) / 1.702``. Any shape in, the same shape out."""

    def forward(self, x: Tensor) -> Tensor:
        # SiLU's backward keeps its input, not its output, so dividing the output in place is safe
        return F.silu(x * QUICK_GELU_ALPHA).div_(QUICK_GELU_ALPHA)


def quick_gelu_mlp(x: Tensor, fc1: nn.Linear, fc2: nn.Linear) -> Tensor:
    """``fc2(quick_gelu(fc1(x)))`` with the 1.702 folded into the weights.

    Args:
        x: ``(..., D)``.
        fc1: ``D -> H`` linear. fc2: ``H -> D`` linear.

    Returns:
        ``(..., D)``.
    """
    bias = None if fc1.bias is None else fc1.bias * QUICK_GELU_ALPHA
    hidden = F.silu(F.linear(x, fc1.weight * QUICK_GELU_ALPHA, bias))
    return F.linear(hidden, fc2.weight / QUICK_GELU_ALPHA, fc2.bias)


def _foldable(fc1: nn.Module, fc2: nn.Module) -> bool:
    return all(type(m) is nn.Linear and not hooked(m) for m in (fc1, fc2))


class FastQuickGELUCLIPMLP(CLIPMLP):
    """transformers ``CLIPMLP`` (QuickGELU) through :func:`quick_gelu_mlp`. ``(B, L, D) -> (B, L, D)``."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        if _foldable(self.fc1, self.fc2):
            return quick_gelu_mlp(hidden_states, self.fc1, self.fc2)
        return super().forward(hidden_states)


class FastQuickGELUSequential(nn.Sequential):
    """open_clip's ``Sequential(c_fc, gelu, c_proj)`` MLP (QuickGELU) through :func:`quick_gelu_mlp`."""

    def forward(self, x: Tensor) -> Tensor:
        if _foldable(self.c_fc, self.c_proj):
            return quick_gelu_mlp(x, self.c_fc, self.c_proj)
        return super().forward(x)


def _open_clip_quick_gelu() -> tuple[type, ...]:
    try:
        from open_clip.transformer import QuickGELU
    except ImportError:  # open_clip is optional for transformers-only models
        return ()
    return (QuickGELU,)


def _is_open_clip_mlp(module: nn.Module, activations: tuple[type, ...]) -> bool:
    names = [name for name, _ in module.named_children()]
    return names == ["c_fc", "gelu", "c_proj"] and type(module.gelu) in activations


def use_fast_quick_gelu(module: nn.Module, fast: bool = True) -> int:
    """Switch the QuickGELU MLPs inside ``module`` (transformers ``CLIPMLP``, open_clip's ``c_fc/gelu/c_proj``
    blocks) to their fused form (``fast=False``: back to the stock classes and activations, e.g. to time the
    stock model). Other MLPs and activations are left alone. Call it before adapters are applied or after:
    an MLP whose linears are wrapped runs them as modules.

    Returns:
        How many MLPs were switched.
    """
    open_clip_gelu = _open_clip_quick_gelu()
    switched = 0
    for m in list(module.modules()):
        if fast and type(m) is CLIPMLP and type(m.activation_fn) is QuickGELUActivation:
            m.activation_fn, m.__class__ = FastQuickGELU(), FastQuickGELUCLIPMLP
        elif fast and type(m) is nn.Sequential and _is_open_clip_mlp(m, open_clip_gelu):
            m.gelu, m.__class__ = FastQuickGELU(), FastQuickGELUSequential
        elif not fast and type(m) is FastQuickGELUCLIPMLP:
            m.activation_fn, m.__class__ = QuickGELUActivation(), CLIPMLP
        elif not fast and type(m) is FastQuickGELUSequential and open_clip_gelu:
            m.gelu, m.__class__ = open_clip_gelu[0](), nn.Sequential
        else:
            continue
        switched += 1
    return switched
