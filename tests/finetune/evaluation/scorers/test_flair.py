"""FLAIR's scorers (finetune/evaluation/scorers/flair.py): the text-conditioned scorer against a brute-force loop,
its top-k prefilter path against the full path, flair_global, and DOCCI-FG retrieval through evaluate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from finetune.data.sources import load_source
from finetune.evaluation import encode_for_retrieval, evaluate_sets
from finetune.models.registry import build_model
from finetune.evaluation.scorers import available_scorers, get_scorer, recall_from_ranks, retrieval_ranks
from tests.finetune.data.fixtures import write_docci_fixture
from tests.finetune.evaluation.scorers.test_base import brute_ranks


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-flair", seed=3).eval()


def _payloads(model, n_images=7, captions=(1, 2, 1, 3, 1, 2, 1), seed=0):
    torch.manual_seed(seed)
    pixels = torch.randn(n_images, 3, 32, 32)
    scorer = get_scorer("flair")
    with torch.no_grad():
        images = scorer.encode_images(model, {"pixel_values": pixels})
        n_texts = sum(captions)
        ids = torch.randint(300, 40000, (n_texts, 9))
        ids[:, 0], ids[:, -1] = 49406, 49407
        texts = scorer.encode_texts(model, ids, torch.ones_like(ids))
    owner = torch.repeat_interleave(torch.arange(n_images), torch.tensor(captions))
    return scorer, texts, images, owner


def _brute(model, texts, images):
    """One text and one image at a time through the pool."""
    n_t, n_i = texts["embeds"].shape[0], images["local"].shape[0]
    sim = torch.empty(n_t, n_i)
    with torch.no_grad():
        for j in range(n_t):
            t = texts["embeds"][j]
            for i in range(n_i):
                tc = model.pool(t[None, None], images["local"][i][None])[0, 0]
                sim[j, i] = F.cosine_similarity(tc, t, dim=0)
    return sim


def test_registered():
    assert {"flair", "flair_global"} <= set(available_scorers())


def test_flair_scores_equal_a_brute_force_loop(model):
    scorer, texts, images, owner = _payloads(model)
    sim = _brute(model, texts, images)
    t, i = scorer.prepare(texts, images)
    torch.testing.assert_close(scorer.score(t, i), sim, rtol=0, atol=1e-5)
    # chunked over images (one image per chunk) and pairwise forms agree too
    small = get_scorer("flair", max_elements=1)
    small.pool = scorer.pool
    torch.testing.assert_close(small.score(t, i), sim, rtol=0, atol=1e-5)
    torch.testing.assert_close(scorer.score_pairs(t, {k: v[owner] for k, v in i.items()}),
                               sim[torch.arange(len(owner)), owner], rtol=0, atol=1e-5)
    ranks = retrieval_ranks(scorer, texts, images, owner, block_size=3)
    t2i, i2t = brute_ranks(sim, owner, tol=scorer.tie_tolerance(t, i))
    assert ranks.t2i.tolist() == t2i.tolist() and ranks.i2t.tolist() == i2t.tolist()


def test_prefilter_path_equals_the_full_path_when_k_covers_everything(model):
    scorer, texts, images, owner = _payloads(model, seed=1)
    full = retrieval_ranks(scorer, texts, images, owner, block_size=4)
    for k in (len(owner), 128):
        for block in (4, 64):  # one query per candidate call, and several
            pre = retrieval_ranks(scorer, texts, images, owner, block_size=block, rerank_top_k=k)
            assert pre.t2i.tolist() == full.t2i.tolist() and pre.i2t.tolist() == full.i2t.tolist()


def test_prefilter_ranks_only_the_cosine_top_k(model):
    """With k = 1 a text whose own image is not its global-cosine best ranks at least 1, whatever FLAIR
    says; one whose own image is the cosine best ranks 0."""
    scorer, texts, images, owner = _payloads(model, seed=2)
    pre = retrieval_ranks(scorer, texts, images, owner, rerank_top_k=1)
    cos = F.normalize(texts["embeds"], dim=-1) @ F.normalize(images["embeds"], dim=-1).T
    top = cos.argmax(1)
    assert ((pre.t2i == 0) == (top == owner)).all()


def test_flair_global_is_the_class_token_cosine(model):
    scorer = get_scorer("flair_global")
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        images = scorer.encode_images(model, {"pixel_values": pixels})
        feats = model.encode_image(pixels, states=True)
        cls = model.project_image_states(feats.pooled_state)
    torch.testing.assert_close(images["embeds"], cls, rtol=0, atol=1e-5)


def test_flair_scorer_refuses_a_model_without_a_pool():
    clip = build_model("tiny-openclip")
    with pytest.raises(ValueError, match="needs a FLAIR model"):
        get_scorer("flair").encode_images(clip, {"pixel_values": torch.randn(1, 3, 32, 32)})


@pytest.mark.filterwarnings("ignore:docci_fg")
def test_docci_fg_retrieval_with_both_scorers(model, tmp_path):
    folder = write_docci_fixture(tmp_path / "docci", n_train=2, n_test=4, n_qual_test=1)
    sets = [{"name": "docci_fg", "path": str(folder)}]
    full = evaluate_sets(model, sets, batch_size=2, ks=[1, 5], scorer="flair")["docci_fg"]
    pre = evaluate_sets(model, sets, batch_size=2, ks=[1, 5], scorer="flair", rerank_top_k=128)["docci_fg"]
    glob = evaluate_sets(model, sets, batch_size=2, ks=[1, 5], scorer="flair_global")["docci_fg"]
    assert full["n_images"] == 4 and full["n_texts"] > 4  # every sentence a caption
    assert full["t2i"] == pre["t2i"] and full["i2t"] == pre["i2t"]
    assert pre["scorer"] == "flair@top128" and glob["scorer"] == "flair_global"
    emb = encode_for_retrieval(model, load_source(sets[0]).dataset, batch_size=2, scorer="flair")
    assert emb.image_payload["local"].shape[1:] == (16, 64)
    assert recall_from_ranks(retrieval_ranks(get_scorer("flair_global"), emb.text_payload, emb.image_payload,
                                             emb.text_to_image), [1])["t2i"]["R@1"] == glob["t2i"]["R@1"]


def test_conditioned_scores_equal_the_pool_called_per_image(model):
    """The one-projection-of-the-texts form equals the pool (the public code's per-image calls), masked-free,
    in every chunking."""
    from finetune.evaluation.scorers.flair import conditioned_scores, public_code_scores

    torch.manual_seed(4)
    texts, local = torch.randn(11, 64), torch.randn(5, 16, 64)
    with torch.no_grad():
        reference = public_code_scores(model.pool, texts, local)
        for max_elements in (1, 64 * 11 * 2, 2 ** 24):
            torch.testing.assert_close(conditioned_scores(model.pool, texts, local, max_elements=max_elements),
                                       reference, rtol=0, atol=1e-5)


def test_candidate_scores_grouped_by_image_equal_the_full_scores(model):
    """The prefilter's grouped form (each candidate image's keys / values once per block) gives, for every
    (text, candidate) pair, the full score matrix's entry: candidates shared by several texts, repeated,
    in any order, in every blocking (one image and one pair per block, a few, all)."""
    from finetune.evaluation.scorers.flair import candidate_scores, conditioned_scores

    torch.manual_seed(5)
    texts, local = torch.randn(6, 64), torch.randn(9, 16, 64)
    candidates = torch.tensor([[8, 0, 3], [3, 3, 1], [0, 8, 2], [5, 7, 8], [2, 1, 0], [4, 6, 3]])
    with torch.no_grad():
        full = conditioned_scores(model.pool, texts, local)
        expected = full.gather(1, candidates)
        for max_elements in (1, 17 * 64 * 2, 17 * 64 * 5, 2 ** 24):
            got = candidate_scores(model.pool, texts, local, candidates, max_elements=max_elements)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert candidate_scores(model.pool, texts[:0], local, candidates[:0]).shape == (0, 3)
