"""losses.contrastive: CLIP InfoNCE, SigLIP sigmoid loss, Long-CLIP PCA and loss."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss, SigLipLoss

import two_rank_cases
from losses import clip_loss, longclip_loss, pca_reconstruct, siglip_loss


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def _direct_infonce(image: torch.Tensor, text: torch.Tensor, scale: float, eps: float = 0.0) -> torch.Tensor:
    """Symmetric InfoNCE with label smoothing written term by term."""
    image, text = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
    n = image.shape[0]
    total = image.new_zeros(())
    for logits in (scale * image @ text.T, scale * text @ image.T):
        logp = logits.log_softmax(dim=1)
        for i in range(n):
            total = total + (1 - eps) * -logp[i, i] + eps * -logp[i].mean()
    return total / (2 * n)


# --- clip_loss -----------------------------------------------------------------------------


def test_clip_loss_hand_computed_orthogonal_pairs() -> None:
    # Logits s*I: each cross-entropy is -log(e^s / (e^s + 1)) = softplus(-s).
    eye = torch.eye(2, dtype=torch.float64)
    s = 3.0
    assert clip_loss(eye, eye, s).item() == pytest.approx(_softplus(-s), rel=1e-12)


def test_clip_loss_label_smoothing_hand_computed() -> None:
    # Smoothing eps over K = 2 candidates: (1 - eps) softplus(-s) + eps (softplus(-s) + softplus(s)) / 2.
    eye = torch.eye(2, dtype=torch.float64)
    s, eps = 3.0, 0.1
    expected = (1 - eps) * _softplus(-s) + eps * (_softplus(-s) + _softplus(s)) / 2
    assert clip_loss(eye, eye, s, label_smoothing=eps).item() == pytest.approx(expected, rel=1e-12)


def test_clip_loss_matches_direct_formula_with_smoothing() -> None:
    image, text = _randn(5, 4, seed=1), _randn(5, 4, seed=2)
    got = clip_loss(image, text, torch.tensor(7.0, dtype=torch.float64), label_smoothing=0.2)
    torch.testing.assert_close(got, _direct_infonce(image, text, 7.0, eps=0.2))


def test_clip_loss_equals_open_clip_clip_loss() -> None:
    image, text = _randn(6, 8, seed=3), _randn(6, 8, seed=4)
    scale = torch.tensor(100.0, dtype=torch.float64)
    expected = ClipLoss()(F.normalize(image, dim=-1), F.normalize(text, dim=-1), scale)
    torch.testing.assert_close(clip_loss(image, text, scale), expected)


def test_clip_loss_normalises_idempotently() -> None:
    image, text = _randn(4, 3, seed=5), _randn(4, 3, seed=6)
    raw = clip_loss(image, text, 10.0)
    torch.testing.assert_close(clip_loss(F.normalize(image, dim=-1), F.normalize(text, dim=-1), 10.0), raw)
    torch.testing.assert_close(clip_loss(5 * image, 0.1 * text, 10.0), raw)


def test_clip_loss_gradcheck() -> None:
    image = _randn(4, 3, seed=7).requires_grad_()
    text = _randn(4, 3, seed=8).requires_grad_()
    log_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda i, t, s: clip_loss(i, t, s.exp(), label_smoothing=0.1), (image, text, log_scale)
    )


def test_clip_loss_valid_equals_loss_on_the_valid_sub_batch() -> None:
    image, text = _randn(6, 4, seed=9), _randn(6, 4, seed=10)
    valid = torch.tensor([True, False, True, True, False, True])
    got = clip_loss(image, text, 9.0, label_smoothing=0.1, valid=valid)
    torch.testing.assert_close(got, clip_loss(image[valid], text[valid], 9.0, label_smoothing=0.1))


def test_clip_loss_without_valid_rows_is_zero_with_a_graph() -> None:
    image = _randn(3, 4, seed=11).requires_grad_()
    text = _randn(3, 4, seed=12).requires_grad_()
    loss = clip_loss(image, text, 9.0, valid=torch.zeros(3, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(image.grad, torch.zeros_like(image))


def _indexed_infonce(image_rows, text_rows, image_cols, text_cols, scale, *, row_offset, world, label_smoothing,
                     valid_rows, valid_cols):
    """The boolean-indexed reference (the form before the masked one): invalid pairs cut out of rows and columns."""
    labels = torch.arange(image_rows.shape[0]) + row_offset
    column_index = torch.cumsum(valid_cols.long(), dim=0) - 1
    labels = column_index[labels][valid_rows]
    image_rows, text_rows = image_rows[valid_rows], text_rows[valid_rows]
    image_cols, text_cols = image_cols[valid_cols], text_cols[valid_cols]
    n_pairs = valid_cols.sum().clamp(min=1)
    ce = F.cross_entropy(scale * image_rows @ text_cols.T, labels, label_smoothing=label_smoothing, reduction="sum") \
        + F.cross_entropy(scale * text_rows @ image_cols.T, labels, label_smoothing=label_smoothing, reduction="sum")
    return ce / 2 * (world / n_pairs)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("world", [1, 3])
def test_masked_infonce_equals_the_boolean_indexed_form(label_smoothing, world) -> None:
    """The masked InfoNCE (no host read) gives the value and gradients of the boolean-indexed form to 1e-6, on
    random float32 data and masks (rows of one rank among ``world`` ranks' columns), label smoothing included."""
    from losses.contrastive import _symmetric_infonce

    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        b, d = 7, 5
        cols = [F.normalize(torch.randn(world * b, d, generator=g), dim=-1) for _ in range(2)]
        valid_cols = torch.rand(world * b, generator=g) > 0.4
        valid_cols[seed % (world * b)] = seed % 3 != 0  # some batches without their first valid pair
        rank = seed % world
        mine = slice(rank * b, (rank + 1) * b)
        if seed == 7:
            valid_cols[mine] = False  # this rank without a valid pair
        if not valid_cols.any():  # the indexed form is NaN there with smoothing (0 / 0 classes); see the next test
            continue
        scale = 1 + 9 * torch.rand((), generator=g)
        got_and_want = []
        for fn in (_symmetric_infonce, _indexed_infonce):
            image_cols, text_cols = (c.clone().requires_grad_() for c in cols)
            loss = fn(image_cols[mine], text_cols[mine], image_cols, text_cols, scale, row_offset=rank * b, world=world,
                      label_smoothing=label_smoothing, valid_rows=valid_cols[mine], valid_cols=valid_cols)
            loss.backward()
            got_and_want.append((loss.detach(), image_cols.grad, text_cols.grad))
        for got, want in zip(*got_and_want):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_masked_infonce_without_any_valid_pair_is_zero_with_finite_gradients() -> None:
    """No valid pair: 0 with zero gradients, label smoothing included (the boolean-indexed form gave NaN there:
    ``F.cross_entropy`` smooths over 0 classes)."""
    image = _randn(4, 3, seed=13, dtype=torch.float32).requires_grad_()
    text = _randn(4, 3, seed=14, dtype=torch.float32).requires_grad_()
    loss = clip_loss(image, text, 9.0, label_smoothing=0.1, valid=torch.zeros(4, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(image.grad, torch.zeros_like(image))
    assert torch.equal(text.grad, torch.zeros_like(text))


def test_clip_loss_with_valid_reads_nothing_back_to_the_host() -> None:
    from tests.finetune.host_reads import HostReads

    image = _randn(6, 4, seed=15, dtype=torch.float32).requires_grad_()
    text = _randn(6, 4, seed=16, dtype=torch.float32).requires_grad_()
    valid = torch.tensor([True, False, True, True, False, True])
    with HostReads() as reads:
        clip_loss(image, text, torch.tensor(9.0), label_smoothing=0.1, valid=valid).backward()
    assert not reads.events, reads.report()


def test_clip_loss_rejects_bad_shapes_and_masks() -> None:
    with pytest.raises(ValueError, match="paired row by row"):
        clip_loss(torch.randn(3, 4), torch.randn(2, 4), 1.0)
    with pytest.raises(ValueError, match="embedding dim"):
        clip_loss(torch.randn(3, 4), torch.randn(3, 5), 1.0)
    with pytest.raises(ValueError, match=r"image_embeds must be a \(B, D\)"):
        clip_loss(torch.randn(3), torch.randn(3), 1.0)
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        clip_loss(torch.randn(3, 4), torch.randn(3, 4), 1.0, valid=torch.ones(3))


# --- siglip_loss ---------------------------------------------------------------------------


def test_siglip_loss_hand_computed_orthogonal_pairs() -> None:
    # Two positives with logit s + b, two negatives with logit b; sum / 2 images.
    eye = torch.eye(2, dtype=torch.float64)
    s, b = 5.0, -2.0
    expected = _softplus(-(s + b)) + _softplus(b)
    assert siglip_loss(eye, eye, s, b).item() == pytest.approx(expected, rel=1e-12)


def test_siglip_loss_equals_open_clip_siglip_loss() -> None:
    image, text = _randn(5, 8, seed=13), _randn(5, 8, seed=14)
    scale, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64)
    expected = SigLipLoss()(F.normalize(image, dim=-1), F.normalize(text, dim=-1), scale, bias)
    torch.testing.assert_close(siglip_loss(image, text, scale, bias), expected)


def test_siglip_loss_multi_positive_matches_direct_sum() -> None:
    image, text = _randn(3, 4, seed=15), _randn(6, 4, seed=16)
    positives = torch.zeros(3, 6, dtype=torch.bool)
    positives[0, :2] = positives[1, 2:4] = positives[2, 4:] = True
    positives[2, 0] = True
    s, b = 4.0, -1.5
    cos = F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T
    expected = sum(
        -F.logsigmoid((1 if positives[i, j] else -1) * (s * cos[i, j] + b)) for i in range(3) for j in range(6)
    ) / 3
    torch.testing.assert_close(siglip_loss(image, text, s, b, positives=positives), expected)


def test_siglip_loss_gradcheck() -> None:
    image = _randn(3, 4, seed=17).requires_grad_()
    text = _randn(3, 4, seed=18).requires_grad_()
    params = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda i, t, p: siglip_loss(i, t, p[0].exp(), p[1]), (image, text, params))


def test_siglip_loss_needs_positives_when_batch_sizes_differ() -> None:
    with pytest.raises(ValueError, match="pass positives"):
        siglip_loss(torch.randn(2, 4), torch.randn(4, 4), 1.0, 0.0)
    with pytest.raises(ValueError, match=r"positives must be a bool tensor of shape \(2, 4\)"):
        siglip_loss(torch.randn(2, 4), torch.randn(4, 4), 1.0, 0.0, positives=torch.ones(2, 3, dtype=torch.bool))


# --- Long-CLIP -----------------------------------------------------------------------------


def _eig_pca(x: torch.Tensor, k: int) -> torch.Tensor:
    """Reference PCA via the eigen-decomposition of the covariance (Long-CLIP's formulation)."""
    x = F.normalize(x, dim=-1)
    mean = x.mean(dim=0, keepdim=True)
    centred = x - mean
    _, vectors = torch.linalg.eigh(centred.T @ centred)
    top = vectors[:, -k:]
    return centred @ top @ top.T + mean


def test_pca_reconstruct_matches_covariance_eigenvectors() -> None:
    x = _randn(12, 6, seed=19)
    got = pca_reconstruct(x, k=3)
    torch.testing.assert_close(got, _eig_pca(x, 3))
    # Not re-normalised, and the centred reconstruction has rank k.
    assert not torch.allclose(got.norm(dim=-1), torch.ones(12, dtype=torch.float64))
    assert torch.linalg.matrix_rank(got - got.mean(dim=0)) == 3


def test_pca_reconstruct_is_the_normalised_input_when_batch_is_small() -> None:
    x = _randn(5, 8, seed=20)
    torch.testing.assert_close(pca_reconstruct(x, k=4), F.normalize(x, dim=-1))
    torch.testing.assert_close(pca_reconstruct(x, k=32), F.normalize(x, dim=-1))


def test_pca_reconstruct_falls_back_when_svd_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing_svd(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "svd", failing_svd)
    x = _randn(10, 4, seed=21)
    with caplog.at_level(logging.WARNING, logger="losses.contrastive"):
        out = pca_reconstruct(x, k=2)
    torch.testing.assert_close(out, F.normalize(x, dim=-1))
    assert "SVD failed" in caplog.text


def test_pca_reconstruct_keeps_half_precision_dtype() -> None:
    x = _randn(10, 4, seed=22, dtype=torch.float32).to(torch.bfloat16)
    out = pca_reconstruct(x, k=2)
    assert out.dtype == torch.bfloat16 and out.shape == (10, 4)


def test_pca_reconstruct_rejects_bad_k() -> None:
    with pytest.raises(ValueError, match="k"):
        pca_reconstruct(torch.randn(4, 3), k=0)


def test_longclip_loss_is_long_plus_short_on_pca_features() -> None:
    image, long, short = _randn(10, 6, seed=23), _randn(10, 6, seed=24), _randn(10, 6, seed=25)
    s = 20.0
    long_part = _direct_infonce(image, long, s, eps=0.1)
    # Short part: the PCA reconstruction (not re-normalised) against normalised short captions.
    pca = _eig_pca(image, 3)
    short_n = F.normalize(short, dim=-1)
    labels = torch.arange(10)
    short_part = (
        F.cross_entropy(s * pca @ short_n.T, labels, label_smoothing=0.1)
        + F.cross_entropy(s * short_n @ pca.T, labels, label_smoothing=0.1)
    ) / 2
    got = longclip_loss(image, long, short, s, pca_dim=3)
    torch.testing.assert_close(got, long_part + short_part)


def test_longclip_loss_small_batch_is_two_clip_losses() -> None:
    image, long, short = _randn(4, 6, seed=26), _randn(4, 6, seed=27), _randn(4, 6, seed=28)
    expected = clip_loss(image, long, 9.0, label_smoothing=0.1) + clip_loss(image, short, 9.0, label_smoothing=0.1)
    torch.testing.assert_close(longclip_loss(image, long, short, 9.0), expected)


def test_longclip_loss_gradcheck_through_pca() -> None:
    image = _randn(6, 4, seed=29).requires_grad_()
    long = _randn(6, 4, seed=30).requires_grad_()
    short = _randn(6, 4, seed=31).requires_grad_()
    assert torch.autograd.gradcheck(lambda i, l, s: longclip_loss(i, l, s, 5.0, pca_dim=2), (image, long, short))


# --- two ranks -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", ["clip", "clip_valid", "clip_valid_empty_rank", "siglip", "siglip_ring", "longclip"])
def test_two_ranks_match_one_process_on_the_concatenated_batch(two_ranks: list[dict], case: str) -> None:
    two_rank_cases.assert_matches_single_process(case, two_ranks)


@pytest.mark.slow
def test_siglip_ring_exchange_equals_the_gather_on_three_ranks(tmp_path) -> None:
    """SigLIP's chunked ring (section 3.3) scores the same pairs as the all-gather: equal loss and
    gradients on every rank of 3, and their mean is the one-process loss of the whole batch."""
    import gloo_ranks

    results = gloo_ranks.run_ranks(two_rank_cases.siglip_exchanges, str(tmp_path), 3)
    assert [r["world"] for r in results] == [3, 3, 3]
    for r in results:
        for key in ("loss", "image", "text"):
            torch.testing.assert_close(r["ring"][key], r["gather"][key], rtol=1e-12, atol=1e-12)
    image, text = two_rank_cases._randn(9, 5, seed=11), two_rank_cases._randn(9, 5, seed=12)
    whole = siglip_loss(image, text, torch.tensor(10.0, dtype=torch.float64), torch.tensor(-4.0, dtype=torch.float64))
    torch.testing.assert_close(sum(r["ring"]["loss"] for r in results) / 3, whole, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="exchange must be 'gather' or 'ring'"):
        siglip_loss(image, text, 10.0, -4.0, exchange="all")
