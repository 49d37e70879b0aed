"""Which parameters get no weight decay (DESIGN 6): biases, norms, positional tables, class tokens
and pooling queries, the logit scale and bias.

The text positional table must be on this list for Long-CLIP's frozen rows (``apply_kps`` with
``freeze_kept``): they get exactly zero gradient, so AdamW leaves them bit-identical only when no
decoupled weight decay touches them.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

_NO_DECAY = re.compile(
    r"(^|\.)(position_embedding|positional_embedding|pos_embed|class_embedding|cls_token|reg_token|"
    r"probe|latent|logit_scale|logit_bias)(\.weight)?$"
)


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the parameters to train without weight
    decay: every parameter with fewer than 2 dimensions (biases, norm weights, scalars) and the
    positional tables, class/register tokens, attention-pool queries and logit scale/bias."""
    return {name for name, p in model.named_parameters() if p.ndim < 2 or _NO_DECAY.search(name)}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW parameter groups over the trainable parameters: with ``weight_decay`` and
    without (:func:`no_weight_decay_names`). Empty groups are left out."""
    skip = no_weight_decay_names(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name in skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
