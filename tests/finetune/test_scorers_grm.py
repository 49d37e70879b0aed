"""The ``grm`` scorer (GRM eq. 7 for retrieval): agreement with a brute-force loop, ranks, the head it
needs, evaluation with rSum, and bounded memory on 1,000 images x 5,000 captions."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from finetune import load_model
from finetune.evaluate import evaluate_sets, recall_at_k
from finetune.scorers import available_scorers, get_scorer, retrieval_ranks
from finetune.scorers_grm import GRMScorer, pairwise_token_similarity


def _brute_force(text, text_mask, image, image_mask, text_gate=None, image_gate=None, slope=None):
    """Eq. 7 pair by pair, token by token (python loops), over the kept tokens (real, gate != 0; 0/1 gates)."""
    out = torch.zeros(image.shape[0], text.shape[0], dtype=torch.float64)
    for i in range(image.shape[0]):
        for j in range(text.shape[0]):
            ts = [t for t in range(text.shape[1]) if text_mask[j, t] and (text_gate is None or text_gate[j, t])]
            vs = [v for v in range(image.shape[1])
                  if (image_mask is None or image_mask[i, v]) and (image_gate is None or image_gate[i, v])]

            def cos(t, v):
                a = torch.nn.functional.normalize(text[j, t].double(), dim=0)
                b = torch.nn.functional.normalize(image[i, v].double(), dim=0)
                c = float(a @ b)
                return c if slope is None or c >= 0 else slope * c

            t2i = sum(max(cos(t, v) for v in vs) for t in ts) / len(ts)
            i2t = sum(max(cos(t, v) for t in ts) for v in vs) / len(vs)
            out[i, j] = t2i + i2t
    return out


def _payloads(seed=0, nt=7, ni=5, lt=6, lv=4, d=8, k=3):
    g = torch.Generator().manual_seed(seed)
    text_mask = torch.ones(nt, lt, dtype=torch.bool)
    for j in range(nt):
        text_mask[j, 1 + j % (lt - 1):] = False  # padding of different lengths
    texts = {"embeds": torch.randn(nt, d, generator=g), "tokens": torch.randn(nt, lt, d, generator=g),
             "mask": text_mask, "gate": (torch.rand(nt, lt, generator=g) > 0.3).float() * text_mask}
    images = {"embeds": torch.randn(ni, d, generator=g), "tokens": torch.randn(ni, lv, d, generator=g),
              "mask": torch.ones(ni, lv, dtype=torch.bool), "gate": (torch.rand(ni, lv, generator=g) > 0.3).float(),
              "regions": torch.randn(ni, k, d, generator=g)}
    images["mask"][0, -1] = False  # a padded image token (NaFlex)
    texts["gate"][:, 0] = images["gate"][:, 0] = 1.0  # every item keeps a token (the head's floor)
    return texts, images


@pytest.mark.parametrize("level", ["key", "ori", "unc"])
@pytest.mark.parametrize("slope", [None, 0.1])
def test_scorer_agrees_with_a_brute_force_loop(level, slope):
    texts, images = _payloads()
    scorer = GRMScorer(level=level, leaky_slope=slope, block_elements=50)  # several blocks
    if level == "ori":
        want = _brute_force(texts["tokens"], texts["mask"], images["tokens"], images["mask"], slope=slope)
    elif level == "key":
        want = _brute_force(texts["tokens"], texts["mask"], images["tokens"], images["mask"], texts["gate"],
                            images["gate"], slope=slope)
    else:
        want = _brute_force(texts["tokens"], texts["mask"], images["regions"], None, texts["gate"], slope=slope)
    got = scorer.score(texts, images)
    assert got.shape == (7, 5)
    torch.testing.assert_close(got.double(), want.T, atol=1e-5, rtol=0)
    n = 5
    pairs = scorer.score_pairs({k: v[:n] for k, v in texts.items()}, images)
    torch.testing.assert_close(pairs.double(), want.T.diagonal(), atol=1e-5, rtol=0)
    assert float(scorer.tie_tolerance(texts, images)) == pytest.approx(4 * 8 * torch.finfo(torch.float32).eps)


def test_ranks_under_the_scorer_are_those_of_the_brute_force_matrix():
    texts, images = _payloads(seed=3, nt=10, ni=5)
    owner = torch.arange(10) % 5
    scorer = GRMScorer(level="key")
    full = _brute_force(texts["tokens"], texts["mask"], images["tokens"], images["mask"], texts["gate"],
                        images["gate"]).T  # (Nt, Ni)
    ranks = retrieval_ranks(scorer, texts, images, owner, block_size=3)
    tol = 1e-6
    want_t2i = [(full[t] >= full[t, owner[t]] - tol).sum() - 1 for t in range(10)]
    assert ranks.t2i.tolist() == [int(r) for r in want_t2i]
    best = [max(full[t, i] for t in range(10) if owner[t] == i) for i in range(5)]
    want_i2t = [int(sum(1 for t in range(10) if owner[t] != i and full[t, i] >= best[i] - tol)) for i in range(5)]
    assert ranks.i2t.tolist() == want_i2t


def test_pairwise_is_the_diagonal_of_the_full_similarity():
    from losses import token_wise_similarity

    texts, images = _payloads(seed=5, nt=5, ni=5)
    full = token_wise_similarity(texts["tokens"], texts["mask"], images["tokens"], images["mask"])
    pairs = pairwise_token_similarity(texts["tokens"], texts["mask"], images["tokens"], images["mask"],
                                      block_elements=10)
    torch.testing.assert_close(pairs, full.diagonal(), atol=1e-6, rtol=0)


def test_registered_and_needs_a_head_for_the_adapted_levels():
    assert "grm" in available_scorers()
    assert isinstance(get_scorer("grm"), GRMScorer) and get_scorer("grm", level="ori").level == "ori"
    alias = get_scorer("grm_ori")
    assert alias.level == "ori" and alias.name == "grm_ori" and get_scorer("grm").name == "grm"
    with pytest.raises(ValueError, match="level must be"):
        GRMScorer(level="sum")
    model = load_model("tiny-clip")
    pixels = model.preprocess_images([__import__("PIL.Image").Image.new("RGB", (32, 32))])
    with pytest.raises(ValueError, match=r"needs the GRM head .* level 'ori'"):
        GRMScorer().encode_images(model, pixels)
    payload = GRMScorer(level="ori").encode_images(model, pixels)
    assert payload["tokens"].shape == (1, 16, 32) and payload["embeds"].shape == (1, 32)


def test_evaluation_with_the_grm_scorer_reports_rsum():
    from finetune.objectives.grm import GRMOptions, install_head

    model = load_model("tiny-clip")
    install_head(model, GRMOptions())
    sets = [{"name": "synthetic", "split": "test", "size": 6, "seed": 1, "options": {"image_size": 32}}]
    result = evaluate_sets(model.eval(), sets, scorer="grm", ks=(1, 5, 10), progress=False)["synthetic"]
    assert result["scorer"] == "grm"
    want = sum(result[d][f"R@{k}"] for d in ("t2i", "i2t") for k in (1, 5, 10))
    assert result["rsum"] == pytest.approx(want)


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time, torch
    from finetune.scorers import retrieval_ranks
    from finetune.scorers_grm import GRMScorer
    torch.manual_seed(0)
    ni, nt, lv, lt, d = 1000, 5000, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    images = {"tokens": torch.randn(ni, lv, d), "mask": torch.ones(ni, lv, dtype=torch.bool),
              "gate": torch.ones(ni, lv), "embeds": torch.randn(ni, d)}
    texts = {"tokens": torch.randn(nt, lt, d), "mask": torch.ones(nt, lt, dtype=torch.bool),
             "gate": torch.ones(nt, lt), "embeds": torch.randn(nt, d)}
    owner = torch.arange(nt) // 5
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.time()
    ranks = retrieval_ranks(GRMScorer(), texts, images, owner, block_size=1024)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_growth_mib": (after - before) / 1024, "seconds": time.time() - t0,
                      "n_t2i": int(ranks.t2i.numel()), "n_i2t": int(ranks.i2t.numel())}))
""")


@pytest.mark.slow
def test_1000_images_x_5000_captions_in_bounded_memory():
    """The scorer path of evaluation (retrieval_ranks over blocks, eq. 7 in blocks of token cosines) on
    1,000 images x 5,000 captions. Tokens are small (16 image, 12 text, d = 32) so that it runs on a CPU in
    about a minute; the memory bound does not depend on them: the cosines of all pairs would take
    5,000 x 1,000 x 16 x 12 x 4 B = 3.7 GB, one block of the library takes 2**22 x 4 B = 16 MiB. Measured
    on the 2-core build machine (shared with other jobs): peak RSS growth 65 MiB over the payloads, 207 s
    (the 1024 x 1024 score blocks and one block of cosines at a time)."""
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, "16", "12", "32"], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print("1,000 x 5,000 with the grm scorer:", result)
    assert result["n_t2i"] == 5000 and result["n_i2t"] == 1000
    all_cosines_mib = 5000 * 1000 * 16 * 12 * 4 / 2**20
    assert result["peak_growth_mib"] < 512 < all_cosines_mib / 4, result
