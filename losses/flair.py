"""FLAIR's text-conditioned attention pooling (FLAIR, section 3.2).

The global text embedding queries the image's local (patch) embeddings through one multi-head
attention layer, giving a text-conditioned image embedding ``v_tc``. The keys and values get an
"empty" slot, a zero key and a zero value appended *after* the in-projection (PyTorch's
``add_zero_attn``, as the authors' ``PureAttentionPoolingBlock``), so that a text with nothing to
attend to can put its weight there: that slot has logit exactly 0 and adds nothing to the output.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TextConditionedAttentionPool(nn.Module):
    """Multi-head attention with text queries over an image's local tokens (FLAIR, section 3.2).

    ``v_tc = out_proj(concat_h softmax(Q_h [K_h; 0]^T / sqrt(d_h)) [V_h; 0])`` with
    ``Q = W_q LN_q(t)``, ``K = W_k LN_k(v_loc)``, ``V = W_v LN_v(v_loc)``; no output norm and no MLP.
    Submodule names (``attn``, ``ln_q``, ``ln_k``, ``ln_v``) are those of the authors' checkpoints,
    so their pool weights load as they are.

    Args:
        dim: embedding width D of texts and local image tokens (512 for FLAIR ViT-B/16).
        heads: attention heads (8 in FLAIR).
        eps: LayerNorm epsilon (PyTorch's default, as the authors').
    """

    def __init__(self, dim: int, heads: int = 8, *, eps: float = 1e-5) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"TextConditionedAttentionPool: dim {dim} is not divisible by heads {heads}")
        self.dim, self.heads = dim, heads
        self.ln_q = nn.LayerNorm(dim, eps=eps)
        self.ln_k = nn.LayerNorm(dim, eps=eps)
        self.ln_v = nn.LayerNorm(dim, eps=eps)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, add_zero_attn=True)

    def forward(
        self,
        queries: Tensor,
        local: Tensor,
        local_mask: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Pool each image's local tokens once per text query.

        Args:
            queries: ``(B, Q, D)`` text embeddings (raw, not normalised), Q queries per image;
                ``(B, D)`` is one query per image.
            local: ``(B, N, D)`` projected local image tokens (patches; no class token).
            local_mask: ``(B, N)`` bool, True for real tokens (padded segments False); None: all real.
                The empty slot is never masked, so an image with no real token pools to zero.
            return_weights: also return the attention weights averaged over heads.

        Returns:
            ``(B, Q, D)`` text-conditioned image embeddings (``(B, D)`` for 2-d ``queries``), and with
            ``return_weights`` the weights ``(B, Q, N + 1)``, the empty slot last.
        """
        single = queries.dim() == 2
        if single:
            queries = queries.unsqueeze(1)
        if queries.dim() != 3 or local.dim() != 3 or queries.shape[0] != local.shape[0]:
            raise ValueError(f"TextConditionedAttentionPool: queries (B, Q, D) and local (B, N, D) must share "
                             f"B, got {tuple(queries.shape)} and {tuple(local.shape)}")
        if queries.shape[-1] != self.dim or local.shape[-1] != self.dim:
            raise ValueError(f"TextConditionedAttentionPool: width must be {self.dim}, got queries "
                             f"{queries.shape[-1]} and local {local.shape[-1]}")
        padding = None
        if local_mask is not None:
            if local_mask.shape != local.shape[:2]:
                raise ValueError(f"TextConditionedAttentionPool: local_mask must be (B, N) = "
                                 f"{tuple(local.shape[:2])}, got {tuple(local_mask.shape)}")
            padding = ~local_mask.bool()
        out, weights = self.attn(self.ln_q(queries), self.ln_k(local), self.ln_v(local),
                                 key_padding_mask=padding, need_weights=return_weights,
                                 average_attn_weights=True)
        if single:
            out = out.squeeze(1)
            weights = weights.squeeze(1) if weights is not None else None
        return (out, weights) if return_weights else out


__all__ = ["TextConditionedAttentionPool"]
