"""Box -> patch geometry: where a box in an image's pixels lands on the network input, through the image
processor's exact resize and centre crop, and which patches of the input it covers (DESIGN 2).

Used by StructXLIP's pooled regions (``regions.encode: pool``) and FAST-GOAL's TSL box pooling. The transform
is described by ``DualEncoder.image_transform_params()``: ``mode`` (``shortest_center_crop``, ``shortest``,
``squash``, ``longest_pad`` or ``naflex``), ``size``, ``crop``, ``patch_size`` and ``crop_offset`` (how the
centre crop rounds: ``floor``, transformers, the default; ``round``, torchvision / open_clip).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["box_patch_mask", "input_geometry", "naflex_grid", "patch_count", "resize_shortest", "visible_box"]


def resize_shortest(width: int, height: int, size: int) -> tuple[int, int]:
    """``(new_w, new_h)`` of an image resized so that its shorter side is ``size`` (aspect kept, the
    longer side truncated), as transformers' ``get_resize_output_image_size(default_to_square=False)``
    and torchvision's ``Resize(int)`` compute it."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def _crop_offset(excess: int, params: dict[str, Any]) -> int:
    """Pixels a centre crop cuts before the kept part, out of ``excess`` cut in all: transformers
    processors floor the half (``excess // 2``), torchvision's ``CenterCrop`` (open_clip) rounds it
    (``int(round(excess / 2))``, half to even); ``params["crop_offset"]`` names which (default floor)."""
    rule = params.get("crop_offset", "floor")
    if rule == "floor":
        return excess // 2
    if rule == "round":
        return int(round(excess / 2.0))
    raise ValueError(f"input_geometry: crop_offset must be 'floor' or 'round', got {rule!r}")


def input_geometry(
    width: int, height: int, params: dict[str, Any], spatial_shape: tuple[int, int] | None = None
) -> tuple[float, float, float, float, int, int]:
    """How the image processor maps an image of ``width`` x ``height`` onto the network input.

    Args:
        params: ``DualEncoder.image_transform_params()``.
        spatial_shape: NaFlex ``(rows, cols)`` of this image.

    Returns:
        ``(scale_x, scale_y, offset_x, offset_y, input_w, input_h)``: a pixel x of the image lands at
        ``x * scale_x - offset_x`` of the input (likewise y).
    """
    mode = params["mode"]
    if mode == "naflex":
        if spatial_shape is None:
            raise ValueError("a NaFlex model needs the image's spatial_shapes to map boxes to patches")
        p = int(params["patch_size"])
        rows, cols = spatial_shape
        return cols * p / width, rows * p / height, 0.0, 0.0, cols * p, rows * p
    size, crop = params["size"], params.get("crop")
    if mode in ("shortest_center_crop", "shortest"):
        new_w, new_h = resize_shortest(width, height, int(size))
        in_h, in_w = (int(crop[0]), int(crop[1])) if crop else (new_h, new_w)
        off_x, off_y = _crop_offset(new_w - in_w, params), _crop_offset(new_h - in_h, params)
        return new_w / width, new_h / height, float(off_x), float(off_y), in_w, in_h
    if mode == "squash":
        in_h, in_w = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
        return in_w / width, in_h / height, 0.0, 0.0, in_w, in_h
    if mode == "longest_pad":
        in_h, in_w = (int(crop[0]), int(crop[1])) if crop else ((int(size),) * 2 if isinstance(size, int) else size)
        scale = max(in_h, in_w) / max(width, height)
        new_w, new_h = int(round(width * scale)), int(round(height * scale))
        return scale, scale, -float(round((in_w - new_w) / 2)), -float(round((in_h - new_h) / 2)), in_w, in_h
    raise ValueError(f"input_geometry: unknown image transform mode {mode!r} (expected naflex, shortest_center_crop, "
                     "shortest, squash or longest_pad); the model's image_transform_params() must name one")


def naflex_grid(width: int, height: int, params: dict[str, Any]) -> tuple[int, int]:
    """NaFlex ``(rows, cols)`` of an image of ``width`` x ``height``: the patch grid SigLIP2's image
    processor resizes it to (``get_image_size_for_max_num_patches`` of transformers, the function the
    processor itself calls), so that boxes can be mapped before the processor has run.

    Args:
        params: ``DualEncoder.image_transform_params()`` with ``mode == "naflex"``, ``patch_size`` and
            ``max_num_patches``.
    """
    from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

    p = int(params["patch_size"])
    new_h, new_w = get_image_size_for_max_num_patches(int(height), int(width), p, int(params["max_num_patches"]))
    return new_h // p, new_w // p


def visible_box(
    width: int, height: int, params: dict[str, Any], spatial_shape: tuple[int, int] | None = None
) -> tuple[float, float, float, float]:
    """The part of an image of ``width`` x ``height`` that lands on the network input's patch grid, in
    pixels of the original image ``(x1, y1, x2, y2)``: what is left after the processor's resize and
    centre crop (a 1000 x 500 image under CLIP's 224 shortest-side resize and 224 x 224 centre crop
    keeps x 250-750). The whole image for transforms that crop nothing (squash, padding, NaFlex).

    Args:
        params: ``DualEncoder.image_transform_params()``.
        spatial_shape: NaFlex ``(rows, cols)`` (not needed: NaFlex keeps the whole image).
    """
    if params["mode"] == "naflex":
        return 0.0, 0.0, float(width), float(height)
    sx, sy, ox, oy, in_w, in_h = input_geometry(width, height, params, spatial_shape)
    p = int(params["patch_size"])
    grid_w, grid_h = (in_w // p) * p, (in_h // p) * p
    return (max(0.0, ox / sx), max(0.0, oy / sy), min(float(width), (grid_w + ox) / sx),
            min(float(height), (grid_h + oy) / sy))


def box_patch_mask(
    box: tuple[float, float, float, float] | list[float],
    image_size: tuple[int, int],
    params: dict[str, Any],
    *,
    n_patches: int | None = None,
    spatial_shape: tuple[int, int] | None = None,
    cover: str = "centre",
) -> Tensor | None:
    """The patches of the network input that a region box covers (``regions.encode: pool``, TSL).

    The box ``(x1, y1, x2, y2)`` in pixels of the original image is mapped through the processor's exact
    resize and centre crop (:func:`input_geometry`). With ``cover="centre"`` (StructXLIP's pooled
    regions) a patch belongs to the region when its centre lies in the mapped box, and a box that holds
    no patch centre takes the patch under its own centre. With ``cover="overlap"`` (FAST-GOAL appendix C,
    Algorithm 1) the mapped box is clipped to the patch grid and every patch it overlaps belongs to the
    region: columns ``floor(x1 / p)`` to ``ceil(x2 / p)`` (exclusive), rows likewise, so a box inside one
    patch takes that patch.

    Args:
        image_size: ``(width, height)`` of the original image.
        params: ``DualEncoder.image_transform_params()``.
        n_patches: length of the mask (NaFlex: the padded patch count); default rows x cols.
        spatial_shape: NaFlex ``(rows, cols)`` of this image.
        cover: ``"centre"`` or ``"overlap"`` (see above).

    Returns:
        ``(N,)`` bool mask in the row-major patch order of the states, or ``None`` when the box lies
        outside the input (cut away by the centre crop) or, with ``"overlap"``, has no area there.
    """
    if cover not in ("centre", "overlap"):
        raise ValueError(f"box_patch_mask: cover must be 'centre' or 'overlap', got {cover!r}")
    width, height = image_size
    sx, sy, ox, oy, in_w, in_h = input_geometry(width, height, params, spatial_shape)
    p = int(params["patch_size"])
    rows, cols = in_h // p, in_w // p
    x1, y1, x2, y2 = (box[0] * sx - ox, box[1] * sy - oy, box[2] * sx - ox, box[3] * sy - oy)
    if cover == "overlap":
        inside = _overlapped_patches((x1, y1, x2, y2), p, rows, cols)
        if inside is None:
            return None
        return _grid_to_mask(inside, rows, cols, n_patches)
    centres_x = (torch.arange(cols, dtype=torch.float32) + 0.5) * p
    centres_y = (torch.arange(rows, dtype=torch.float32) + 0.5) * p
    inside = ((centres_y >= y1) & (centres_y <= y2))[:, None] & ((centres_x >= x1) & (centres_x <= x2))[None, :]
    if not bool(inside.any()):
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        if not (0 <= cx < cols * p and 0 <= cy < rows * p):
            return None
        inside[int(cy // p), int(cx // p)] = True
    return _grid_to_mask(inside, rows, cols, n_patches)


# Mapped coordinates are products of float scales: a box edge that lands on a patch boundary up to
# rounding (112.00000000000001) must not take the next row or column.
_BOUNDARY_TOLERANCE = 1e-6


def _overlapped_patches(box: tuple[float, float, float, float], p: int, rows: int, cols: int) -> Tensor | None:
    """``(rows, cols)`` bool grid of the patches a box in input pixels overlaps (clipped to the grid),
    or None when nothing of it with positive area lies on the grid."""
    x1, y1, x2, y2 = (min(max(v, 0.0), limit) for v, limit in
                      zip(box, (cols * p, rows * p, cols * p, rows * p)))
    if x2 <= x1 or y2 <= y1:
        return None
    c1 = math.floor(x1 / p + _BOUNDARY_TOLERANCE)
    r1 = math.floor(y1 / p + _BOUNDARY_TOLERANCE)
    c2 = max(math.ceil(x2 / p - _BOUNDARY_TOLERANCE), c1 + 1)
    r2 = max(math.ceil(y2 / p - _BOUNDARY_TOLERANCE), r1 + 1)
    inside = torch.zeros(rows, cols, dtype=torch.bool)
    inside[min(r1, rows - 1) : min(r2, rows), min(c1, cols - 1) : min(c2, cols)] = True
    return inside


def _grid_to_mask(inside: Tensor, rows: int, cols: int, n_patches: int | None) -> Tensor:
    flat = inside.flatten()
    total = n_patches or rows * cols
    if total < flat.numel():
        raise ValueError(f"the patch grid {rows}x{cols} does not fit in {total} patch states")
    mask = torch.zeros(total, dtype=torch.bool)
    mask[: flat.numel()] = flat
    return mask



def patch_count(params: dict[str, Any]) -> int:
    """Patches ``N = rows x cols`` of a fixed-size network input (``DualEncoder.image_transform_params()``
    with ``crop`` or ``size`` and ``patch_size``); NaFlex inputs vary per image and have no fixed count."""
    crop = params.get("crop") or params.get("size")
    h, w = (crop, crop) if isinstance(crop, int) else crop
    p = int(params["patch_size"])
    return (int(h) // p) * (int(w) // p)
