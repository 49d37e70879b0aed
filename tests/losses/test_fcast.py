"""F-CAST's part- and whole-level sigmoid losses (losses/fcast.py, F-CAST eqs. 6-8)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fcast_two_rank_cases
from losses import TextConditionedAttentionPool, fcast_loss, fcast_part_loss, fcast_whole_loss


def _sp(x: float) -> float:
    return math.log1p(math.exp(x))  # softplus: -log sigmoid(-x)


def _constant_pool(u: torch.Tensor) -> TextConditionedAttentionPool:
    """A pool whose output is ``u`` for every query (out_proj weight 0, bias u)."""
    pool = TextConditionedAttentionPool(2, 1).double()
    with torch.no_grad():
        pool.attn.out_proj.weight.zero_()
        pool.attn.out_proj.bias.copy_(u)
    return pool


def test_part_loss_by_hand():
    # B = 2 images, K = 2 sub-captions; the pool returns u = (1, 0) whatever it attends to.
    sub = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [-1.0, 0.0]]], dtype=torch.float64)
    fine = torch.randn(2, 3, 2, dtype=torch.float64)
    pool = _constant_pool(torch.tensor([1.0, 0.0], dtype=torch.float64))
    indices = torch.tensor([[0, 1, 3], [1, 2, 3]])  # own K, then one sub-caption of the other image
    got = fcast_part_loss(sub, fine, pool, 2.0, -1.0, text_indices=indices, gather=False)
    # cos(u, t): row 0 -> [1, 0, -1], y [+, +, -]; row 1 -> [0, 1, -1], y [-, +, +]; logits 2 cos - 1
    row0 = _sp(-1) + _sp(1) + _sp(-3)
    row1 = _sp(-1) + _sp(-1) + _sp(3)
    assert got.item() == pytest.approx((row0 + row1) / 3, rel=1e-12)


def test_whole_loss_by_hand():
    coarse = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    long = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    got = fcast_whole_loss(coarse, long, 10.0, -5.0, gather=False)
    # positives: logit 5 -> -log sigmoid(5); negatives: logit -5, y = -1 -> -log sigmoid(5); / B = 2
    assert got.item() == pytest.approx(4 * _sp(-5) / 2, rel=1e-6)


def test_total_is_the_sum_with_separate_scales_and_biases():
    torch.manual_seed(0)
    pool = TextConditionedAttentionPool(8, 2)
    sub, fine = torch.randn(3, 4, 8), torch.randn(3, 5, 8)
    coarse, long = torch.randn(3, 8), torch.randn(3, 8)
    idx = torch.tensor([[0, 1, 2, 3, 5, 9], [2, 4, 5, 6, 7, 8], [1, 6, 8, 9, 10, 11]])
    out = fcast_loss(sub, fine, coarse, long, pool, 14.0, -10.0, 3.0, -1.0, text_indices=idx, gather=False)
    part = fcast_part_loss(sub, fine, pool, 14.0, -10.0, text_indices=idx, gather=False)
    whole = fcast_whole_loss(coarse, long, 3.0, -1.0, gather=False)
    torch.testing.assert_close(out["part"], part)
    torch.testing.assert_close(out["whole"], whole)
    torch.testing.assert_close(out["loss"], part + whole)
    # the part level is the loop over each image's K + B - 1 texts
    texts = sub.reshape(12, 8)
    ref = 0.0
    for i in range(3):
        for c in idx[i].tolist():
            v = pool(texts[c][None, None], fine[i:i + 1])[0, 0]
            y = 1.0 if c // 4 == i else -1.0
            ref += -F.logsigmoid(torch.tensor(y) * (14.0 * F.cosine_similarity(v, texts[c], dim=0) - 10.0)) / 6
    torch.testing.assert_close(part, ref)


def test_padded_segments_do_not_change_the_part_loss():
    torch.manual_seed(1)
    pool = TextConditionedAttentionPool(8, 2)
    sub, fine = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    mask = torch.tensor([[True, True, False, True], [True, True, True, True]])
    idx = torch.tensor([[0, 1, 2, 4], [1, 3, 4, 5]])
    a = fcast_part_loss(sub, fine, pool, 5.0, -2.0, fine_mask=mask, text_indices=idx, gather=False)
    fine2 = fine.clone()
    fine2[0, 2] = 50.0
    b = fcast_part_loss(sub, fine2, pool, 5.0, -2.0, fine_mask=mask, text_indices=idx, gather=False)
    torch.testing.assert_close(a, b)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return fcast_two_rank_cases.run_two_ranks(str(tmp_path_factory.mktemp("fcast_two_ranks")))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fcast", "fcast_keyed"])
def test_two_ranks_match_one_process_on_the_concatenated_batch(two_ranks, case):
    """A fixed draw, or one keyed by a seed (each rank drawing only its own rows): the mean loss and the
    gradients of two ranks equal one process on the concatenated batch with that draw."""
    fcast_two_rank_cases.assert_matches_single_process(case, two_ranks)
