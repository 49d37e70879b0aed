"""The ``structxlip`` objective term: StructXLIP's three structure-centric losses on top of any base term.

StructXLIP (Ruan et al., "StructXLIP: Enhancing Vision-language Models with Multimodal Structural Cues")
adds to the base image-text loss L_{I,T} (``objective.base``: clip, siglip or longclip) the auxiliary
objective of eq. 4, ``L* = l1 L_{I',T'} + l2 L_{I,I'} + l3 L^local_{I',T'}``:

- ``structure`` L_{I',T'} (3.2): symmetric InfoNCE between edge maps I' and appearance-filtered captions T'
  with its own temperature tau' (3.2: "a dedicated temperature"; learnable and clamped as D.2's main one: ours);
- ``consistency`` L_{I,I'} (3.2, eq. 3): mean of ``1 - cos`` between each colour image and its edge map;
- ``local`` L^local_{I',T'} (3.2, eqs. 1-2): each chunk of T' against the edge-map regions of the batch,
  its K most similar regions (under the frozen pretrained model) as positives, temperature 0.07.

``compat: paper`` (the default) takes what the paper states: weights 0.25 / 0.1 / 0.1 (section 4), local
temperature 0.07 (D.2), Canny edge maps (section 4), FastSAM regions (D.3), chunks split at sentence
delimiters (3.2); the paper gives no number for K ("a total of K regions", 3.2): K = 3 is our choice (the
public ``train.py``'s ``--chunk_top_k`` default), with 3 regions encoded per image. The lexicon is the Supp.
Mat. Fig. 5 vocabulary; its revert threshold of one content word is ours (see :class:`LexiconOptions`).
``compat: official`` reproduces the public code's choices (DESIGN 5; intelligolabs/StructXLIP ``train.py``,
``losses.py``, ``scripts/finetune.sh``): weights 0.25 / 0.001 / 0.001 decayed per epoch (floors 0.7 / 0.5 /
0.4, :meth:`StructXLIPTerm.set_epoch`), L_{I',T'} with the main logit scale detached instead of its own
temperature, a local scale ``min(s / 0.07, 100)``, chunks that are sliding word windows over clauses split at
``[.,;!?]``, K = 2 regions per image (``finetune.sh``'s ``--chunk_top_k 2``), every one a positive of every
chunk, and the lexicon's colours only with a revert threshold of 2 (``--remove_colors``,
``min_content_tokens``). ``null`` in ``weights``, ``lexicon``, ``regions.k`` and ``regions.per_image`` takes
the ``compat`` value; a number given in the recipe wins over both.

Where the work happens:

- :meth:`StructXLIPTerm.preprocess` (once per dataset, cached by ``finetune.data.cache.cached_map``,
  keyed by the parameters): lexicon-filtered captions (with what was removed, for the B.3 statistics),
  edge maps (unless ``edges.on_the_fly``), regions (FastSAM masks' boxes, or the default regions), chunks
  and each chunk's top-K regions under the frozen model as loaded, before any training step.
- :meth:`prepare` / :meth:`collate` (data workers): the regions kept per image (``regions.per_image``, the
  ones most often among the chunks' top-K), their edge-map crops (crop mode) or patch masks (pool mode),
  and tokenised filtered captions and chunks. Chunks and regions take a fixed number of rows per sample, the
  most of any example of the training set (:meth:`shape_scan`, before training), padded rows marked invalid in
  ``chunk_valid`` / ``region_valid`` and left out of every loss, so that every step's passes have fixed rows.
- :meth:`image_inputs` / :meth:`text_inputs`: the edge maps and (crop mode) the region crops join the base
  term's colour images in ONE pass of the image tower; filtered captions go through the text tower with the
  captions, and chunks, marked short, in the second pass, padded to the planned bucket length of their longest
  (:mod:`finetune.objectives.shapes`), so that chunks are not padded to caption length.
- ``regions.encode: pool`` (our extension, not in the paper): a region is the mean of the edge map's last
  patch states inside its box (the box mapped through the processor's exact resize and centre crop), then
  the model's own final norm and projection (``DualEncoder.project_image_states``): no extra image forward.

Per-sample batch fields are ``(B, ...)`` tensors under ``batch["structxlip"]``, so that the trainer's
micro-batch split slices them correctly; feature rows carry their sample index in ``*_owner`` keys, which
``merge_features`` offsets, and positives are stored as region indices *within the sample* (``chunk_topk``
against ``region_slot``), so merged micro-batches give the loss of one batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from finetune.extras import require_extra
from losses import clip_loss, consistency_loss, local_structure_loss
from losses.structxlip import (
    OFFICIAL_LOCAL_SCALE_MAX,
    OFFICIAL_WEIGHT_FLOORS,
    OFFICIAL_WEIGHTS,
    PAPER_WEIGHTS,
    official_weight_decay,
)

from finetune.objectives.base import (
    Batch,
    Features,
    ImageRequest,
    Term,
    TextRequest,
    host_tensor,
    scale_of,
)
from finetune.objectives.contrastive import image_request
from finetune.objectives.registry import register_term
from finetune.objectives.structxlip.options import (
    COMPAT_K,
    EdgeOptions,
    LexiconOptions,
    RegionOptions,
    StructXLIPOptions,
    StructXLIPWeights,
)
from finetune.objectives.structxlip.preprocessing import add_regions, lexicon_statistics
from finetune.objectives.structxlip.data import (
    CODE_VERSION,
    LEXICON_COLUMNS,
    DefaultRegionSegmenter,
    _EdgeColumn,
    _LexiconColumns,
    official_chunks,
    select_regions,
)

__all__ = [
    "EdgeOptions",
    "LexiconOptions",
    "RegionOptions",
    "StructXLIPOptions",
    "StructXLIPTerm",
    "StructXLIPWeights",
    "COMPAT_K",
    "DefaultRegionSegmenter",
    "build_structxlip",
    "official_chunks",
    "select_regions",
]

logger = logging.getLogger("xlipkit")

TERM_NAME = "structxlip"
LOSS_KEYS = ("structure", "consistency", "local")

class StructXLIPTerm(Term):
    """StructXLIP's L* (paper 3.2, eq. 4) as an objective term added to any base term and any adapter.

    ``loss`` returns the unweighted ``{"structure": L_{I',T'}, "consistency": L_{I,I'}, "local": L^local}``;
    :attr:`weights` (returned by :func:`build_structxlip` and applied by the ``Objective``) holds lambda_1-3.

    Args:
        options: :class:`StructXLIPOptions` (a recipe's ``objective.terms.structxlip``).

    Raises:
        FileNotFoundError: ``lexicon.file`` or ``regions.checkpoint`` does not exist.
        ValueError: inconsistent edge parameters (e.g. ``low > high``).
    """

    name = TERM_NAME
    needs = frozenset({"edges", "filtered_caption", "regions"})
    produces = frozenset({"sx_edges", "sx_filtered", "sx_chunks", "sx_topk", "sx_slots", "sx_boxes", "sx_size",
                          "sx_crops", "structxlip"})
    requests = frozenset({"image", "edge", "region", "filtered_text", "chunk"})
    features = frozenset({"chunk_owner", "chunk_topk", "chunk_valid", "region_owner", "region_slot", "region_valid",
                          "chunk", "region"})

    def __init__(self, options: StructXLIPOptions | None = None) -> None:
        super().__init__()
        from finetune.preprocess.edges import EdgeConfig
        from finetune.preprocess.lexicon import LexiconFilter

        opts = options or StructXLIPOptions()
        k = COMPAT_K[opts.compat] if opts.regions.k is None else opts.regions.k
        per_image = k if opts.regions.per_image is None else opts.regions.per_image
        #: the options with the compat values filled in (``regions.k``, ``regions.per_image``), as recorded
        self.options = opts = replace(opts, regions=replace(opts.regions, k=k, per_image=per_image))
        self.compat = opts.compat
        edge_values = {k: v for k, v in asdict(opts.edges).items() if k != "on_the_fly"}
        self.edge_cfg = EdgeConfig(**edge_values)
        lex = opts.lexicon
        official = opts.compat == "official"
        self.lexicon = LexiconFilter(
            file=lex.file, extra_terms=list(lex.extra_terms),
            min_content_words=(2 if official else 1) if lex.min_content_words is None else lex.min_content_words,
            categories=(["colour"] if official else None) if lex.categories is None else lex.categories,
        )
        r = opts.regions
        if r.checkpoint is not None and r.source == "segmenter":
            require_extra("regions", "objective.terms.structxlip.regions.checkpoint (FastSAM regions)")
        if r.checkpoint is not None and not Path(r.checkpoint).expanduser().is_file():
            from finetune.preprocess.regions import FASTSAM_DOWNLOAD_HINT

            raise FileNotFoundError(
                f"objective.terms.structxlip.regions.checkpoint: {r.checkpoint!r} not found: {FASTSAM_DOWNLOAD_HINT}"
                " (or set it to null to use the default regions)"
            )
        if r.source == "dataset" and r.checkpoint is not None:
            raise ValueError("objective.terms.structxlip.regions: checkpoint (FastSAM) is not used with source: "
                             "dataset, whose regions come from the data; set checkpoint: null or source: segmenter")
        if r.min_area > r.max_area:
            raise ValueError(f"objective.terms.structxlip.regions: min_area ({r.min_area}) must not exceed max_area "
                             f"({r.max_area})")
        defaults = PAPER_WEIGHTS if opts.compat == "paper" else OFFICIAL_WEIGHTS
        given = (opts.weights.structure, opts.weights.consistency, opts.weights.local)
        self.base_weights: dict[str, float] = {
            k: float(d if w is None else w) for k, w, d in zip(LOSS_KEYS, given, defaults)
        }
        #: lambda_1-3 in effect; the Objective holds this very dict, so :meth:`set_epoch` updates it in place
        self.weights: dict[str, float] = dict(self.base_weights)
        self.use_local = self.base_weights["local"] > 0
        self.local_temperature = float(opts.local_temperature)
        self.structure_logit_scale_max = float(opts.structure_logit_scale_max)
        if opts.compat == "paper" and self.base_weights["structure"] > 0:
            self.structure_logit_scale: nn.Parameter | None = nn.Parameter(
                torch.tensor(math.log(1.0 / opts.structure_temperature))
            )
        else:  # official: no own temperature; an unused parameter (weight 0) would break DDP
            self.structure_logit_scale = None
        self.stats: dict[str, Any] = {}
        self._transform: dict[str, Any] | None = None

    # -- schedule hooks (the trainer calls them when it offers the hooks) -------------------------
    def set_epoch(self, epoch: int) -> None:
        """``compat: official``: scale the weights by the public code's per-epoch decay
        (``official_weight_decay``, floors 0.7 / 0.5 / 0.4); the paper's weights are constant."""
        if self.compat != "official":
            return
        for key, floor in zip(LOSS_KEYS, OFFICIAL_WEIGHT_FLOORS):
            self.weights[key] = self.base_weights[key] * official_weight_decay(epoch, floor)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Clamp log(1 / tau') to ``structure_logit_scale_max`` (as D.2 clamps the main scale)."""
        if self.structure_logit_scale is not None:
            self.structure_logit_scale.clamp_(max=self.structure_logit_scale_max)

    # -- preprocessing (once per dataset, cached) ------------------------------------------------
    def chunker(self) -> Any:
        """Caption -> chunks: sentence delimiters (paper 3.2) or the public code's word windows."""
        from finetune.preprocess.regions import split_chunks

        return official_chunks if self.compat == "official" else split_chunks

    def segmenter(self) -> Any:
        """FastSAM on the colour image when ``regions.checkpoint`` is set, else the default regions."""
        r = self.options.regions
        if r.checkpoint is None:
            return DefaultRegionSegmenter()
        from finetune.preprocess.regions import FastSAMRegions

        return FastSAMRegions(Path(r.checkpoint).expanduser(), imgsz=r.imgsz, conf=r.conf, iou=r.iou,
                              min_area=r.min_area, max_area=r.max_area, max_regions=r.max_masks, device=r.device)

    def preprocess(self, dataset: Any, model: Any, *, cache_dir: str | None = None, log: Any = None) -> Any:
        """Add the filtered captions, edge maps and regions to ``dataset`` (paper 3.1, 3.2, D.3).

        Each step is a ``cached_map`` keyed by its parameters (and the dataset, and for regions the
        frozen model's fingerprint): a second run reuses it and logs "reusing cached ...". Fills
        :attr:`stats` (lexicon B.3 statistics, region counts).

        Args:
            dataset: a ``datasets.Dataset`` with ``image`` and ``caption`` columns.
            model: the DualEncoder as loaded (before training): it ranks the regions of each chunk.
            cache_dir: cache root (the recipe's ``data.cache_dir``); steps go to ``<cache_dir>/preprocess``,
                default ``finetune.data.cache.default_cache_dir()``.
            log: a logger (default ``logging.getLogger("xlipkit")``).

        Returns:
            ``dataset`` plus the columns of :data:`LEXICON_COLUMNS`, ``edges`` (unless on the fly) and,
            when the local loss is on, ``region_boxes``, ``region_fallback``, ``chunks``, ``chunk_topk``,
            ``chunk_topk_scores``.
        """
        import datasets

        from finetune.data.cache import cached_map

        log = log or logger
        for column in ("image", "caption"):
            if column not in dataset.column_names:
                raise ValueError(f"structxlip preprocessing needs a {column!r} column; the dataset has "
                                 f"{dataset.column_names}")
        root = Path(cache_dir) / "preprocess" if cache_dir else None
        text_features = datasets.Features({
            "filtered_caption": datasets.Value("string"),
            "lexicon_removed": datasets.List(datasets.Value("string")),
            "lexicon_categories": datasets.List(datasets.Value("string")),
            "lexicon_reverted": datasets.Value("bool"),
            "caption_words": datasets.Value("int32"),
        })
        lexicon = cached_map(
            dataset.select_columns(["caption"]), _LexiconColumns(self.lexicon), params=self.lexicon.params(),
            name="lexicon", cache_dir=root, code_version=CODE_VERSION, batched=True, batch_size=1000,
            features=text_features, desc="StructXLIP lexicon filter",
        )
        added = [lexicon.select_columns(list(LEXICON_COLUMNS))]
        self.stats = {"lexicon": lexicon_statistics(lexicon)}
        s = self.stats["lexicon"]
        log.info("structxlip lexicon: %d of %d captions modified (%.1f%%), %.2f words removed per caption, "
                 "%d reverted; removed words by category: %s", s["modified"], s["captions"],
                 100 * s["modified_share"], s["removed_words_per_caption"], s["reverted"], s["category_counts"])
        if not self.options.edges.on_the_fly:
            edges = cached_map(
                dataset.select_columns(["image"]), _EdgeColumn(self.edge_cfg), params=self.edge_cfg.params(),
                name="edges", cache_dir=root, code_version=CODE_VERSION, batched=True, batch_size=64,
                features=datasets.Features({"edges": datasets.Image()}), desc="StructXLIP edge maps",
            )
            added.append(edges.select_columns(["edges"]))
        out = datasets.concatenate_datasets([dataset.remove_columns([c for c in dataset.column_names if c in
                                                                     (*LEXICON_COLUMNS, "edges")]), *added], axis=1)
        if self.use_local:
            out = add_regions(self, out, model, root, log)
        return out

    def stream_map(self, example: dict[str, Any], model: Any) -> dict[str, Any]:
        """Streamed data: the lexicon columns and the edge map of one example, computed now (as
        :meth:`preprocess` adds them; no statistics, no cache)."""
        from PIL import Image

        from finetune.preprocess.edges import edge_array

        r = self.lexicon.filter(example.get("caption") or "")
        return {"filtered_caption": r.text, "lexicon_removed": r.removed, "lexicon_categories": r.categories,
                "lexicon_reverted": r.reverted, "caption_words": r.n_words,
                "edges": Image.fromarray(edge_array(example["image"], self.edge_cfg))}

    def check_stream(self) -> None:
        """The local loss needs each chunk's top-K regions under the frozen model, matched over the whole
        dataset before training: not on a stream."""
        if self.use_local:
            raise ValueError(
                "objective.terms.structxlip: the local loss ranks regions with the frozen pretrained model "
                "before training, which a streamed data.train cannot do; set "
                "objective.terms.structxlip.weights.local: 0 to train on a stream (edge maps and the lexicon "
                "filter run per example), or use a map-style data.train")

    def shape_scan(self, dataset: Any, model: Any) -> Any:
        """The training set's filtered captions and, with the local loss, its chunks and most chunks and kept regions
        per example (:func:`~finetune.objectives.structxlip.batch.shape_scan`)."""
        from finetune.objectives.structxlip.batch import shape_scan

        return shape_scan(self, dataset)

    # -- data workers ----------------------------------------------------------------------------
    def edge_image(self, example: dict[str, Any]) -> Any:
        """The example's edge map as a one-channel PIL image (cached column, or computed now)."""
        from PIL import Image

        from finetune.preprocess.edges import edge_array

        edges = example.get("edges")
        if edges is not None:
            return edges
        if not self.options.edges.on_the_fly:
            raise KeyError("the example has no 'edges' column: run the objective's preprocess(dataset, model) "
                           "first, or set objective.terms.structxlip.edges.on_the_fly: true")
        return Image.fromarray(edge_array(example["image"], self.edge_cfg))

    def kept_regions(self, example: dict[str, Any]) -> list[int]:
        """Indices of the regions of ``example`` that are encoded (:func:`select_regions`)."""
        per_image = self.options.regions.per_image
        return select_regions(example["chunk_topk"], example["chunk_topk_scores"],
                              None if per_image == "all" else per_image)

    def prepare(self, example: dict[str, Any]) -> dict[str, Any]:
        """Per example: the edge map, the filtered caption and, for the local loss, the chunks, their top-K
        region indices, the kept regions' indices and boxes and (crop mode) their edge-map crops."""
        if "filtered_caption" not in example:
            raise KeyError("the example has no 'filtered_caption': run the objective's preprocess(dataset, model) "
                           "before batching")
        edges = self.edge_image(example)
        out: dict[str, Any] = {"sx_edges": edges, "sx_filtered": example["filtered_caption"]}
        if not self.use_local:
            return out
        if "chunk_topk" not in example:
            raise KeyError("the example has no regions ('chunk_topk'): run the objective's preprocess first")
        chunks = list(example["chunks"])
        slots = self.kept_regions(example) if chunks else []
        boxes = [example["region_boxes"][s] for s in slots]
        out.update({"sx_chunks": chunks, "sx_topk": [list(row) for row in example["chunk_topk"]],
                    "sx_slots": slots, "sx_boxes": boxes, "sx_size": edges.size})
        if self.options.regions.encode == "crop":
            from finetune.preprocess.regions import crop_box

            out["sx_crops"] = [crop_box(edges, b) for b in boxes]
        return out

    def collate(self, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        """Batch the prepared fields into ``batch["structxlip"]``:

        - ``edge_inputs``: the edge maps through ``model.preprocess_images`` (``pixel_values (B, 3, H, W)``);
        - ``filtered_input_ids`` / ``filtered_attention_mask``: ``(B, L')`` filtered captions;
        - per sample, padded to a fixed number of rows (the run's capacity, :attr:`Term.shapes`, else the batch's
          most) with validity masks: ``chunk_input_ids`` / ``chunk_attention_mask`` ``(B, C, Lc)`` with Lc the
          longest chunk of the batch (the step pads it to its bucket length), ``chunk_valid`` ``(B, C)``,
          ``chunk_topk`` ``(B, C, K)`` region indices (-1 padded), ``region_slot`` ``(B, P)`` the kept regions'
          indices (-2 padded), ``region_valid`` ``(B, P)``, and ``region_inputs`` (crop mode: a dict of
          ``(B, P, ...)`` processor outputs) or ``region_patch_mask`` (pool mode: ``(B, P, N)`` bool).
        """
        from finetune.objectives.structxlip.batch import collate_batch

        return collate_batch(self, examples, model)

    # -- model side ------------------------------------------------------------------------------
    def image_inputs(self, batch: Batch) -> dict[str, ImageRequest]:
        """``image`` (the B colour images, shared with the base term: encoded once), ``edge`` (the B edge maps,
        with patch states in pool mode) and, in crop mode, ``region`` (``B * P`` crops, padded rows included;
        absent when P is 0)."""
        sx = batch["structxlip"]
        pool = self.use_local and self.options.regions.encode == "pool"
        reqs = {"image": image_request(batch), "edge": ImageRequest(sx["edge_inputs"], states=pool)}
        if self.use_local and not pool and sx["region_inputs"]:
            inputs = {name: t.reshape(-1, *t.shape[2:]) for name, t in sx["region_inputs"].items()}
            if inputs["pixel_values"].shape[0]:
                reqs["region"] = ImageRequest(inputs)
        return reqs

    def text_inputs(self, batch: Batch) -> dict[str, TextRequest]:
        """``filtered_text`` (B filtered captions, as long as captions) and ``chunk`` (``B * C`` chunk rows, short
        texts: the objective pads them to the bucket of the longest chunk, not to the captions'; absent when C is
        0)."""
        sx = batch["structxlip"]
        reqs = {"filtered_text": TextRequest(sx["filtered_input_ids"], sx["filtered_attention_mask"])}
        if self.use_local:
            ids = sx["chunk_input_ids"]
            if ids.shape[0] * ids.shape[1]:
                reqs["chunk"] = TextRequest(ids.reshape(-1, ids.shape[-1]),
                                            sx["chunk_attention_mask"].reshape(-1, ids.shape[-1]), short=True)
        return reqs

    def extra_features(self, model: Any, batch: Batch, feats: Features) -> None:
        """Owners, validity, positives' indices and (pool mode) the pooled region embeddings, ``B * C`` chunk and
        ``B * P`` region rows (fixed per sample, padded rows marked invalid), so that every micro-batch has the
        same keys."""
        if not self.use_local:
            return
        sx = batch["structxlip"]
        ref = feats["image"]
        dim, device = ref.shape[1], ref.device
        b, c = sx["chunk_valid"].shape
        p = sx["region_valid"].shape[1]
        feats["chunk_owner"] = _owners([c] * b, device)
        feats["chunk_valid"] = sx["chunk_valid"].reshape(-1).to(device)
        feats["chunk_topk"] = sx["chunk_topk"].reshape(b * c, self.options.regions.k).to(device)
        feats["region_owner"] = _owners([p] * b, device)
        feats["region_slot"] = sx["region_slot"].reshape(-1).to(device)
        feats["region_valid"] = sx["region_valid"].reshape(-1).to(device)
        if "chunk" not in feats:
            feats["chunk"] = ref.new_zeros((0, dim))
        if self.options.regions.encode == "pool":
            states = feats.pop("edge_states")
            if b * p:
                mask = sx["region_patch_mask"].to(device).reshape(b * p, -1).to(states.dtype)
                if mask.shape[1] != states.shape[1]:
                    raise ValueError(f"region patch masks have {mask.shape[1]} patches, the edge maps' states "
                                     f"{states.shape[1]}: the model's image_transform_params() does not match "
                                     "its processor")
                weights = mask / mask.sum(dim=1, keepdim=True).clamp(min=1)  # padded rows: all zero
                pooled = torch.einsum("rn,rnw->rw", weights, states[feats["region_owner"]])
                feats["region"] = model.project_image_states(pooled)
            else:
                feats["region"] = ref.new_zeros((0, dim))
        elif "region" not in feats:
            feats["region"] = ref.new_zeros((0, dim))

    def positives(self, feats: Features) -> Tensor:
        """``(Nc, Nr)`` bool P_c of eq. 1: the chunk's top-K regions among the kept regions of its sample
        (``compat: official``: every kept region of the chunk's image); none for padded chunk or region rows."""
        same = feats["chunk_owner"][:, None] == feats["region_owner"][None, :]
        same = same & feats["chunk_valid"][:, None] & feats["region_valid"][None, :]
        if self.compat == "official":
            return same
        listed = (feats["chunk_topk"][:, :, None] == feats["region_slot"][None, None, :]).any(dim=1)
        return same & listed

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        """The unweighted L_{I',T'}, L_{I,I'} and L^local (paper eqs. 1-3; see the module docstring for
        ``compat: official``), from possibly merged features."""
        image, edge, filtered = feats["image"], feats["edge"], feats["filtered_text"]
        out: dict[str, Tensor] = {}
        main_scale = scale_of(model.logit_scale, detach_params)
        if self.structure_logit_scale is not None:
            structure_scale = scale_of(self.structure_logit_scale, detach_params)
        else:
            structure_scale = main_scale.detach()
        if self.base_weights["structure"]:
            out["structure"] = clip_loss(edge, filtered, structure_scale)
        if self.base_weights["consistency"]:
            out["consistency"] = consistency_loss(image, edge)
        if self.use_local:
            if self.compat == "official":
                temperature: float | Tensor = 1.0 / (main_scale / self.local_temperature).clamp(
                    max=OFFICIAL_LOCAL_SCALE_MAX)
            else:
                temperature = self.local_temperature
            out["local"] = local_structure_loss(
                feats["chunk"], feats["chunk_owner"], feats["region"], feats["region_owner"],
                temperature=temperature, positives=self.positives(feats), region_valid=feats["region_valid"],
            )
        return out

    # -- report ----------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """What a run's ``metrics.json`` records about the term: options, weights and the preprocessing
        statistics (lexicon B.3, regions)."""
        return {"options": asdict(self.options), "weights": dict(self.weights), **self.stats}

    def preview_fields(self, example: dict[str, Any]) -> dict[str, Any]:
        """What the preview shows of one preprocessed example
        (:func:`~finetune.objectives.structxlip.preview.fields`)."""
        from finetune.objectives.structxlip.preview import fields

        return fields(self, example)

    def report_sections(self, run_dir: str | Path, dataset: Any, *, n: int = 8) -> list[str]:
        """Markdown sections for the run report (:func:`~finetune.objectives.structxlip.preview.report_sections`):
        the lexicon statistics (paper B.3), the regions, and a preview of ``n`` training examples written to
        ``<run_dir>/plots/structxlip_preview.png``."""
        from finetune.objectives.structxlip.preview import report_sections

        return report_sections(self, run_dir, dataset, n=n)

    def extra_repr(self) -> str:
        return (f"compat={self.compat!r}, weights={self.base_weights}, encode={self.options.regions.encode!r}, "
                f"k={self.options.regions.k}, local_temperature={self.local_temperature}")


def _owners(counts: list[int], device: torch.device) -> Tensor:
    """``(sum(counts),)`` the sample index of each row, from host counts (no device read)."""
    return host_tensor([i for i, c in enumerate(counts) for _ in range(c)], device)


@register_term(TERM_NAME, StructXLIPOptions, citation={  # a finetune.plugins.Citation's fields
    "text": "Ruan et al., StructXLIP: Enhancing Vision-language Models with Multimodal Structural Cues"})
def build_structxlip(options: StructXLIPOptions | None) -> tuple[StructXLIPTerm, dict[str, float]]:
    """Build the term of ``objective.terms.structxlip`` and its weights (the Objective applies them)."""
    term = StructXLIPTerm(options or StructXLIPOptions())
    return term, term.weights
