"""losses.grm: GRM's adapters (eq. 1), regions (eqs. 2-6), token-wise similarity (eq. 7), VSE++
hinge (eq. 8) and objective (eqs. 9-13)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import two_rank_grm_cases
from grm_host_reads import CountHostReads
from losses import (
    GRMHead,
    GRMLoss,
    TokenAdapter,
    grm_loss,
    grm_similarity,
    gumbel_gate,
    keep_floor,
    sample_regions,
    token_wise_similarity,
    vse_hinge_loss,
)
from losses.grm import reconstruction, region_entropy, region_kl

ROOT = Path(__file__).resolve().parents[2]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _gelu(x: float) -> float:
    return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))


def _unit(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v] if n > 0 else [0.0 for _ in v]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


# --- eq. 1: Gumbel gate and adapters --------------------------------------------------------


def test_gumbel_gate_hard_is_exactly_binary_with_the_soft_gradient() -> None:
    logits = _randn(4, 7, 2, seed=1).requires_grad_()
    hard = gumbel_gate(logits, tau=0.5, hard=True, generator=torch.Generator().manual_seed(3))
    assert set(hard.unique().tolist()) <= {0.0, 1.0}
    # The same Gumbel noise, soft: the hard value is its rounding, the gradient its gradient.
    soft_logits = logits.detach().clone().requires_grad_()
    soft = gumbel_gate(soft_logits, tau=0.5, hard=False, generator=torch.Generator().manual_seed(3))
    assert torch.equal(hard.detach(), (soft.detach() > 0.5).double())
    weights = _randn(4, 7, seed=2)
    (hard * weights).sum().backward()
    (soft * weights).sum().backward()
    torch.testing.assert_close(logits.grad, soft_logits.grad)
    assert logits.grad.abs().sum() > 0


def test_gumbel_gate_soft_is_softmax_of_logits_plus_gumbel_noise() -> None:
    logits = _randn(3, 5, 2, seed=4)
    generator = torch.Generator().manual_seed(5)
    exponential = torch.empty_like(logits).exponential_(generator=generator)
    expected = ((logits - exponential.log()) / 2.0).softmax(dim=-1)[..., 1]
    got = gumbel_gate(logits, tau=2.0, hard=False, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(got, expected)


def test_gumbel_gate_at_evaluation_is_the_argmax_of_the_logits() -> None:
    logits = _randn(6, 9, 2, seed=6).requires_grad_()
    for hard in (True, False):
        gate = gumbel_gate(logits, hard=hard, stochastic=False)
        assert torch.equal(gate.detach(), (logits[..., 1] > logits[..., 0]).double())
    gate.sum().backward()  # straight-through through softmax(D / tau), no noise
    p = logits.detach().softmax(dim=-1)[..., 1]
    torch.testing.assert_close(logits.grad[..., 1], p * (1 - p))


def test_gumbel_gate_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="2 columns"):
        gumbel_gate(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="tau"):
        gumbel_gate(torch.zeros(3, 2), tau=0.0)


def _identity_adapter(adapter: TokenAdapter) -> None:
    """W1 = I, b1 = 0; keep logit = GELU(x_0) - GELU(x_1), drop logit = 0."""
    with torch.no_grad():
        adapter.fc1.weight.copy_(torch.eye(2))
        adapter.fc1.bias.zero_()
        adapter.fc2.weight.copy_(_t([0.0, 0.0], [1.0, -1.0]))
        adapter.fc2.bias.zero_()


def test_keep_floor_keeps_the_preferred_real_tokens_hand_computed() -> None:
    preference = _t([3.0, 1.0, 2.0, 0.0, 5.0], [0.5, -1.0, 0.2, 0.1, 0.3])
    mask = torch.tensor([[True, True, True, True, False], [True, True, True, True, True]])
    # Row 0: 4 real tokens (5.0 is padding); row 1: 5. ceil(0.5 * 4) = 2, ceil(0.5 * 5) = 3.
    assert keep_floor(preference, mask, 0.5).tolist() == [[True, False, True, False, False],
                                                          [True, False, True, False, True]]
    # At least one token even with min_keep = 0; all real tokens with 1.
    assert keep_floor(preference, mask, 0.0).sum(1).tolist() == [1, 1]
    assert keep_floor(preference, mask, 0.0)[0, 0] and keep_floor(preference, mask, 0.0)[1, 0]
    assert torch.equal(keep_floor(preference, mask, 1.0), mask)
    # ceil in exact arithmetic: 0.3 * 10 = 3 tokens, not 4 (0.3 * 10 is 3.0000000000000004 in floats).
    assert keep_floor(torch.arange(10.0)[None], None, 0.3).sum().item() == 3
    with pytest.raises(ValueError, match="min_keep"):
        keep_floor(preference, mask, -0.1)


def test_gumbel_gate_noise_does_not_depend_on_the_padding() -> None:
    """With ``noise_length``, the noise of the first L positions is the same whatever L the rows are padded to (up to
    noise_length): the gates and their gradients of the real tokens do not change with the padding. Without it the
    noise follows the padded shape."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 2)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False

    def gate(pad: int, noise_length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([logits, torch.zeros(3, pad, 2)], dim=1).requires_grad_(True)
        m = torch.cat([mask, torch.zeros(3, pad, dtype=torch.bool)], dim=1)
        torch.manual_seed(7)
        g = gumbel_gate(x, tau=0.5, mask=m, min_keep=0.2, noise_length=noise_length)
        (g * torch.arange(g.shape[1])).sum().backward()
        return g[:, :6], x.grad[:, :6]

    for a, b in zip(gate(0, 32), gate(20, 32)):
        torch.testing.assert_close(a, b)
    assert not torch.equal(gate(0, None)[1], gate(20, None)[1])
    with pytest.raises(ValueError, match="with noise_length, logits must be"):
        gumbel_gate(torch.zeros(4, 2), noise_length=8)


def test_gumbel_gate_floor_keeps_tokens_the_logits_would_all_drop() -> None:
    logits = torch.zeros(3, 8, 2, dtype=torch.float64)
    logits[..., 0] = 30.0  # drop wins by 30 on every token, also with Gumbel noise (practically)
    logits.requires_grad_()
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[2, 5:] = False  # 5 real tokens: ceil(0.25 * 5) = 2
    assert gumbel_gate(logits, generator=torch.Generator().manual_seed(0), mask=mask).sum() == 0  # eq. 1 alone
    gate = gumbel_gate(logits, generator=torch.Generator().manual_seed(0), mask=mask, min_keep=0.25)
    assert set(gate.detach().unique().tolist()) == {0.0, 1.0}
    assert gate.detach().sum(1).tolist() == [2.0, 2.0, 2.0] and not gate[2, 5:].any()
    # The floor takes the tokens whose sampled keep-minus-drop logit is highest, with the soft gradient.
    noisy = logits.detach().clone()
    g = torch.Generator().manual_seed(0)
    noisy = noisy - torch.empty_like(noisy).exponential_(generator=g).log()
    margin = (noisy[..., 1] - noisy[..., 0]).masked_fill(~mask, float("-inf"))
    assert torch.equal(gate.detach().bool(), margin.argsort(1, descending=True).argsort(1) < 2)
    gate.sum().backward()
    assert logits.grad.abs().sum() > 0
    # At evaluation: the argmax, then the floor by the logits' margin.
    ev = gumbel_gate(logits.detach(), stochastic=False, mask=mask, min_keep=0.0)
    assert ev.sum(1).tolist() == [1.0, 1.0, 1.0]


def test_token_adapter_eq1_hand_computed() -> None:
    adapter = TokenAdapter(2, hidden_dim=3).double()
    with torch.no_grad():
        adapter.fc1.weight.copy_(_t([1.0, -1.0], [0.5, 2.0], [0.0, 1.0]))
        adapter.fc1.bias.copy_(_t(0.1, -0.2, 0.3))
        adapter.fc2.weight.copy_(_t([1.0, 0.0, -1.0], [0.5, 0.5, 2.0]))
        adapter.fc2.bias.copy_(_t(0.0, -0.1))
    x = [0.7, -0.4]
    h = [_gelu(1.0 * x[0] - 1.0 * x[1] + 0.1), _gelu(0.5 * x[0] + 2.0 * x[1] - 0.2), _gelu(x[1] + 0.3)]
    expected = [h[0] - h[2], 0.5 * h[0] + 0.5 * h[1] + 2.0 * h[2] - 0.1]
    got = adapter(_t(x)[None])[0, 0]
    torch.testing.assert_close(got, _t(*expected))


def test_head_text_gate_eq1_with_padding() -> None:
    head = GRMHead(2, num_regions=2).double().eval()
    _identity_adapter(head.text_adapter)
    # Token 0 kept (GELU(1.5) > GELU(0)), token 1 dropped, token 2 would be kept but is padding.
    tokens = _t([[1.5, 0.0], [0.0, 2.0], [3.0, -1.0]])
    out = head.encode_text(tokens, torch.tensor([[1, 1, 0]]))
    assert out.mask.tolist() == [[True, True, False]]
    assert out.gate.tolist() == [[1.0, 0.0, 0.0]]
    torch.testing.assert_close(out.key_tokens, _t([[1.5, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(out.keep_ratio(), _t(0.5))


def test_keep_bias_initialises_both_adapters_to_keep_and_default_is_pytorch_init() -> None:
    torch.manual_seed(0)
    default = TokenAdapter(8)
    assert default.fc2.bias.abs().max() < 1 / math.sqrt(8)  # nn.Linear's uniform(-1/sqrt(in), 1/sqrt(in))
    head = GRMHead(8, num_regions=3, keep_bias=20.0).eval()
    for adapter in (head.vision_adapter, head.text_adapter):
        assert adapter.fc2.bias.tolist() == [0.0, 20.0]
    tokens = torch.randn(4, 6, 8)
    # keep - drop = (w_keep - w_drop) . h + 20 > 0 for these tokens: every gate is 1 at evaluation.
    assert head.encode_image(tokens).gate.eq(1).all()
    assert head.encode_text(tokens).gate.eq(1).all()
    assert GRMHead(8, num_regions=3).vision_adapter.fc2.bias.abs().max() < 1


def test_head_has_two_adapter_instances_and_rejects_bad_arguments() -> None:
    head = GRMHead(4, num_regions=3)
    assert isinstance(head.vision_adapter, TokenAdapter) and isinstance(head.text_adapter, TokenAdapter)
    assert head.vision_adapter.fc1.weight.data_ptr() != head.text_adapter.fc1.weight.data_ptr()
    assert head.prompts.shape == (3, 4) and head.phi.weight.shape == (4, 4)
    with pytest.raises(ValueError, match="num_regions"):
        GRMHead(4, num_regions=0)
    with pytest.raises(ValueError, match="tau"):
        GRMHead(4, tau=0)
    with pytest.raises(ValueError, match="min_keep"):
        GRMHead(4, min_keep=1.5)
    with pytest.raises(ValueError, match="leaky_slope"):
        GRMHead(4, leaky_slope=-0.1)
    with pytest.raises(ValueError, match="width 3"):
        head.encode_image(torch.randn(1, 2, 3))
    # A sample without a real token: a ValueError naming the rows, or under autograd (the training
    # step) a device-side assertion, which reads nothing back to the host (a ValueError at once on the CPU).
    with torch.no_grad(), pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        head.encode_text(torch.randn(2, 2, 4), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="a sample has no real token"):
        head.encode_text(torch.randn(2, 2, 4), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        head.encode_text(torch.randn(2, 2, 4), torch.ones(2, 3, dtype=torch.bool))


# --- eqs. 2-6: regions ---------------------------------------------------------------------

PROMPTS = [[1.0, 0.0], [0.0, 3.0], [1.0, 1.0], [-2.0, 0.0]]  # K = 4 > 2 real tokens
TOKENS = [[2.0, 0.0], [0.0, 1.0], [9.0, 9.0]]  # the last one is padding


def _region_head() -> GRMHead:
    head = GRMHead(2, num_regions=4).double()
    _identity_adapter(head.vision_adapter)
    with torch.no_grad():
        head.prompts.copy_(_t(*PROMPTS))
        head.phi.weight.copy_(_t([0.5, 0.0], [0.0, -1.0]))
        head.phi.bias.copy_(_t(0.1, 0.2))
    return head


def _regions_by_hand(keep: list[bool]) -> dict:
    """Eqs. 1-4 with lists over the kept tokens: A_r (0 on a dropped token), A_hat_r, mu, log sigma^2
    of the two real tokens."""
    v_hat = [t if k else [0.0, 0.0] for t, k in zip(TOKENS[:2], keep)]
    p_hat = [_unit(p) for p in PROMPTS]
    a = [[_sigmoid(_dot(v, p)) if kept else 0.0 for p in p_hat] for v, kept in zip(v_hat, keep)]
    a_hat = [[a[l][k] / (a[0][k] + a[1][k]) for k in range(4)] for l in range(2)]
    mu = [[sum(a_hat[l][k] * v_hat[l][j] for l in range(2)) for j in range(2)] for k in range(4)]
    log_var = [[0.5 * m[0] + 0.1, -1.0 * m[1] + 0.2] for m in mu]
    return {"v_hat": v_hat, "a": a, "a_hat": a_hat, "mu": mu, "log_var": log_var}


def test_regions_eqs2_to_4_hand_computed_with_padding_a_dropped_token_and_k_above_tokens() -> None:
    head = _region_head().eval()
    out = head.encode_image(_t(*TOKENS)[None], torch.tensor([[True, True, False]]))
    # Token 1 is dropped by the adapter (GELU(0) - GELU(1) < 0): V_hat_1 = 0 and no region weight;
    # each region is then token 0 alone (A_hat = 1 on it).
    hand = _regions_by_hand([True, False])
    assert out.gate.tolist() == [[1.0, 0.0, 0.0]]
    torch.testing.assert_close(out.key_tokens[0, :2], _t(*hand["v_hat"]))
    torch.testing.assert_close(out.region_scores[0], _t(*hand["a"], [0.0] * 4))
    torch.testing.assert_close(out.region_weights[0], _t([1.0] * 4, [0.0] * 4, [0.0] * 4))
    torch.testing.assert_close(out.region_weights[0], _t(*hand["a_hat"], [0.0] * 4))
    torch.testing.assert_close(out.mu[0], _t(*[TOKENS[0]] * 4))
    torch.testing.assert_close(out.region_weights.sum(dim=1), torch.ones(1, 4, dtype=torch.float64))
    torch.testing.assert_close(out.mu[0], _t(*hand["mu"]))
    torch.testing.assert_close(out.log_var[0], _t(*hand["log_var"]))
    # Evaluation is deterministic: U = mu.
    assert torch.equal(out.regions, out.mu)


def test_regions_are_independent_of_padding_content_and_length() -> None:
    head = _region_head().eval()
    short = head.encode_image(_t(*TOKENS[:2])[None])
    padded = head.encode_image(_t(*TOKENS[:2], [-5.0, 4.0], [1.0, 1.0])[None], torch.tensor([[1, 1, 0, 0]]))
    for name in ("mu", "log_var", "regions"):
        torch.testing.assert_close(getattr(padded, name), getattr(short, name))


def test_regions_eqs5_6_with_given_noise_hand_computed() -> None:
    head = _region_head().train()
    noise = _randn(1, 3, 4, 2, seed=7)
    out = head.encode_image(
        _t(*TOKENS)[None], torch.tensor([[True, True, False]]), stochastic=True, noise=noise,
        generator=torch.Generator().manual_seed(0),
    )
    keep = [bool(g) for g in out.gate[0, :2].tolist()]
    hand = _regions_by_hand(keep)
    for k in range(4):
        sigma = [math.exp(0.5 * lv) for lv in hand["log_var"][k]]
        z = [[hand["mu"][k][j] + noise[0, l, k, j].item() * sigma[j] for j in range(2)] for l in range(2)]
        u = [sum(hand["a_hat"][l][k] * z[l][j] for l in range(2)) for j in range(2)]
        torch.testing.assert_close(out.regions[0, k], _t(*u))


def test_sample_regions_has_the_distribution_of_eqs5_6() -> None:
    # u_k - mu_k = sigma_k sum_l A_hat_lk eps_lk: mean 0, variance sigma_k^2 sum_l A_hat_lk^2, both
    # for the collapsed draw (default) and for eqs. 5-6 with one eps per token and region.
    n = 20000
    mu = _randn(1, 2, 3, seed=8).expand(n, 2, 3)
    log_var = torch.log(_t([1.0, 4.0, 0.25], [2.0, 1.0, 1.0]))[None].expand(n, 2, 3)
    weights = _t([0.5, 0.2], [0.5, 0.3], [0.0, 0.5])[None].expand(n, 3, 2)
    generator = torch.Generator().manual_seed(12)
    collapsed = sample_regions(mu, log_var, weights, generator=generator)
    noise = torch.randn(n, 3, 2, 3, generator=generator, dtype=torch.float64)
    literal = sample_regions(mu, log_var, weights, noise=noise)
    expected = log_var[0].exp() * _t(0.5, 0.38)[:, None]  # sum_l A_hat^2: 0.25 + 0.25, 0.04 + 0.09 + 0.25
    for u in (collapsed, literal):
        torch.testing.assert_close(u.var(dim=0), expected, rtol=0.05, atol=0)
        torch.testing.assert_close(u.mean(dim=0), mu[0], atol=4 * (expected / n).sqrt().max().item(), rtol=0)
    with pytest.raises(ValueError, match="noise"):
        sample_regions(mu[:1], log_var[:1], weights[:1], noise=torch.zeros(1, 3, 2, 2))


def test_training_regions_are_stochastic_and_eval_regions_are_not() -> None:
    head = GRMHead(6, num_regions=3).double()
    tokens = _randn(2, 5, 6, seed=13)
    a = head.encode_image(tokens, generator=torch.Generator().manual_seed(1))
    b = head.encode_image(tokens, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(a.regions, b.regions)
    head.eval()
    c = head.encode_image(tokens, generator=torch.Generator().manual_seed(1))
    d = head.encode_image(tokens, generator=torch.Generator().manual_seed(2))
    assert torch.equal(c.regions, d.regions) and torch.equal(c.regions, c.mu)
    assert torch.equal(c.gate, (c.logits[..., 1] > c.logits[..., 0]).double())


# --- eq. 7: token-wise similarity ----------------------------------------------------------


def _brute_force_similarity(text, text_mask, image, image_mask, text_w=None, image_w=None, slope=None):
    """Eq. 7 one pair and one token at a time, on Python lists. A token is kept when it is real and
    its gate (weight) is not 0; the maxima run over the kept tokens, the means are gate-weighted
    means over them (for 0/1 gates: the plain mean over the kept tokens)."""
    def side(tokens, mask, weights):
        w = weights.tolist() if weights is not None else [[1.0] * tokens.shape[1]] * tokens.shape[0]
        units = [[_unit(tok) for tok in seq] for seq in tokens.tolist()]
        kept = [[m for m in range(tokens.shape[1]) if mask[b, m] and w[b][m] != 0] for b in range(tokens.shape[0])]
        return units, kept, w

    t_units, t_kept, t_w = side(text, text_mask, text_w)
    v_units, v_kept, v_w = side(image, image_mask, image_w)
    out = torch.zeros(image.shape[0], text.shape[0], dtype=torch.float64)
    for i in range(image.shape[0]):
        for j in range(text.shape[0]):
            t_idx, v_idx = t_kept[j], v_kept[i]
            cos = {}
            for m in t_idx:
                for l in v_idx:
                    c = _dot(t_units[j][m], v_units[i][l])
                    cos[m, l] = c if slope is None or c >= 0 else slope * c
            t2i = sum(t_w[j][m] * max(cos[m, l] for l in v_idx) for m in t_idx) / sum(t_w[j][m] for m in t_idx)
            i2t = sum(v_w[i][l] * max(cos[m, l] for m in t_idx) for l in v_idx) / sum(v_w[i][l] for l in v_idx)
            out[i, j] = t2i + i2t
    return out


def test_token_wise_similarity_hand_computed_with_padding_and_leaky_relu() -> None:
    # Text 0: (1, 0), (0, 1) and a padding token (5, 5); text 1: (-1, 0).
    text = _t([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]], [[-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    text_mask = torch.tensor([[True, True, False], [True, False, False]])
    # Image: (2, 0), (3, 3) and a padding token (0, -7).
    image = _t([[2.0, 0.0], [3.0, 3.0], [0.0, -7.0]])
    image_mask = torch.tensor([[True, True, False]])
    r = 1 / math.sqrt(2)
    # Text 0: t2i = (max(1, r) + max(0, r)) / 2, i2t = (max(1, 0) + max(r, r)) / 2.
    # Text 1: t2i = max(-1, -r) = -r, i2t = (-1 - r) / 2.
    expected = _t([1 + r, -r + (-1 - r) / 2])[None].reshape(1, 2)
    got = token_wise_similarity(text, text_mask, image, image_mask)
    torch.testing.assert_close(got, expected)
    leaky = token_wise_similarity(text, text_mask, image, image_mask, leaky_slope=0.1)
    torch.testing.assert_close(leaky, _t([1 + r, 0.1 * (-r + (-1 - r) / 2)]).reshape(1, 2))
    torch.testing.assert_close(got, _brute_force_similarity(text, text_mask, image, image_mask))


def _random_tokens(seed: int):
    text = _randn(7, 6, 5, seed=seed)
    image = _randn(4, 9, 5, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    text_mask = torch.rand(7, 6, generator=g) > 0.4
    text_mask[:, 0] = True
    image_mask = torch.rand(4, 9, generator=g) > 0.3
    image_mask[:, 3] = True
    return text, text_mask, image, image_mask


@pytest.mark.parametrize("slope", [None, 0.1])
def test_token_wise_similarity_agrees_with_brute_force_in_every_block_size(slope) -> None:
    text, text_mask, image, image_mask = _random_tokens(20)
    g = torch.Generator().manual_seed(23)
    text_w = (torch.rand(7, 6, generator=g) > 0.5).double()
    text_w[:, 0] = 1.0  # every text keeps a real token
    image_w = torch.rand(4, 9, generator=g, dtype=torch.float64)
    image_w[:, 1] = 0.0  # a dropped image token (soft weights elsewhere)
    expected = _brute_force_similarity(text, text_mask, image, image_mask, slope=slope)
    weighted = _brute_force_similarity(text, text_mask, image, image_mask, text_w, image_w, slope=slope)
    for block in (1, 54, 200, 10**9):
        got = token_wise_similarity(text, text_mask, image, image_mask, leaky_slope=slope, block_elements=block)
        torch.testing.assert_close(got, expected)
        got_w = token_wise_similarity(
            text, text_mask, image, image_mask, text_weights=text_w, image_weights=image_w,
            leaky_slope=slope, block_elements=block,
        )
        torch.testing.assert_close(got_w, weighted)
    # Under autograd the blocks are concatenated instead of written in place: same values.
    text_grad = text.clone().requires_grad_()
    torch.testing.assert_close(
        token_wise_similarity(text_grad, text_mask, image, image_mask, leaky_slope=slope, block_elements=54), expected
    )


def test_token_wise_similarity_gradcheck_and_normalisation() -> None:
    text = _randn(2, 3, 3, seed=30).requires_grad_()
    image = _randn(2, 4, 3, seed=31).requires_grad_()
    weights = torch.rand(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(32)).requires_grad_()
    text_mask = torch.tensor([[True, True, False], [True, True, True]])
    image_mask = torch.tensor([[True, False, True, True], [True, True, True, True]])
    assert torch.autograd.gradcheck(
        lambda t, v, w: token_wise_similarity(t, text_mask, v, image_mask, text_weights=w), (text, image, weights)
    )
    torch.testing.assert_close(
        token_wise_similarity(F.normalize(text, dim=-1) * 3, text_mask, image, image_mask),
        token_wise_similarity(text, text_mask, image, image_mask),
    )


@pytest.mark.parametrize("slope", [None, 0.1])
def test_token_wise_similarity_keeps_no_block_of_cosines_for_the_backward(slope) -> None:
    """Under autograd only arg-max indices and token inputs are saved: memory linear in
    Bi x Bt x (Lv + Lt), not Bi x Bt x Lv x Lt (LAPS's leaky ReLU included)."""
    text = _randn(8, 40, 4, seed=33).requires_grad_()
    image = _randn(8, 50, 4, seed=34).requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sim = token_wise_similarity(text, None, image, None, leaky_slope=slope, block_elements=8 * 8 * 50 * 40)
    sim.sum().backward()
    all_cosines = 8 * 8 * 50 * 40
    assert max(saved) < all_cosines / 10 and sum(saved) < all_cosines / 2, (max(saved), sum(saved))
    assert torch.isfinite(text.grad).all() and text.grad.abs().sum() > 0


def test_token_wise_similarity_rejects_bad_inputs() -> None:
    text, image = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="width"):
        token_wise_similarity(text, None, torch.randn(2, 5, 3), None)
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        token_wise_similarity(text, torch.tensor([[1, 1, 0], [0, 0, 0]]), image, None)
    # Every sample must keep a token: gates all 0 on a row (on its real tokens) are an error.
    with pytest.raises(ValueError, match=r"rows \[0\] have no kept token"):
        token_wise_similarity(text, torch.tensor([[1, 1, 0], [1, 1, 1]]), image, None,
                              text_weights=torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="a sample has no kept token"):  # under autograd: device-side
        token_wise_similarity(text.requires_grad_(), None, image, None, image_weights=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="text_weights"):
        token_wise_similarity(text, None, image, None, text_weights=torch.ones(2, 4))
    with pytest.raises(ValueError, match="block_elements"):
        token_wise_similarity(text, None, image, None, block_elements=0)
    assert token_wise_similarity(text[:0], None, image, None).shape == (2, 0)


MEMORY_SCRIPT = """
import gc, json, sys, time
import torch
from losses import token_wise_similarity
torch.set_num_threads(1)
n_image, n_text, lv, lt, d = 1000, 5000, 8, 8, 16
g = torch.Generator().manual_seed(0)
image = torch.randn(n_image, lv, d, generator=g)
text = torch.randn(n_text, lt, d, generator=g)
text_mask = torch.arange(lt)[None] < torch.randint(1, lt + 1, (n_text, 1), generator=g)
image_mask = torch.ones(n_image, lv, dtype=torch.bool)
def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
with torch.no_grad():  # warm-up: one-time kernel and allocator set-up is not the evaluation's memory
    token_wise_similarity(text[:300], text_mask[:300], image[:300], image_mask[:300], block_elements=2**20)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (the peak) to the current VmRSS
    f.write("5")
current = status_kib("VmRSS")
start = time.perf_counter()
with torch.no_grad():
    sim = token_wise_similarity(text, text_mask, image, image_mask, block_elements=2**20)
seconds = time.perf_counter() - start
peak = status_kib("VmHWM")
ok = bool(torch.isfinite(sim).all()) and tuple(sim.shape) == (n_image, n_text)
print(json.dumps({"extra_mib": (peak - current) / 1024, "seconds": seconds, "ok": ok,
                  "full_mib": n_image * n_text * lv * lt * 4 / 2**20}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_token_wise_similarity_1000_images_x_5000_texts_in_bounded_memory() -> None:
    """Peak resident memory over the inputs, measured in a fresh single-threaded process after a
    warm-up call, with the peak (VmHWM) reset just before the evaluation (Lv = Lt = 8, d = 16,
    blocks of 2^20 cosines): +28 MiB on the development machine (the 1000 x 5000
    result itself is 19 MiB), against 1,221 MiB for all token cosines at once."""
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"token_wise_similarity 1000 x 5000: peak +{stats['extra_mib']:.0f} MiB, {stats['seconds']:.1f} s")
    assert stats["ok"]
    assert stats["full_mib"] > 1000
    assert stats["extra_mib"] < 100, stats


# --- the mask must matter: hard vs soft gates -------------------------------------------------


def _pairs(seed: int = 40):
    text = _randn(5, 6, 8, seed=seed)
    text_mask = torch.ones(5, 6, dtype=torch.bool)
    text_mask[1, 4:] = False
    image = _randn(5, 7, 8, seed=seed + 1)
    return image, text, text_mask


def test_soft_gates_cancel_under_normalisation_and_the_key_level_drops_tokens() -> None:
    image, text, text_mask = _pairs()
    torch.manual_seed(0)
    head = GRMHead(8, num_regions=3, hard=False).double().train()
    original = token_wise_similarity(text, text_mask, image, None)
    soft = head(image, text, None, text_mask, generator=torch.Generator().manual_seed(1))
    assert 0 < soft.image.gate.min() and soft.image.gate.max() < 1
    # Why the default gate is hard: eq. 7 on the normalised soft-gated tokens V_hat = A V cancels A.
    torch.testing.assert_close(
        token_wise_similarity(soft.text.key_tokens, text_mask, soft.image.key_tokens, None), original
    )
    # The key level weights the means by a soft gate instead (no cancellation).
    assert (grm_similarity(soft.image, soft.text, "key") - original).abs().max() > 1e-3
    head.hard = True
    hard = head(image, text, None, text_mask, generator=torch.Generator().manual_seed(1))
    assert set(hard.image.gate.unique().tolist()) == {0.0, 1.0}
    key = grm_similarity(hard.image, hard.text, "key")
    assert (key - original).abs().max() > 0.05
    # The key level is eq. 7 with the dropped tokens out of the maxima and the means, as if padding.
    torch.testing.assert_close(
        key,
        _brute_force_similarity(text, text_mask & (hard.text.gate > 0), image, hard.image.gate > 0),
    )
    torch.testing.assert_close(grm_similarity(hard.image, hard.text, "ori"), original)


def test_straight_through_gates_pass_gradient_to_both_adapters() -> None:
    image, text, text_mask = _pairs(50)
    torch.manual_seed(1)
    head = GRMHead(8, num_regions=3).double().train()
    out = head(image, text, None, text_mask, generator=torch.Generator().manual_seed(2))
    assert set(out.text.gate.unique().tolist()) == {0.0, 1.0}
    loss = grm_loss(out.image, out.text, max_violation=False)
    loss["key"].backward()  # the key level alone: reaches the adapters only through the gates
    for adapter in (head.vision_adapter, head.text_adapter):
        for name, p in adapter.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
    assert head.prompts.grad is None and head.phi.weight.grad is None


def test_unc_level_reaches_prompts_and_phi() -> None:
    image, text, text_mask = _pairs(55)
    torch.manual_seed(2)
    head = GRMHead(8, num_regions=3).double().train()
    out = head(image, text, None, text_mask, generator=torch.Generator().manual_seed(3))
    grm_loss(out.image, out.text, max_violation=False)["unc"].backward()
    for p in (head.prompts, head.phi.weight, head.vision_adapter.fc2.weight, head.text_adapter.fc2.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


# --- eq. 8: VSE++ hinge --------------------------------------------------------------------

SIM = [[0.9, 0.5, 0.1], [0.8, 0.6, 0.7], [0.2, 0.75, 0.3]]


def test_vse_hinge_loss_hand_computed() -> None:
    sim = _t(*SIM)
    # Rows (image queries): 0 | 0.4 + 0.3 | 0.1 + 0.65; columns (text queries): 0.1 | 0.1 + 0.35 | 0.6.
    assert vse_hinge_loss(sim, max_violation=False).item() == pytest.approx(2.6)
    # Hardest negatives: 0 | 0.4 | 0.65 and 0.1 | 0.35 | 0.6.
    assert vse_hinge_loss(sim).item() == pytest.approx(2.1)
    assert vse_hinge_loss(sim, margin=0.0, max_violation=False).item() == pytest.approx(0.2 + 0.45 + 0.1 + 0.15 + 0.4)


def test_vse_hinge_loss_positives_are_never_negatives() -> None:
    # Images 1 and 2 are one image: texts 1 and 2 describe both.
    positives = torch.tensor([[True, False, False], [False, True, True], [False, True, True]])
    sim = _t(*SIM)
    # LAPS (anchors "own"): anchors are the diagonal 0.9, 0.6, 0.3; (1, 2) and (2, 1) are only no negatives.
    # Image queries: row 1 vs text 0: 0.2 + 0.8 - 0.6 = 0.4; row 2 vs text 0: 0.2 + 0.2 - 0.3 = 0.1.
    # Text queries: column 0 vs image 1: 0.2 + 0.8 - 0.9 = 0.1; column 1 vs image 0: 0.2 + 0.5 - 0.6 = 0.1.
    # Every other term is <= 0. One violation per query at most, so the hardest and the sum agree.
    for max_violation in (True, False):
        got = vse_hinge_loss(sim, positives=positives, max_violation=max_violation)
        assert got.item() == pytest.approx(0.7)
    # Every positive pair an anchor adds (1, 2) = 0.7 and (2, 1) = 0.75: row 1 vs text 0: 0.2 + 0.8 - 0.7
    # = 0.3; column 2 vs image 0, row 2 vs text 0 and column 1 vs image 0 are <= 0: 0.7 + 0.3 = 1.0.
    for max_violation in (True, False):
        got = vse_hinge_loss(sim, positives=positives, max_violation=max_violation, anchors="positives")
        assert got.item() == pytest.approx(1.0)


# 4 samples of 3 images: samples 0 and 1 are two captions of image A (rows 0 and 1 both its image),
# sample 2 is image B, sample 3 image C. Rows: the samples' images; columns: their captions.
SIM4 = [[0.7, 0.6, 0.5, 0.1], [0.6, 0.8, 0.2, 0.65], [0.4, 0.3, 0.5, 0.2], [0.3, 0.1, 0.45, 0.6]]
SAME4 = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)


def test_vse_hinge_loss_with_two_captions_of_one_image_is_laps_contrastive_loss_by_hand() -> None:
    """Issue 23 item 2. LAPS's ContrastiveLoss (lib/loss.py): anchors are the diagonal (0.7, 0.8, 0.5,
    0.6); the same-image mask only removes (0, 1) and (1, 0) from the negatives. Margin 0.2.

    Image queries (rows), negatives = the other images' captions:
      row 0: 0.2 + 0.5 - 0.7 = 0, 0.2 + 0.1 - 0.7 < 0              -> 0
      row 1: 0.2 + 0.2 - 0.8 < 0, 0.2 + 0.65 - 0.8 = 0.05           -> 0.05
      row 2: 0.2 + 0.4 - 0.5 = 0.1, 0.2 + 0.3 - 0.5 = 0, 0.2 + 0.2 - 0.5 < 0 -> 0.1
      row 3: 0.2 + 0.3 - 0.6 < 0, 0.2 + 0.1 - 0.6 < 0, 0.2 + 0.45 - 0.6 = 0.05 -> 0.05
    Text queries (columns), negatives = the other images:
      col 0: 0.2 + 0.4 - 0.7 < 0, 0.2 + 0.3 - 0.7 < 0              -> 0
      col 1: 0.2 + 0.3 - 0.8 < 0, 0.2 + 0.1 - 0.8 < 0              -> 0
      col 2: 0.2 + 0.5 - 0.5 = 0.2, 0.2 + 0.2 - 0.5 < 0, 0.2 + 0.45 - 0.5 = 0.15 -> sum 0.35, hardest 0.2
      col 3: 0.2 + 0.1 - 0.6 < 0, 0.2 + 0.65 - 0.6 = 0.25, 0.2 + 0.2 - 0.6 < 0 -> 0.25
    Sum: 0.8; hardest: 0.65.

    The toolkit's earlier form (every same-image pair an anchor, ``anchors="positives"``) adds the
    anchors (0, 1) = 0.6 and (1, 0) = 0.6: row 0 vs caption 2: 0.2 + 0.5 - 0.6 = 0.1; row 1 vs
    caption 3: 0.2 + 0.65 - 0.6 = 0.25; columns 1 and 0: 0 -> sum 1.15, hardest 1.0.
    """
    sim = _t(*SIM4)
    assert vse_hinge_loss(sim, positives=SAME4, max_violation=False).item() == pytest.approx(0.8, abs=1e-12)
    assert vse_hinge_loss(sim, positives=SAME4, max_violation=True).item() == pytest.approx(0.65, abs=1e-12)
    assert vse_hinge_loss(sim, positives=SAME4, max_violation=False, anchors="positives").item() == pytest.approx(1.15)
    assert vse_hinge_loss(sim, positives=SAME4, max_violation=True, anchors="positives").item() == pytest.approx(1.0)


def _laps_contrastive_loss(sim: torch.Tensor, image_ids: list[int], margin: float, max_violation: bool) -> float:
    """LAPS's ContrastiveLoss (lib/loss.py) transcribed to loops: d1 / d2 are the diagonal, the cost
    matrices are masked where the image ids agree, max over each row (i2t) and each column (t2i)."""
    n = sim.shape[0]
    s = sim.tolist()
    cost_s = [[0.0 if image_ids[i] == image_ids[j] else max(0.0, margin + s[i][j] - s[i][i]) for j in range(n)]
              for i in range(n)]
    cost_im = [[0.0 if image_ids[i] == image_ids[j] else max(0.0, margin + s[i][j] - s[j][j]) for j in range(n)]
               for i in range(n)]
    if max_violation:
        return sum(max(row) for row in cost_s) + sum(max(cost_im[i][j] for i in range(n)) for j in range(n))
    return sum(map(sum, cost_s)) + sum(map(sum, cost_im))


@pytest.mark.parametrize("max_violation", [True, False])
def test_vse_hinge_loss_matches_laps_on_six_samples_of_four_images(max_violation: bool) -> None:
    image_ids = [0, 0, 1, 2, 2, 3]
    sim = _randn(6, 6, seed=62) * 0.3
    same = torch.tensor([[a == b for b in image_ids] for a in image_ids])
    expected = _laps_contrastive_loss(sim, image_ids, 0.2, max_violation)
    assert vse_hinge_loss(sim, positives=same, max_violation=max_violation).item() == pytest.approx(expected, rel=1e-12)
    every = vse_hinge_loss(sim, positives=same, max_violation=max_violation, anchors="positives").item()
    assert every == pytest.approx(_brute_force_hinge(sim, same, 0.2, max_violation), rel=1e-12)
    assert every > expected  # the extra same-image anchors add cost


def _brute_force_hinge(sim: torch.Tensor, positives: torch.Tensor, margin: float, max_violation: bool) -> float:
    total = 0.0
    n_i, n_t = sim.shape
    for i in range(n_i):
        for j in range(n_t):
            if not positives[i, j]:
                continue
            rows = [max(0.0, margin + sim[i, c].item() - sim[i, j].item()) for c in range(n_t) if not positives[i, c]]
            cols = [max(0.0, margin + sim[r, j].item() - sim[i, j].item()) for r in range(n_i) if not positives[r, j]]
            for costs in (rows, cols):
                if costs:
                    total += max(costs) if max_violation else sum(costs)
    return total


@pytest.mark.parametrize("max_violation", [True, False])
def test_vse_hinge_loss_matches_brute_force_with_several_captions_per_image(max_violation: bool) -> None:
    sim = _randn(4, 10, seed=60) * 0.3
    positives = torch.zeros(4, 10, dtype=torch.bool)
    for j in range(10):
        positives[j % 4, j] = True
    positives[2, 0] = True
    got = vse_hinge_loss(sim, positives=positives, margin=0.25, max_violation=max_violation, anchors="positives")
    assert got.item() == pytest.approx(_brute_force_hinge(sim, positives, 0.25, max_violation), rel=1e-12)
    with pytest.raises(ValueError, match="anchors='own'"):  # LAPS's own anchors need one text per image
        vse_hinge_loss(sim, positives=positives, margin=0.25, max_violation=max_violation)


def test_vse_hinge_loss_gradients() -> None:
    sim = (_randn(5, 5, seed=61) * 0.3).requires_grad_()
    assert torch.autograd.gradcheck(lambda s: vse_hinge_loss(s, max_violation=False), (sim,))
    assert torch.autograd.gradcheck(lambda s: vse_hinge_loss(s, max_violation=True), (sim,))
    positives = torch.eye(5, dtype=torch.bool)
    positives[1, 3] = positives[3, 1] = positives[0, 2] = True
    for anchors in ("own", "positives"):
        for max_violation in (True, False):
            assert torch.autograd.gradcheck(
                lambda s: vse_hinge_loss(s, positives=positives, anchors=anchors, max_violation=max_violation), (sim,)
            )
    # Nothing but positives: no negatives, 0 with the graph intact.
    for anchors in ("own", "positives"):
        for max_violation in (True, False):
            sim.grad = None
            loss = vse_hinge_loss(sim, positives=torch.ones(5, 5, dtype=torch.bool), anchors=anchors,
                                  max_violation=max_violation)
            loss.backward()
            assert loss.item() == 0.0 and torch.equal(sim.grad, torch.zeros_like(sim))


def test_vse_hinge_loss_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="as many"):
        vse_hinge_loss(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="positives"):
        vse_hinge_loss(torch.zeros(2, 2), positives=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="margin"):
        vse_hinge_loss(torch.zeros(2, 2), margin=-1.0)
    with pytest.raises(ValueError, match="gather=True"):
        vse_hinge_loss(torch.zeros(2, 2), gather=True)
    with pytest.raises(ValueError, match="anchors"):
        vse_hinge_loss(torch.zeros(2, 2), anchors="every")


# --- eqs. 9-13: grm_loss --------------------------------------------------------------------


def _batch(seed: int = 70, hard: bool = True):
    torch.manual_seed(seed)
    head = GRMHead(6, num_regions=7, hard=hard).double().train()
    image = _randn(4, 5, 6, seed=seed + 1)
    image_mask = torch.ones(4, 5, dtype=torch.bool)
    image_mask[2, 3:] = False  # K = 7 > 5 tokens, and > 3 real tokens
    text = _randn(4, 6, 6, seed=seed + 2)
    text_mask = torch.arange(6)[None] < torch.tensor([6, 2, 4, 5])[:, None]
    out = head(image, text, image_mask, text_mask, generator=torch.Generator().manual_seed(seed + 3))
    return head, out


def test_regularisers_eqs10_to_12_hand_computed() -> None:
    _, out = _batch()
    img = out.image
    assert (img.gate == 0).logical_and(img.mask).any()  # some real tokens are dropped
    for b in range(4):
        kept = [l for l in range(5) if img.mask[b, l] and img.gate[b, l] != 0]  # the means run over these
        k_count = img.mu.shape[1]
        region_mean = [sum(img.regions[b, k, j].item() for k in range(k_count)) / k_count for j in range(6)]
        patch_mean = [sum(img.tokens[b, l, j].item() for l in kept) / len(kept) for j in range(6)]
        recon = sum((r - p) ** 2 for r, p in zip(region_mean, patch_mean))
        assert reconstruction(img)[b].item() == pytest.approx(recon, rel=1e-10)
        kl = -0.5 * sum(
            1 + img.log_var[b, k, j].item() - img.mu[b, k, j].item() ** 2 - math.exp(img.log_var[b, k, j].item())
            for k in range(k_count)
            for j in range(6)
        )
        assert region_kl(img)[b].item() == pytest.approx(kl, rel=1e-10)
        for entropy_of, a in (("normalised", img.region_weights), ("sigmoid", img.region_scores)):
            ent = -sum(a[b, l, k].item() * math.log(a[b, l, k].item()) for k in range(k_count) for l in kept) / k_count
            assert region_entropy(img, entropy_of=entropy_of)[b].item() == pytest.approx(ent, rel=1e-10)


def test_grm_loss_combines_the_levels_and_regularisers() -> None:
    _, out = _batch()
    got = grm_loss(out.image, out.text, max_violation=False, recon_weight=0.5, reg_weight=2.0, leaky_slope=0.1)
    text, image = out.text, out.image
    s_ori = _brute_force_similarity(text.tokens, text.mask, image.tokens, image.mask, slope=0.1)
    # Eq. 7 on the kept tokens (0/1 gates: the dropped ones leave the maxima and the means).
    s_key = _brute_force_similarity(text.tokens, text.mask, image.tokens, image.mask, text.gate, image.gate, slope=0.1)
    all_regions = torch.ones(4, 7, dtype=torch.bool)
    s_unc = _brute_force_similarity(text.tokens, text.mask, image.regions, all_regions, text.gate, slope=0.1)
    diag = torch.eye(4, dtype=torch.bool)
    for name, sim in (("ori", s_ori), ("key", s_key), ("unc", s_unc)):
        assert got[name].item() == pytest.approx(_brute_force_hinge(sim, diag, 0.2, False), rel=1e-9)
    assert got["con"].item() == pytest.approx(0.4 * got["ori"].item() + 0.4 * got["key"].item() + 0.2 * got["unc"].item())
    assert got["recon"].item() == pytest.approx(reconstruction(image).mean().item())
    assert got["kl"].item() == pytest.approx(region_kl(image).mean().item())
    assert got["ent"].item() == pytest.approx(region_entropy(image).mean().item())
    assert got["reg"].item() == pytest.approx(got["kl"].item() + got["ent"].item())
    assert got["loss"].item() == pytest.approx(got["con"].item() + 0.5 * got["recon"].item() + 2.0 * got["reg"].item())
    assert len({round(got[k].item(), 6) for k in ("ori", "key", "unc")}) == 3
    # The gates' keep ratios, for the logs (not part of the loss).
    for side, key in ((image, "keep_image"), (text, "keep_text")):
        kept = ((side.gate != 0) & side.mask).sum(1) / side.mask.sum(1)
        assert got[key].item() == pytest.approx(kept.mean().item()) and not got[key].requires_grad


def test_grm_loss_module_and_per_call_max_violation() -> None:
    _, out = _batch(80)
    module = GRMLoss(level_weights=(0.2, 0.6, 0.2), entropy_of="sigmoid")
    hardest = module(out.image, out.text)
    summed = module(out.image, out.text, max_violation=False)
    assert hardest["ori"].item() == pytest.approx(vse_hinge_loss(grm_similarity(out.image, out.text, "ori")).item())
    assert summed["ori"].item() == pytest.approx(
        vse_hinge_loss(grm_similarity(out.image, out.text, "ori"), max_violation=False).item()
    )
    assert summed["ori"] > hardest["ori"]
    assert hardest["ent"].item() == pytest.approx(region_entropy(out.image, entropy_of="sigmoid").mean().item())
    assert hardest["loss"].item() == pytest.approx(hardest["con"].item() + hardest["recon"].item() + hardest["reg"].item())
    options = GRMLoss(leaky_slope=0.1, recon_weight=0.3, reg_weight=0.7, margin=0.5, max_violation=False)
    leaky = options(out.image, out.text)
    s_leaky = grm_similarity(out.image, out.text, "ori", leaky_slope=0.1)
    assert leaky["ori"].item() == pytest.approx(vse_hinge_loss(s_leaky, margin=0.5, max_violation=False).item())
    assert leaky["loss"].item() == pytest.approx(leaky["con"].item() + 0.3 * leaky["recon"].item() + 0.7 * leaky["reg"].item())
    assert hardest["con"].item() == pytest.approx(
        0.2 * hardest["ori"].item() + 0.6 * hardest["key"].item() + 0.2 * hardest["unc"].item()
    )
    with pytest.raises(ValueError, match="entropy_of"):
        GRMLoss(entropy_of="gaussian")
    with pytest.raises(ValueError, match="level_weights"):
        grm_loss(out.image, out.text, level_weights=(0.5, -0.1, 0.6))


def test_grm_loss_trains_every_head_parameter() -> None:
    head, out = _batch(90)
    grm_loss(out.image, out.text)["loss"].backward()
    for name, p in head.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_grm_under_bfloat16_autocast_is_finite_and_trains() -> None:
    torch.manual_seed(3)
    head = GRMHead(16, num_regions=5)
    image = torch.randn(6, 10, 16)
    text = torch.randn(6, 7, 16)
    text_mask = torch.arange(7)[None] < torch.tensor([7, 3, 5, 1, 7, 2])[:, None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(image, text, None, text_mask)
        values = grm_loss(out.image, out.text)
    assert all(torch.isfinite(v) for v in values.values())
    values["loss"].float().backward()
    for name, p in head.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# --- the gates cannot collapse (issue 23, item 1) ---------------------------------------------


def test_gates_that_want_to_drop_everything_keep_the_floor_and_scores_still_differ() -> None:
    """Read literally (dropped tokens as zero vectors in the means), closing every gate scores every pair
    0 at the key level and sets mu = 0: the state the paper recipes collapsed into. With the floor and
    the kept-token means, the key level still ranks."""
    torch.manual_seed(4)
    head = GRMHead(8, num_regions=3, keep_bias=-40.0, min_keep=0.2).double()
    image, text = _randn(5, 10, 8, seed=100), _randn(5, 7, 8, seed=101)
    text_mask = torch.arange(7)[None] < torch.tensor([7, 3, 5, 1, 6])[:, None]
    for training in (True, False):
        head.train(training)
        out = head(image, text, None, text_mask, generator=torch.Generator().manual_seed(5))
        # max(1, ceil(0.2 n)) tokens: 2 of 10 image tokens; 2, 1, 1, 1, 2 of the texts' 7, 3, 5, 1, 6.
        assert out.image.gate.sum(1).tolist() == [2.0] * 5
        assert out.text.gate.sum(1).tolist() == [2.0, 1.0, 1.0, 1.0, 2.0]
        torch.testing.assert_close(out.image.keep_ratio(), torch.full((5,), 0.2, dtype=torch.float64))
        key = grm_similarity(out.image, out.text, "key")
        assert key.max() - key.min() > 0.1  # not one score for every pair
        values = grm_loss(out.image, out.text)
        assert all(torch.isfinite(v) for v in values.values())
        assert out.image.mu.norm(dim=-1).min() > 0.5  # the regions are kept tokens' means, not 0


def test_dropping_tokens_does_not_shrink_the_regions() -> None:
    """With every token the same vector c, mu_k (eq. 3) and eq. 10's patch mean are c whichever tokens are
    kept; counting dropped tokens as zero vectors would shrink both towards 0 (lower L_KL: the pull that
    closed the gates)."""
    c = _t(0.5, -1.0, 2.0, 0.25)
    tokens = c.expand(3, 6, 4).clone()
    head = GRMHead(4, num_regions=2).double().eval()
    with torch.no_grad():
        head.vision_adapter.fc2.weight.zero_()
        head.vision_adapter.fc2.bias.copy_(_t(0.0, -1.0))  # every gate 0 but the floor's
    out = head.encode_image(tokens)
    assert out.gate.sum(1).tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(out.mu, c.expand(3, 2, 4))
    torch.testing.assert_close(out.regions, c.expand(3, 2, 4))
    torch.testing.assert_close(reconstruction(out), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("anchors", ["own", "positives"])
@pytest.mark.parametrize("max_violation", [True, False])
def test_the_training_path_reads_nothing_back_to_the_host(anchors: str, max_violation: bool) -> None:
    torch.manual_seed(6)
    head = GRMHead(8, num_regions=3).train()
    image, text = torch.randn(6, 9, 8, requires_grad=True), torch.randn(6, 5, 8, requires_grad=True)
    text_mask = torch.arange(5)[None] < torch.tensor([5, 2, 4, 5, 1, 3])[:, None]
    same = torch.eye(6, dtype=torch.bool)
    same[0, 1] = same[1, 0] = True  # two captions of one image
    with CountHostReads() as counter:
        out = head(image, text, None, text_mask)
        values = grm_loss(out.image, out.text, positives=same, anchors=anchors, max_violation=max_violation)
        values["loss"].backward()
    assert counter.reads == []
    assert image.grad.abs().sum() > 0 and all(p.grad is not None for p in head.parameters())


# --- two ranks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grm_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return two_rank_grm_cases.run_two_ranks(str(tmp_path_factory.mktemp("grm_two_ranks")))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(two_rank_grm_cases.GRM_CASES))
def test_two_ranks_match_one_process_on_the_concatenated_batch(grm_two_ranks: list[dict], case: str) -> None:
    assert all(r["world_size"] == two_rank_grm_cases.WORLD for r in grm_two_ranks)
    two_rank_grm_cases.assert_matches_single_process(case, grm_two_ranks)
