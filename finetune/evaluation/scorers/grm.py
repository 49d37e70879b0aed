"""Scorer ``grm``: GRM's token-wise retrieval (GRM eq. 7) on the model's projected token states.

``eval.scorer: grm`` keeps, per image, its patch tokens through the model's own norm and projection
(``project_image_states``, ``(Ni, Lv, D)``) and per caption its token states (``(Nt, Lt, D)``, padding
masked), and scores a text block against an image block with :func:`losses.token_wise_similarity`.
``level`` chooses the tokens:

- ``key`` (default): the adapted tokens of the GRM head in ``model.inference_modules["grm"]`` (the
  ``grm`` objective term trains it): the tokens the significance- / granularity-aware gates of eq. 1
  keep (argmax at evaluation, with the head's floor ``min_keep``), S^key;
- ``ori``: the raw projected tokens (S^ori), which needs no head (also registered as ``grm_ori``);
- ``unc``: the kept text tokens against the K region means (U = mu at evaluation, S^unc).

Ranking with the key level alone is the toolkit's choice: the paper does not say which of its three
levels it ranks with; LAPS, its likely base code, ranks with its one similarity. The token
normalisation of eq. 7 is LAPS's; LAPS's leaky ReLU is used when the head was trained with it (the
scorer's ``leaky_slope`` defaults to the head's).

``prepare`` logs the gates' keep ratios and warns when the scores of a probe block of pairs are all
the same (collapsed gates or a collapsed model: Recall@K is then meaningless).

``score_pairs`` scores text j with image j directly (one ``(Lv, Lt)`` cosine block per pair, in chunks),
not through the diagonal of ``score``. Payloads keep the global ``embeds`` too, so ``eval.rerank_top_k``
can prefilter with cosine.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from finetune.evaluation.scorers.base import Payload, Scorer, payload_len, register_scorer, take
from losses.grm import DEFAULT_BLOCK_ELEMENTS, LAPS_LEAKY_SLOPE, token_wise_similarity

__all__ = ["GRMScorer", "grm_ori", "pairwise_token_similarity", "LAPS_LEAKY_SLOPE", "TRAINED"]

log = logging.getLogger("xlipkit")

Level = Literal["key", "ori", "unc"]
#: ``leaky_slope`` of :class:`GRMScorer`: the slope the model's GRM head was trained with (None without a head)
TRAINED = "trained"
#: texts x images scored by :meth:`GRMScorer.prepare` to detect scores that are all the same
PROBE = 64


def pairwise_token_similarity(
    text: Tensor,
    text_mask: Tensor,
    image: Tensor,
    image_mask: Tensor | None = None,
    *,
    text_weights: Tensor | None = None,
    image_weights: Tensor | None = None,
    leaky_slope: float | None = None,
    block_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> Tensor:
    """GRM eq. 7 of text ``j`` with image ``j`` only: the diagonal of :func:`losses.token_wise_similarity`
    without the off-diagonal work.

    Args:
        text: ``(n, Lt, d)`` text tokens; text_mask: ``(n, Lt)`` True / 1 for real tokens.
        image: ``(n, Lv, d)`` image tokens (or regions); image_mask: ``(n, Lv)`` or None (all real).
        text_weights, image_weights: ``(n, L)`` gates (the key level): a token with gate 0 leaves the
            maxima and the means, the means are gate-weighted.
        leaky_slope: LAPS's leaky ReLU before the max (None: eq. 7).
        block_elements: token cosines computed at once (memory bound).

    Returns:
        ``(n,)`` similarities.
    """
    n, lv = image.shape[:2]
    lt = text.shape[1]
    text_mask = text_mask.bool()
    image_mask = torch.ones(n, lv, dtype=torch.bool, device=image.device) if image_mask is None else image_mask.bool()
    step = max(1, block_elements // max(1, lv * lt))
    low = torch.finfo(image.dtype).min
    text_w = text_mask.to(text.dtype) if text_weights is None else text_weights.to(text.dtype) * text_mask
    image_w = image_mask.to(image.dtype) if image_weights is None else image_weights.to(image.dtype) * image_mask
    text_keep, image_keep = text_w != 0, image_w != 0
    out = []
    for j0 in range(0, n, step):
        j = slice(j0, min(j0 + step, n))
        t = F.normalize(text[j], dim=-1)
        v = F.normalize(image[j], dim=-1)
        s = v @ t.transpose(1, 2)  # (c, Lv, Lt)
        if leaky_slope is not None:
            s = F.leaky_relu(s, leaky_slope)
        tk, ik, tw, iw = text_keep[j], image_keep[j], text_w[j], image_w[j]
        t2i = s.masked_fill(~ik[:, :, None], low).max(dim=1).values  # (c, Lt)
        t2i = (t2i * tw).sum(-1) / tw.sum(-1)
        i2t = s.masked_fill(~tk[:, None, :], low).max(dim=2).values  # (c, Lv)
        i2t = (i2t * iw).sum(-1) / iw.sum(-1)
        out.append(t2i + i2t)
    return torch.cat(out) if out else image.new_zeros(0)


@register_scorer("grm")
class GRMScorer(Scorer):
    """Token-wise bidirectional similarity (GRM eq. 7) for retrieval; see the module docstring.

    Args:
        level: ``"key"`` (the tokens the GRM head keeps, default), ``"ori"`` (raw tokens) or ``"unc"``
            (kept text tokens against the K region means).
        leaky_slope: LAPS's ``leaky_relu(cos, slope)`` before the max. ``"trained"`` (default): the
            slope the model's GRM head was trained with (``objective.terms.grm.leaky_slope``, recorded
            with the head; None for a model without a head), read when the scorer encodes. A number
            or None (eq. 7) overrides it.
        block_elements: token cosines per block of :func:`losses.token_wise_similarity`.
    """

    def __init__(self, level: Level = "key", leaky_slope: float | None | str = TRAINED,
                 block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> None:
        if level not in ("key", "ori", "unc"):
            raise ValueError(f"scorer grm: level must be 'key', 'ori' or 'unc', got {level!r}")
        if isinstance(leaky_slope, str) and leaky_slope != TRAINED:
            raise ValueError(f"scorer grm: leaky_slope must be a number, None or {TRAINED!r}, got {leaky_slope!r}")
        if isinstance(leaky_slope, (int, float)) and leaky_slope < 0:
            raise ValueError(f"scorer grm: leaky_slope must be >= 0, got {leaky_slope!r}")
        self.level = level
        self.slope_option = leaky_slope
        #: the slope in use: the option, or the head's once the scorer has encoded with a model
        self.leaky_slope: float | None = None if leaky_slope == TRAINED else leaky_slope
        self.block_elements = int(block_elements)

    def _resolve_slope(self, model: Any) -> None:
        if self.slope_option != TRAINED:
            return
        from finetune.objectives.grm import HEAD_KEY

        modules = getattr(model, "inference_modules", None)
        head = modules[HEAD_KEY] if modules is not None and HEAD_KEY in modules else None
        self.leaky_slope = getattr(head, "leaky_slope", None)

    def _head(self, model: Any) -> Any:
        from finetune.objectives.grm import HEAD_KEY

        modules = getattr(model, "inference_modules", None)
        if modules is None or HEAD_KEY not in modules:
            raise ValueError(f"scorer grm (level {self.level!r}) needs the GRM head in model.inference_modules['grm'], "
                             f"which model {getattr(model, 'name_or_path', '?')!r} does not hold: train it with "
                             f"objective.terms.grm, or score the raw tokens with the grm scorer's level 'ori'")
        return modules[HEAD_KEY]

    def encode_images(self, model: Any, inputs: Mapping[str, Any]) -> Payload:
        """``{"embeds" (B, D), "tokens" (B, Lv, D), "mask" (B, Lv)}`` plus ``"gate"`` (key) or ``"regions"``
        ``(B, K, D)`` (unc), float32."""
        self._resolve_slope(model)
        feats = model.encode_image(**inputs, states=True)
        tokens = model.project_image_states(feats.states)
        mask = feats.patch_mask if feats.patch_mask is not None else torch.ones(tokens.shape[:2], dtype=torch.bool,
                                                                                  device=tokens.device)
        out = {"embeds": feats.embeds.float(), "mask": mask.bool()}
        if self.level == "ori":
            return {**out, "tokens": tokens.float()}
        head = self._head(model)
        side = head.encode_image(tokens.to(head.prompts.dtype), mask, stochastic=False)
        if self.level == "unc":
            return {**out, "regions": side.regions.float()}
        return {**out, "tokens": tokens.float(), "gate": side.gate.float()}

    def encode_texts(self, model: Any, input_ids: Tensor, attention_mask: Tensor) -> Payload:
        """``{"embeds" (B, D), "tokens" (B, Lt, D), "mask" (B, Lt)}`` plus ``"gate"`` (key, unc), float32."""
        self._resolve_slope(model)
        feats = model.encode_text(input_ids, attention_mask, states=True)
        tokens = model.project_text_states(feats.states)
        mask = attention_mask.bool()
        out = {"embeds": feats.embeds.float(), "tokens": tokens.float(), "mask": mask}
        if self.level == "ori":
            return out
        head = self._head(model)
        side = head.encode_text(tokens.to(head.prompts.dtype), mask, stochastic=False)
        return {**out, "gate": side.gate.float()}

    def _sides(self, texts: Payload, images: Payload) -> dict[str, Any]:
        image = images["regions"] if self.level == "unc" else images["tokens"]
        return {"text": texts["tokens"], "text_mask": texts["mask"], "image": image,
                "image_mask": None if self.level == "unc" else images["mask"],
                "text_weights": texts.get("gate") if self.level != "ori" else None,
                "image_weights": images.get("gate") if self.level == "key" else None,
                "leaky_slope": self.leaky_slope, "block_elements": self.block_elements}

    def prepare(self, texts: Payload, images: Payload) -> tuple[Payload, Payload]:
        """Unchanged payloads. Logs the gates' keep ratios and warns, with them, when the scores of the
        first ``PROBE`` texts x ``PROBE`` images are all the same (every pair tied: Recall@K is then
        meaningless; collapsed gates or a collapsed model do this)."""
        ratios = self._keep_ratios(texts, images)
        if ratios:
            log.info("scorer grm (level %s): the gates keep %s", self.level, ratios)
        n_t, n_i = min(PROBE, payload_len(texts)), min(PROBE, payload_len(images))
        if n_t * n_i > 1:
            probe = self.score(take(texts, slice(0, n_t)), take(images, slice(0, n_i)))
            low, high = float(probe.min()), float(probe.max())
            if high - low <= self.tie_tolerance(texts, images):
                log.warning("scorer grm (level %s): all %d x %d probed text-image scores are %.6g: every pair "
                            "scores the same, so the ranking (and Recall@K) is meaningless. Gates: %s. Collapsed "
                            "gates (keep ratios near 0) or collapsed token states cause this.", self.level, n_t,
                            n_i, low, ratios or "none at this level")
        return texts, images

    def _keep_ratios(self, texts: Payload, images: Payload) -> str:
        """``"images mean a (min b), texts mean c (min d)"`` over the payloads' gates ('' without gates)."""
        parts = []
        for side, payload in (("images", images), ("texts", texts)):
            if "gate" in payload:
                mask = payload["mask"].to(payload["gate"].dtype)
                ratio = (payload["gate"] * mask).sum(1) / mask.sum(1).clamp(min=1)
                parts.append(f"{side} mean {float(ratio.mean()):.3f} (min {float(ratio.min()):.3f}) of their tokens")
        return ", ".join(parts)

    def score(self, texts: Payload, images: Payload) -> Tensor:
        """``(Tt, Ti)``: eq. 7 of every text with every image."""
        return token_wise_similarity(**self._sides(texts, images)).T

    def score_pairs(self, texts: Payload, images: Payload) -> Tensor:
        """``(n,)``: eq. 7 of text j with image j (:func:`pairwise_token_similarity`)."""
        return pairwise_token_similarity(**self._sides(texts, images))

    def tie_tolerance(self, texts: Payload, images: Payload) -> float:
        """``4 d eps``: a token cosine of unit vectors is exact to about ``d eps`` whichever way its sum is
        ordered (a matmul in :meth:`score`, a batched product in :meth:`score_pairs`), and eq. 7 adds two
        means of such cosines."""
        x = texts["tokens"]
        return 4 * x.shape[-1] * torch.finfo(x.dtype).eps


@register_scorer("grm_ori")
def grm_ori(leaky_slope: float | None | str = TRAINED, block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> GRMScorer:
    """``eval.scorer: grm_ori``: :class:`GRMScorer` with ``level="ori"`` (eq. 7 on the raw projected tokens,
    S^ori; no GRM head needed)."""
    scorer = GRMScorer(level="ori", leaky_slope=leaky_slope, block_elements=block_elements)
    scorer.name = "grm_ori"
    return scorer
