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


def warmup_problem(cfg: Any, total_steps: int, how: str) -> str | None:
    """What is wrong with a warm-up that does not end before the run does, or None when it does.

    With ``train.warmup_steps >= total_steps`` the linear warm-up of :func:`lr_lambda` covers the whole run: the
    learning rate of the last step is ``lr * total_steps / warmup_steps`` (``warmup_steps: 1000`` with 4 steps
    trains at 0.4 % of ``train.lr``) and the cosine decay never starts. The run is allowed (a smoke run of a few
    steps does this on purpose); the message says so before anything slow starts.

    Args:
        cfg: the recipe's ``train`` section.
        total_steps: the run's optimiser steps.
        how: where the total comes from, for the message (``"train.max_steps=4"``, ...).
    Returns:
        the message, naming the keys and the learning rate the run will reach, or None.
    """
    warmup = int(cfg.warmup_steps or 0)
    if not warmup or total_steps <= 0 or warmup < total_steps:
        return None
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    peak = cfg.lr * lr_lambda(cfg.schedule, warmup, total_steps, min_ratio)(total_steps - 1)
    decay = ", and the cosine decay never starts" if cfg.schedule == "cosine" else ""
    return (f"train.warmup_steps={warmup} is not below the run's {total_steps} optimiser steps ({how}): the learning "
            f"rate rises for the whole run and reaches {peak:.3g} at the last step, not train.lr={cfg.lr:g}{decay}. "
            f"Lower train.warmup_steps below {total_steps} (about a tenth of the steps is usual) or train longer.")


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
