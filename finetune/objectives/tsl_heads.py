"""FAST-GOAL's TSL glue to the model (paper III-B, eqs. 7-10): what :mod:`losses.tsl` leaves to the toolkit.

``losses.tsl`` holds TSL's tensor functions and needs torch only. Here is what needs a model, its image
processor's geometry or the toolkit's inference-module registry:

* :func:`tsl_sentence_spans`: each pair's sentence span in ``model.tokenize(captions)`` (eq. 7), through
  ``DualEncoder.sentence_spans`` and :func:`losses.tsl.select_sentence_spans`;
* :class:`BoxGeometry` and :func:`box_patch_masks` (eq. 9, appendix C): boxes in original-image pixels ->
  the patches they cover, through :mod:`finetune.preprocess.geometry`; :func:`losses.tsl.pool_box_states`
  (``pool_box_states(states, boxes, BoxGeometry.from_model(model, image_sizes))``) and
  :func:`losses.tsl.pool_patch_states` then pool the states under them;
* :func:`tsl_heads_from_model` and :func:`attach_tsl_heads` (eqs. 8, 10, option ``heads: new``):
  :class:`losses.tsl.TSLHeads` initialised as a copy of the model's final norms and projections and kept in
  ``model.inference_modules["tsl_heads"]``; the class is registered here as the inference module
  ``tsl.heads``, so it is saved and restored with the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from finetune.models.inference_modules import register_inference_module
from finetune.preprocess.geometry import box_patch_mask, patch_count
from losses.tsl import SentenceSpans, TSLHeads, select_sentence_spans

__all__ = [
    "BoxGeometry",
    "TSL_HEADS_NAME",
    "attach_tsl_heads",
    "box_patch_masks",
    "tsl_heads_from_model",
    "tsl_sentence_spans",
]

TSL_HEADS_NAME = "tsl_heads"
"""The key of :class:`losses.tsl.TSLHeads` in ``model.inference_modules`` (see :func:`attach_tsl_heads`)."""

register_inference_module(TSLHeads, name="tsl.heads")


# --- text: sentence spans (eq. 7) ------------------------------------------------------------------


def tsl_sentence_spans(model: Any, captions: list[str], sentence_index: Sequence[int | None]) -> SentenceSpans:
    """:func:`select_sentence_spans` of ``model.sentence_spans(captions)``: the spans refer to the rows
    of ``model.tokenize(captions)`` (right padding; tokenise the same list of captions)."""
    return select_sentence_spans(model.sentence_spans(list(captions)), sentence_index)


# --- image: box pooling (eq. 9) ----------------------------------------------------------------------


@dataclass(frozen=True)
class BoxGeometry:
    """Where boxes given in original-image pixels land on the patch states of a batch.

    Attributes:
        image_sizes: ``(B, 2)`` ``(width, height)`` of each original image (PIL's ``image.size``), the
            frame the boxes are given in.
        params: ``DualEncoder.image_transform_params()``: the processor's exact resize and centre
            crop, and the model's patch size (14 for ViT-L/14, 16 for ViT-B/16).
        spatial_shapes: NaFlex only, ``(B, 2)`` per-image patch grid ``(rows, cols)``
            (``ImageFeatures.spatial_shapes``, or ``preprocess_images``'s ``spatial_shapes``).
        cover: which patches a box selects: ``"overlap"`` (FAST-GOAL appendix C: every patch the
            box overlaps, the default) or ``"centre"`` (patches whose centre lies in the box, as
            StructXLIP's pooled regions); see ``finetune.preprocess.geometry.box_patch_mask``.
    """

    image_sizes: Sequence[Sequence[int]] | Tensor
    params: Mapping[str, Any]
    spatial_shapes: Sequence[Sequence[int]] | Tensor | None = None
    cover: str = "overlap"

    def __post_init__(self) -> None:
        if self.cover not in ("overlap", "centre"):
            raise ValueError(f"BoxGeometry.cover must be 'overlap' (FAST-GOAL appendix C) or 'centre', got "
                             f"{self.cover!r}")

    @classmethod
    def from_model(
        cls,
        model: Any,
        image_sizes: Sequence[Sequence[int]] | Tensor,
        *,
        spatial_shapes: Sequence[Sequence[int]] | Tensor | None = None,
        cover: str = "overlap",
    ) -> BoxGeometry:
        """The geometry of ``model``'s image processor for a batch of images of ``image_sizes``.

        Raises:
            ValueError: the model has no ``patch_geometry`` capability (no transform params).
        """
        params = model.image_transform_params()
        if params is None:
            raise ValueError(f"{type(model).__name__} does not describe its image transform "
                             "(image_transform_params() is None), so boxes cannot be mapped to its patches")
        return cls(image_sizes, params, spatial_shapes, cover)

    def box_patch_masks(
        self, boxes: Tensor | Sequence[Sequence[float]], n_patches: int, *, valid: Tensor | None = None,
        outside: str = "raise",
    ) -> Tensor:
        """:func:`box_patch_masks` of ``boxes`` on this geometry: ``(B, N)`` bool. This method is what
        :func:`losses.tsl.pool_box_states` calls, so ``pool_box_states(states, boxes, geometry)`` works with
        a :class:`BoxGeometry`."""
        return box_patch_masks(boxes, self, n_patches, valid=valid, outside=outside)


def _check_valid(valid: Tensor | None, batch: int) -> Tensor | None:
    if valid is not None and (not isinstance(valid, Tensor) or valid.dtype != torch.bool
                              or tuple(valid.shape) != (batch,)):
        got = (valid.dtype, tuple(valid.shape)) if isinstance(valid, Tensor) else type(valid).__name__
        raise ValueError(f"valid must be a ({batch},) bool tensor, got {got}")
    return valid


def _boxes_tensor(boxes: Tensor | Sequence[Sequence[float]]) -> Tensor:
    out = boxes.detach().double().cpu() if isinstance(boxes, Tensor) else torch.as_tensor(boxes, dtype=torch.float64)
    if out.dim() != 2 or out.shape[1] != 4:
        raise ValueError(f"boxes must be a (B, 4) tensor of (x1, y1, x2, y2) pixels, got {tuple(out.shape)}")
    return out


def box_patch_masks(
    boxes: Tensor | Sequence[Sequence[float]],
    geometry: BoxGeometry,
    n_patches: int,
    *,
    valid: Tensor | None = None,
    outside: str = "raise",
) -> Tensor:
    """The patches each box selects (FAST-GOAL eq. 9's set B), as ``(B, N)`` bool masks.

    A box ``(x1, y1, x2, y2)`` in original-image pixels is mapped through the processor's resize and
    centre crop; the part outside the crop is clipped away; with the default ``cover="overlap"``
    every patch it overlaps is selected (``floor`` of the top-left corner to ``ceil`` of the
    bottom-right one in patch units, FAST-GOAL appendix C), so a box smaller than a patch selects the
    patch under it.

    Args:
        boxes: ``(B, 4)`` boxes in pixels of the original images.
        geometry: :class:`BoxGeometry` of the batch.
        n_patches: ``N``, the number of patch states per image (NaFlex: the padded count).
        valid: optional ``(B,)`` bool; rows marked False get an all-False mask and are not checked.
        outside: what a box of zero area or one entirely outside the network input (cut away by the
            centre crop) does: ``"raise"`` (the default), or ``"drop"``: its row is all False, so that
            ``masks.any(dim=1)`` says which boxes can be pooled (a collate function decides there, on
            the CPU, what a training step then only masks).

    Returns:
        ``(B, N)`` bool, row-major patch order of ``ImageFeatures.states``.

    Raises:
        ValueError: (``outside="raise"``) a box of zero area, or one entirely outside the crop (the
            message names the sample); a geometry that does not match the batch (sizes, NaFlex shapes,
            patch count).
    """
    if outside not in ("raise", "drop"):
        raise ValueError(f"box_patch_masks: outside must be 'raise' or 'drop', got {outside!r}")
    boxes = _boxes_tensor(boxes)
    batch = boxes.shape[0]
    valid = _check_valid(valid, batch)
    sizes = torch.as_tensor(geometry.image_sizes).tolist()
    if len(sizes) != batch:
        raise ValueError(f"BoxGeometry has {len(sizes)} image sizes for {batch} boxes")
    params = dict(geometry.params)
    naflex = params.get("mode") == "naflex"
    shapes = None
    if geometry.spatial_shapes is not None:
        shapes = torch.as_tensor(geometry.spatial_shapes).tolist()
        if len(shapes) != batch:
            raise ValueError(f"BoxGeometry has {len(shapes)} spatial shapes for {batch} boxes")
    elif naflex:
        raise ValueError("a NaFlex model's boxes need BoxGeometry.spatial_shapes (ImageFeatures.spatial_shapes)")
    if not naflex:
        grid = patch_count(params)
        if grid != n_patches:
            raise ValueError(f"the states hold {n_patches} patches per image but the model's input geometry has "
                             f"{grid} (patch size {params.get('patch_size')}); the states and the geometry come from "
                             "different models or inputs")
    use = [True] * batch if valid is None else valid.cpu().tolist()
    masks = torch.zeros(batch, n_patches, dtype=torch.bool)
    for b, box in enumerate(boxes.tolist()):
        if not use[b]:
            continue
        x1, y1, x2, y2 = box
        if not x2 > x1 or not y2 > y1:
            if outside == "drop":
                continue
            raise ValueError(f"sample {b}: box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) has zero area (x2 <= x1 or y2 <= y1); "
                             "boxes are (x1, y1, x2, y2) pixels of the original image")
        shape = tuple(int(v) for v in shapes[b]) if shapes is not None else None
        mask = box_patch_mask(box, (int(sizes[b][0]), int(sizes[b][1])), params, n_patches=n_patches,
                              spatial_shape=shape, cover=geometry.cover)
        if mask is None:
            if outside == "drop":
                continue
            raise ValueError(f"sample {b}: box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) lies entirely outside the network "
                             f"input of its {int(sizes[b][0])}x{int(sizes[b][1])} image (cut away by the processor's "
                             "centre crop): no patch state covers it")
        masks[b] = mask
    return masks


# --- projections psi_v, psi_t (eqs. 8, 10) ---------------------------------------------------------


def _norm_and_projection(model: Any, side: str) -> tuple[nn.Module, Tensor, Tensor | None]:
    """The final norm and the linear projection ``(D, W)`` weight (+ bias) of a tower whose head is
    ``projection(norm(x))``: transformers CLIP (both towers), SigLIP's text tower, open_clip CLIP."""
    inner = getattr(model, "model", model)
    if side == "image":
        vm = getattr(inner, "vision_model", None)
        if vm is not None and hasattr(inner, "visual_projection"):
            lin = inner.visual_projection
            return vm.post_layernorm, lin.weight, lin.bias
        visual = getattr(inner, "visual", None)
        if visual is not None and hasattr(visual, "ln_post") and not hasattr(visual, "trunk"):
            if visual.proj is None:
                raise ValueError("heads: new needs an image projection; this open_clip tower has none")
            return visual.ln_post, visual.proj.T, None
        raise ValueError(f"heads: new copies the image tower's final norm + linear projection, and "
                         f"{type(model).__name__}'s image head is not one (e.g. SigLIP's attention-pooling head); "
                         "use the model's own head (heads: own)")
    tm = getattr(inner, "text_model", None)
    if tm is not None:
        lin = getattr(inner, "text_projection", None) or getattr(tm, "head", None)
        if isinstance(lin, nn.Linear):
            return tm.final_layer_norm, lin.weight, lin.bias
    text = getattr(inner, "text", inner)
    ln, proj = getattr(text, "ln_final", None), getattr(text, "text_projection", None)
    if ln is not None and isinstance(proj, nn.Linear):
        return ln, proj.weight, proj.bias
    if ln is not None and isinstance(proj, Tensor):
        return ln, proj.T, None
    raise ValueError(f"heads: new copies the text tower's final norm + linear projection, and "
                     f"{type(model).__name__}'s text head is not one; use the model's own head (heads: own)")


def tsl_heads_from_model(model: Any) -> TSLHeads:
    """:class:`losses.tsl.TSLHeads` copied from ``model``'s final norms and projections, on its device and
    dtype: at initialisation ``heads.project_image_states`` / ``project_text_states`` equal the model's own
    ``project_image_states`` / ``project_text_states`` (FAST-GOAL eqs. 8, 10, option ``heads: new``).

    Raises:
        ValueError: a tower whose head is not a norm + linear projection (SigLIP's image tower).
    """
    image_norm, image_w, image_b = _norm_and_projection(model, "image")
    text_norm, text_w, text_b = _norm_and_projection(model, "text")
    if image_w.shape[0] != text_w.shape[0]:
        raise ValueError(f"the image and text projections map to different widths ({image_w.shape[0]} and "
                         f"{text_w.shape[0]})")
    heads = TSLHeads(int(image_w.shape[1]), int(text_w.shape[1]), int(image_w.shape[0]),
                     image_bias=image_b is not None, text_bias=text_b is not None,
                     image_eps=float(getattr(image_norm, "eps", 1e-5)), text_eps=float(getattr(text_norm, "eps", 1e-5)))
    heads.to(device=image_w.device, dtype=image_w.dtype)
    heads.image.copy_from(image_norm, image_w, image_b)
    heads.text.copy_from(text_norm, text_w, text_b)
    return heads


def attach_tsl_heads(model: Any) -> TSLHeads:
    """``model.inference_modules["tsl_heads"]``, created with :func:`tsl_heads_from_model` when the model
    does not hold one yet (a model loaded from a run that trained them keeps its trained heads).

    The heads' parameters are then part of ``model.parameters()`` (trained, saved with ``final/`` and
    adapters, pushed, restored by ``load_finetuned``)."""
    modules = model.inference_modules
    if TSL_HEADS_NAME not in modules:
        modules[TSL_HEADS_NAME] = tsl_heads_from_model(model)
    heads = modules[TSL_HEADS_NAME]
    if not isinstance(heads, TSLHeads):
        raise ValueError(f"model.inference_modules[{TSL_HEADS_NAME!r}] holds a {type(heads).__name__}, not TSLHeads")
    return heads
