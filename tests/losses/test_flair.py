"""losses.flair: FLAIR's text-conditioned attention pool (section 3.2)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from losses import TextConditionedAttentionPool


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _pool(dim: int = 8, heads: int = 2, seed: int = 0) -> TextConditionedAttentionPool:
    torch.manual_seed(seed)
    pool = TextConditionedAttentionPool(dim, heads).double()
    with torch.no_grad():  # non-trivial norms, so that a swapped LayerNorm shows
        for i, ln in enumerate((pool.ln_q, pool.ln_k, pool.ln_v)):
            ln.weight.copy_(1.0 + 0.1 * (i + 1) * _randn(dim, seed=10 + i))
            ln.bias.copy_(0.1 * _randn(dim, seed=20 + i))
        pool.attn.in_proj_bias.copy_(0.1 * _randn(3 * dim, seed=30))
        pool.attn.out_proj.bias.copy_(0.1 * _randn(dim, seed=31))
    return pool


def _by_hand(pool: TextConditionedAttentionPool, t: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One image, one query at a time: the zero slot appended after the in-projection."""
    d, h = pool.dim, pool.heads
    dh = d // h
    w, b = pool.attn.in_proj_weight, pool.attn.in_proj_bias
    out = torch.zeros(t.shape[0], t.shape[1], d, dtype=t.dtype)
    weights = torch.zeros(t.shape[0], t.shape[1], v.shape[1] + 1, dtype=t.dtype)
    for i in range(t.shape[0]):
        k = F.layer_norm(v[i], (d,), pool.ln_k.weight, pool.ln_k.bias) @ w[d:2 * d].T + b[d:2 * d]
        val = F.layer_norm(v[i], (d,), pool.ln_v.weight, pool.ln_v.bias) @ w[2 * d:].T + b[2 * d:]
        k = torch.cat([k, torch.zeros(1, d, dtype=t.dtype)])
        val = torch.cat([val, torch.zeros(1, d, dtype=t.dtype)])
        for j in range(t.shape[1]):
            q = F.layer_norm(t[i, j], (d,), pool.ln_q.weight, pool.ln_q.bias) @ w[:d].T + b[:d]
            heads_out = []
            for hh in range(h):
                sl = slice(hh * dh, (hh + 1) * dh)
                logits = k[:, sl] @ q[sl] / math.sqrt(dh)
                if mask is not None:
                    logits[:-1] = logits[:-1].masked_fill(~mask[i], float("-inf"))
                a = logits.softmax(0)
                weights[i, j] += a / h
                heads_out.append(a @ val[:, sl])
            out[i, j] = torch.cat(heads_out) @ pool.attn.out_proj.weight.T + pool.attn.out_proj.bias
    return out, weights


def test_pool_matches_hand_computation_with_the_empty_slot() -> None:
    pool = _pool()
    t, v = _randn(3, 4, 8, seed=1), _randn(3, 5, 8, seed=2)
    out, weights = pool(t, v, return_weights=True)
    want, want_w = _by_hand(pool, t, v)
    assert out.shape == (3, 4, 8) and weights.shape == (3, 4, 6)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(weights, want_w)
    assert (weights[..., -1] > 0).all()  # the empty slot takes some weight


def test_pool_masks_padded_tokens_and_an_all_padded_image_pools_to_the_output_bias() -> None:
    pool = _pool()
    t, v = _randn(2, 3, 8, seed=3), _randn(2, 4, 8, seed=4)
    mask = torch.tensor([[True, True, False, True], [False, False, False, False]])
    out, weights = pool(t, v, mask, return_weights=True)
    want, want_w = _by_hand(pool, t, v, mask)
    torch.testing.assert_close(out, want)
    assert (weights[0, :, 2] == 0).all()
    torch.testing.assert_close(weights[1, :, -1], torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(out[1], pool.attn.out_proj.bias.expand(3, -1))


def test_one_query_per_image_and_gradients_reach_every_submodule() -> None:
    pool = _pool()
    t, v = _randn(2, 8, seed=5).requires_grad_(), _randn(2, 5, 8, seed=6).requires_grad_()
    out = pool(t, v)
    assert out.shape == (2, 8)
    torch.testing.assert_close(out, pool(t.unsqueeze(1), v).squeeze(1))
    out.square().sum().backward()
    for name, p in pool.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert t.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


def test_pool_parameter_names_are_the_authors_checkpoint_names() -> None:
    names = set(TextConditionedAttentionPool(8, 2).state_dict())
    assert names == {"ln_q.weight", "ln_q.bias", "ln_k.weight", "ln_k.bias", "ln_v.weight", "ln_v.bias",
                     "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias"}


def test_pool_rejects_mismatched_shapes() -> None:
    pool = _pool()
    with pytest.raises(ValueError, match="share"):
        pool(_randn(2, 3, 8), _randn(3, 4, 8))
    with pytest.raises(ValueError, match="width must be 8"):
        pool(_randn(2, 3, 6), _randn(2, 4, 6))
    with pytest.raises(ValueError, match="local_mask"):
        pool(_randn(2, 3, 8), _randn(2, 4, 8), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="divisible"):
        TextConditionedAttentionPool(10, 3)
