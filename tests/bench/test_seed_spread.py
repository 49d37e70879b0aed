"""bench/seed_spread.py: the seeded recipes change only the seed and where the run goes, a finished run of one is
reused instead of trained again, and the spread, gaps and means are what the R@1 values give."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.config import dump_recipe, load_recipe, recipe_to_dict

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import seed_spread  # noqa: E402


def _metrics(t2i: float, i2t: float) -> dict:
    return {"objective": "clip", "after": {"synthetic": {"t2i": {"R@1": t2i, "R@5": 90.0}, "i2t": {"R@1": i2t}}}}


RUNS = {
    "recipes/a.yaml": {0: _metrics(60.0, 58.0), 1: _metrics(62.5, 55.0), 2: _metrics(61.0, 57.0)},
    "recipes/b.yaml": {0: _metrics(59.0, 59.0), 1: _metrics(58.0, 56.0), 2: _metrics(60.0, 57.5)},
}


def test_spread_gaps_and_means_are_those_of_the_r1_values():
    table = seed_spread.recall_table(RUNS)
    assert table["synthetic"]["t2i"]["recipes/a.yaml"] == {0: 60.0, 1: 62.5, 2: 61.0}
    # ranges: a t2i 2.5, a i2t 3.0, b t2i 2.0, b i2t 3.0 -> the largest
    assert seed_spread.seed_spread(table) == pytest.approx(3.0)
    gaps = seed_spread.paired_gaps(table, "recipes/a.yaml", "recipes/b.yaml")
    assert gaps["synthetic"]["t2i"] == {0: 1.0, 1: 4.5, 2: 1.0}
    assert gaps["synthetic"]["i2t"] == {0: -1.0, 1: -1.0, 2: -0.5}
    means = seed_spread.mean_after(table, "recipes/a.yaml")
    assert means["synthetic"]["t2i"]["R@1"] == pytest.approx(61.1666667)
    text = seed_spread.markdown(table, "recipes/a.yaml", ["recipes/b.yaml"], [0, 1, 2])
    assert "| 1 | 62.5 / 55.0 | 58.0 / 56.0 | +4.5 / -1.0 |" in text
    assert "| mean | 61.2 / 56.7 | 59.0 / 57.5 | +2.2 / -0.8 |" in text
    with pytest.raises(ValueError, match="two seeds"):
        seed_spread.seed_spread(seed_spread.recall_table({"r": {0: _metrics(1.0, 1.0)}}))


def test_a_seeded_recipe_changes_only_the_seed_and_the_run_folder(tmp_path):
    path, data = seed_spread.seeded_recipe("recipes/grm_tiny_synthetic.yaml", 2, tmp_path)
    assert path == tmp_path / "grm_tiny_synthetic-seed2.yaml"
    shipped = recipe_to_dict(load_recipe(ROOT / "recipes" / "grm_tiny_synthetic.yaml"))
    seeded = recipe_to_dict(load_recipe(path))
    assert seeded == data
    assert seeded["train"]["seed"] == 2 and seeded["output"]["dir"] == str(tmp_path / "grm_tiny_synthetic-seed2")
    assert seeded["eval"]["compare_with"] == [] and seeded["eval"]["seed_spread"] is None
    for section in ("train", "eval", "output"):
        for key in ("seed", "compare_with", "seed_spread", "dir"):
            shipped[section].pop(key, None)
            seeded[section].pop(key, None)
    for meta in ("source", "description"):
        shipped.pop(meta, None)
        seeded.pop(meta, None)
    assert seeded == shipped


def test_a_finished_run_of_the_seeded_recipe_is_reused(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their prerequisites relative to the repository
    path, _ = seed_spread.seeded_recipe("recipes/quickstart_clip.yaml", 1, tmp_path)
    run_dir = tmp_path / "quickstart_clip-seed1"
    (run_dir / "final").mkdir(parents=True)
    dump_recipe(load_recipe(path), run_dir / "recipe.yaml")
    (run_dir / "metrics.json").write_text(json.dumps(_metrics(50.0, 49.0)))
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("a current run was trained again"))
    metrics, status = seed_spread.run_seeded(path)
    assert status == "reused" and metrics["after"]["synthetic"]["t2i"]["R@1"] == 50.0

    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **k: launched.append(cmd) or 0)
    seed_spread.seeded_recipe("recipes/quickstart_clip.yaml", 1, tmp_path)
    path.write_text(path.read_text().replace("lr: 0.0005", "lr: 0.0004"))  # a stale run: trained again
    with pytest.raises(Exception, match="failed"):  # the fake launch wrote no final/ of the new recipe
        (run_dir / "final").rmdir()
        seed_spread.run_seeded(path)
    assert launched and launched[0][1].endswith("finetune/run.py") and launched[0][2] == str(path)
    assert "output.overwrite=true" in launched[0]


def test_the_sweeps_verdict_says_the_spread_was_measured_by_it():
    """The sweep reuses finetune.evaluation.report.verdict, whose wording for a single run's spread it replaces."""
    from finetune.evaluation.report import verdict

    said = verdict(("a", {"after": {"s": {"t2i": {"R@1": 70.0}}}, "objective": "x"}),
                   [("b", {"after": {"s": {"t2i": {"R@1": 60.0}}}, "objective": "clip"})], 3.0)
    assert seed_spread.RECIPE_SPREAD in said
