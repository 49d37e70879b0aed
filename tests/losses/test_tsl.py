"""losses.tsl: FAST-GOAL's Token Similarity-based Learning (paper III-B), the torch-only part: sentence-span
selection and span pooling (eq. 7), patch-mask pooling (eq. 9) and tsl_loss (eq. 14), against hand-worked values.
The model glue (spans of a model's tokens, box geometry, TSL heads) is tested in
tests/finetune/objectives/test_tsl_heads.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import two_rank_cases
from losses import (
    TSLHeads,
    pool_box_states,
    pool_patch_states,
    pool_span_states,
    select_sentence_spans,
    tsl_loss,
    tsl_similarity_loss,
)
from tests.losses.tsl_host_reads import HostReads

def _ramp_states(batch: int, length: int, width: int = 3) -> torch.Tensor:
    """states[b, l, w] = 100 b + l + w / 10: the mean over positions is read off by hand."""
    b = torch.arange(batch, dtype=torch.float64)[:, None, None]
    pos = torch.arange(length, dtype=torch.float64)[None, :, None]
    w = torch.arange(width, dtype=torch.float64)[None, None, :]
    return 100 * b + pos + w / 10


# --- spans (eq. 7) -------------------------------------------------------------------------------------

def test_select_sentence_spans_checks_indices_and_skips_rows_without_a_pair():
    spans = [[(1, 5), (5, 9)], [(1, 4), None], [(1, 3)]]
    selected = select_sentence_spans(spans, [1, 1, None])
    assert selected.spans.tolist() == [[5, 9], [0, 0], [0, 0]]
    assert selected.valid.tolist() == [True, False, False] and selected.truncated == 1  # None index: not truncation
    with pytest.raises(ValueError, match="sample 2 asks for sentence 1, but its caption has 1 sentences"):
        select_sentence_spans(spans, [0, 0, 1])
    with pytest.raises(ValueError, match="3 captions' spans but 2 sentence indices"):
        select_sentence_spans(spans, [0, 0])


def test_pool_span_states_rejects_empty_and_overlong_spans():
    states = _ramp_states(2, 6)
    with pytest.raises(ValueError, match="sample 1 has span \\(4, 7\\)"):
        pool_span_states(states, [[1, 2], [4, 7]])
    with pytest.raises(ValueError, match="sample 0 has span \\(3, 3\\)"):
        pool_span_states(states, [[3, 3], [1, 2]])
    with pytest.raises(ValueError, match="\\(B, 2\\)"):
        pool_span_states(states, [[1, 2]])
    pooled = pool_span_states(states, torch.tensor([[0, 6], [5, 6]]))
    assert pooled[:, 0].tolist() == [2.5, 105.0]


class _GridGeometry:
    """A user's own geometry (no toolkit): boxes given in patch units of a 2 x 3 grid, half-open."""

    def box_patch_masks(self, boxes, n_patches, *, valid=None):
        assert n_patches == 6
        masks = torch.zeros(len(boxes), 6, dtype=torch.bool)
        for b, (x1, y1, x2, y2) in enumerate(boxes):
            for r in range(int(y1), int(y2)):
                masks[b, r * 3 + int(x1):r * 3 + int(x2)] = True
        return masks if valid is None else masks & valid[:, None]


def test_pool_box_states_pools_under_the_masks_any_geometry_gives():
    """eq. 9 needs only a geometry with ``box_patch_masks`` (the toolkit's ``BoxGeometry`` is tested in
    tests/finetune/objectives/test_tsl_heads.py): here the top-left 1 x 2 patches and the right column."""
    states = _ramp_states(2, 6)
    pooled = pool_box_states(states, [(0, 0, 2, 1), (2, 0, 3, 2)], _GridGeometry())
    torch.testing.assert_close(pooled, torch.stack([states[0, [0, 1]].mean(0), states[1, [2, 5]].mean(0)]))
    dropped = pool_box_states(states, [(0, 0, 2, 1), (2, 0, 3, 2)], _GridGeometry(), valid=torch.tensor([False, True]))
    assert dropped[0].abs().sum() == 0 and torch.equal(dropped[1], pooled[1])
    with pytest.raises(ValueError, match="sample 0 selects no patch"):
        pool_box_states(states, [(1, 1, 1, 2), (2, 0, 3, 2)], _GridGeometry())
    with pytest.raises(TypeError, match="geometry must have a box_patch_masks"):
        pool_box_states(states, [(0, 0, 2, 1), (2, 0, 3, 2)], {"mode": "squash"})


def test_tsl_heads_rebuild_from_their_inference_config():
    """The heads are a plain module: their init kwargs (what the toolkit saves beside a model) rebuild them."""
    heads = TSLHeads(8, 6, 4, image_bias=True, text_eps=1e-6)
    config = heads.inference_config()
    assert config == {"image_width": 8, "text_width": 6, "dim": 4, "image_bias": True, "text_bias": False,
                      "image_eps": 1e-5, "text_eps": 1e-6}
    rebuilt = TSLHeads(**config)
    rebuilt.load_state_dict(heads.state_dict())
    x, t = torch.randn(3, 8), torch.randn(2, 5, 6)
    torch.testing.assert_close(rebuilt.project_image_states(x), heads.project_image_states(x))
    assert heads.project_image_states(x).shape == (3, 4) and heads.project_text_states(t).shape == (2, 5, 4)
    assert heads.image.proj.bias is not None and heads.text.proj.bias is None


def test_pooling_and_the_loss_read_nothing_back_in_a_training_step():
    """With validity decided beforehand (collate), eq. 7 / eq. 9 pooling (``check=False``) and eq. 14 use masks only:
    no ``.item()`` / ``.cpu()`` / ``bool()`` / boolean indexing, so a step on an accelerator does not sync on them.
    A row without a patch or a span pools zeros."""
    states = _ramp_states(2, 6)
    masks = torch.tensor([[[True, True, False, False, False, False], [False] * 6],
                          [[False, False, False, False, True, True], [False, False, True, False, False, False]]])
    spans = torch.tensor([[[1, 3], [0, 0]], [[2, 6], [5, 6]]])
    valid = torch.tensor([[True, False], [True, True]])
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    weights = torch.tensor([1.0, 0.0, 2.0, 1.0], dtype=torch.float64)
    with HostReads() as mode:
        pooled = pool_patch_states(states, masks, valid=valid, check=False)
        spanned = pool_span_states(states, spans, valid=valid, check=False)
        matrix = tsl_similarity_loss(a, b, valid=valid.flatten(), weights=weights)
        diagonal = tsl_similarity_loss(a, b, form="diagonal", valid=valid.flatten(), weights=weights)
    assert mode.reads == []
    assert pooled.shape == (2, 2, 3) and pooled[0, 1].abs().sum() == 0
    torch.testing.assert_close(pooled[1, 0], states[1, 4:6].mean(0))
    torch.testing.assert_close(spanned[1, 0], states[1, 2:6].mean(0))
    keep = valid.flatten()
    cos = F.normalize(a[keep], dim=-1) @ F.normalize(b[keep], dim=-1).T
    w = weights[keep]
    torch.testing.assert_close(matrix, (((cos - torch.eye(3, dtype=torch.float64)) ** 2).sum(1) * w).sum() / 9)
    torch.testing.assert_close(diagonal, (((cos.diagonal() - 1) ** 2) * w).sum() / 3)
    # the checking path (a user's own loop) still names a row without a patch
    with pytest.raises(ValueError, match="sample \\(0, 1\\) selects no patch"):
        pool_patch_states(states, masks, valid=torch.ones(2, 2, dtype=torch.bool))


def test_the_loss_and_its_backward_dispatch_no_host_read():
    """Counted at the dispatcher (``tests.finetune.host_reads``), which also sees the reads ops make inside
    (``F.one_hot`` checks its indices' range with ``.item()``): eq. 14 in both forms, forward and backward."""
    from tests.finetune.host_reads import HostReads as DispatchReads

    g = torch.Generator().manual_seed(1)
    a, b, c, d = (torch.randn(4, 3, generator=g).requires_grad_() for _ in range(4))
    box_valid, span_valid = torch.tensor([True, False, True, True]), torch.tensor([True, True, False, True])
    weights = torch.tensor([1.0, 0.5, 2.0, 1.0])
    for form in ("matrix", "diagonal"):
        with DispatchReads() as reads:
            tsl_loss(a, b, c, d, form=form, box_valid=box_valid, span_valid=span_valid, weights=weights).backward()
        assert not reads.events, reads.report()


# --- tsl_loss (eq. 14) ------------------------------------------------------------------------------


def _t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# Image side: P = [(3, 0), (0, 2)], v = [(1, 0), (1, 1)]: cos = [[1, 1/sqrt2], [0, 1/sqrt2]].
# Text side:  S = [(1, 1), (-1, 0)], t = [(0, 5), (-1, 0)]: cos = [[1/sqrt2, -1/sqrt2], [0, 1]].
P, V = _t([3, 0], [0, 2]), _t([1, 0], [1, 1])
S, T = _t([1, 1], [-1, 0]), _t([0, 5], [-1, 0])
R = 1 / math.sqrt(2)
IMAGE_MATRIX = ((1 - 1) ** 2 + R**2 + 0**2 + (R - 1) ** 2) / 4
TEXT_MATRIX = ((R - 1) ** 2 + R**2 + 0**2 + (1 - 1) ** 2) / 4
IMAGE_DIAGONAL = ((1 - 1) ** 2 + (R - 1) ** 2) / 2
TEXT_DIAGONAL = ((R - 1) ** 2 + (1 - 1) ** 2) / 2


def test_tsl_loss_matrix_form_hand_computed():
    assert IMAGE_MATRIX == pytest.approx(0.1464466094, rel=1e-9)
    assert tsl_similarity_loss(P, V).item() == pytest.approx(IMAGE_MATRIX, rel=1e-12)
    assert tsl_similarity_loss(S, T).item() == pytest.approx(TEXT_MATRIX, rel=1e-12)
    assert tsl_loss(P, V, S, T).item() == pytest.approx(IMAGE_MATRIX + TEXT_MATRIX, rel=1e-12)


def test_tsl_loss_diagonal_form_hand_computed():
    assert tsl_loss(P, V, S, T, form="diagonal").item() == pytest.approx(IMAGE_DIAGONAL + TEXT_DIAGONAL, rel=1e-12)
    assert IMAGE_DIAGONAL + TEXT_DIAGONAL == pytest.approx(0.0857864376, rel=1e-9)


def test_tsl_loss_is_mse_of_the_cosine_matrix_against_the_identity():
    g = torch.Generator().manual_seed(0)
    a, b, c, d = (torch.randn(6, 5, generator=g, dtype=torch.float64) for _ in range(4))
    cos = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T
    cos_t = F.normalize(c, dim=-1) @ F.normalize(d, dim=-1).T
    eye = torch.eye(6, dtype=torch.float64)
    expected = F.mse_loss(cos, eye) + F.mse_loss(cos_t, eye)
    torch.testing.assert_close(tsl_loss(a, b, c, d), expected)
    diagonal = F.mse_loss(cos.diagonal(), torch.ones(6, dtype=torch.float64)) + F.mse_loss(
        cos_t.diagonal(), torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(tsl_loss(a, b, c, d, form="diagonal"), diagonal)


@pytest.mark.parametrize("form", ["matrix", "diagonal"])
def test_tsl_loss_gradients(form):
    g = torch.Generator().manual_seed(1)
    inputs = tuple(torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4))
    weights = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float64)
    valid = torch.tensor([True, False, True, True])
    assert torch.autograd.gradcheck(lambda a, b, c, d: tsl_loss(a, b, c, d, form=form), inputs)
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: tsl_loss(a, b, c, d, form=form, span_valid=valid, weights=weights), inputs)
    # hand gradient of the diagonal image term for one pair: d/dp (cos(p, v) - 1)^2 with p = (3, 0), v = (1, 1)
    p = _t([3, 0]).requires_grad_(True)
    tsl_similarity_loss(p, _t([1, 1]), form=form).backward()
    # n = 1: both forms are (cos - 1)^2; d cos / dp = (v_hat - cos p_hat) / |p| = ((R, R) - R (1, 0)) / 3
    torch.testing.assert_close(p.grad, 2 * (R - 1) * _t([0, R / 3]))


def test_dropped_pairs_leave_the_matrix():
    valid = torch.tensor([True, False, True])
    a = torch.cat([P[:1], _t([5, 5]), P[1:]]).requires_grad_(True)
    b = torch.cat([V[:1], _t([-1, 2]), V[1:]])
    # the dropped pair is neither a row nor a column: the loss is the 2 x 2 one, n = 2
    assert tsl_similarity_loss(a, b, valid=valid).item() == pytest.approx(IMAGE_MATRIX, rel=1e-12)
    tsl_similarity_loss(a, b, valid=valid).backward()
    assert a.grad[1].abs().sum() == 0 and a.grad[0].abs().sum() > 0
    assert tsl_similarity_loss(a, b, valid=valid, form="diagonal").item() == pytest.approx(IMAGE_DIAGONAL, rel=1e-12)
    none = tsl_similarity_loss(a, b, valid=torch.zeros(3, dtype=torch.bool))
    assert none.item() == 0 and none.requires_grad
    # weights scale each pair's row of squared errors; the normaliser stays n^2
    w = torch.tensor([2.0, 1.0], dtype=torch.float64)
    weighted = (2 * (0 + R**2) + 1 * (0 + (R - 1) ** 2)) / 4
    assert tsl_similarity_loss(P, V, weights=w).item() == pytest.approx(weighted, rel=1e-12)


def test_the_matrix_form_puts_one_nth_of_its_weight_on_the_pairs():
    """Issue 23 item 7, the numbers the README quotes: at n = 256, with the pairs' cosine c on the diagonal and 0
    elsewhere, eq. 14's matrix form is (1 - c)^2 / n and its gradient on c is -2 (1 - c) / n: the diagonal holds
    n / n^2 = 1 / n of its weight (0.39 %). The GOAL code's diagonal form is (1 - c)^2, n times more."""
    n, c = 256, 0.3
    eye = torch.eye(n, dtype=torch.float64)
    cos = torch.tensor(c, dtype=torch.float64, requires_grad=True)
    pooled = torch.cat([cos * eye, (1 - cos**2).sqrt() * eye], dim=1)  # unit rows: cos(pooled_i, target_j) = c delta_ij
    target = torch.cat([eye, torch.zeros(n, n, dtype=torch.float64)], dim=1)
    matrix = tsl_similarity_loss(pooled, target)
    diagonal = tsl_similarity_loss(pooled, target, form="diagonal")
    assert matrix.item() == pytest.approx((1 - c) ** 2 / n, rel=1e-9)
    assert diagonal.item() == pytest.approx((1 - c) ** 2, rel=1e-9)
    (g_matrix,) = torch.autograd.grad(matrix, cos, retain_graph=True)
    (g_diagonal,) = torch.autograd.grad(diagonal, cos)
    assert g_matrix.item() == pytest.approx(-2 * (1 - c) / n, rel=1e-9)
    assert g_diagonal.item() / g_matrix.item() == pytest.approx(n, rel=1e-9)
    assert 1 / n == pytest.approx(0.0039, abs=1e-4)


def test_tsl_loss_rejects_bad_inputs():
    with pytest.raises(ValueError, match="TSL form must be one of"):
        tsl_loss(P, V, S, T, form="diag")
    with pytest.raises(ValueError, match="paired row by row"):
        tsl_loss(P, V[:1], S, T)
    with pytest.raises(ValueError, match="span_valid must be a \\(2,\\) bool|valid must be a \\(2,\\) bool"):
        tsl_loss(P, V, S, T, span_valid=torch.tensor([1, 0]))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tsl_matrix", "tsl_diagonal", "tsl_valid_weighted"])
def test_two_ranks_match_one_process_on_the_concatenated_batch(two_ranks: list[dict], case: str) -> None:
    two_rank_cases.assert_matches_single_process(case, two_ranks)


def test_the_losses_need_no_toolkit():
    """``losses`` is torch only (README, "Losses library"): TSL's pooling and loss work without ``finetune``."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "sys.modules['finetune'] = None  # the toolkit cannot be imported\n"
        "import torch, losses\n"
        "x = torch.randn(3, 4)\n"
        "assert losses.tsl_loss(x, x, x, x, form='diagonal').item() < 1e-12\n"
        "states = torch.arange(12.).reshape(1, 6, 2)\n"
        "assert losses.pool_span_states(states, [[1, 3]]).tolist() == [[3.0, 4.0]]\n"
        "mask = torch.tensor([[True, False, False, False, False, True]])\n"
        "assert losses.pool_patch_states(states, mask).tolist() == [[5.0, 6.0]]\n"
        "print('torch only')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "torch only"
