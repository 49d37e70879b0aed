"""xlipkit losses: contrastive and structure losses for CLIP-family models, torch only.

Embeddings are passed raw (every loss L2-normalises), ``logit_scale`` is the multiplier (already
exponentiated), and every loss gathers across ranks with autograd when a process group of size
> 1 is initialised (``gather=None``), so that it can be used in any training loop.
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
    BoxGeometry,
    SentenceSpans,
    TSLHeads,
    attach_tsl_heads,
    box_patch_masks,
    pool_box_states,
    pool_patch_states,
    pool_span_states,
    select_sentence_spans,
    tsl_loss,
    tsl_sentence_spans,
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
    "pool_patch_states",
    "box_patch_masks",
    "BoxGeometry",
    "pool_span_states",
    "select_sentence_spans",
    "tsl_sentence_spans",
    "SentenceSpans",
    "TSLHeads",
    "attach_tsl_heads",
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
