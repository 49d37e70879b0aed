"""The optimiser and its schedule (DESIGN 6): AdamW over parameter groups without weight decay on biases, norms,
positional tables and the logit scale and bias, fused where the device has it; linear warmup, then cosine to
``train.min_lr`` or constant."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from finetune.models.weight_decay import param_groups

__all__ = ["build_optimizer", "build_scheduler", "lr_lambda"]


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base lr at step ``s``: linear warmup, then cosine to ``min_ratio`` or constant."""

    def f(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_optimizer(module: nn.Module, cfg: Any, extra_no_decay: set[str] = frozenset()) -> torch.optim.Optimizer:
    """AdamW over :func:`finetune.models.weight_decay.param_groups`; fused when ``cfg.fused_optimizer`` allows and
    the device has it."""
    groups = param_groups(module, cfg.weight_decay, extra_no_decay)
    fused = cfg.fused_optimizer
    if fused == "auto":
        params = [p for g in groups for p in g["params"]]
        fused = all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params) and all(
            p.device.type in ("cpu", "cuda", "xpu", "mps") for p in params
        )
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=bool(fused) or None
    )



def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Any,
                    total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The recipe's schedule over ``total_steps`` optimiser steps (:func:`lr_lambda`; ``cfg`` is ``train``)."""
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.schedule, cfg.warmup_steps, total_steps, min_ratio)
    )
