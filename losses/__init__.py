"""xlipkit losses: contrastive and structure losses for CLIP-family models, torch only.

Embeddings are passed raw (every loss L2-normalises), ``logit_scale`` is the multiplier (already
exponentiated), and every loss gathers across ranks with autograd when a process group of size
> 1 is initialised (``gather=None``), so that it can be used in any training loop.

The package needs torch only: ``import losses`` loads nothing of ``finetune``, transformers, open_clip,
datasets or pydantic (``tests/losses/test_import.py``). What needs a model lives in the toolkit: FAST-GOAL's
model glue (``tsl_sentence_spans``, ``BoxGeometry``, ``box_patch_masks``, ``tsl_heads_from_model``,
``attach_tsl_heads``) in :mod:`finetune.objectives.tsl_heads`.
"""

from .contrastive import clip_loss, longclip_loss, pca_reconstruct, siglip_loss
from .distributed import (
    VariableGather,
    gather_variable_with_grad,
    gather_with_grad,
    ring_exchange_with_grad,
    should_gather,
    world_info,
)
from .fcast import fcast_loss, fcast_part_loss, fcast_whole_loss
from .flair import FLAIRLoss, TextConditionedAttentionPool, flair_draw_seed, flair_loss, sample_flair_text_indices
from .grm import (
    GRMHead,
    GRMImageOutput,
    GRMLoss,
    GRMOutput,
    GRMTextOutput,
    TokenAdapter,
    grm_loss,
    grm_similarity,
    gumbel_gate,
    keep_floor,
    sample_regions,
    token_wise_similarity,
    vse_hinge_loss,
)
from .structxlip import StructXLIPLoss, consistency_loss, local_structure_loss, official_weight_decay
from .tsl import (
    PatchGeometry,
    SentenceSpans,
    TSLHeads,
    pool_box_states,
    pool_patch_states,
    pool_span_states,
    select_sentence_spans,
    tsl_loss,
    tsl_similarity_loss,
)

__all__ = [
    "clip_loss",
    "siglip_loss",
    "longclip_loss",
    "pca_reconstruct",
    "consistency_loss",
    "local_structure_loss",
    "StructXLIPLoss",
    "official_weight_decay",
    "TextConditionedAttentionPool",
    "tsl_loss",
    "tsl_similarity_loss",
    "pool_box_states",
    "PatchGeometry",
    "pool_patch_states",
    "pool_span_states",
    "select_sentence_spans",
    "SentenceSpans",
    "TSLHeads",
    "flair_loss",
    "FLAIRLoss",
    "sample_flair_text_indices",
    "flair_draw_seed",
    "fcast_part_loss",
    "fcast_whole_loss",
    "fcast_loss",
    "GRMHead",
    "GRMImageOutput",
    "GRMTextOutput",
    "GRMOutput",
    "GRMLoss",
    "TokenAdapter",
    "grm_loss",
    "grm_similarity",
    "keep_floor",
    "gumbel_gate",
    "sample_regions",
    "token_wise_similarity",
    "vse_hinge_loss",
    "gather_with_grad",
    "gather_variable_with_grad",
    "VariableGather",
    "ring_exchange_with_grad",
    "should_gather",
    "world_info",
]
