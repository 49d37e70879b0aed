"""Which parameters get no weight decay (DESIGN 6), the one rule of the trainer and of a plain loop:
biases, norms and every other parameter with fewer than 2 dimensions, positional tables, class and
register tokens, pooling queries, the logit scale and bias.

The text positional table must be on this list for Long-CLIP's frozen rows (``apply_kps`` with
``freeze_kept``): they get exactly zero gradient, so AdamW leaves them bit-identical only when no
decoupled weight decay touches them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

_NO_DECAY = re.compile(
    r"(^|\.)(position_embedding|positional_embedding|pos_embed|class_embedding|cls_token|reg_token|"
    r"probe|latent|logit_scale|logit_bias)(\.weight)?$"
)
#: substrings of a (lower-cased) name that mark a parameter as a norm, a positional table or a logit parameter
_NO_DECAY_PARTS = ("norm", "position", "logit_scale", "logit_bias")


def skips_weight_decay(name: str, param: Tensor) -> bool:
    """Whether the parameter ``name`` (as in ``named_parameters()``, any prefix) trains without weight
    decay: fewer than 2 dimensions (biases, norm weights, scalars), a name ending in ``.bias``, containing
    ``norm``, ``position``, ``logit_scale`` or ``logit_bias``, or naming a class/register token or an
    attention-pool query (``probe``, ``latent``)."""
    lname = name.lower()
    return (
        param.ndim < 2
        or lname.endswith(".bias")
        or any(part in lname for part in _NO_DECAY_PARTS)
        or _NO_DECAY.search(name) is not None
    )


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the parameters to train without weight decay
    (:func:`skips_weight_decay`)."""
    return {name for name, p in model.named_parameters() if skips_weight_decay(name, p)}


def param_groups(
    model: nn.Module, weight_decay: float, extra_no_decay: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """Two AdamW parameter groups over the trainable parameters of ``model`` (a ``DualEncoder``, or the
    trainer's model + objective module): ``[{"params": decayed, "weight_decay": weight_decay},
    {"params": rest, "weight_decay": 0.0}]``, ``rest`` by :func:`skips_weight_decay` plus the names in
    ``extra_no_decay``. Empty groups are left out."""
    extra = set(extra_no_decay)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name in extra or skips_weight_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
