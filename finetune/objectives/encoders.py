"""The encoder passes of a step (DESIGN 4 Seams): every image request in ONE image-tower pass, the text requests in
one text-tower pass per text length, at most two under fixed shapes (:mod:`finetune.objectives.shapes`).

Text requests of one length go through the tower together (their rows concatenated), with states when any of them
asks for states. Under :class:`~finetune.objectives.shapes.BatchShapes` a request's length is fixed before
training (``text_length`` or, for short requests of a causal tower, ``short_length``), so a step has at most two
text passes, each of a (rows, length) shape that every step repeats. Without fixed shapes (a direct call) each
request keeps its own width and requests of equal width share a pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .shapes import BatchShapes, is_causal_tower, pad_columns, pad_token_id

Features = dict[str, Tensor]


@dataclass(frozen=True)
class TextPlan:
    """Host facts about a batch's text requests, checked on the CPU where the batch is collated
    (:class:`~finetune.objectives.planning.PlannedCollate`) so that the step reads nothing back from the device.

    Attributes:
        right_padded: every text request's mask is ones then zeros: a causal tower may then run without its
            padding mask (under the causal mask no real token attends to the padding after it).
    """

    right_padded: bool = False

    def to(self, device: Any, non_blocking: bool = False) -> "TextPlan":
        return self

    def pin_memory(self) -> "TextPlan":
        return self


def right_padded(masks: list[Tensor]) -> bool:
    """Whether every ``(n, L)`` mask (CPU tensors) is ones then zeros in each row."""
    for mask in masks:
        if mask.numel() and not torch.equal(mask.bool(), torch.arange(mask.shape[-1])[None, :] < mask.sum(-1)[:, None]):
            return False
    return True


def encode_images(model: Any, reqs: dict[str, Any]) -> Features:
    """Every image request in ONE ``encode_image`` call (rows concatenated; requests that need patch states first,
    so that the tower computes states for those rows only)."""
    if not reqs:
        return {}
    keys = sorted(reqs, key=lambda k: not reqs[k].states)
    want_states = any(r.states for r in reqs.values())
    states_rows = sum(reqs[k].count for k in keys if reqs[k].states)
    names = list(reqs[keys[0]].inputs)
    inputs = {n: torch.cat([reqs[k].inputs[n] for k in keys]) if len(keys) > 1 else reqs[keys[0]].inputs[n]
              for n in names}
    out = model.encode_image(**inputs, states=want_states, states_rows=states_rows if want_states else None)
    feats: Features = {}
    start = 0
    for k in keys:
        n = reqs[k].count
        feats[k] = out.embeds[start:start + n]
        if reqs[k].states and out.states is not None:
            feats[f"{k}_states"] = out.states[start:start + n]
        start += n
    if want_states:
        feats["image_grid"] = torch.tensor(out.grid)
    return feats


@dataclass(frozen=True)
class TextPass:
    """One text-tower pass: the request keys it carries (in order), its columns and whether it returns states."""

    keys: tuple[str, ...]
    length: int
    states: bool


def text_passes(model: Any, reqs: dict[str, Any], shapes: BatchShapes | None = None) -> list[TextPass]:
    """How the text requests go through the tower: one pass per length (module docstring), in request order."""
    causal = is_causal_tower(model)
    groups: dict[int, list[str]] = {}
    for key, req in reqs.items():
        width = int(req.input_ids.shape[-1])
        if shapes is not None:
            length = shapes.length(req.short and causal)
            width = length if width <= length else shapes.text_length
        groups.setdefault(width, []).append(key)
    return [TextPass(tuple(keys), length, any(reqs[k].states for k in keys)) for length, keys in groups.items()]


def encode_texts(model: Any, reqs: dict[str, Any], plan: TextPlan | None = None,
                 shapes: BatchShapes | None = None) -> Features:
    """Encode every text request in :func:`text_passes` passes: embeds under each request's key and, for requests
    with states, ``<key>_states`` ``(n, L, W)`` and ``<key>_mask`` ``(n, L)`` (``L`` the pass's columns). The
    passes without states go to ``encode_text_groups`` together (transformers CLIP: one token lookup, one dense
    embedding gradient); ``plan.right_padded`` lets a causal tower skip its padding mask without reading it."""
    feats: Features = {}
    pad = pad_token_id(model)
    passes = text_passes(model, {k: r for k, r in reqs.items() if r.input_ids.shape[0]}, shapes)
    for key, req in reqs.items():
        if not req.input_ids.shape[0]:
            feats[key] = req.input_ids.new_zeros((0, 0), dtype=torch.float32)
    inputs = {}
    for p in passes:
        cols = [pad_columns(reqs[k].input_ids, reqs[k].attention_mask, p.length, pad) for k in p.keys]
        inputs[p] = (torch.cat([c[0] for c in cols]), torch.cat([c[1] for c in cols]))
    plain = [p for p in passes if not p.states]
    if plain:
        rp = bool(plan is not None and plan.right_padded and is_causal_tower(model))
        for p, embeds in zip(plain, model.encode_text_groups([inputs[p] for p in plain], right_padded=rp)):
            _split(feats, reqs, p, embeds)
    for p in passes:
        if p.states:
            ids, mask = inputs[p]
            out = model.encode_text(ids, mask, states=True)
            _split(feats, reqs, p, out.embeds, out.states, mask)
    return feats


def _split(feats: Features, reqs: dict[str, Any], p: TextPass, embeds: Tensor, states: Tensor | None = None,
           mask: Tensor | None = None) -> None:
    start = 0
    for k in p.keys:
        n = reqs[k].input_ids.shape[0]
        feats[k] = embeds[start:start + n]
        if reqs[k].states and states is not None:
            feats[f"{k}_states"] = states[start:start + n]
            feats[f"{k}_mask"] = mask[start:start + n]
        start += n
