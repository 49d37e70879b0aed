"""Retrieval evaluation: Recall@K against a direct argsort computation, chunking, ties, the
encoding of evaluation sets, the table and the command line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from finetune.evaluation import format_table, recall_at_k


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
    with pytest.raises(ValueError, match="two .N, D. tensors or two scorer payloads"):
        recall_at_k(images, {"embeds": texts}, owner)


def test_chunk_size_is_the_former_name_of_block_size():
    images, texts, owner = noisy_pairs(20, 2, 8, noise=1.0, seed=2)
    assert recall_at_k(images, texts, owner, chunk_size=3) == recall_at_k(images, texts, owner, block_size=3)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        recall_at_k(images, texts, owner, chunk_size=0)


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


# -- encoding with a real tiny model --------------------------------------------------------------
# Building tiny-clip imports transformers (several seconds on a shared CPU): these tests are `slow`.
REPO = __import__("pathlib").Path(__file__).resolve().parents[3]
LONG = " ".join(f"word{i}" for i in range(120))  # well past 77 tokens


@pytest.fixture(scope="module")
def tiny_clip():
    from finetune.models import load_model

    return load_model("tiny-clip")


def _image(colour, mode="RGB"):
    from PIL import Image

    return Image.new(mode, (40, 30), colour)


def _rows(tmp_path):
    import io

    path = tmp_path / "blue.png"
    _image((0, 0, 255)).save(path)
    buf = io.BytesIO()
    _image((0, 255, 0)).save(buf, format="PNG")
    return [
        {"id": "a", "image": _image((255, 0, 0, 128), "RGBA"), "caption": "a red square"},
        {"id": "b", "image": str(path), "caption": "unused", "captions": ["a blue circle", LONG]},
        {"id": "c", "image": buf.getvalue(), "caption": "a green star", "captions": None},
        {"id": "d", "image": {"bytes": buf.getvalue(), "path": None}, "captions": ["green", "still green", "a star"]},
    ]


def _direct(model, rows):
    from finetune.data.images import read_image

    images, texts, owner = [], [], []
    with torch.no_grad():
        for i, row in enumerate(rows):
            inputs = model.preprocess_images([read_image(row["image"])])
            images.append(model.encode_image(**inputs).embeds[0])
            for caption in row.get("captions") or [row["caption"]]:
                tok = model.tokenize([caption])
                texts.append(model.encode_text(tok.input_ids, tok.attention_mask).embeds[0])
                owner.append(i)
    return torch.stack(images), torch.stack(texts), torch.tensor(owner)


@pytest.mark.slow
def test_encode_matches_one_by_one_encoding(tiny_clip, tmp_path):
    from finetune.evaluation import encode_for_retrieval

    rows = _rows(tmp_path)
    tiny_clip.train()
    stats = dict(tiny_clip.truncation_stats)
    got = encode_for_retrieval(tiny_clip, rows, batch_size=3)
    assert tiny_clip.training and tiny_clip.truncation_stats == stats  # restored
    images, texts, owner = _direct(tiny_clip, rows)
    assert got.text_to_image.tolist() == owner.tolist() == [0, 1, 1, 2, 3, 3, 3]
    torch.testing.assert_close(got.image_embeds, images, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.text_embeds, texts, atol=1e-5, rtol=1e-4)
    assert got.truncated == 1  # the 120-word caption


@pytest.mark.slow
def test_encode_names_the_bad_example(tiny_clip, tmp_path):
    from finetune.data.images import DataError
    from finetune.evaluation import encode_for_retrieval

    rows = _rows(tmp_path)
    with pytest.raises(DataError, match=r"example 'x' has an empty or missing caption"):
        encode_for_retrieval(tiny_clip, rows + [{"id": "x", "image": _image((1, 2, 3)), "caption": " "}], batch_size=8)
    with pytest.raises(DataError, match=r"example 'y': cannot read image .*missing\.png"):
        encode_for_retrieval(tiny_clip, rows + [{"id": "y", "image": str(tmp_path / "missing.png"), "caption": "x"}],
                             batch_size=8)


@pytest.mark.slow
def test_evaluate_sets_on_synthetic_scenes(tiny_clip):
    from finetune.data.sources import load_source
    from finetune.evaluation import encode_for_retrieval, evaluate_sets

    spec = {"name": "synthetic", "split": "test", "size": 12, "seed": 4}
    res = evaluate_sets(tiny_clip, [spec, spec], batch_size=5, ks=(1, 5), progress=False)
    assert list(res) == ["synthetic", "synthetic#2"]
    one = res["synthetic"]
    assert (one["n_images"], one["n_texts"], one["skipped"]) == (12, 12, 0)
    assert one["truncated"] > 0  # synthetic captions run past tiny-clip's 77 positions
    emb = encode_for_retrieval(tiny_clip, load_source(spec).dataset, batch_size=12)
    assert {d: one[d] for d in ("t2i", "i2t")} == recall_at_k(*emb[:3], ks=(1, 5))
    assert res["synthetic#2"] == one


# Recall@K of tiny-clip computed before the scorers existed (finetune.evaluation at a25cdc1): the
# cosine scorer must give these numbers to the last digit.
BEFORE_SCORERS_SINGLE = {
    "t2i": {"R@1": 0.0, "R@2": 4.166666666666666, "R@3": 8.333333333333332, "R@5": 10.416666666666668,
            "R@10": 18.75, "R@20": 35.41666666666667},
    "i2t": {"R@1": 2.083333333333333, "R@2": 8.333333333333332, "R@3": 10.416666666666668,
            "R@5": 10.416666666666668, "R@10": 29.166666666666668, "R@20": 45.83333333333333},
}
BEFORE_SCORERS_MULTI = {
    "t2i": {"R@1": 5.333333333333334, "R@2": 9.333333333333334, "R@3": 13.333333333333334,
            "R@5": 18.666666666666668, "R@10": 38.666666666666664, "R@20": 74.66666666666667},
    "i2t": {"R@1": 0.0, "R@2": 6.666666666666667, "R@3": 10.0, "R@5": 20.0, "R@10": 33.33333333333333,
            "R@20": 46.666666666666664},
}
KS_BEFORE = (1, 2, 3, 5, 10, 20)


def _multi_caption_set():
    from finetune.data.sources import load_source

    ds = load_source({"name": "synthetic", "split": "test", "size": 30, "seed": 5}).dataset
    return ds.map(lambda row, i: {"captions": [row["caption"], row["caption"].split(".")[0] + "."]
                                  + ([row["caption"][:40]] if i % 2 else [])}, with_indices=True)


@pytest.mark.slow
def test_cosine_scorer_gives_the_numbers_from_before_the_scorers(tiny_clip):
    from finetune.evaluation import encode_for_retrieval, evaluate_sets

    spec = {"name": "synthetic", "split": "test", "size": 48, "seed": 11}
    for block_size in (1024, 5):
        res = evaluate_sets(tiny_clip, [spec], batch_size=7, ks=KS_BEFORE, progress=False, block_size=block_size)
        assert {d: res["synthetic"][d] for d in ("t2i", "i2t")} == BEFORE_SCORERS_SINGLE
        assert res["synthetic"]["scorer"] == "cosine"
    emb = encode_for_retrieval(tiny_clip, _multi_caption_set(), batch_size=4)
    assert emb.image_payload["embeds"] is emb.image_embeds and emb.text_payload["embeds"] is emb.text_embeds
    for block_size in (1024, 7):
        assert recall_at_k(*emb[:3], ks=KS_BEFORE, block_size=block_size) == BEFORE_SCORERS_MULTI
        assert recall_at_k(emb.image_payload, emb.text_payload, emb.text_to_image, KS_BEFORE,
                           block_size=block_size, scorer="cosine") == BEFORE_SCORERS_MULTI


def _register_neg_euclidean():
    from finetune.evaluation.scorers import Scorer, available_scorers, register_scorer

    if "test-neg-euclidean" not in available_scorers():
        @register_scorer("test-neg-euclidean")
        class NegEuclidean(Scorer):
            """Negative Euclidean distance of the raw global embeddings."""

            def score(self, texts, images):
                return -torch.cdist(texts["embeds"].double(), images["embeds"].double())

    return "test-neg-euclidean"


def _neg_euclidean_recall(emb, ks):
    """Brute force: the full distance matrix, ranks by counting."""
    sim = -torch.cdist(emb.text_embeds.double(), emb.image_embeds.double())
    own = sim[torch.arange(len(emb.text_to_image)), emb.text_to_image]
    wrong = emb.text_to_image[:, None] != torch.arange(sim.shape[1])[None, :]
    t_rank = ((sim >= own[:, None]) & wrong).sum(1)
    best = torch.full((sim.shape[1],), float("-inf"), dtype=sim.dtype).scatter_reduce(
        0, emb.text_to_image, own, reduce="amax")
    i_rank = ((sim >= best[None, :]) & wrong).sum(0)
    return {"t2i": {f"R@{k}": float((t_rank < k).double().mean() * 100) for k in ks},
            "i2t": {f"R@{k}": float((i_rank < k).double().mean() * 100) for k in ks}}


@pytest.mark.slow
def test_a_registered_scorer_is_used_through_evaluate_sets(tiny_clip):
    from finetune.data.sources import load_source
    from finetune.evaluation import encode_for_retrieval, evaluate_sets

    name = _register_neg_euclidean()
    spec = {"name": "synthetic", "split": "test", "size": 40, "seed": 3}
    ks = (1, 3, 10)
    res = evaluate_sets(tiny_clip, [spec], batch_size=9, ks=ks, progress=False, scorer=name, block_size=7)
    emb = encode_for_retrieval(tiny_clip, load_source(spec).dataset, batch_size=40)
    expected = _neg_euclidean_recall(emb, ks)
    got = res["synthetic"]
    assert got["scorer"] == name
    for d in ("t2i", "i2t"):
        assert got[d] == pytest.approx(expected[d], abs=1e-9)
    cosine = evaluate_sets(tiny_clip, [spec], batch_size=9, ks=ks, progress=False)["synthetic"]
    assert (got["t2i"], got["i2t"]) != (cosine["t2i"], cosine["i2t"])  # the scorer really was used
    # the prefilter with k >= N changes nothing; with k = 1, R@K of the reranked scorer is cosine's R@K for K > 1
    top = evaluate_sets(tiny_clip, [spec], batch_size=9, ks=ks, progress=False, scorer=name, rerank_top_k=40)
    assert top["synthetic"]["scorer"] == f"{name}@top40"
    assert (top["synthetic"]["t2i"], top["synthetic"]["i2t"]) == (got["t2i"], got["i2t"])
    top1 = evaluate_sets(tiny_clip, [spec], batch_size=9, ks=ks, progress=False, scorer=name, rerank_top_k=1)
    assert top1["synthetic"]["t2i"]["R@3"] == cosine["t2i"]["R@3"]
    assert top1["synthetic"]["t2i"]["R@1"] == cosine["t2i"]["R@1"]  # the only candidate is cosine's first


@pytest.mark.slow
def test_cli_scorer_from_the_recipe_and_the_flags(tiny_clip, tmp_path, capsys):
    import json

    from finetune.config import dump_recipe, load_recipe
    from finetune.cli.evaluate import main
    from finetune.evaluation import evaluate_sets
    from finetune.models import save_finetuned

    name = _register_neg_euclidean()
    spec = {"name": "synthetic", "split": "test", "size": 12, "seed": 2}
    recipe_file = tmp_path / "in.yaml"
    recipe_file.write_text("model: {name_or_path: tiny-clip, max_text_len: null}\n"
                           "eval:\n  sets: [{name: synthetic, split: test, size: 12, seed: 2}]\n  ks: [1, 5]\n"
                           f"  scorer: {name}\n  block_size: 5\n")
    run = tmp_path / "run"
    dump_recipe(load_recipe(recipe_file), run / "recipe.yaml")
    save_finetuned(tiny_clip, run / "final")

    assert main([str(run)]) == 0
    written = json.loads((run / "metrics_eval.json").read_text())
    expected = evaluate_sets(tiny_clip, [spec], batch_size=64, ks=(1, 5), progress=False, scorer=name)
    assert written["sets"] == json.loads(json.dumps(expected)) and written["sets"]["synthetic"]["scorer"] == name

    out = tmp_path / "cos.json"
    assert main([str(run), "--scorer", "cosine", "--rerank-top-k", "3", "--block-size", "4", "--out", str(out)]) == 0
    cosine = evaluate_sets(tiny_clip, [spec], batch_size=64, ks=(1, 5), progress=False)
    sets = json.loads(out.read_text())["sets"]
    assert sets["synthetic"]["scorer"] == "cosine@top3"
    got, ref = sets["synthetic"], cosine["synthetic"]
    assert (got["t2i"], got["i2t"]) == (ref["t2i"], ref["i2t"])
    capsys.readouterr()

    assert main([str(run), "--scorer", "cosin"]) == 2
    err = capsys.readouterr().err
    assert "unknown scorer 'cosin'" in err and "did you mean 'cosine'" in err and "registered scorers are" in err
    assert main(["tiny-clip", "--sets", "synthetic", "--rerank-top-k", "0"]) == 2
    assert "--rerank-top-k '0': give a positive integer K" in capsys.readouterr().err
    assert main(["tiny-clip", "--sets", "synthetic", "--block-size", "0"]) == 2
    assert "--block-size must be >= 1" in capsys.readouterr().err
    assert main(["tiny-clip", "--sets", "synthetic", "--import", "no_such_module_xyz"]) == 2
    assert "--import no_such_module_xyz: cannot import it" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_run_folder_and_model(tiny_clip, tmp_path, capsys):
    import json

    from finetune.config import dump_recipe, load_recipe
    from finetune.cli.evaluate import main
    from finetune.evaluation import evaluate_sets
    from finetune.models import save_finetuned

    recipe_file = tmp_path / "in.yaml"
    recipe_file.write_text("# tiny\nmodel: {name_or_path: tiny-clip, max_text_len: null}\n"
                           "eval:\n  sets: [{name: synthetic, split: test, size: 10, seed: 2}]\n  ks: [1, 5]\n")
    run = tmp_path / "run"
    dump_recipe(load_recipe(recipe_file), run / "recipe.yaml")
    save_finetuned(tiny_clip, run / "final")

    assert main([str(run)]) == 0
    written = json.loads((run / "metrics_eval.json").read_text())
    expected = evaluate_sets(tiny_clip, [{"name": "synthetic", "split": "test", "size": 10, "seed": 2}],
                             batch_size=64, ks=(1, 5), progress=False)
    assert written["sets"] == json.loads(json.dumps(expected))
    assert written["run"] is True and written["ks"] == [1, 5]
    out = capsys.readouterr().out
    assert "| synthetic | 10 / 10 | text→image |" in out and "metrics_eval.json" in out

    out_file = tmp_path / "model.json"
    sets = "[{name: synthetic, split: test, size: 20}, urban1k]"
    assert main(["tiny-clip", "--sets", sets, "--ks", "1,10", "--out", str(out_file)]) == 2  # urban1k: no local copy
    assert "urban1k" in capsys.readouterr().err and not out_file.exists()
    assert main(["tiny-clip", "--sets", sets.replace(", urban1k", ""), "--ks", "1,10", "--out", str(out_file)]) == 0
    written = json.loads(out_file.read_text())
    assert written["run"] is False and written["max_text_len"] == 77
    assert written["sets"]["synthetic"]["n_images"] == 20 and list(written["sets"]["synthetic"]["t2i"]) == ["R@1", "R@10"]


@pytest.mark.slow
def test_cli_bad_arguments_exit_2(tmp_path, capsys):
    from finetune.cli.evaluate import main

    assert main(["no-such-model-xyz"]) == 2
    assert "not a run folder: give the sets" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere"), "--sets", "synthetic"]) == 2
    assert "cannot load" in capsys.readouterr().err
    assert main(["tiny-clip", "--sets", "synthetic", "--protocol", "docci=goal"]) == 2
    assert "no set named 'docci'" in capsys.readouterr().err
    assert main(["tiny-clip", "--sets", "synthetic:goal"]) == 2
    assert "has no protocols" in capsys.readouterr().err
    assert main(["tiny-clip", "--sets", "synthetic", "--ks", "1,x"]) == 2
    assert main(["tiny-clip", "--sets", "[{name: synthetic, splt: test}]"]) == 2
    assert "`--sets.0.splt` is not a recipe key: did you mean `--sets.0.split`?" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("train: {}\n")
    assert main([str(run)]) == 2
    assert "has no final/" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["tiny-clip", "--batch-size", "many"])
    assert info.value.code == 2


MULTI_PROCESS_SCRIPT = """
import os, sys, torch
from accelerate import Accelerator
from finetune.data.sources import load_source
from finetune.evaluation import encode_for_retrieval
from finetune.models import load_model

acc = Accelerator(cpu=True)
model = load_model("tiny-clip").to(acc.device)
ds = load_source({"name": "synthetic", "split": "test", "size": 7, "seed": 3}).dataset
ds = ds.map(lambda row, i: {"captions": [row["caption"]] * (1 + i % 3)}, with_indices=True)
emb = encode_for_retrieval(model, ds, batch_size=2, accelerator=acc)
if acc.is_main_process:
    torch.save({**emb._asdict(), "num_processes": acc.num_processes}, sys.argv[1])
acc.wait_for_everyone()
acc.end_training()  # destroys the process group: a rank that exits with it alive can abort its peer
sys.stdout.flush(); sys.stderr.flush()
# Leave without C++ static destructors: even after the group is destroyed, torch's gloo teardown rarely
# aborts a rank at interpreter exit ("terminate called without an active exception"; pytorch#179291).
os._exit(0)
"""


@pytest.mark.slow
def test_two_processes_give_the_single_process_embeddings(tiny_clip, tmp_path):
    import os
    import subprocess
    import sys

    from finetune.data.sources import load_source
    from finetune.evaluation import encode_for_retrieval

    script, out = tmp_path / "enc.py", tmp_path / "emb.pt"
    script.write_text(MULTI_PROCESS_SCRIPT)
    # `accelerate launch --num_processes 2 --cpu` starts ONE process (accelerate 1.15); torchrun starts two
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["num_processes"] == 2  # 7 rows: shards of 3 and 4, so the gather pads one row
    ds = load_source({"name": "synthetic", "split": "test", "size": 7, "seed": 3}).dataset
    ds = ds.map(lambda row, i: {"captions": [row["caption"]] * (1 + i % 3)}, with_indices=True)
    ref = encode_for_retrieval(tiny_clip, ds, batch_size=2)
    assert got["text_to_image"].tolist() == ref.text_to_image.tolist() == [0, 1, 1, 2, 2, 2, 3, 4, 4, 5, 5, 5, 6]
    torch.testing.assert_close(got["image_embeds"], ref.image_embeds, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["text_embeds"], ref.text_embeds, atol=1e-5, rtol=1e-4)
    assert got["truncated"] == ref.truncated


# -- rSum and the 5-fold COCO 1K protocol (GRM, LAPS, VSE++) -----------------------------------------
def test_recall_sum_and_its_table_row():
    from finetune.evaluation import recall_sum

    metrics = {"t2i": {"R@1": 1.0, "R@5": 2.0, "R@10": 3.0, "R@50": 90.0}, "i2t": {"R@1": 4.0, "R@5": 5.0, "R@10": 6.0}}
    assert recall_sum(metrics) == 21.0
    assert recall_sum({"t2i": {"R@1": 1.0}, "i2t": {"R@1": 1.0}}) is None
    before, after = _result(10.0, 20.0), _result(30.0, 40.0)
    before["rsum"], after["rsum"] = 100.0, 250.5
    lines = format_table({"s": before}, {"s": after}).splitlines()
    assert lines[-1] == "| s | 10 / 50 | rSum (R@1+5+10, both) | 100.0 → 250.5 | |"


def test_fold_recall_averages_blocks_that_see_only_their_own_captions():
    from finetune.evaluation import fold_recall

    g = torch.Generator().manual_seed(0)
    images = torch.randn(6, 8, generator=g)
    owner = torch.arange(12) // 2
    texts = images[owner] + 0.9 * torch.randn(12, 8, generator=g)
    got = fold_recall({"embeds": images}, {"embeds": texts}, owner, (1, 2), 3)
    parts = [recall_at_k(images[2 * f:2 * f + 2], texts[4 * f:4 * f + 4], owner[4 * f:4 * f + 4] - 2 * f, (1, 2))
             for f in range(3)]
    for d in ("t2i", "i2t"):
        for k in ("R@1", "R@2"):
            assert got[d][k] == pytest.approx(sum(p[d][k] for p in parts) / 3)
    assert got["t2i"]["R@2"] == 100.0  # two images per fold
    assert got != recall_at_k(images, texts, owner, (1, 2))
    with pytest.raises(ValueError, match="cannot be split into 4 folds"):
        fold_recall({"embeds": images}, {"embeds": texts}, owner, (1,), 4)


def test_coco_karpathy_1k_is_evaluated_as_five_folds(tmp_path):
    from finetune import load_model
    from finetune.evaluation import evaluate_sets, fold_recall, encode_for_retrieval
    from finetune.data.sources import load_source
    from tests.finetune.data.fixtures import write_coco_fixture

    folder = write_coco_fixture(tmp_path / "coco", 0, karpathy=(0, 0, 10))
    model = load_model("tiny-clip")
    spec = {"name": "coco", "protocol": "karpathy_1k", "path": str(folder)}
    with pytest.warns(UserWarning, match="has 10 images here"):
        result = evaluate_sets(model, [spec], ks=(1, 5, 10), progress=False)["coco:karpathy_1k"]
    assert result["folds"] == 5 and result["n_images"] == 10 and result["n_texts"] == 50
    with pytest.warns(UserWarning):
        emb = encode_for_retrieval(model, load_source(spec).dataset, batch_size=4)
    want = fold_recall(emb.image_payload, emb.text_payload, emb.text_to_image, (1, 5, 10), 5)
    assert result["t2i"] == want["t2i"] and result["i2t"] == want["i2t"]
    assert result["rsum"] == pytest.approx(sum(want[d][f"R@{k}"] for d in ("t2i", "i2t") for k in (1, 5, 10)))


# -- an untrusted or unwritable run folder: refused before anything loads -------------------------
def _run_folder(tmp_path, imports=()):
    """A run folder as far as the command line reads it before the model loads (recipe.yaml, final/)."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    lines = ["# a run from somewhere", "eval:", "  sets: [{name: synthetic, split: test, size: 4}]"]
    if imports:
        lines += ["objective:", f"  import: [{', '.join(imports)}]"]
    (run / "recipe.yaml").write_text("\n".join(lines) + "\n")
    return run


@pytest.fixture
def no_model_load(monkeypatch):
    import finetune.models

    for name in ("load_finetuned", "load_model"):
        monkeypatch.setattr(finetune.models, name, lambda *a, **k: pytest.fail("the model was loaded"))


def test_a_run_folders_imports_run_only_with_the_flag(tmp_path, monkeypatch, capsys):
    import sys

    from finetune.cli.evaluate import main

    marker = tmp_path / "imported"
    (tmp_path / "planted_xyz.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_xyz", raising=False)
    run = _run_folder(tmp_path, imports=["planted_xyz"])
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert "`objective.import.0` would import the module 'planted_xyz', which runs its code" in err
    assert "pass --trust-recipe-code to `xlipkit train`, `preview` or `eval` if you trust the recipe" in err
    assert not marker.exists()
    assert main([str(run), "--trust-recipe-imports"]) == 2  # the earlier name; imported; final/ is empty: no model
    assert marker.exists() and "cannot load" in capsys.readouterr().err


def test_a_read_only_run_folder_is_refused_before_the_model_loads(tmp_path, no_model_load, capsys):
    from finetune.cli.evaluate import main
    from tests.finetune.mounts import require_read_only_possible, tmpfs

    with tmpfs(tmp_path / "mnt", "4m") as mount:
        require_read_only_possible(mount)
        run = _run_folder(mount.path)
        mount.read_only()
        assert main([str(run)]) == 2
        err = capsys.readouterr().err
        assert f"error: run folder '{run}' is not writable (" in err and "(nothing was evaluated)" in err
        assert main([str(run), "--out", str(mount.path / "elsewhere.json")]) == 2
        assert f"the folder of '{mount.path / 'elsewhere.json'}' is not writable" in capsys.readouterr().err


def test_no_room_for_the_results_or_a_busy_run_folder_is_refused_first(tmp_path, no_model_load, monkeypatch, capsys):
    import shutil
    import subprocess
    import sys

    from finetune.cli.evaluate import main

    run = _run_folder(tmp_path)
    with monkeypatch.context() as patch:
        real = shutil.disk_usage
        patch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
        assert main([str(run)]) == 2
        assert ("has 1000 bytes free, but about 1.0 MiB will be written there (the evaluation results); free some "
                "space, or write the results elsewhere (--out)") in capsys.readouterr().err
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom finetune.runs.lock import RunLock\n"
         "lock = RunLock(sys.argv[1], command='finetune/run.py x.yaml').acquire()\nprint('held', flush=True)\n"
         "time.sleep(600)\n", str(run)], stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main([str(run)]) == 2
        assert f"in use by another run: PID {holder.pid} on " in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_the_command_line_lives_in_cli_and_the_documented_command_keeps_working():
    """The library (finetune.evaluation) does not import its command line (finetune.cli.evaluate), and
    ``python -m finetune.evaluate`` (DESIGN 1) still runs it (``tests/test_old_paths.py``: without a warning)."""
    import subprocess
    import sys

    from finetune.cli.main import COMMANDS

    assert COMMANDS["eval"].module == "finetune.cli.evaluate"
    probe = "import sys, finetune.evaluation; print('finetune.cli.evaluate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.stdout.strip() == "False", out.stderr
    out = subprocess.run([sys.executable, "-m", "finetune.evaluate", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=600)
    assert out.returncode == 0 and "MODEL_OR_RUN" in out.stdout, out.stderr
