"""The encoder passes of a step (DESIGN 4 Seams): every image request in ONE image-tower pass, the text requests in
one text-tower pass per text kind (:mod:`finetune.objectives.shapes`: captions and the texts like them, short texts).

Text requests of one kind go through the tower together (their rows concatenated), with states when any of them
asks for states. Under :class:`~finetune.objectives.shapes.BatchShapes` a pass's columns are those the batch's
:class:`TextPlan` chose where it was collated (the smallest planned bucket length that holds the pass's longest
row), so a step has one pass per kind, each of a (rows, length) shape among the few planned. Without planned
shapes (a direct call) each request keeps its own width and requests of equal width share a pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .shapes import SHORT, TEXT, BatchShapes, fit_columns, is_causal_tower, pad_token_id, text_extent

Features = dict[str, Tensor]


@dataclass(frozen=True)
class TextPlan:
    """Host facts about a batch's text passes, decided on the CPU where the batch is collated
    (:class:`~finetune.objectives.planning.PlannedCollate`) so that the step reads nothing back from the device.

    Attributes:
        right_padded: every text request's mask is ones then zeros: a causal tower may then run without its
            padding mask (under the causal mask no real token attends to the padding after it).
        lengths: ``{kind: columns}`` of the batch's text passes (:meth:`BatchShapes.length`; without planned
            shapes the longest row, which only the terms' own texts use).
        rows: ``{kind: rows}`` of the batch's text passes.
        real_tokens: the real text tokens of the batch's passes (their masks' sum).
        computed_tokens: the text tokens the passes compute (rows x columns, padding included).
        warmup: a warm-up pass (:meth:`finetune.training.step_setup.StepSetup.warm_up`): rows longer than a
            length are cut to it; its values are not used.
    """

    right_padded: bool = False
    lengths: Mapping[str, int] = field(default_factory=dict)
    rows: Mapping[str, int] = field(default_factory=dict)
    real_tokens: int = 0
    computed_tokens: int = 0
    warmup: bool = False

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


def request_kind(req: Any) -> str:
    """The text kind of a request: :data:`~finetune.objectives.shapes.SHORT` for short texts, else
    :data:`~finetune.objectives.shapes.TEXT`."""
    return SHORT if getattr(req, "short", False) else TEXT


def plan_lengths(shapes: BatchShapes | None, masks: Mapping[str, list[Tensor]]) -> TextPlan:
    """The :class:`TextPlan` lengths and token counts of a batch's texts, ``masks`` ``{kind: [(n, L) masks]}`` on
    the host: each kind at :meth:`BatchShapes.length` of its longest row (without ``shapes``: the longest row
    itself)."""
    lengths, rows, real, computed = {}, {}, 0, 0
    for kind, ms in masks.items():
        ms = [m for m in ms if m.shape[0]]
        if not ms:
            continue
        longest = max(text_extent(ms), 1)
        lengths[kind] = shapes.length(kind, longest) if shapes is not None else longest
        rows[kind] = sum(m.shape[0] for m in ms)
        real += int(sum(int(m.sum()) for m in ms))
        computed += rows[kind] * lengths[kind]
    return TextPlan(lengths=lengths, rows=rows, real_tokens=real, computed_tokens=computed)


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


def text_passes(model: Any, reqs: dict[str, Any], shapes: BatchShapes | None = None,
                plan: TextPlan | None = None) -> list[TextPass]:
    """How the text requests go through the tower (module docstring), in request order: under ``shapes``, one pass
    per kind at the plan's length for it (computed here from the masks when the batch has no plan: a direct call);
    without, one pass per width."""
    groups: dict[Any, list[str]] = {}
    for key, req in reqs.items():
        groups.setdefault(request_kind(req) if shapes is not None else int(req.input_ids.shape[-1]), []).append(key)
    passes = []
    for group, keys in groups.items():
        if shapes is None:
            length = group
        elif plan is not None and group in plan.lengths:
            length = plan.lengths[group]
        else:
            length = shapes.length(group, max(text_extent([reqs[k].attention_mask for k in keys]), 1))
        passes.append(TextPass(tuple(keys), int(length), any(reqs[k].states for k in keys)))
    return passes


def encode_texts(model: Any, reqs: dict[str, Any], plan: TextPlan | None = None,
                 shapes: BatchShapes | None = None) -> Features:
    """Encode every text request in :func:`text_passes` passes: embeds under each request's key and, for requests
    with states, ``<key>_states`` ``(n, L, W)`` and ``<key>_mask`` ``(n, L)`` (``L`` the pass's columns). The
    passes without states go to ``encode_text_groups`` together (transformers CLIP: one token lookup, one dense
    embedding gradient); ``plan.right_padded`` lets a causal tower skip its padding mask without reading it."""
    feats: Features = {}
    pad = pad_token_id(model)
    passes = text_passes(model, {k: r for k, r in reqs.items() if r.input_ids.shape[0]}, shapes, plan)
    for key, req in reqs.items():
        if not req.input_ids.shape[0]:
            feats[key] = req.input_ids.new_zeros((0, 0), dtype=torch.float32)
    inputs = {}
    for p in passes:
        # the plan's length holds every real token (it was chosen from the masks); a warm-up pass may cut them
        cols = [fit_columns(reqs[k].input_ids, reqs[k].attention_mask, p.length, pad) for k in p.keys]
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
