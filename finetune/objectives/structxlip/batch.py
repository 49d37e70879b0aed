"""StructXLIP's batches, made in the data workers (:meth:`StructXLIPTerm.collate
<finetune.objectives.structxlip.term.StructXLIPTerm.collate>`): edge maps, filtered captions, and the local loss's
chunks and regions at a fixed number of rows per sample.

Chunks and regions vary in number from sample to sample. Every sample gets the same number of rows (the run's
capacity, :class:`~finetune.objectives.shapes.BatchShapes`, the most of any example of the training set; without
planned shapes the batch's most), the padded ones marked invalid in ``chunk_valid`` / ``region_valid``, so that the
image and text passes of every step have one shape (issue 29) while the losses see only the real rows: padded
chunks hold the empty text and have no positive, padded crops repeat the batch's first edge map, padded patch
masks select nothing, and none of them is a positive or a negative of any chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from finetune.objectives.shapes import (SHORT, TEXT, ShapeScan, dataset_columns, empty_text_row, pad_rows,
                                        pad_token_id)
from finetune.preprocess.geometry import box_patch_mask, patch_count

#: the capacity keys of :class:`~finetune.objectives.shapes.BatchShapes` (rows per sample)
CHUNKS, REGIONS = "structxlip/chunks", "structxlip/regions"


def collate_batch(term: Any, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
    """``{"structxlip": {...}}`` of a batch (see :meth:`StructXLIPTerm.collate` for the fields)."""
    filtered = model.tokenize([e["sx_filtered"] for e in examples])
    sx: dict[str, Any] = {
        "edge_inputs": dict(model.preprocess_images([e["sx_edges"] for e in examples])),
        "filtered_input_ids": filtered.input_ids,
        "filtered_attention_mask": filtered.attention_mask,
    }
    if term.use_local:
        sx.update(collate_chunks(term, examples, model))
        if term.options.regions.encode == "crop":
            sx.update(collate_crops(term, examples, model, sx["edge_inputs"]))
        else:
            sx.update(collate_patch_masks(term, examples, model, sx["edge_inputs"]))
    return {"structxlip": sx}


def capacity(term: Any, key: str, most: int) -> int:
    """Rows per sample of ``key`` (:data:`CHUNKS`, :data:`REGIONS`): the run's fixed capacity (``term.shapes``),
    else this batch's ``most``.

    Raises:
        ValueError: a sample of the batch has more rows than the capacity planned from the training set.
    """
    cap = term.shapes.capacity(key) if term.shapes is not None else None
    if cap is None:
        return most
    if most > cap:
        what = key.split("/")[-1]
        raise ValueError(f"structxlip: a sample of this batch has {most} {what}, more than the {cap} per sample "
                         "planned before training from the training set (finetune.objectives.shapes): the batch "
                         "does not come from the preprocessed training set the run was planned on")
    return cap


def collate_chunks(term: Any, examples: list[dict[str, Any]], model: Any) -> dict[str, Tensor]:
    """``chunk_input_ids`` / ``chunk_attention_mask`` ``(B, C, Lc)`` (Lc the batch's longest chunk), ``chunk_valid``
    ``(B, C)`` and ``chunk_topk`` ``(B, C, K)`` (-1 padded)."""
    k = term.options.regions.k
    counts = [len(e["sx_chunks"]) for e in examples]
    c = capacity(term, CHUNKS, max(counts, default=0))
    fill_ids, fill_mask = empty_text_row(model)
    chunks = [t for e in examples for t in e["sx_chunks"]]
    if chunks:
        tok = model.tokenize(chunks)
        ids, mask = trim(tok.input_ids, tok.attention_mask, model)
    else:
        ids = mask = torch.zeros((0, fill_ids.shape[0]), dtype=torch.long)
    width = max(ids.shape[1], fill_ids.shape[0])
    pad = pad_token_id(model)

    def widen(t: Tensor, value: int) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=value)

    ids, mask, fill_ids, fill_mask = widen(ids, pad), widen(mask, 0), widen(fill_ids, pad), widen(fill_mask, 0)
    topk = torch.full((len(examples), c, k), -1, dtype=torch.long)
    for i, e in enumerate(examples):
        for j, row in enumerate(e["sx_topk"][:c]):
            topk[i, j, : len(row[:k])] = torch.tensor(row[:k], dtype=torch.long)
    return {"chunk_input_ids": torch.stack([pad_rows(t, c, fill_ids) for t in ids.split(counts)]),
            "chunk_attention_mask": torch.stack([pad_rows(t, c, fill_mask) for t in mask.split(counts)]),
            "chunk_valid": torch.arange(c)[None, :] < torch.tensor(counts)[:, None],
            "chunk_topk": topk}


def collate_crops(term: Any, examples: list[dict[str, Any]], model: Any, edge_inputs: dict[str, Tensor]) -> dict:
    """Crop mode: ``region_inputs`` ``{name: (B, P, ...)}`` (the crops through the model's processor, padded with
    the batch's first edge map), ``region_slot`` and ``region_valid`` ``(B, P)``."""
    n_crops = [len(e["sx_crops"]) for e in examples]
    p = capacity(term, REGIONS, max(n_crops, default=0))
    crops = [c for e in examples for c in e["sx_crops"]]
    region_inputs: dict[str, Tensor] = {}
    if p:
        processed = dict(model.preprocess_images(crops)) if crops else {n: t[:0] for n, t in edge_inputs.items()}
        region_inputs = {name: torch.stack([pad_rows(part, p, edge_inputs[name][0]) for part in t.split(n_crops)])
                         for name, t in processed.items()}
    return {**region_slots([list(e["sx_slots"]) for e in examples], p), "region_inputs": region_inputs}


def collate_patch_masks(term: Any, examples: list[dict[str, Any]], model: Any, edge_inputs: dict[str, Tensor]
                        ) -> dict:
    """Pool mode: ``region_patch_mask`` ``(B, P, N)`` (each kept region's patches of the edge map, through the
    processor's exact resize and centre crop; a region the crop cut away is dropped), ``region_slot`` and
    ``region_valid`` ``(B, P)``."""
    if term._transform is None:
        model.require("patch_geometry", "StructXLIP's region pooling (regions.encode: pool)")
        term._transform = model.image_transform_params()
    params = term._transform
    shapes = edge_inputs.get("spatial_shapes")
    n_patches = int(edge_inputs["pixel_values"].shape[1]) if params["mode"] == "naflex" else None
    slots, masks = [], []
    for i, e in enumerate(examples):
        shape = tuple(int(v) for v in shapes[i]) if shapes is not None else None
        kept, rows = [], []
        for slot, box in zip(e["sx_slots"], e["sx_boxes"]):
            m = box_patch_mask(box, e["sx_size"], params, n_patches=n_patches, spatial_shape=shape)
            if m is not None:  # a region cut away by the centre crop has no patch: it is dropped
                kept.append(slot)
                rows.append(m)
        slots.append(kept)
        masks.append(torch.stack(rows) if rows else torch.zeros((0, n_patches or patch_count(params)),
                                                                 dtype=torch.bool))
    p = capacity(term, REGIONS, max((len(k) for k in slots), default=0))
    return {**region_slots(slots, p), "region_patch_mask": torch.stack([pad_rows(m, p, False) for m in masks])}


def shape_scan(term: Any, dataset: Any) -> ShapeScan | None:
    """What the run's planned shapes need from the term, read from the preprocessed columns before training: the
    filtered captions (encoded with the captions, the :data:`~finetune.objectives.shapes.TEXT` kind) and, with the
    local loss, each example's chunks (the short texts) and the most chunks and kept regions of any example
    (:data:`CHUNKS`, :data:`REGIONS`). None without the columns (a stream)."""
    filtered = dataset_columns(dataset, ["filtered_caption"])
    if filtered is None:
        return None
    texts = {TEXT: [[t or ""] for t in filtered["filtered_caption"]]}
    if not term.use_local:
        return ShapeScan(texts=texts)
    cols = dataset_columns(dataset, ["chunks", "chunk_topk", "chunk_topk_scores"])
    if cols is None:
        return ShapeScan(texts=texts)
    regions = [len(term.kept_regions({"chunk_topk": t, "chunk_topk_scores": s})) if c else 0
               for c, t, s in zip(cols["chunks"], cols["chunk_topk"], cols["chunk_topk_scores"])]
    return ShapeScan(texts={**texts, SHORT: [list(c or []) for c in cols["chunks"]]},
                     capacities={CHUNKS: max((len(c) for c in cols["chunks"]), default=0),
                                 REGIONS: max(regions, default=0)})


def region_slots(slots: list[list[int]], p: int) -> dict[str, Tensor]:
    """``region_slot`` ``(B, p)`` (-2 where padded: never a top-K index, which -1 pads) and ``region_valid``."""
    out = torch.full((len(slots), p), -2, dtype=torch.long)
    valid = torch.zeros((len(slots), p), dtype=torch.bool)
    for i, row in enumerate(slots):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        valid[i, : len(row)] = True
    return {"region_slot": out, "region_valid": valid}


def trim(ids: Tensor, mask: Tensor, model: Any, *, causal: bool | None = None) -> tuple[Tensor, Tensor]:
    """Cut right padding down to the longest real row, for causal towers that pool the end token (CLIP):
    there, trailing padding does not change the embedding. Towers that pool the last position of a
    fixed-length context (SigLIP) keep the model's own padding."""
    if causal is None:
        causal = getattr(model, "family", "clip") == "clip"
    if not causal or not ids.shape[0]:
        return ids, mask
    longest = max(int(mask.sum(dim=1).max()), 1)
    return ids[:, :longest], mask[:, :longest]
