"""FAST-GOAL's Token Similarity-based Learning (TSL, paper III-B, eqs. 4-14): the tensor functions.

TSL pools the last-layer states of the global image inside the box of a local pair (eq. 9) and the
last-layer states of the global caption inside the token span of its sentence (eq. 7), projects the
two pooled states into the joint space (psi_v, psi_t, eqs. 8 and 10) and pulls each towards the
embedding of the local crop (v_l^cls) and of the sentence encoded alone (t_l^cls):

    L_TSL = MSE(sim(P_l, v_l^cls), I) + MSE(sim(S_l, t_l^cls), I)                        (eq. 14)

with ``sim`` the n x n cosine-similarity matrix of the batch.

The pieces, in the order a training step uses them:

* :func:`select_sentence_spans`: the span of each pair's sentence in the caption's token ids (from
  ``DualEncoder.sentence_spans``), sentences cut by truncation marked invalid and counted;
* :func:`pool_span_states` (eq. 7) and :func:`pool_box_states` (eq. 9, through a :class:`PatchGeometry`
  that maps the boxes to patches); :func:`pool_patch_states` when the masks are computed ahead, e.g. in a
  collate function;
* psi: the model's own final norm + projection (``DualEncoder.project_image_states`` /
  ``project_text_states``, as the GOAL code), or :class:`TSLHeads` (option ``heads: new``: a separate
  copy, trained on its own and saved with the model);
* :func:`tsl_loss` (eq. 14), with :func:`tsl_similarity_loss` for one modality.

Conventions (DESIGN 4): embeddings are raw (normalised here); with ``gather`` each rank scores its
local rows against the gathered columns of every rank, and the mean over ranks of the returned value
is the single-process value on the concatenated batch (same gradients under DDP's averaging).

Like the rest of ``losses``, the module needs torch only. What needs a model or the image processor's
geometry lives in the toolkit, :mod:`finetune.objectives.tsl_heads`: ``tsl_sentence_spans(model, ...)``,
``BoxGeometry`` with ``box_patch_masks`` (boxes in image pixels -> patch masks, the processor's geometry),
``tsl_heads_from_model`` / ``attach_tsl_heads`` (heads copied from a model's projections), and the
registration of :class:`TSLHeads` as an inference module (``tsl.heads``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import check_number, device_check
from .distributed import gather_with_grad, should_gather, world_info

__all__ = [
    "PatchGeometry",
    "SentenceSpans",
    "TSL_FORMS",
    "TSLHeads",
    "pool_box_states",
    "pool_patch_states",
    "pool_span_states",
    "select_sentence_spans",
    "tsl_loss",
    "tsl_similarity_loss",
]

TSL_FORMS = ("matrix", "diagonal")


# --- text: sentence spans (eq. 7) ------------------------------------------------------------------


class SentenceSpans(NamedTuple):
    """The token span of one sentence per caption, as :func:`pool_span_states` takes it.

    Attributes:
        spans: ``(B, 2)`` long, half-open ``(start, end)`` positions in the rows of
            ``DualEncoder.tokenize(captions).input_ids``; ``(0, 0)`` where ``valid`` is False.
        valid: ``(B,)`` bool, False where the sentence was cut by truncation (or the row has no
            sentence): pass it to :func:`pool_span_states` and as ``span_valid`` to :func:`tsl_loss`.
        truncated: how many rows were dropped because truncation cut their sentence (for the report).
    """

    spans: Tensor
    valid: Tensor
    truncated: int


def select_sentence_spans(
    caption_spans: Sequence[Sequence[tuple[int, int] | None]], sentence_index: Sequence[int | None]
) -> SentenceSpans:
    """Pick each caption's span of its local pair's sentence.

    Args:
        caption_spans: ``DualEncoder.sentence_spans(captions)``: per caption, one ``(start, end)`` or
            ``None`` (cut by truncation) per sentence of ``finetune.data.text.split_sentences``.
        sentence_index: ``(B,)`` per caption, the index of the pair's sentence among those sentences
            (FLISM's cached ``sentence_index``); ``None`` for a caption without a local pair (invalid,
            not counted as truncated).

    Returns:
        :class:`SentenceSpans`.

    Raises:
        ValueError: the lengths differ, or an index does not name a sentence of its caption (the
            message names the sample).
    """
    if len(caption_spans) != len(sentence_index):
        raise ValueError(f"select_sentence_spans: {len(caption_spans)} captions' spans but "
                         f"{len(sentence_index)} sentence indices")
    spans = torch.zeros(len(caption_spans), 2, dtype=torch.long)
    valid = torch.zeros(len(caption_spans), dtype=torch.bool)
    truncated = 0
    for b, (sentences, index) in enumerate(zip(caption_spans, sentence_index)):
        if index is None:
            continue
        index = int(index)
        if not 0 <= index < len(sentences):
            raise ValueError(f"select_sentence_spans: sample {b} asks for sentence {index}, but its caption has "
                             f"{len(sentences)} sentences (split_sentences); the cached pairs do not belong to "
                             f"these captions")
        span = sentences[index]
        if span is None:
            truncated += 1
            continue
        spans[b] = torch.tensor(span, dtype=torch.long)
        valid[b] = True
    return SentenceSpans(spans, valid, truncated)


def _span_tensor(spans: Tensor | Sequence[Sequence[int]], lead: tuple[int, ...]) -> Tensor:
    out = torch.as_tensor(spans, dtype=torch.long) if not isinstance(spans, Tensor) else spans.long()
    if out.dim() not in (2, 3) or out.shape[-1] != 2 or out.shape[0] != lead[0]:
        raise ValueError(f"spans must be a (B, 2) or (B, K, 2) tensor of (start, end) with B = {lead[0]}, got "
                         f"{tuple(out.shape)}")
    return out


def _check_valid(valid: Tensor | None, batch: int | tuple[int, ...], name: str = "valid") -> Tensor | None:
    if valid is None:
        return None
    shape = (batch,) if isinstance(batch, int) else tuple(batch)
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool or tuple(valid.shape) != shape:
        got = (valid.dtype, tuple(valid.shape)) if isinstance(valid, Tensor) else type(valid).__name__
        raise ValueError(f"{name} must be a {shape} bool tensor, got {got}")
    return valid


def _masked_mean(states: Tensor, mask: Tensor) -> Tensor:
    """``(B, N, W)``, ``(B, N)`` or ``(B, K, N)`` bool -> ``(B, W)`` or ``(B, K, W)``: mean of the selected
    rows (rows without any: 0). No host read: empty rows are not detected here."""
    weights = mask.to(states.dtype)
    counts = weights.sum(dim=-1, keepdim=True).clamp(min=1)
    if mask.dim() == 2:
        return torch.einsum("bn,bnw->bw", weights, states) / counts
    return torch.einsum("bkn,bnw->bkw", weights, states) / counts


def _first_bad(rows: Tensor) -> str:
    """The index of the first True entry of a ``(B,)`` or ``(B, K)`` bool tensor, for a message (a host read:
    only on the checking path)."""
    index = rows.nonzero()[0].tolist()
    return str(index[0]) if len(index) == 1 else str(tuple(index))


def pool_span_states(
    states: Tensor, spans: Tensor | Sequence[Sequence[int]], *, valid: Tensor | None = None, check: bool = True
) -> Tensor:
    """Mean of the token states of each caption's sentence span (FAST-GOAL eq. 7, ``S_m``).

    Args:
        states: ``(B, L, W)`` last-layer token states of the global captions (``encode_text(...,
            states=True).states``, before the final norm: psi_t applies it, as the GOAL code).
        spans: ``(B, 2)`` half-open ``(start, end)`` token positions (``SentenceSpans.spans``), or
            ``(B, K, 2)`` for K sentences per caption (FAST-GOAL's top-3 pairs).
        valid: optional ``(B,)`` (or ``(B, K)``) bool; rows marked False are not pooled and give zeros
            (drop them from the loss with ``span_valid``).
        check: raise on a valid row whose span is empty or outside ``[0, L]``. This reads the spans on
            the host; a training step passes ``check=False`` (validity decided in the collate function,
            :func:`select_sentence_spans`), and then such a row pools nothing and gives zeros.

    Returns:
        ``(B, W)`` (or ``(B, K, W)``) ``S_m``.

    Raises:
        ValueError: bad shapes, or (``check``) a valid row whose span is empty or outside ``[0, L]``
            (the message names the sample).
    """
    if not isinstance(states, Tensor) or states.dim() != 3:
        raise ValueError(f"states must be a (B, L, W) tensor, got {getattr(states, 'shape', type(states).__name__)}")
    batch, length, _ = states.shape
    spans = _span_tensor(spans, (batch,)).to(states.device)
    valid = _check_valid(valid, tuple(spans.shape[:-1]))
    positions = torch.arange(length, device=states.device)
    start, end = spans[..., :1], spans[..., 1:]
    mask = (positions >= start) & (positions < end)  # (B, L) or (B, K, L)
    if valid is not None:
        mask &= valid.to(states.device)[..., None]
    if check:
        use = torch.ones(spans.shape[:-1], dtype=torch.bool) if valid is None else valid.cpu()
        bad = use & ~((spans[..., 0] >= 0) & (spans[..., 0] < spans[..., 1]) & (spans[..., 1] <= length)).cpu()
        if bool(bad.any()):
            b = _first_bad(bad)
            raise ValueError(f"pool_span_states: sample {b} has span {tuple(spans.cpu()[bad][0].tolist())}, which "
                             f"is empty or outside the {length} token states; mark it invalid (valid[{b}] = False) "
                             "or fix the span")
    return _masked_mean(states, mask)


# --- image: box pooling (eq. 9) ----------------------------------------------------------------------


def pool_patch_states(states: Tensor, masks: Tensor, *, valid: Tensor | None = None, check: bool = True) -> Tensor:
    """Mean of the patch states selected by ``masks`` (FAST-GOAL eq. 9, ``P_m``).

    Args:
        states: ``(B, N, W)`` last-layer patch states (``ImageFeatures.states``: prefix tokens removed,
            before the final norm).
        masks: ``(B, N)`` bool (``PatchGeometry.box_patch_masks``), or ``(B, K, N)`` for K boxes per
            image (FAST-GOAL's top-3 pairs).
        valid: optional ``(B,)`` (or ``(B, K)``) bool; rows marked False give zeros.
        check: raise on a valid row without any selected patch. This reads the masks on the host; a
            training step passes ``check=False`` (validity decided in the collate function with
            ``box_patch_masks(..., outside="drop")``), and then such a row gives zeros.

    Returns:
        ``(B, W)`` (or ``(B, K, W)``) ``P_m``.

    Raises:
        ValueError: bad shapes, or (``check``) a valid row without any selected patch (naming the sample).
    """
    if not isinstance(states, Tensor) or states.dim() != 3:
        raise ValueError(f"states must be a (B, N, W) tensor, got {getattr(states, 'shape', type(states).__name__)}")
    if (not isinstance(masks, Tensor) or masks.dtype != torch.bool or masks.dim() not in (2, 3)
            or masks.shape[0] != states.shape[0] or masks.shape[-1] != states.shape[1]):
        got = (masks.dtype, tuple(masks.shape)) if isinstance(masks, Tensor) else type(masks).__name__
        raise ValueError(f"masks must be a bool tensor of shape {tuple(states.shape[:2])} (or (B, K, N) with B = "
                         f"{states.shape[0]}, N = {states.shape[1]}), got {got}")
    valid = _check_valid(valid, tuple(masks.shape[:-1]))
    masks = masks.to(states.device)
    if valid is not None:
        masks = masks & valid.to(states.device)[..., None]
    if check:
        empty = ~masks.any(dim=-1)
        if valid is not None:
            empty &= valid.to(states.device)
        if bool(empty.any()):
            raise ValueError(f"pool_patch_states: sample {_first_bad(empty.cpu())} selects no patch; its box is "
                             "empty or off the image")
    return _masked_mean(states, masks)


class PatchGeometry(Protocol):
    """Where boxes land on the patch states of a batch, as :func:`pool_box_states` takes it: the toolkit's
    ``finetune.objectives.tsl_heads.BoxGeometry`` (the image processor's exact resize and centre crop,
    FAST-GOAL appendix C), or a user's own object with this method."""

    def box_patch_masks(self, boxes: Any, n_patches: int, *, valid: Tensor | None = None) -> Tensor:
        """``(B, 4)`` boxes ``(x1, y1, x2, y2)`` -> ``(B, N)`` bool masks of the patches each selects."""
        ...


def pool_box_states(
    states: Tensor,
    boxes: Tensor | Sequence[Sequence[float]],
    geometry: PatchGeometry,
    *,
    valid: Tensor | None = None,
) -> Tensor:
    """Mean of the patch states inside each box (FAST-GOAL eq. 9, ``P_m``).

    ``geometry.box_patch_masks(boxes, N, valid=valid)`` then :func:`pool_patch_states`.

    Args:
        states: ``(B, N, W)`` patch states of the global images (``encode_image(..., states=True)``).
        boxes: ``(B, 4)`` ``(x1, y1, x2, y2)`` in pixels of the original images.
        geometry: a :class:`PatchGeometry`; in the toolkit ``BoxGeometry.from_model(model, [im.size for im in
            images])`` (``finetune.objectives.tsl_heads``).
        valid: optional ``(B,)`` bool; rows marked False (no local pair) give zeros and are not checked.

    Returns:
        ``(B, W)`` ``P_m``.

    Raises:
        ValueError: a box that selects no patch (the toolkit's geometry: a zero-area box or one entirely
            outside the crop, naming the sample), or a geometry that does not fit the states.
        TypeError: ``geometry`` has no ``box_patch_masks`` method.
    """
    if not isinstance(states, Tensor) or states.dim() != 3:
        raise ValueError(f"states must be a (B, N, W) tensor, got {getattr(states, 'shape', type(states).__name__)}")
    if not callable(getattr(geometry, "box_patch_masks", None)):
        raise TypeError(f"pool_box_states: geometry must have a box_patch_masks(boxes, n_patches, valid=...) method "
                        f"(the toolkit's finetune.objectives.tsl_heads.BoxGeometry), got {type(geometry).__name__}")
    masks = geometry.box_patch_masks(boxes, states.shape[1], valid=valid)
    if masks.shape[0] != states.shape[0]:
        raise ValueError(f"{masks.shape[0]} boxes for {states.shape[0]} images' states")
    return pool_patch_states(states, masks, valid=valid)


# --- projections psi_v, psi_t (eqs. 8, 10) ---------------------------------------------------------


class _NormLinear(nn.Module):
    def __init__(self, width: int, dim: int, *, bias: bool, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=eps)
        self.proj = nn.Linear(width, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.norm(x))

    @torch.no_grad()
    def copy_from(self, norm: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
        self.norm.weight.copy_(norm.weight)
        self.norm.bias.copy_(norm.bias)
        self.proj.weight.copy_(weight)
        if bias is not None:
            self.proj.bias.copy_(bias)


class TSLHeads(nn.Module):
    """Separate TSL projections psi_v and psi_t (FAST-GOAL eqs. 8, 10; option ``heads: new``).

    Each head is a LayerNorm followed by a linear layer. The toolkit initialises them as a copy of the
    model's own final norm and projection (``finetune.objectives.tsl_heads.tsl_heads_from_model``), so at
    initialisation they map states exactly as ``DualEncoder.project_image_states`` /
    ``project_text_states`` do, and then train on their own: TSL's gradients reach the encoders through
    these heads without moving the model's projections. The toolkit registers the class as an inference
    module (``tsl.heads``, in ``finetune.objectives.tsl_heads``), so it is saved and restored with the model
    (``attach_tsl_heads``); the model's embeddings never use it.

    Args:
        image_width, text_width: ``W`` of the image and text states.
        dim: ``D``, the joint embedding width.
        image_bias, text_bias: whether the linear layers have a bias (as the model's projections).
        image_eps, text_eps: the LayerNorms' eps (as the model's final norms).
    """

    def __init__(self, image_width: int, text_width: int, dim: int, *, image_bias: bool = False,
                 text_bias: bool = False, image_eps: float = 1e-5, text_eps: float = 1e-5) -> None:
        super().__init__()
        for name, value in (("image_width", image_width), ("text_width", text_width), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TSLHeads: {name} must be an integer >= 1, got {value!r}")
        check_number("image_eps", image_eps, low=0.0, above=True, where="TSLHeads")
        check_number("text_eps", text_eps, low=0.0, above=True, where="TSLHeads")
        self._config = {"image_width": int(image_width), "text_width": int(text_width), "dim": int(dim),
                        "image_bias": bool(image_bias), "text_bias": bool(text_bias), "image_eps": float(image_eps),
                        "text_eps": float(text_eps)}
        self.image = _NormLinear(image_width, dim, bias=image_bias, eps=image_eps)
        self.text = _NormLinear(text_width, dim, bias=text_bias, eps=text_eps)

    def inference_config(self) -> dict[str, Any]:
        """The init kwargs that rebuild these heads (written into ``xlipkit_inference.json``)."""
        return dict(self._config)

    def project_image_states(self, x: Tensor) -> Tensor:
        """psi_v: ``(..., W_image)`` -> ``(..., D)``."""
        return self.image(x)

    def project_text_states(self, x: Tensor) -> Tensor:
        """psi_t: ``(..., W_text)`` -> ``(..., D)``."""
        return self.text(x)


# --- the loss (eq. 14) -------------------------------------------------------------------------------


def _check_pair(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    for name, x in ((name_a, a), (name_b, b)):
        if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
            got = (x.dtype, tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a (B, D) floating-point tensor, got {got}")
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must be paired row by row "
                         "with the same embedding width")


def tsl_similarity_loss(
    pooled_embeds: Tensor,
    target_embeds: Tensor,
    *,
    form: str = "matrix",
    valid: Tensor | None = None,
    weights: Tensor | None = None,
    gather: bool | None = None,
) -> Tensor:
    """One modality of FAST-GOAL eq. 14: ``MSE(sim(pooled, target), I)``.

    ``form="matrix"`` (the paper): ``sim`` is the n x n cosine matrix of the (global) batch,
    ``cos(pooled_i, target_j)``, and the MSE is the mean of ``(sim - I)^2`` over its n^2 entries.
    ``form="diagonal"`` (the GOAL code): the mean over the n pairs of ``(cos(pooled_i, target_i) - 1)^2``.
    No temperature.

    The two forms weigh the pairs differently: the matrix form gives each of its n^2 cells 1 / n^2, so
    the n pairs (the diagonal) hold 1 / n of its weight (0.39 % at n = 256) and the n^2 - n cells of
    unrelated crops / sentences the rest; the gradient on a pair's cosine is ``2 (cos - 1) / n^2``. The
    diagonal form puts all its weight on the pairs, ``2 (cos - 1) / n``: n times more per pair, and
    nothing pushes unrelated pairs apart. Which one the paper's numbers used: README, FAST-GOAL.

    Args:
        pooled_embeds: ``(B, D)`` raw projected pooled states (``P_l`` or ``S_l``).
        target_embeds: ``(B, D)`` raw embeddings of the local crops / sentences (``v_l``, ``t_l``).
        form: ``"matrix"`` or ``"diagonal"``.
        valid: optional ``(B,)`` bool; pairs marked False leave the batch (neither rows nor columns);
            n counts the valid pairs of every rank. No valid pair: 0 with the graph intact.
        weights: optional ``(B,)`` floating per-pair weights (FAST-GOAL Table VIII's similarity-weighted
            top-3), finite and >= 0 (checked on the device, :mod:`losses.checks`): each pair's row of squared
            errors is multiplied by its weight; the normaliser stays n^2 (``matrix``) or n (``diagonal``).
        gather: ``None`` gathers across ranks when a process group of size > 1 is initialised; rows
            are local, columns gathered with autograd, and the value is scaled so that the mean over
            ranks equals the single-process loss on the concatenated batch. Every rank must pass the
            same B.

    Returns:
        Scalar loss; 0 with the graph intact for an empty batch or when no pair is valid.

    Raises:
        ValueError: naming the argument: ``form``, shapes that do not pair, a ``valid`` that is not a
            ``(B,)`` bool tensor, ``weights`` that are not a ``(B,)`` floating tensor of finite values >= 0.
    """
    if form not in TSL_FORMS:
        raise ValueError(f"TSL form must be one of {TSL_FORMS}, got {form!r}")
    _check_pair("pooled_embeds", pooled_embeds, "target_embeds", target_embeds)
    batch = pooled_embeds.shape[0]
    valid = _check_valid(valid, batch)
    if weights is not None:
        if not isinstance(weights, Tensor) or weights.shape != (batch,) or not weights.is_floating_point():
            got = (weights.dtype, tuple(weights.shape)) if isinstance(weights, Tensor) else type(weights).__name__
            raise ValueError(f"tsl_similarity_loss: weights must be a ({batch},) floating tensor, got {got}")
        if batch:
            device_check((torch.isfinite(weights) & (weights >= 0)).all(),
                         "tsl_similarity_loss: weights must be finite and >= 0")
    pooled = F.normalize(pooled_embeds, dim=-1)
    target = F.normalize(target_embeds, dim=-1)
    rank, world = world_info() if should_gather(gather) else (0, 1)
    # masks, not boolean indexing: no host read of the validity (the step stays free of device syncs)
    local_valid = valid.to(pooled.device) if valid is not None else torch.ones(batch, dtype=torch.bool,
                                                                                  device=pooled.device)
    all_valid = gather_with_grad(local_valid) if world > 1 else local_valid
    n = all_valid.sum().clamp(min=1).to(pooled.dtype)
    row_weight = local_valid.to(pooled.dtype)
    if weights is not None:
        row_weight = row_weight * weights.to(device=pooled.device, dtype=pooled.dtype)
    if form == "diagonal":
        errors = ((pooled * target).sum(dim=-1) - 1) ** 2  # (B,)
        return torch.where(local_valid, errors * row_weight, 0.0).sum() * (world / n)
    columns = gather_with_grad(target) if world > 1 else target
    sim = pooled @ columns.T  # (B, world * B): local rows against every rank's columns
    own = torch.arange(batch, device=pooled.device) + rank * batch
    # a comparison, not F.one_hot: one_hot checks its indices' range on the host (off CUDA)
    eye = (own[:, None] == torch.arange(sim.shape[1], device=sim.device)[None, :]).to(sim.dtype)
    cells = torch.where(all_valid[None, :], (sim - eye) ** 2, 0.0)  # invalid pairs leave the columns ...
    errors = cells.sum(dim=1)
    return torch.where(local_valid, errors * row_weight, 0.0).sum() * (world / n**2)  # ... and the rows


def tsl_loss(
    box_embeds: Tensor,
    crop_embeds: Tensor,
    span_embeds: Tensor,
    sentence_embeds: Tensor,
    *,
    form: str = "matrix",
    box_valid: Tensor | None = None,
    span_valid: Tensor | None = None,
    weights: Tensor | None = None,
    gather: bool | None = None,
) -> Tensor:
    """FAST-GOAL's token similarity loss (eq. 14):
    ``MSE(sim(P_l, v_l^cls), I) + MSE(sim(S_l, t_l^cls), I)``.

    Args:
        box_embeds: ``(B, D)`` ``P_l = psi_v(P_m)``, the projected box-pooled patch states (eq. 10).
        crop_embeds: ``(B, D)`` ``v_l^cls``, the embeddings of the local crops (eq. 5).
        span_embeds: ``(B, D)`` ``S_l = psi_t(S_m)``, the projected span-pooled token states (eq. 8).
        sentence_embeds: ``(B, D)`` ``t_l^cls``, the embeddings of the sentences encoded alone (eq. 3).
        form: ``"matrix"`` (n x n cosine matrices against I, the paper) or ``"diagonal"``
            (``MSE(diag, 1)``, the GOAL code); see :func:`tsl_similarity_loss`.
        box_valid: optional ``(B,)`` bool, pairs that take part in the image term.
        span_valid: optional ``(B,)`` bool, pairs that take part in the text term
            (``SentenceSpans.valid``: sentences cut by truncation are dropped).
        weights: optional ``(B,)`` per-pair weights, applied to both terms.
        gather: as :func:`tsl_similarity_loss` (``None``: gather when distributed).

    Returns:
        Scalar loss, the sum of the image and the text term.
    """
    image = tsl_similarity_loss(box_embeds, crop_embeds, form=form, valid=box_valid, weights=weights, gather=gather)
    text = tsl_similarity_loss(span_embeds, sentence_embeds, form=form, valid=span_valid, weights=weights,
                               gather=gather)
    return image + text
