"""CAST encoder (finetune/models/cast.py): FPS, segment means, graph pooling, the encoder's outputs."""

from __future__ import annotations

import itertools

import pytest
import torch

from finetune.models.cast import (
    CAST_CONFIGS,
    CastConfig,
    CastEncoder,
    GraphPool,
    farthest_point_sampling,
    hierarchy_labels,
    segment_mean,
    sincos_2d,
)

LINE = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [3.0, 0.0], [-1.0, 0.0]]])


def test_fps_hand_checked_with_ties():
    # from 0: d = [0, 1, 9, 9, 1] -> 2 (first of the tied 9s); then min d = [0, 1, 0, 0, 1] -> 1 (tie with 4)
    assert farthest_point_sampling(LINE, 4).tolist() == [[0, 2, 1, 4]]
    assert farthest_point_sampling(LINE, 2, start=4).tolist() == [[4, 2]]


def test_fps_never_picks_padded_points():
    valid = torch.tensor([[True, True, False, True, True]])
    # point 2 padded: d = [0, 1, -, 9, 1] -> 3; then [0, 1, -, 0, 1] -> 1; then -> 4
    assert farthest_point_sampling(LINE, 4, valid=valid).tolist() == [[0, 3, 1, 4]]
    # fewer valid points than centres: later picks repeat the first valid point, never the padded one
    picks = farthest_point_sampling(LINE, 5, valid=torch.tensor([[True, False, False, True, False]]))
    assert picks.tolist() == [[0, 3, 0, 0, 0]]


def _brute_fps(x, m, start, valid):
    n = len(x)
    chosen = [start]
    while len(chosen) < m:
        best, best_d = None, None
        for i in range(n):
            if not valid[i]:
                continue
            d = min(sum((a - b) ** 2 for a, b in zip(x[i], x[c])) for c in chosen)
            if best_d is None or d > best_d:  # strict: the first maximum wins
                best, best_d = i, d
        chosen.append(best)
    return chosen


@pytest.mark.parametrize("seed", range(5))
def test_fps_matches_the_squared_l2_first_max_rule(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (3, 12, 2), generator=g).float()  # integer grid: many ties
    valid = torch.rand(3, 12, generator=g) > 0.2
    valid[:, 0] = True
    got = farthest_point_sampling(x, 6, valid=valid)
    for b in range(3):
        assert got[b].tolist() == _brute_fps(x[b].tolist(), 6, 0, valid[b].tolist())


def test_segment_mean_matches_a_loop_and_flags_empty_segments():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 30, 5, generator=g)
    labels = torch.randint(0, 7, (2, 30), generator=g)
    labels[labels == 3] = 4  # segment 3 empty everywhere
    means, counts = segment_mean(x, labels, 8)
    for b, s in itertools.product(range(2), range(8)):
        rows = x[b][labels[b] == s]
        assert counts[b, s] == len(rows)
        expected = rows.mean(0) if len(rows) else torch.zeros(5)
        torch.testing.assert_close(means[b, s], expected)
    assert counts[:, 3].eq(0).all() and counts[:, 7].eq(0).all()
    shared, _ = segment_mean(x[0], labels, 8)  # (P, C) values shared by every row
    torch.testing.assert_close(shared[0], means[0])
    with pytest.raises(ValueError, match="labels"):
        segment_mean(x, labels + 8, 8)


def test_sincos_positions_layout():
    pos = sincos_2d(2, 3, 8)
    assert pos.shape == (6, 8)
    # row-major: token 4 is (y=1, x=1); omega_0 = 1, omega_1 = 1e-2
    torch.testing.assert_close(pos[4, :2], torch.tensor([1.0, 0.01]).sin())
    torch.testing.assert_close(pos[3, 4:6], torch.tensor([1.0, 0.01]).sin())
    torch.testing.assert_close(pos[3, :2], torch.zeros(2))


def test_graph_pool_centres_start_from_the_mean_of_valid_tokens():
    pool = GraphPool(2, 1, 3)
    valid = torch.tensor([[True, True, False, True, True]])
    # mean of valid = (0.75, 0): d = [.5625, .0625, -, 5.0625, 3.0625] -> 3; then 4; then 0
    assert pool.centres(LINE, valid).tolist() == [[3, 4, 0]]


def test_graph_pool_matches_a_loop_and_ignores_padded_tokens():
    torch.manual_seed(0)
    pool = GraphPool(8, 2, 3, dropout=0.0).eval()
    x = torch.randn(2, 7, 8)
    cls = torch.randn(2, 8)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5] = False
    out, new_cls, assign, idx = pool(x, cls, valid)
    for b in range(2):
        keep = valid[b]
        h = pool.norm(x[b:b + 1])
        pad = ~valid[b:b + 1]
        h = x[b:b + 1] + pool.attn(h, h, h, key_padding_mask=pad)[0]
        h = h[0]
        h = h - h[keep].mean(0) + pool.centre_bias
        for m in range(3):
            num, den = torch.zeros(32), torch.tensor(0.0)
            for n in range(7):
                logits = torch.stack([5 * torch.cosine_similarity(h[n], h[idx[b, j]], dim=0) for j in range(3)])
                a = logits.softmax(0)[m] if keep[n] else torch.tensor(0.0)
                torch.testing.assert_close(assign[b, n, m], a)
                num = num + a * pool.fc1(x[b, n])
                den = den + a
            torch.testing.assert_close(out[b, m], pool.fc2(num / den) + x[b, idx[b, m]], rtol=1e-4, atol=1e-5)
        assert 5 not in idx[1].tolist() or not valid[b, 5]
    torch.testing.assert_close(new_cls, pool.fc2(pool.fc1(cls)) + cls)
    # a padded token's content changes nothing
    x2 = x.clone()
    x2[1, 5] = 100.0
    out2 = pool(x2, cls, valid)[0]
    torch.testing.assert_close(out2, out)


def test_graph_pool_dropout_does_not_depend_on_the_padded_slots():
    """In training, f's dropout is drawn for noise_tokens tokens and sliced: the same tokens padded with 3 or 9
    invalid slots give the same output (and so the same gradients); drawn at each padding's own size (as
    nn.Dropout does) they would not."""
    torch.manual_seed(0)
    pool = GraphPool(8, 2, 3, dropout=0.5).train()
    x, cls = torch.randn(2, 5, 8), torch.randn(2, 8)

    def padded(extra: int, noise: int | None) -> torch.Tensor:
        xs = torch.cat([x, torch.zeros(2, extra, 8)], dim=1)
        valid = torch.arange(5 + extra)[None, :].expand(2, -1) < 5
        torch.manual_seed(1)
        return pool(xs, cls, valid, noise)[0]

    torch.testing.assert_close(padded(3, 16), padded(9, 16))
    assert not torch.allclose(padded(3, None), padded(9, None))


def _grid_superpixels(side: int, cells: int) -> torch.Tensor:
    step = side // cells
    r = torch.arange(side) // step
    return (r[:, None] * cells + r[None, :])[None]


def test_encoder_outputs_and_hierarchy():
    torch.manual_seed(0)
    enc = CastEncoder(CAST_CONFIGS["cast-tiny"]).eval()
    sp = torch.cat([_grid_superpixels(64, 6), _grid_superpixels(64, 5)])  # 36 and 25 segments
    out = enc(torch.randn(2, 3, 64, 64), sp)
    assert out.fine.shape == (2, 16, 64) and out.coarse.shape == (2, 64)
    assert [tuple(a.shape) for a in out.assignments] == [(2, 36, 16), (2, 16, 8), (2, 8, 4)]
    assert out.segment_valid[1, 25:].eq(False).all() and out.segment_valid[1, :25].all()
    assert out.assignments[0][1, 25:].eq(0).all()  # padded segments are assigned nowhere
    levels = hierarchy_labels(out)
    assert [int(lv.max()) < k for lv, k in zip(levels, (36, 16, 8, 4))] == [True] * 4
    out.coarse.sum().backward()
    assert enc.stem.proj[0].weight.grad.abs().sum() > 0


def test_cast_b_parameter_count_and_config_checks():
    n = sum(p.numel() for p in CastEncoder(CAST_CONFIGS["cast-b"]).parameters())
    assert 100e6 < n < 112e6  # CAST-B without its 16 -> 8 pooling and classifier head (111.8M with them)
    with pytest.raises(ValueError, match="depths"):
        CastConfig(depths=(1, 1), clusters=(4, 2))
