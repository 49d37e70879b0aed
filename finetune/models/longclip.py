"""Long-CLIP knowledge-preserving stretching (KPS) of the text positions.

Long-CLIP (Zhang et al., 2024), section 3.1, "Knowledge-Preserved Stretching": the first ``keep``
(20) rows of the pretrained positional table are kept, since they are well trained; the rest are
interpolated by a ratio (4), which turns CLIP's 77 positions into ``20 + 4·(77-20) = 248``. DESIGN 4
fixes the exact rule, including the extrapolated tail of the official code (``model/longclip.py``
L228-255), and the frozen kept rows. SigLIP tables (64 rows) reach 248 with ratio 6, cut to 248.

Two deviations from the public code are deliberate (DESIGN 5): the stretch is computed in float32
whatever the model dtype (Long-CLIP computes it in fp16 at load time), and the model's config,
position ids and tokenizer are updated so that a saved model reloads with its 248 positions (the
StructXLIP/GOAL code leaves ``max_position_embeddings`` at 77 and needs ``strict=False``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from finetune.models.core.encoder import DualEncoder

#: Long-CLIP's defaults (paper 3.1): keep 20 rows, stretch CLIP's 77 positions to 248
DEFAULT_LENGTH = 248
DEFAULT_KEEP = 20
DEFAULT_RATIO = 4


def kps_ratio(n: int, keep: int, length: int) -> int:
    """The smallest integer ratio whose stretched table (``keep + ratio·(n-keep)`` rows) reaches
    ``length``: 4 for 77 -> 248, 6 for 64 -> 248."""
    return max(1, math.ceil((length - keep) / (n - keep)))


def stretch_positions(
    table: Tensor, *, keep: int = DEFAULT_KEEP, ratio: int | None = None, length: int | None = None
) -> Tensor:
    """Stretch a positional table ``(n, W)`` to ``(length, W)`` (Long-CLIP 3.1, DESIGN 4).

    Rows ``< keep`` are copied. Each later gap ``(old[i], old[i+1])``, ``keep <= i < n-1``, is
    filled by ``ratio`` rows ``((ratio-r)·old[i] + r·old[i+1]) / ratio``, ``r = 0..ratio-1``; the
    last ``ratio`` rows extrapolate from the last two old rows, ``old[-1] + k·(old[-1]-old[-2])
    / ratio``, ``k = 0..ratio-1``. That gives ``keep + ratio·(n-keep)`` rows (77 -> 248 with
    ratio 4), cut to ``length``.

    Args:
        table: ``(n, W)`` pretrained positional embeddings, ``n >= 2``.
        keep: rows copied unchanged, ``0 <= keep < n``.
        ratio: rows per old gap; ``None``: 4 when ``length`` is None, else the smallest integer
            ratio that reaches ``length`` (:func:`kps_ratio`).
        length: rows of the result; ``None``: ``keep + ratio·(n-keep)``.

    Returns:
        ``(length, W)`` in ``table``'s dtype (computed in float32, or float64 for float64 input).

    Raises:
        ValueError: on a table that is not 2-D or has fewer than 2 rows, ``keep`` outside
            ``[0, n-1]``, ``ratio < 1``, ``length < n``, or a ``ratio`` too small for ``length``.
    """
    if table.ndim != 2 or table.shape[0] < 2:
        raise ValueError(f"stretch_positions needs a (n, W) table with n >= 2 rows, got shape {tuple(table.shape)}")
    n = table.shape[0]
    if not 0 <= keep <= n - 1:
        raise ValueError(f"keep={keep} must be between 0 and {n - 1} for a table of {n} rows")
    if length is not None and length < n:
        raise ValueError(f"length={length} is shorter than the table ({n} rows): KPS only lengthens")
    if ratio is None:
        ratio = DEFAULT_RATIO if length is None else kps_ratio(n, keep, length)
    if ratio < 1:
        raise ValueError(f"ratio must be a positive integer, got {ratio}")
    full = keep + ratio * (n - keep)
    if length is None:
        length = full
    elif full < length:
        raise ValueError(
            f"ratio={ratio} stretches {n} rows (keep={keep}) to {full}, fewer than length={length}: "
            f"use ratio >= {kps_ratio(n, keep, length)} or leave ratio unset"
        )

    work = table.detach().to(torch.float64 if table.dtype == torch.float64 else torch.float32)
    a, b = work[keep : n - 1], work[keep + 1 : n]
    r = torch.arange(ratio, dtype=work.dtype, device=work.device).view(1, ratio, 1)
    gaps = ((ratio - r) * a[:, None] + r * b[:, None]) / ratio
    k = torch.arange(ratio, dtype=work.dtype, device=work.device).view(ratio, 1)
    tail = work[-1] + k * (work[-1] - work[-2]) / ratio
    out = torch.cat([work[:keep], gaps.reshape(-1, work.shape[1]), tail], dim=0)
    return out[:length].to(table.dtype)


def freeze_rows(embeds: Tensor, positions: Tensor, keep: int) -> Tensor:
    """Cut the gradient of positional embeddings looked up at positions ``< keep``.

    Args:
        embeds: ``(..., L, W)`` rows of the positional table for ``positions``.
        positions: ``(..., L)`` (broadcastable) position ids.
        keep: rows below this index get no gradient.

    Returns:
        ``embeds`` with the same values; the table's rows ``< keep`` receive exactly zero gradient,
        so Adam (with no weight decay on the table) leaves them bit-identical (Long-CLIP 3.1 freezes
        them; its code builds ``pe·mask1 + pe_res·mask2`` for the same effect).
    """
    frozen = (positions < keep).unsqueeze(-1)
    return torch.where(frozen, embeds.detach(), embeds)


class FrozenRowsHook:
    """Forward hook for a positional ``nn.Embedding`` that applies :func:`freeze_rows`.

    A plain object (not a closure), so it survives ``copy.deepcopy`` and peft's
    ``modules_to_save`` copies of the module.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> Tensor:
        positions = inputs[0]
        return freeze_rows(output, positions, self.keep)


def sync_frozen_rows_hook(embedding: nn.Module, kps: dict[str, Any] | None) -> None:
    """(Re)install :class:`FrozenRowsHook` on ``embedding`` to match ``kps`` settings: one hook when
    ``kps["freeze_kept"]`` and ``kps["keep"] > 0``, none otherwise."""
    for key, hook in list(embedding._forward_hooks.items()):
        if isinstance(hook, FrozenRowsHook):
            del embedding._forward_hooks[key]
    if kps and kps.get("freeze_kept") and kps.get("keep", 0) > 0:
        embedding.register_forward_hook(FrozenRowsHook(int(kps["keep"])))


def apply_kps(
    model: DualEncoder,
    length: int = DEFAULT_LENGTH,
    keep: int = DEFAULT_KEEP,
    ratio: int | None = None,
    freeze_kept: bool = True,
) -> DualEncoder:
    """Stretch a model's text positions to ``length`` with :func:`stretch_positions`, in place.

    Updates everything that knows the text length (the backend's ``resize_text_positions``:
    position ids, open_clip's causal mask and context length, ``config.max_position_embeddings``,
    the tokenizer's ``model_max_length``, ``model.max_text_len``) and records the settings in
    ``model.kps``, which ``save_pretrained`` writes into the model's config so that ``load_model``
    restores them. With ``freeze_kept`` the first ``keep`` rows get no gradient (Long-CLIP 3.1);
    list the table in :func:`finetune.models.no_weight_decay_names` so that weight decay leaves
    them alone too.

    Args:
        model: a DualEncoder without an adapter (stretch first, then add LoRA/DoRA).
        length: target number of text positions (Long-CLIP: 248).
        keep: rows kept as they are (Long-CLIP: 20).
        ratio: see :func:`stretch_positions`.
        freeze_kept: keep rows ``< keep`` fixed during training.

    Returns:
        ``model`` itself, stretched (unchanged when it already has ``length`` positions and no
        stretch is needed).

    Raises:
        ValueError: when the model already carries an adapter, was already stretched with other
            settings (calling again with the same settings is a no-op), or ``length`` is below
            its current number of positions.
        MissingCapabilityError: the model has no text position table (no ``kps`` capability).
    """
    model.require("kps", f"Long-CLIP KPS (apply_kps to {length} text positions)")
    if model.adapter is not None and getattr(model.adapter, "type", "full") != "full":
        raise ValueError("apply_kps must run before a LoRA/DoRA adapter is added (load_model(..., max_text_len=...) "
                         "then apply_adapter)")
    n = model.position_embedding().shape[0]
    if model.kps is not None:
        same = (model.kps["length"] == length and model.kps["keep"] == keep
                and model.kps["freeze_kept"] == freeze_kept and ratio in (None, model.kps["ratio"]))
        if same:
            return model
        raise ValueError(
            f"model {model.name_or_path!r} is already stretched ({model.kps}); load the base model to stretch it "
            f"differently"
        )
    if length < n:
        raise ValueError(
            f"max_text_len={length} is below the model's {n} text positions ({model.name_or_path!r}); "
            f"use a value >= {n} (captions longer than the limit are truncated with the end token kept)"
        )
    if length == n:
        return model
    with torch.no_grad():
        table = stretch_positions(model.position_embedding().detach(), keep=keep, ratio=ratio, length=length)
    model.kps = {"length": length, "keep": keep, "ratio": ratio or kps_ratio(n, keep, length),
                 "freeze_kept": freeze_kept}
    model.resize_text_positions(table)
    return model
