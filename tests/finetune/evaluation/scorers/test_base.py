"""Scorers (finetune/evaluation/scorers/base.py, cosine.py, ranking.py): the registry, payloads, ranking from blocks
against a brute-force ranking of the full score matrix (ties, several captions per image, block sizes that do not divide
N), the global-cosine top-k prefilter, and a token-wise scorer whose payloads change shape between
batches and processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from finetune.evaluation import recall_at_k
from finetune.evaluation.scorers import (
    CosineScorer,
    Scorer,
    available_scorers,
    concat_payloads,
    get_scorer,
    recall_from_ranks,
    register_scorer,
    retrieval_ranks,
    take,
)


# -- scorers used by the tests --------------------------------------------------------------------
class DotScorer(Scorer):
    """Raw dot product, no tolerance: integer-valued embeddings give exact ties."""

    def score(self, texts, images):
        return texts["embeds"] @ images["embeds"].T


class NegEuclidean(Scorer):
    """Negative Euclidean distance of the raw embeddings (not a cosine ranking)."""

    def score(self, texts, images):
        return -torch.cdist(texts["embeds"].double(), images["embeds"].double())


class Oracle(Scorer):
    """Knows the answer: 1 for a text and its own image, 0 otherwise (payloads carry the ids)."""

    def score(self, texts, images):
        return (texts["owner"][:, None] == images["index"][None, :]).float()


class TokenMaxSim(Scorer):
    """A token-wise scorer in the spirit of GRM eq. 7: mean over real text tokens of the best
    cosine with any real image patch. Payloads: ``states (B, L, W)`` and ``mask (B, L)``."""

    def score(self, texts, images):
        t = F.normalize(texts["states"].double(), dim=-1)
        i = F.normalize(images["states"].double(), dim=-1)
        sim = torch.einsum("alw,bnw->abln", t, i)  # (Tt, Ti, L, N)
        sim = sim.masked_fill(~images["mask"].bool()[None, :, None, :], float("-inf")).amax(-1)
        tmask = texts["mask"].double()[:, None, :]
        return (sim.masked_fill(tmask == 0, 0.0) * tmask).sum(-1) / tmask.sum(-1)


def brute_ranks(sim, owner, tol=0.0):
    """Ranks from the full ``(Nt, Ni)`` matrix, one query at a time: wrong items scoring at least
    the correct score minus ``tol``; an image's correct score is its best caption's."""
    n_texts, n_images = sim.shape
    t2i = []
    for t in range(n_texts):
        wrong = torch.ones(n_images, dtype=torch.bool)
        wrong[owner[t]] = False
        t2i.append(int(((sim[t] >= sim[t, owner[t]] - tol) & wrong).sum()))
    i2t = []
    for i in range(n_images):
        mine = owner == i
        if not mine.any():
            continue
        best = sim[mine, i].max()
        i2t.append(int(((sim[:, i] >= best - tol) & ~mine).sum()))
    return torch.tensor(t2i), torch.tensor(i2t)


def data(n_images, captions, dim, seed, *, integer=False, missing=0):
    """Images, texts (several per image, shuffled) and text_to_image; ``missing`` images get no text."""
    g = torch.Generator().manual_seed(seed)
    if integer:  # few distinct values: many exact ties
        images = torch.randint(-1, 2, (n_images, dim), generator=g).float()
    else:
        images = torch.randn(n_images, dim, generator=g)
    owner = torch.arange(n_images - missing).repeat_interleave(captions)
    owner = owner[torch.randperm(len(owner), generator=g)]
    if integer:
        texts = images[owner] + torch.randint(-1, 2, (len(owner), dim), generator=g).float()
    else:
        texts = images[owner] + 1.3 * torch.randn(len(owner), dim, generator=g)
    return images, texts, owner


BLOCKS = [1, 3, 7, 16, 1000]  # 53 images, 3 x 53 - 2 x 3 texts: none of 3, 7, 16 divides them


# -- ranking from blocks --------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", BLOCKS)
def test_blocked_ranks_equal_brute_force_with_exact_ties(block_size):
    images, texts, owner = data(53, 3, 4, seed=1, integer=True, missing=2)
    sim = texts @ images.T
    assert (sim[torch.arange(len(owner)), owner][:, None] == sim).sum() > 2 * len(owner)  # ties abound
    ref_t2i, ref_i2t = brute_ranks(sim, owner)
    got = retrieval_ranks(DotScorer(), {"embeds": texts}, {"embeds": images}, owner, block_size=block_size)
    assert torch.equal(got.t2i, ref_t2i)
    assert torch.equal(got.i2t, ref_i2t) and len(got.i2t) == 51  # the 2 images without captions left out


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("captions", [1, 5])
def test_blocked_cosine_equals_brute_force(block_size, captions):
    images, texts, owner = data(53, captions, 8, seed=captions)
    cos = F.normalize(texts.double(), dim=-1) @ F.normalize(images.double(), dim=-1).T
    ref_t2i, ref_i2t = brute_ranks(cos, owner)
    got = retrieval_ranks(CosineScorer(), {"embeds": texts}, {"embeds": images}, owner, block_size=block_size)
    assert torch.equal(got.t2i, ref_t2i) and torch.equal(got.i2t, ref_i2t)
    ks = (1, 5, 10)
    expected = {"t2i": {f"R@{k}": 100.0 * float((ref_t2i < k).double().mean()) for k in ks},
                "i2t": {f"R@{k}": 100.0 * float((ref_i2t < k).double().mean()) for k in ks}}
    got = recall_at_k(images, texts, owner, ks, block_size=block_size)
    for d in ("t2i", "i2t"):
        assert got[d] == pytest.approx(expected[d])
    assert 0 < expected["t2i"]["R@1"] < 100  # neither trivial nor perfect


def test_collapsed_model_ranks_last_under_every_block_size():
    same = torch.ones(6, 4)
    for block_size in (1, 4, 6):
        ranks = retrieval_ranks(CosineScorer(), {"embeds": same}, {"embeds": same.clone()}, torch.arange(6),
                                block_size=block_size)
        assert ranks.t2i.tolist() == ranks.i2t.tolist() == [5] * 6


@pytest.mark.parametrize("block_size", [2, 5, 64])
def test_token_wise_payloads_of_several_lengths(block_size):
    """Batches pad their token states to different lengths; concatenation pads with zeros (masks
    pad as 0) and the ranks equal the brute force over the unpadded tokens."""
    g = torch.Generator().manual_seed(0)
    n_images, width = 9, 6
    owner = torch.tensor([0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 8, 3])
    img_len = [int(x) for x in torch.randint(1, 5, (n_images,), generator=g)]
    txt_len = [int(x) for x in torch.randint(1, 6, (len(owner),), generator=g)]
    img_tokens = [torch.randn(n, width, generator=g) for n in img_len]
    txt_tokens = [img_tokens[o][:1].repeat(n, 1) + torch.randn(n, width, generator=g) for o, n in zip(owner, txt_len)]

    def batch(tokens):  # one batch: states padded to its own longest item, and masks
        length = max(len(x) for x in tokens)
        states = torch.stack([F.pad(x, (0, 0, 0, length - len(x)), value=7.0) for x in tokens])
        mask = torch.stack([torch.arange(length) < len(x) for x in tokens]).long()
        return {"states": states, "mask": mask}

    images = concat_payloads([batch(img_tokens[i:i + 4]) for i in range(0, n_images, 4)])
    texts = concat_payloads([batch(txt_tokens[i:i + 5]) for i in range(0, len(owner), 5)])
    assert images["states"].shape == (n_images, max(img_len), width)
    assert images["mask"].sum(1).tolist() == img_len  # padding is masked out

    def one(t, i):
        a, b = F.normalize(txt_tokens[t].double(), dim=-1), F.normalize(img_tokens[i].double(), dim=-1)
        return (a @ b.T).amax(1).mean()

    sim = torch.tensor([[one(t, i) for i in range(n_images)] for t in range(len(owner))], dtype=torch.double)
    ref_t2i, ref_i2t = brute_ranks(sim, owner)
    got = retrieval_ranks(TokenMaxSim(), texts, images, owner, block_size=block_size)
    assert torch.equal(got.t2i, ref_t2i) and torch.equal(got.i2t, ref_i2t)


# -- the top-k prefilter --------------------------------------------------------------------------
@pytest.mark.parametrize("captions", [1, 3])
def test_rerank_with_k_at_least_n_equals_full_scoring(captions):
    images, texts, owner = data(23, captions, 6, seed=4)
    full = retrieval_ranks(NegEuclidean(), {"embeds": texts}, {"embeds": images}, owner, block_size=5)
    for k in (len(owner), 1000):
        got = retrieval_ranks(NegEuclidean(), {"embeds": texts}, {"embeds": images}, owner, block_size=5,
                              rerank_top_k=k)
        assert torch.equal(got.t2i, full.t2i) and torch.equal(got.i2t, full.i2t)
    # and Euclidean is not cosine here (raw norms differ), so the prefilter had something to keep
    cosine = retrieval_ranks(CosineScorer(), {"embeds": texts}, {"embeds": images}, owner)
    assert not torch.equal(full.t2i, cosine.t2i)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("captions", [1, 4])
def test_rerank_cannot_reach_outside_the_top_k(k, captions):
    """The oracle puts every correct item first, but only among the cosine top-k: a query whose
    correct item is outside them keeps its cosine rank (>= k), so R@K = cosine R@max(K, k)."""
    images, texts, owner = data(30, captions, 6, seed=k + captions)
    t_pay = {"embeds": texts, "owner": owner}
    i_pay = {"embeds": images, "index": torch.arange(len(images))}
    cosine = retrieval_ranks(CosineScorer(), {"embeds": texts}, {"embeds": images}, owner, block_size=7)
    full = retrieval_ranks(Oracle(), t_pay, i_pay, owner, block_size=7)
    assert full.t2i.max() == 0 and full.i2t.max() == 0
    got = retrieval_ranks(Oracle(), t_pay, i_pay, owner, block_size=7, rerank_top_k=k)
    for ours, cos in ((got.t2i, cosine.t2i), (got.i2t, cosine.i2t)):
        inside = cos < k
        assert torch.equal(ours[inside], torch.zeros_like(ours[inside]))  # re-scored: the oracle wins
        assert torch.equal(ours[~inside], cos[~inside])  # outside: below all k candidates, cosine order
        assert 0 < int(inside.sum()) < len(cos) or k == 8  # both kinds of query occur
    ks = (1, 2, 5, 10, 20)
    ours = recall_from_ranks(got, ks)
    for K in ks:
        cos_recall = recall_from_ranks(cosine, [max(K, k)])
        for d in ("t2i", "i2t"):
            assert ours[d][f"R@{K}"] == cos_recall[d][f"R@{max(K, k)}"]


def test_rerank_of_cosine_by_cosine_is_cosine():
    """Re-scoring the top-k with the scorer that chose them changes no rank (ties included)."""
    images, texts, owner = data(40, 2, 3, seed=9, integer=True)
    texts[::7] = images[owner[::7]]  # some exact matches
    full = recall_at_k(images, texts, owner, (1, 3, 5, 10), block_size=6)
    for k in (1, 4, 9):
        assert recall_at_k(images, texts, owner, (1, 3, 5, 10), block_size=6, rerank_top_k=k) == full


def test_rerank_needs_global_embeddings():
    texts = {"states": torch.randn(3, 2, 4), "mask": torch.ones(3, 2)}
    images = {"states": torch.randn(3, 2, 4), "mask": torch.ones(3, 2)}
    with pytest.raises(ValueError, match=r"rerank_top_k needs the global embeddings: .* 'embeds' in its text "
                                         r"and image payloads"):
        retrieval_ranks(TokenMaxSim(), texts, images, torch.arange(3), rerank_top_k=2)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="rerank_top_k must be >= 1"):
            recall_at_k(torch.randn(3, 4), torch.randn(3, 4), torch.arange(3), rerank_top_k=bad)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        recall_at_k(torch.randn(3, 4), torch.randn(3, 4), torch.arange(3), block_size=0)


def test_a_scorer_returning_the_wrong_shape_is_named():
    class Broken(Scorer):
        def score(self, texts, images):
            return texts["embeds"] @ images["embeds"][:1].T

    pay = {"embeds": torch.randn(3, 4)}
    with pytest.raises(ValueError, match=r"scorer 'Broken': score_pairs returned \(1,\), expected \(3,\)"):
        retrieval_ranks(Broken(), pay, pay, torch.arange(3))

    class BrokenBlocks(Broken):
        def score_pairs(self, texts, images):
            return (texts["embeds"] * images["embeds"]).sum(-1)

    with pytest.raises(ValueError, match=r"scorer 'BrokenBlocks': score returned \(3, 1\), expected \(3, 3\)"):
        retrieval_ranks(BrokenBlocks(), pay, pay, torch.arange(3))


# -- the registry ---------------------------------------------------------------------------------
def test_registry_builds_registered_scorers_with_options():
    assert "cosine" in available_scorers()
    assert isinstance(get_scorer("cosine"), CosineScorer) and get_scorer("cosine").name == "cosine"

    @register_scorer("test-scaled-dot")
    class ScaledDot(Scorer):
        def __init__(self, scale=1.0):
            self.scale = scale

        def score(self, texts, images):
            return self.scale * texts["embeds"] @ images["embeds"].T

    try:
        assert "test-scaled-dot" in available_scorers()
        built = get_scorer("test-scaled-dot", scale=-1.0)
        assert built.scale == -1.0 and built.name == "test-scaled-dot"
        assert get_scorer(built) is built
        with pytest.raises(ValueError, match=r"scorer 'test-scaled-dot' does not take the options \['temperature'\]"):
            get_scorer("test-scaled-dot", temperature=2)
        with pytest.raises(ValueError, match="already registered"):
            register_scorer("test-scaled-dot")(DotScorer)
        register_scorer("test-scaled-dot")(ScaledDot)  # the same class again is fine
        with pytest.raises(TypeError, match="must subclass finetune.evaluation.scorers.Scorer"):
            register_scorer("test-not-a-scorer")(dict)
        # a negated scorer reverses the ranking: the best item becomes the worst
        images, texts, owner = data(10, 1, 4, seed=0)
        up = retrieval_ranks(get_scorer("test-scaled-dot"), {"embeds": texts}, {"embeds": images}, owner)
        down = retrieval_ranks(built, {"embeds": texts}, {"embeds": images}, owner)
        assert torch.equal(up.t2i + down.t2i, torch.full_like(up.t2i, 9))  # no ties: ranks mirror
    finally:
        from finetune import plugins

        plugins.SCORERS.remove("test-scaled-dot")


def test_unknown_scorer_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown scorer 'cosin'.*did you mean 'cosine'\? registered scorers "
                                         r"are .*cosine.*objective.import"):
        get_scorer("cosin")
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        recall_at_k(torch.randn(3, 4), torch.randn(3, 4), torch.arange(3), scorer="nope")
    from finetune.evaluation import evaluate_sets

    # before any set is loaded or any model is called
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        evaluate_sets(None, ["no-such-set"], scorer="nope")


def test_payload_helpers():
    a = {"x": torch.ones(2, 3), "m": torch.ones(2, 3, dtype=torch.long)}
    b = {"x": torch.ones(1, 5), "m": torch.ones(1, 5, dtype=torch.long)}
    both = concat_payloads([a, b])
    assert both["x"].shape == (3, 5) and both["m"][:2, 3:].sum() == 0 and both["m"].dtype == torch.long
    assert torch.equal(take(both, torch.tensor([2, 0]))["x"], both["x"][[2, 0]])
    with pytest.raises(ValueError, match="different keys"):
        concat_payloads([a, {"x": torch.ones(1, 3)}])
    with pytest.raises(ValueError, match="disagree on the number of items"):
        recall_at_k({"embeds": torch.randn(3, 4), "other": torch.randn(2)}, {"embeds": torch.randn(3, 4)},
                    torch.arange(3))


# -- payloads gathered over processes -------------------------------------------------------------
STATES_SCRIPT = """
import os, sys, torch
from accelerate import Accelerator
from finetune.data.sources import load_source
from finetune.evaluation import encode_for_retrieval
from finetune.models import load_model
from finetune.evaluation.scorers import Scorer, register_scorer

@register_scorer("test-states")
class States(Scorer):
    def encode_texts(self, model, input_ids, attention_mask):
        f = model.encode_text(input_ids, attention_mask, states=True)
        return {"embeds": f.embeds.float(), "states": f.states.float(), "mask": attention_mask}

    def score(self, texts, images):
        return texts["embeds"] @ images["embeds"].T

acc = Accelerator(cpu=True)
model = load_model("tiny-clip").to(acc.device)
out = {"world": acc.num_processes, "single": {}}
for size in (7, 1):  # with 1 row, process 0 has an empty shard
    ds = load_source({"name": "synthetic", "split": "test", "size": size, "seed": 3}).dataset
    ds = ds.map(lambda row, i: {"captions": [row["caption"][: 20 + 37 * i]] * (1 + i % 3)}, with_indices=True)
    emb = encode_for_retrieval(model, ds, batch_size=2, accelerator=acc, scorer="test-states")
    out[size] = {"text": emb.text_payload, "image": emb.image_payload, "owner": emb.text_to_image}
    if acc.is_main_process:  # the reference: the whole set in this one process, no accelerator
        emb = encode_for_retrieval(model, ds, batch_size=2, scorer="test-states")
        out["single"][size] = {"text": emb.text_payload, "image": emb.image_payload, "owner": emb.text_to_image}
if acc.is_main_process:
    torch.save(out, sys.argv[1])
acc.wait_for_everyone()
acc.end_training()  # destroys the process group: a rank that exits with it alive can abort its peer
sys.stdout.flush(); sys.stderr.flush()
# Leave without C++ static destructors: even after the group is destroyed, torch's gloo teardown rarely
# aborts a rank at interpreter exit ("terminate called without an active exception"; pytorch#179291).
os._exit(0)
"""


@pytest.mark.slow
def test_two_processes_gather_payloads_of_different_lengths(tmp_path):
    """Each process pads its token states to its own longest caption (and one process may have no
    rows at all); the gathered payloads equal the single-process ones on the real tokens (the reference
    encoded by process 0 alone, without the accelerator, in the same launched run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[4]
    script, out = tmp_path / "states.py", tmp_path / "states.pt"
    script.write_text(STATES_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo), "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(out)], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["world"] == 2
    for size in (7, 1):
        g, r = got[size], got["single"][size]
        assert g["owner"].tolist() == r["owner"].tolist()
        assert g["text"].keys() == r["text"].keys() == {"embeds", "states", "mask"}
        assert g["text"]["states"].shape == r["text"]["states"].shape  # padded to the longest caption of all
        assert torch.equal(g["text"]["mask"], r["text"]["mask"])
        real = r["text"]["mask"].bool()
        torch.testing.assert_close(g["text"]["states"][real], r["text"]["states"][real], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(g["text"]["embeds"], r["text"]["embeds"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(g["image"]["embeds"], r["image"]["embeds"], atol=1e-5, rtol=1e-4)
    assert got[7]["owner"].tolist() == [0, 1, 1, 2, 2, 2, 3, 4, 4, 5, 5, 5, 6]
    assert got[1]["text"]["states"].shape[0] == 1
    assert got[7]["text"]["mask"].sum(1).unique().numel() > 2  # the captions really have different lengths


# -- the recipe keys reach run.py's evaluation ----------------------------------------------------
SCORER_MODULE = '''
import torch

from finetune.evaluation.scorers import Scorer, register_scorer

CALLS = {"score": 0}


@register_scorer("test-run-scorer", replace=True)
class NegEuclidean(Scorer):
    def score(self, texts, images):
        CALLS["score"] += 1
        return -torch.cdist(texts["embeds"], images["embeds"])
'''


@pytest.mark.slow
def test_run_evaluates_with_the_recipe_scorer(tmp_path, monkeypatch):
    """``eval.scorer`` (registered by a module of ``objective.import``), ``eval.rerank_top_k`` and
    ``eval.block_size`` reach the evaluation before and after training."""
    import json
    import sys

    from accelerate.state import AcceleratorState, GradientState

    from finetune.config import load_recipe
    from finetune.training import run_recipe

    (tmp_path / "my_scorer_mod.py").write_text(SCORER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        "model: {name_or_path: tiny-clip, max_text_len: null}\n"
        "data: {train: {name: synthetic, split: train, size: 8, seed: 0}}\n"
        "eval:\n  sets: [{name: synthetic, split: test, size: 6, seed: 1}]\n  batch_size: 4\n"
        "  scorer: test-run-scorer\n  rerank_top_k: 4\n  block_size: 2\n"
        "objective: {base: clip, import: [my_scorer_mod]}\n"
        f"train: {{max_steps: 1, batch_size: 4, mixed_precision: 'no', checkpoint_every: 0, trackers: []}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n")
    recipe = load_recipe(recipe_file, trust_imports=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert run_recipe(recipe) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for when in ("before", "after"):
        assert metrics[when]["synthetic"]["scorer"] == "test-run-scorer@top4"
    # the default score_candidates scores each query's 4 candidates in one call: 6 texts + 6 images, twice
    assert sys.modules["my_scorer_mod"].CALLS["score"] == 2 * (6 + 6)


@pytest.mark.slow
def test_the_toolkits_scorers_are_discovered_on_the_first_lookup() -> None:
    # no list of built-in modules: the first lookup imports every module of the finetune.evaluation.scorers package
    code = ("import sys; from finetune.evaluation.scorers import available_scorers; "
            "before = sorted(m for m in sys.modules if m.startswith('finetune.evaluation.scorers.')); "
            "print(before); print(available_scorers())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, names = out.stdout.strip().splitlines()[-2:]
    assert "finetune.evaluation.scorers.grm" not in before and "finetune.evaluation.scorers.flair" not in before
    assert eval(names) == ["cosine", "flair", "flair_global", "grm", "grm_ori"]


def test_a_scorer_module_dropped_into_the_package_registers(tmp_path, monkeypatch) -> None:
    import finetune.evaluation.scorers as scorers
    from finetune import plugins

    (tmp_path / "probe_scorer_xlip.py").write_text(
        "from finetune.evaluation.scorers.cosine import CosineScorer\n"
        "from finetune.evaluation.scorers.base import register_scorer\n"
        "register_scorer('probe_scorer')(type('ProbeScorer', (CosineScorer,), {}))\n")
    monkeypatch.setattr(scorers, "__path__", [*scorers.__path__, str(tmp_path)])
    monkeypatch.setattr(plugins, "SCORERS", plugins.Registry("scorer", ("finetune.evaluation.scorers",), recipe_key="eval.scorer"))
    monkeypatch.delitem(sys.modules, "finetune.evaluation.scorers.probe_scorer_xlip", raising=False)
    assert "finetune.evaluation.scorers.probe_scorer_xlip" not in sys.modules
    assert "probe_scorer" in scorers.available_scorers()
    assert scorers.get_scorer("probe_scorer").name == "probe_scorer"
    sys.modules.pop("finetune.evaluation.scorers.probe_scorer_xlip", None)
