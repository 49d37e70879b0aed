"""Retrieval evaluation: Recall@K against a direct argsort computation, chunking, ties, the
encoding of evaluation sets, the table and the command line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from finetune.evaluate import format_table, recall_at_k


def direct_recall(image_embeds, text_embeds, text_to_image, ks):
    """Recall@K from the full similarity matrix and argsort (no ties in the inputs used here)."""
    sim = F.normalize(text_embeds.double(), dim=-1) @ F.normalize(image_embeds.double(), dim=-1).T
    t_ranks = []
    for t in range(sim.shape[0]):
        order = torch.argsort(sim[t], descending=True)
        t_ranks.append(int((order == text_to_image[t]).nonzero()))
    i_ranks = []
    for i in range(sim.shape[1]):
        mine = (text_to_image == i).nonzero().flatten()
        if len(mine) == 0:
            continue
        order = torch.argsort(sim[:, i], descending=True)
        i_ranks.append(min(int((order == t).nonzero()) for t in mine))
    pct = lambda ranks, k: 100.0 * sum(r < k for r in ranks) / len(ranks)  # noqa: E731
    return {"t2i": {f"R@{k}": pct(t_ranks, k) for k in ks}, "i2t": {f"R@{k}": pct(i_ranks, k) for k in ks}}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for d in a:
        assert a[d].keys() == b[d].keys()
        for k in a[d]:
            assert a[d][k] == pytest.approx(b[d][k], abs=1e-9), (d, k)


def noisy_pairs(n_images, captions_per_image, dim, noise, seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n_images, dim, generator=g)
    owner = torch.arange(n_images).repeat_interleave(captions_per_image)
    owner = owner[torch.randperm(len(owner), generator=g)]  # texts in no particular order
    texts = images[owner] + noise * torch.randn(len(owner), dim, generator=g)
    return images, texts, owner


@pytest.mark.parametrize("captions_per_image", [1, 5])
def test_recall_equals_direct_argsort(captions_per_image):
    images, texts, owner = noisy_pairs(40, captions_per_image, 16, noise=1.2, seed=captions_per_image)
    ks = (1, 5, 10, 25, 50)
    got = recall_at_k(images, texts, owner, ks)
    assert_same(got, direct_recall(images, texts, owner, ks))
    # a noisy but informative model: neither trivial nor perfect
    assert 0 < got["t2i"]["R@1"] < 100 and 0 < got["i2t"]["R@1"] < 100
    assert got["t2i"]["R@50"] == 100.0  # K above the number of images


@pytest.mark.parametrize("captions_per_image", [1, 5])
def test_chunked_equals_unchunked(captions_per_image):
    images, texts, owner = noisy_pairs(53, captions_per_image, 8, noise=1.0, seed=7)
    whole = recall_at_k(images, texts, owner, chunk_size=10_000)
    for chunk in (1, 7, 16):
        assert recall_at_k(images, texts, owner, chunk_size=chunk) == whole


def test_hand_built_angles():
    def unit(deg):
        return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]

    images = torch.tensor([unit(0), unit(90), unit(180)])
    # t0 is nearest its image 0; t1 (image 0) is nearer images 1 and 2; t2 is nearest its image 2
    texts = 3.0 * torch.tensor([unit(10), unit(100), unit(200)])  # norms do not matter
    owner = torch.tensor([0, 0, 2])
    got = recall_at_k(images, texts, owner, ks=(1, 2, 3))
    assert got["t2i"] == pytest.approx({"R@1": 200 / 3, "R@2": 200 / 3, "R@3": 100.0})
    # image 1 has no caption and is left out; images 0 and 2 find a caption of theirs first
    assert got["i2t"] == {"R@1": 100.0, "R@2": 100.0, "R@3": 100.0}


def test_ties_count_against_the_model():
    collapsed = torch.ones(4, 8)
    got = recall_at_k(collapsed, collapsed.clone(), torch.arange(4), ks=(1, 3, 4))
    assert got["t2i"] == {"R@1": 0.0, "R@3": 0.0, "R@4": 100.0}
    assert got["i2t"] == {"R@1": 0.0, "R@3": 0.0, "R@4": 100.0}
    # two identical images: the caption of the first one ties with the second
    images = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    got = recall_at_k(images, images.clone(), torch.arange(3), ks=(1, 2))
    assert got["t2i"]["R@1"] == pytest.approx(100 / 3) and got["t2i"]["R@2"] == 100.0


def test_half_and_double_inputs_give_the_float32_result():
    images, texts, owner = noisy_pairs(30, 2, 16, noise=1.0, seed=3)
    ref = recall_at_k(images, texts, owner)
    assert recall_at_k(images.double(), texts.double(), owner) == ref
    assert recall_at_k(images.half(), texts.half(), owner.int()) == recall_at_k(
        images.half().float(), texts.half().float(), owner)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    images, texts, owner = noisy_pairs(300, 5, 64, noise=1.0, seed=5)
    assert recall_at_k(images.cuda(), texts.cuda(), owner.cuda(), chunk_size=128) == recall_at_k(images, texts, owner)


def test_bad_inputs_raise_clear_errors():
    images, texts, owner = noisy_pairs(5, 1, 4, noise=0.1, seed=0)
    with pytest.raises(ValueError, match="different widths"):
        recall_at_k(images, texts[:, :3], owner)
    with pytest.raises(ValueError, match=r"text_to_image must be \(Nt,\)"):
        recall_at_k(images, texts, owner[:3])
    with pytest.raises(ValueError, match=r"index 5, outside \[0, 5\)"):
        recall_at_k(images, texts, torch.tensor([0, 1, 2, 3, 5]))
    with pytest.raises(ValueError, match="integer image indices"):
        recall_at_k(images, texts, owner.float())
    with pytest.raises(ValueError, match="positive integers"):
        recall_at_k(images, texts, owner, ks=(0, 1))
    bad = texts.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="text_embeds contains NaN"):
        recall_at_k(images, bad, owner)
    with pytest.raises(ValueError, match="nothing to rank"):
        recall_at_k(images[:0], texts[:0], owner[:0])


# -- table ----------------------------------------------------------------------------------------
def _result(r1, r5, n=(10, 50)):
    return {"protocol": "default", "n_images": n[0], "n_texts": n[1], "truncated": 0,
            "t2i": {"R@1": r1, "R@5": r5}, "i2t": {"R@1": r1 + 1, "R@5": r5 + 1}}


def test_format_table_before_and_after():
    table = format_table({"docci": _result(10.0, 20.0)}, {"docci": _result(30.25, 40.0), "urban1k": _result(1.0, 2.0)})
    lines = table.splitlines()
    assert lines[0] == "| set | images / texts | direction | R@1 | R@5 |"
    assert lines[1] == "|---|---|---|---|---|"
    assert lines[2] == "| docci | 10 / 50 | text→image | 10.0 → 30.2 | 20.0 → 40.0 |"
    assert lines[3] == "| docci | 10 / 50 | image→text | 11.0 → 31.2 | 21.0 → 41.0 |"
    assert lines[4] == "| urban1k | 10 / 50 | text→image | 1.0 | 2.0 |"  # no "before" for this set
    assert len(lines) == 6


def test_format_table_single_result_and_empty():
    assert format_table(None, {"s": _result(5.0, 6.0)}).splitlines()[2] == "| s | 10 / 50 | text→image | 5.0 | 6.0 |"
    assert format_table(None, {}) == "(no evaluation sets)"
