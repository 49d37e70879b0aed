"""The transformers CLIP towers with their last layer run for the pooled token only.

CLIP's image embedding is the class token after the last encoder layer, its text embedding the end-of-text
token's (Radford et al. 2021, sec. 2.4). In the last layer every other token only feeds the keys and values
that the pooled token attends to: its query, attention output, residual and MLP rows are computed and thrown
away. :func:`clip_vision_forward` and :func:`clip_text_forward` run layers ``1 .. L-1`` as transformers does
(through each layer's own call, so gradient checkpointing, adapters and hooks of those layers behave as
usual) and the last layer as: LayerNorm and keys/values of all tokens; query, attention, projection, residual
and MLP of the pooled token only (image rows that need patch states get the whole layer). That drops 10 of
the 12 ``d x d`` matrix products per token of one layer in L, about 7 % of a 12-layer tower's work in
training and evaluation; the embeddings equal the transformers forward's up to float rounding (tested at
``atol 1e-5`` with gradients).

It is used only where a tower is the stock transformers CLIP structure with no hooks on the modules it
calls around (FSDP, DeepSpeed ZeRO-3 and other wrappers register hooks or change the classes, and then
:func:`fast_path_ok` is False and the caller runs the transformers forward).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

try:  # transformers >= 5: the mask builder the CLIP text tower itself calls
    from transformers.masking_utils import create_causal_mask
except ImportError:  # pragma: no cover - older transformers take the transformers forward
    create_causal_mask = None
# transformers 5.24 renamed its cache argument from ``past_key_values`` (deprecated, removed in 5.40) to ``cache``
_MASK_CACHE_KWARG = ("cache" if create_causal_mask is not None
                     and "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values")

__all__ = ["clip_text_forward", "clip_vision_forward", "fast_path_kwargs_ok", "fast_path_ok"]

_LAYERS = {"encoder": "CLIPEncoder", "layer": "CLIPEncoderLayer", "attn": "CLIPAttention"}
_EMBEDDINGS = {"CLIPVisionEmbeddings", "CLIPTextEmbeddings"}


#: the module of the forward hooks transformers >= 5 installs on a model's layers the first time a call asks for
#: their outputs (``output_hidden_states=True``): they record nothing unless such a call is running
_OUTPUT_CAPTURING = "transformers.utils.output_capturing"


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has forward hooks or pre-hooks (wrappers such as DeepSpeed ZeRO-3 work through them), other
    than transformers' output-capturing hooks, which stay on the layers after the first call with
    ``output_hidden_states=True`` (FAST-GOAL's and GRM's token states) and do nothing outside such a call: counting
    them turned the pooled path off for every later step of those runs (and changed its shapes)."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return any(getattr(h, "__module__", None) != _OUTPUT_CAPTURING for h in hooks)


def fast_path_ok(tower: nn.Module) -> bool:
    """Whether ``tower`` (``CLIPModel.vision_model`` or ``.text_model``) is a stock transformers CLIP tower
    whose last layer :func:`clip_vision_forward` / :func:`clip_text_forward` may run itself: the expected
    classes, no hooks on the modules they bypass (the tower, its encoder, the last layer and its attention),
    and for text the transformers >= 5 layer signature and an SDPA or eager attention."""
    encoder = getattr(tower, "encoder", None)
    layers = getattr(encoder, "layers", None)
    if encoder is None or not layers:
        return False
    last = layers[-1]
    attn = getattr(last, "self_attn", None)
    names = {"encoder": type(encoder).__name__, "layer": type(last).__name__, "attn": type(attn).__name__}
    if names != _LAYERS or type(getattr(tower, "embeddings", None)).__name__ not in _EMBEDDINGS:
        return False
    if type(tower.embeddings).__name__ == "CLIPTextEmbeddings":
        if create_causal_mask is None or not hasattr(tower, "final_layer_norm") or _old_signature(last):
            return False
        if getattr(tower.config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
            return False
    elif not hasattr(tower, "post_layernorm"):
        return False
    return not any(hooked(m) for m in (tower, encoder, last, attn))


def _old_signature(layer: nn.Module) -> bool:
    return _takes_causal_mask(type(layer))


@functools.lru_cache(maxsize=None)
def _takes_causal_mask(cls: type) -> bool:
    return "causal_attention_mask" in inspect.signature(cls.forward).parameters


def _call_layer(layer: nn.Module, hidden: Tensor) -> Tensor:
    # transformers < 5 layers take (hidden, attention_mask, causal_attention_mask) and return a tuple
    out = layer(hidden, None, None) if _old_signature(layer) else layer(hidden, None)
    return out[0] if isinstance(out, tuple) else out


def _attend(attn: nn.Module, queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None) -> Tensor:
    """``(b, q, W)`` queries against ``(b, n, W)`` keys/values, multi-head, with an optional additive ``mask``
    ``(b, 1, q, n)`` -> ``(b, q, W)``."""
    b, q, width = queries.shape
    heads, dim = attn.num_heads, attn.head_dim

    def split(x: Tensor) -> Tensor:
        return x.view(b, x.shape[1], heads, dim).transpose(1, 2)

    dropout = attn.dropout if attn.training else 0.0
    out = F.scaled_dot_product_attention(split(queries), split(keys), split(values), attn_mask=mask,
                                         dropout_p=dropout, scale=attn.scale)
    return out.transpose(1, 2).reshape(b, q, width)


def _last_layer(layer: nn.Module, hidden: Tensor, n_full: int) -> tuple[Tensor, Tensor]:
    """The last CLIP encoder layer: rows ``[:n_full]`` whole ``(n_full, N, W)``, the other rows for the class
    token only ``(B - n_full, 1, W)``."""
    attn = layer.self_attn
    x = layer.layer_norm1(hidden)
    keys, values = attn.k_proj(x), attn.v_proj(x)
    out = []
    for rows, n_queries in ((slice(0, n_full), None), (slice(n_full, None), 1)):
        q_in, residual = x[rows, :n_queries], hidden[rows, :n_queries]
        if not q_in.shape[0]:
            out.append(hidden.new_zeros((0, q_in.shape[1], hidden.shape[2])))
            continue
        y = residual + attn.out_proj(_attend(attn, attn.q_proj(q_in), keys[rows], values[rows]))
        out.append(y + layer.mlp(layer.layer_norm2(y)))
    return out[0], out[1]


def clip_vision_forward(
    vision_model: nn.Module, pixel_values: Tensor, *, states_rows: int = 0, interpolate_pos_encoding: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Run the CLIP image tower with the last layer for the class token only (module docstring).

    Args:
        vision_model: ``CLIPModel.vision_model`` (check :func:`fast_path_ok` first).
        pixel_values: ``(B, 3, H, W)``.
        states_rows: the first ``states_rows`` images also get every token of the last layer.
        interpolate_pos_encoding: passed to the patch embeddings, as in transformers.

    Returns:
        ``pooled`` ``(B, W)`` (``post_layernorm`` of the class token, the transformers ``pooler_output``),
        ``cls`` ``(B, W)`` (the class token before ``post_layernorm``) and ``last`` ``(states_rows, N, W)``,
        the last hidden states of the first rows (None when ``states_rows`` is 0).
    """
    hidden = vision_model.embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
    hidden = vision_model.pre_layrnorm(hidden)
    layers = vision_model.encoder.layers
    for layer in layers[:-1]:
        hidden = _call_layer(layer, hidden)
    last = layers[-1]
    if getattr(last, "gradient_checkpointing", False) and last.training and torch.is_grad_enabled():
        full, cls_only = checkpoint(_last_layer, last, hidden, states_rows, use_reentrant=False)
    else:
        full, cls_only = _last_layer(last, hidden, states_rows)
    cls = torch.cat([full[:, 0], cls_only[:, 0]])
    return vision_model.post_layernorm(cls), cls, (full if states_rows else None)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def clip_text_forward(
    text_model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    pool_positions: Tensor,
    token_embeds: Tensor | None = None,
    *,
    right_padded: bool = False,
) -> Tensor:
    """Run the CLIP text tower with the last layer for the pooled (end-of-text) token only.

    Args:
        text_model: ``CLIPModel.text_model`` (check :func:`fast_path_ok` first).
        input_ids: ``(B, L)``.
        attention_mask: ``(B, L)`` 1 for real tokens (None: all real).
        pool_positions: ``(B,)`` the end-of-text position of each row (the transformers pooling rule).
        token_embeds: ``(B, L, W)`` the rows' token embeddings when the caller looked them up already
            (positions are still added here).
        right_padded: the caller knows the rows are right-padded (checked on the CPU): the mask is not
            checked here (that check reads the device).

    Returns:
        ``(B, W)`` the pooled states after ``final_layer_norm`` (the transformers ``pooler_output``).
    """
    hidden = text_model.embeddings(input_ids=input_ids, inputs_embeds=token_embeds)
    if attention_mask is not None and (right_padded or bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())):
        # right padding: under the causal mask no real token attends to the padding after it, and the padding
        # rows are never read, so the padding mask changes nothing and SDPA keeps its causal kernel
        attention_mask = None
    # layers 1 .. L-1 get the mask transformers builds (None without padding under SDPA: its causal kernel)
    mask = create_causal_mask(config=text_model.config, inputs_embeds=hidden, attention_mask=attention_mask,
                              **{_MASK_CACHE_KWARG: None})
    layers = text_model.encoder.layers
    for layer in layers[:-1]:
        hidden = layer(hidden, mask, is_causal=True)
    b, length, _ = hidden.shape
    keys = torch.arange(length, device=hidden.device)
    allowed = keys[None, :] <= pool_positions[:, None]  # (B, L): the pooled token sees itself and before
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()
    pooled_mask = _additive(allowed[:, None, None, :], hidden.dtype)  # (B, 1, 1, L)
    last = layers[-1]
    if getattr(last, "gradient_checkpointing", False) and last.training and torch.is_grad_enabled():
        out = checkpoint(_last_layer_at, last, hidden, pool_positions, pooled_mask, use_reentrant=False)
    else:
        out = _last_layer_at(last, hidden, pool_positions, pooled_mask)
    return text_model.final_layer_norm(out)


def _last_layer_at(layer: nn.Module, hidden: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
    """The last CLIP encoder layer for the token at ``positions`` ``(B,)`` of each row only -> ``(B, W)``."""
    attn = layer.self_attn
    x = layer.layer_norm1(hidden)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    q_in, residual = x[rows, positions][:, None], hidden[rows, positions][:, None]
    y = residual + attn.out_proj(_attend(attn, attn.q_proj(q_in), attn.k_proj(x), attn.v_proj(x), mask))
    return (y + layer.mlp(layer.layer_norm2(y)))[:, 0]


def fast_path_kwargs_ok(kwargs: dict[str, Any]) -> bool:
    """Whether the keyword arguments of an ``encode_image`` call are ones :func:`clip_vision_forward` takes."""
    return set(kwargs) <= {"interpolate_pos_encoding"}
