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


# --- flair_loss (sections 3.3-3.4) ---------------------------------------------------------

import flair_ranks  # noqa: E402  (tests/losses is on sys.path: conftest)

from losses import FLAIRLoss, flair_draw_seed, flair_loss, sample_flair_text_indices  # noqa: E402
from tests.losses.flair_probes import HostReads, as_rank, largest_cpu_allocation  # noqa: E402


def _nls(z: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(z), written out."""
    return torch.log1p(torch.exp(-z))


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.dot(a, b) / (a.norm() * b.norm())


def _hand_tcs(pool, texts, rows, local, mask, s, b, k, first_image=0, foreign=False):
    """Sum over pairs (i, c): image i conditioned on text rows[i, c], compared with that text."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(rows.shape[0]):
        for c in range(rows.shape[1]):
            j = int(rows[i, c])
            t = texts[j]
            v = _by_hand(pool, t.view(1, 1, -1), local[i : i + 1], None if mask is None else mask[i : i + 1])[0][0, 0]
            y = 1.0 if not foreign and j // k == first_image + i else -1.0
            total = total + _nls(y * (s * _cos(v, t) + b))
    return total


def _hand_mps(glob, texts, s, b, k, first_image=0, foreign=False):
    """The public code's L_mps, summed: every image against every text."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(glob.shape[0]):
        for c in range(texts.shape[0]):
            y = 1.0 if not foreign and c // k == first_image + i else -1.0
            total = total + _nls(y * (s * _cos(glob[i], texts[c]) + b))
    return total


def _hand_mps_rows(glob, texts, rows, s, b, k, first_image=0, foreign=False):
    """The paper's L_mps, summed: image i against the texts of its row of the draw only."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(rows.shape[0]):
        for c in range(rows.shape[1]):
            j = int(rows[i, c])
            y = 1.0 if not foreign and j // k == first_image + i else -1.0
            total = total + _nls(y * (s * _cos(glob[i], texts[j]) + b))
    return total


def _hand_flair(pool, text, local, glob, s, b, indices, mask=None, add_mps=True, mps="paper"):
    """One process, the whole batch: (sum_i mean_c tcs + sum_i mean_c mps) / 2."""
    n_img, k, d = text.shape
    flat = text.reshape(-1, d)
    tcs = _hand_tcs(pool, flat, indices, local, mask, s, b, k) / (k + n_img - 1)
    if not add_mps:
        return tcs
    if mps == "paper":
        return (tcs + _hand_mps_rows(glob, flat, indices, s, b, k) / (k + n_img - 1)) / 2
    return (tcs + _hand_mps(glob, flat, s, b, k) / (n_img * k)) / 2


def _hand_ring(pool, text, local, glob, s, b, indices, mask, world, add_mps=True, mps="paper"):
    """The loss of every rank under the public code's ring: own block + all-negative foreign blocks."""
    per, k, d = text.shape[0] // world, text.shape[1], text.shape[2]
    losses, parts = [], []
    for r in range(world):
        rows = slice(r * per, (r + 1) * per)
        tcs = mps_sum = torch.zeros((), dtype=torch.float64)
        for q in range(world):
            texts_q = text[q * per : (q + 1) * per].reshape(-1, d)
            tcs = tcs + _hand_tcs(pool, texts_q, indices[q], local[rows], mask[rows], s, b, k, foreign=q != r)
            if mps == "paper":
                mps_sum = mps_sum + _hand_mps_rows(glob[rows], texts_q, indices[q], s, b, k, foreign=q != r)
            else:
                mps_sum = mps_sum + _hand_mps(glob[rows], texts_q, s, b, k, foreign=q != r)
        tcs = tcs / (k + per - 1)
        mps_sum = mps_sum / ((k + per - 1) if mps == "paper" else (per * k))
        parts.append({"tcs": tcs, "mps": mps_sum})
        losses.append((tcs + mps_sum) / 2 if add_mps else tcs)
    return losses, parts


def _leaves(world: int):
    full = flair_ranks.global_inputs(world)
    pool = flair_ranks.make_pool()
    leaves = {k: full[k].clone().requires_grad_(True) for k in ("text", "local", "global", "log_scale", "bias")}
    return leaves, full["mask"], pool


def _grads(loss, leaves, pool) -> dict[str, torch.Tensor]:
    names = list(leaves) + [f"pool.{k}" for k, _ in pool.named_parameters()]
    tensors = list(leaves.values()) + [p for _, p in pool.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, tensors, allow_unused=True, retain_graph=True)))


@pytest.mark.parametrize("add_mps,mps", [(True, "paper"), (True, "public_code"), (False, "paper")])
def test_flair_loss_matches_a_hand_computation_with_gradients(add_mps: bool, mps: str) -> None:
    leaves, mask, pool = _leaves(2)  # 4 images, K = 3, image 1 with a padded token
    mask[3] = False  # image 3: every token padded, only the empty slot is left
    indices = sample_flair_text_indices(4, 3, generator=torch.Generator().manual_seed(7))
    s, b = leaves["log_scale"].exp(), leaves["bias"]
    got = flair_loss(leaves["text"], leaves["local"], leaves["global"], pool, s, b, add_mps=add_mps,
                     mps_negatives=mps, text_indices=indices, local_mask=mask)
    want = _hand_flair(pool, leaves["text"], leaves["local"], leaves["global"], s, b, indices, mask, add_mps, mps)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got_grads, want_grads = _grads(got, leaves, pool), _grads(want, leaves, pool)
    for name, want_grad in want_grads.items():
        if name == "global" and not add_mps:
            assert got_grads[name] is None
            continue
        assert want_grad.abs().sum() > 0, name
        torch.testing.assert_close(got_grads[name], want_grad, rtol=1e-8, atol=1e-12, msg=name)
    assert got_grads["local"][3].abs().sum() == 0  # a fully padded image pools to the empty slot


def test_flair_loss_normalisation_sums_over_images_and_averages_over_each_images_texts() -> None:
    # s = 0: every logit is b, so the loss only counts pairs and divides them.
    n_img, k, bias = 5, 3, -2.0
    text, local, glob = _randn(n_img, k, 8, seed=1), _randn(n_img, 4, 8, seed=2), _randn(n_img, 8, seed=3)
    pool = _pool()
    sp = F.softplus
    pos, neg = sp(torch.tensor(-bias, dtype=torch.float64)), sp(torch.tensor(bias, dtype=torch.float64))
    tcs = n_img * (k * pos + (n_img - 1) * neg) / (k + n_img - 1)
    # the paper's L_mps (section 3.4): K positives and 1 of every other image's K sub-captions, as L_tcs
    mps = n_img * (k * pos + (n_img - 1) * neg) / (k + n_img - 1)
    # the public code's: all K sub-captions of every other image
    mps_public = n_img * (k * pos + (n_img - 1) * k * neg) / (n_img * k)
    assert FLAIRLoss().mps_negatives == "paper"
    parts = FLAIRLoss()(text, local, glob, pool, 0.0, bias)
    torch.testing.assert_close(parts["tcs"], tcs)
    torch.testing.assert_close(parts["mps"], mps)
    torch.testing.assert_close(parts["loss"], (tcs + mps) / 2)
    public = FLAIRLoss(mps_negatives="public_code")(text, local, glob, pool, 0.0, bias)
    torch.testing.assert_close(public["tcs"], tcs)
    torch.testing.assert_close(public["mps"], mps_public)
    assert not torch.allclose(mps, mps_public)
    torch.testing.assert_close(flair_loss(text, local, glob, pool, 0.0, bias, add_mps=False), tcs)
    assert set(FLAIRLoss(add_mps=False)(text, local, glob, pool, 0.0, bias)) == {"loss", "tcs"}
    with pytest.raises(ValueError, match="mps_negatives must be 'paper'.*'public_code'"):
        FLAIRLoss(mps_negatives="all")


def test_flair_loss_conditions_each_image_on_the_text_it_is_compared_with() -> None:
    # One image, K = 2: if v_tc were pooled from another text, swapping the texts would change
    # each pair's score; with the right pairing it only permutes the pairs.
    pool = _pool()
    text, local, glob = _randn(1, 2, 8, seed=4), _randn(1, 5, 8, seed=5), _randn(1, 8, seed=6)
    a = flair_loss(text, local, glob, pool, 5.0, -1.0, add_mps=False)
    swapped = flair_loss(text.flip(1), local, glob, pool, 5.0, -1.0, add_mps=False)
    torch.testing.assert_close(a, swapped)
    want = sum(_nls(5.0 * _cos(pool(text[:, j], local)[0], text[0, j]) - 1.0) for j in range(2)) / 2
    torch.testing.assert_close(a, want)


def test_flair_loss_draws_the_same_texts_as_the_sampler_and_ring_equals_global_in_one_process() -> None:
    leaves, mask, pool = _leaves(2)
    args = (leaves["text"], leaves["local"], leaves["global"], pool, 3.0, -1.0)
    torch.manual_seed(11)
    drawn = flair_loss(*args, local_mask=mask)
    torch.manual_seed(11)
    indices = sample_flair_text_indices(4, 3)
    torch.testing.assert_close(drawn, flair_loss(*args, local_mask=mask, text_indices=indices))
    torch.testing.assert_close(drawn, flair_loss(*args, local_mask=mask, text_indices=indices, distributed="ring"))
    torch.manual_seed(11)
    torch.testing.assert_close(drawn, flair_loss(*args, local_mask=mask, distributed="ring"))
    other = sample_flair_text_indices(4, 3, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(other, indices)
    assert not torch.allclose(drawn, flair_loss(*args, local_mask=mask, text_indices=other))


def test_sample_flair_text_indices_layout_and_uniform_negatives() -> None:
    n_img, k = 4, 3
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_flair_text_indices(n_img, k, generator=generator) for _ in range(3000)])
    assert draws.shape == (3000, n_img, k + n_img - 1) and draws.dtype == torch.int64
    for i in range(n_img):
        own = draws[:, i, i : i + k]
        assert (own == torch.arange(i * k, (i + 1) * k)).all()  # positives at columns i .. i+K-1
        others = torch.cat([draws[:, i, :i], draws[:, i, i + k :]], dim=1)
        assert (others // k == torch.tensor([j for j in range(n_img) if j != i])).all()  # one per other image
        freq = torch.bincount((others % k).flatten(), minlength=k).double() / others.numel()
        torch.testing.assert_close(freq, torch.full((k,), 1 / k, dtype=torch.float64), atol=0.02, rtol=0)
    # rows and images draw independently: image 0's and image 1's picks from image 2 often differ
    assert (draws[:, 0, 1] != draws[:, 1, 1 + k]).double().mean() > 0.5
    again = sample_flair_text_indices(n_img, k, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again, draws[0])
    assert sample_flair_text_indices(1, 2).tolist() == [[0, 1]]
    # a process builds its rows of the global draw: the same rows as the whole draw
    part = sample_flair_text_indices(n_img, k, rows=slice(2, 4), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(part, draws[0, 2:4])
    with pytest.raises(ValueError, match="step-1 slice"):
        sample_flair_text_indices(n_img, k, rows=slice(0, 4, 2))
    with pytest.raises(ValueError, match="k >= 1"):
        sample_flair_text_indices(n_img, 0)


def test_the_draw_is_a_function_of_seed_row_and_column_so_any_rows_equal_the_whole_draw() -> None:
    n_img, k = 37, 5
    whole = sample_flair_text_indices(n_img, k, seed=2024)
    torch.testing.assert_close(whole, sample_flair_text_indices(n_img, k, seed=2024))
    for first, stop in ((0, 1), (3, 11), (36, 37), (0, 37)):
        torch.testing.assert_close(sample_flair_text_indices(n_img, k, rows=slice(first, stop), seed=2024),
                                   whole[first:stop])
    # neighbouring keys (a run's consecutive steps) draw unrelated negatives: agreement near 1 / K
    others = torch.cat([whole[i, :i] for i in range(n_img)] + [whole[i, i + k:] for i in range(n_img)])
    nxt = sample_flair_text_indices(n_img, k, seed=2025)
    others_next = torch.cat([nxt[i, :i] for i in range(n_img)] + [nxt[i, i + k:] for i in range(n_img)])
    assert abs((others == others_next).double().mean().item() - 1 / k) < 0.05
    # a seed drawn from a CPU generator: the same generator state, the same draw
    torch.testing.assert_close(sample_flair_text_indices(n_img, k, generator=torch.Generator().manual_seed(3)),
                               sample_flair_text_indices(n_img, k, generator=torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="seed must be an int"):
        sample_flair_text_indices(n_img, k, seed=1.5)


def test_negatives_are_uniform_and_independent_across_pairs_and_keys() -> None:
    """Over 4,000 keys: each (image, other image) pick is uniform over the other image's K
    sub-captions, and two cells of one draw agree as often as independent picks (1 / K)."""
    n_img, k = 6, 4
    draws = torch.stack([sample_flair_text_indices(n_img, k, seed=flair_draw_seed(9, step)) for step in range(4000)])
    picks = torch.stack([torch.cat([draws[:, i, :i], draws[:, i, i + k:]], 1) % k for i in range(n_img)], 1)
    for i in range(n_img):
        for j in range(n_img - 1):
            freq = torch.bincount(picks[:, i, j], minlength=k).double() / len(picks)
            torch.testing.assert_close(freq, torch.full((k,), 1 / k, dtype=torch.float64), atol=0.03, rtol=0)
    same_row = (picks[:, 0, 0] == picks[:, 0, 1]).double().mean().item()
    same_column = (picks[:, 0, 0] == picks[:, 1, 0]).double().mean().item()  # images 0 and 1 picking from 2
    assert abs(same_row - 1 / k) < 0.03 and abs(same_column - 1 / k) < 0.03


@pytest.mark.parametrize("mps", ["paper", "public_code"])
def test_a_process_draws_only_its_own_rows_of_the_global_negative_matrix(monkeypatch, mps: str) -> None:
    """Issue 22: rank 3 of 1,024 processes with 2 images each (a global batch of 2,048) must not build
    anything of the global batch's square size (2,048 x 2,048 picks: 4 MB as bytes, 33 MB as int64)."""
    as_rank(monkeypatch, 3, 1024)
    pool = _pool()
    text, local, glob = _randn(2, 2, 8, seed=1), _randn(2, 4, 8, seed=2), _randn(2, 8, seed=3)
    rows = sample_flair_text_indices(2048, 2, rows=slice(6, 8), seed=77)
    assert rows.shape == (2, 2049)
    torch.testing.assert_close(flair_loss(text, local, glob, pool, 3.0, -1.0, seed=77, mps_negatives=mps),
                               flair_loss(text, local, glob, pool, 3.0, -1.0, text_indices=_whole_from_rows(
                                   rows, 2048, 2, 6), mps_negatives=mps))
    largest = largest_cpu_allocation(lambda: flair_loss(text, local, glob, pool, 3.0, -1.0, seed=77,
                                                         mps_negatives=mps))
    assert largest < 2048 * 2048 // 4, largest


def _whole_from_rows(rows: torch.Tensor, n_img: int, k: int, first: int) -> torch.Tensor:
    """A whole global draw whose rows ``first ..`` are ``rows`` (the others: any valid rows)."""
    whole = sample_flair_text_indices(n_img, k, seed=0)
    whole[first:first + rows.shape[0]] = rows
    return whole


@pytest.mark.parametrize("distributed", ["global", "ring"])
def test_a_keyed_draw_reads_nothing_back_to_the_host(distributed: str) -> None:
    pool = _pool()
    text, local, glob = (_randn(4, 3, 8, seed=1).requires_grad_(), _randn(4, 5, 8, seed=2).requires_grad_(),
                         _randn(4, 8, seed=3).requires_grad_())
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 2] = False
    with HostReads() as spy:
        loss = flair_loss(text, local, glob, pool, torch.tensor(3.0), torch.tensor(-1.0), seed=flair_draw_seed(0, 5),
                          distributed=distributed, local_mask=mask)
        loss.backward()
    assert spy.reads == []
    want = flair_loss(text, local, glob, pool, 3.0, -1.0, local_mask=mask, distributed=distributed,
                      text_indices=sample_flair_text_indices(4, 3, seed=flair_draw_seed(0, 5)))
    torch.testing.assert_close(loss, want)
    with HostReads() as spy:  # the check of a user's fixed draw does read (it is not the training path)
        flair_loss(text, local, glob, pool, 3.0, -1.0, text_indices=sample_flair_text_indices(4, 3, seed=1))
    assert spy.reads
    with pytest.raises(ValueError, match="not both"):
        flair_loss(text, local, glob, pool, 3.0, -1.0, seed=1, text_indices=sample_flair_text_indices(4, 3, seed=1))


def test_flair_loss_rejects_bad_inputs() -> None:
    pool = _pool()
    text, local, glob = _randn(3, 2, 8, seed=1), _randn(3, 4, 8, seed=2), _randn(3, 8, seed=3)
    good = sample_flair_text_indices(3, 2)
    bad_cases = {
        "shape": (good[:, :-1], "shape \\(3, 4\\)"),
        "float": (good.double(), "integer tensor"),
        "range": (good + 100, "lie in \\[0, 6\\)"),
        "missing positive": (good.masked_fill(good == 0, 2), "once each"),
        "two of one image": (torch.tensor([[0, 1, 2, 3], [0, 2, 3, 5], [1, 3, 4, 5]]), "every other image"),
    }
    for name, (indices, message) in bad_cases.items():
        with pytest.raises(ValueError, match=message):
            flair_loss(text, local, glob, pool, 1.0, 0.0, text_indices=indices)
        assert name
    with pytest.raises(ValueError, match="'global' or 'ring'"):
        flair_loss(text, local, glob, pool, 1.0, 0.0, distributed="all")
    with pytest.raises(ValueError, match="'global' or 'ring'"):
        FLAIRLoss(distributed="ring-ish")
    with pytest.raises(ValueError, match="share B"):
        flair_loss(text, local[:2], glob, pool, 1.0, 0.0)
    with pytest.raises(ValueError, match="share D"):
        flair_loss(text, local, glob[:, :4], pool, 1.0, 0.0)
    with pytest.raises(ValueError, match="\\(B, K, D\\)"):
        flair_loss(text[:, 0], local, glob, pool, 1.0, 0.0)
    with pytest.raises(ValueError, match="local_mask"):
        flair_loss(text, local, glob, pool, 1.0, 0.0, local_mask=torch.ones(3, 5, dtype=torch.bool))


# --- across processes (2 and 3 gloo processes) ---------------------------------------------


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["2proc", "3proc"])
def flair_world(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    return world, flair_ranks.run_ranks(str(tmp_path_factory.mktemp(f"flair{world}")), world)


def _assert_close(got, want, msg: str, rtol: float = 1e-9) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-12, msg=lambda m: f"{msg}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["global", "global_public_mps", "global_no_mps", "global_seeded", "global_keyed"])
def test_global_semantics_equal_one_process_on_the_concatenated_batch(flair_world, case: str) -> None:
    """Each rank draws only its own rows; with the same draw (a fixed one, one seeded alike, or one
    keyed alike) the loss and gradients equal one process on the concatenated batch."""
    world, results = flair_world
    assert [r["world_size"] for r in results] == [world] * world
    leaves, mask, pool = _leaves(world)
    if case == "global_seeded":  # every rank drew its rows itself, from the same seed
        torch.manual_seed(flair_ranks.SAMPLE_SEED)
        indices = sample_flair_text_indices(world * flair_ranks.B, flair_ranks.K)
    elif case == "global_keyed":  # every rank drew its rows keyed by the same seed
        indices = sample_flair_text_indices(world * flair_ranks.B, flair_ranks.K, seed=flair_ranks.DRAW_KEY)
    else:
        indices = flair_ranks.global_indices(world)
    want = _hand_flair(pool, leaves["text"], leaves["local"], leaves["global"], leaves["log_scale"].exp(),
                       leaves["bias"], indices, mask, add_mps=case != "global_no_mps", mps=flair_ranks.mps_form(case))
    _assert_close(sum(r[case]["loss"] for r in results) / world, want, f"{case} loss")
    want_grads = _grads(want, leaves, pool)
    per = flair_ranks.B
    for name, full in want_grads.items():
        if full is None:  # the class token without L_mps
            assert all(r[case]["grads"][name] is None for r in results)
            continue
        assert full.abs().sum() > 0, name
        if name in ("text", "local", "global"):
            for rank, r in enumerate(results):  # DDP divides by W what the rank's gather summed
                _assert_close(r[case]["grads"][name] / world, full[rank * per : (rank + 1) * per],
                              f"{case} grad {name} rank {rank}")
        else:  # shared parameters: DDP's mean over ranks
            _assert_close(sum(r[case]["grads"][name] for r in results) / world, full, f"{case} grad {name}")


@pytest.mark.parametrize("case", ["ring", "ring_public_mps", "ring_no_mps", "ring_module", "ring_keyed"])
def test_ring_semantics_equal_the_public_codes_per_rank_loss(flair_world, case: str) -> None:
    world, results = flair_world
    assert [r["world_size"] for r in results] == [world] * world
    leaves, mask, pool = _leaves(world)
    losses, parts = _hand_ring(pool, leaves["text"], leaves["local"], leaves["global"], leaves["log_scale"].exp(),
                               leaves["bias"], flair_ranks.ring_keyed_indices(world) if case == "ring_keyed"
                               else flair_ranks.ring_indices(world), mask, world,
                               add_mps=case != "ring_no_mps", mps=flair_ranks.mps_form(case))
    for rank, r in enumerate(results):
        _assert_close(r[case]["loss"], losses[rank], f"{case} loss rank {rank}")
        if case == "ring_module":
            _assert_close(r[case]["parts"]["tcs"], parts[rank]["tcs"], f"tcs rank {rank}")
            _assert_close(r[case]["parts"]["mps"], parts[rank]["mps"], f"mps rank {rank}")
    # Every rank backpropagates its own loss: the texts' gradients come back over the ring, so
    # the gradients of all ranks together are those of the sum of the per-rank losses.
    want_grads = _grads(sum(losses), leaves, pool)
    per = flair_ranks.B
    for name, full in want_grads.items():
        if full is None:
            assert all(r[case]["grads"][name] is None for r in results)
            continue
        assert full.abs().sum() > 0, name
        if name in ("text", "local", "global"):
            for rank, r in enumerate(results):
                _assert_close(r[case]["grads"][name], full[rank * per : (rank + 1) * per],
                              f"{case} grad {name} rank {rank}")
        else:
            _assert_close(sum(r[case]["grads"][name] for r in results), full, f"{case} grad {name}")
    # A text's gradient includes the other ranks' (all-negative) losses: its own rank's loss alone
    # gives a different gradient.
    own_only = torch.autograd.grad(losses[0], leaves["text"])[0][:per]
    assert not torch.allclose(own_only, results[0][case]["grads"]["text"])


def test_gather_false_keeps_each_process_on_its_own_batch(flair_world) -> None:
    world, results = flair_world
    leaves, mask, pool = _leaves(world)
    per = flair_ranks.B
    for rank, r in enumerate(results):
        rows = slice(rank * per, (rank + 1) * per)
        want = _hand_flair(pool, leaves["text"][rows], leaves["local"][rows], leaves["global"][rows],
                           leaves["log_scale"].exp(), leaves["bias"], flair_ranks.ring_indices(world)[rank],
                           mask[rows])
        _assert_close(r["local"]["loss"], want, f"local loss rank {rank}")
        want_text = torch.autograd.grad(want, leaves["text"], retain_graph=True)[0][rows]
        _assert_close(r["local"]["grads"]["text"], want_text, f"local text grad rank {rank}")


def test_flair_loss_under_bf16_autocast_keeps_float32_logits() -> None:
    pool = TextConditionedAttentionPool(8, 2)
    text, local, glob = (_randn(*shape, seed=i).float().requires_grad_(True)
                         for i, shape in enumerate([(3, 2, 8), (3, 4, 8), (3, 8)]))
    scale, bias = torch.tensor(14.3, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    indices = sample_flair_text_indices(3, 2, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = FLAIRLoss()(text, local, glob, pool, scale, bias, text_indices=indices)
    assert {k: v.dtype for k, v in parts.items()} == dict.fromkeys(("tcs", "mps", "loss"), torch.float32)
    loss = parts["loss"]
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (text, local, glob, scale, bias))
    full = flair_loss(text, local, glob, pool, scale, bias, text_indices=indices)
    torch.testing.assert_close(loss, full, rtol=0.02, atol=0.0)  # bf16 cosines, float32 logits
