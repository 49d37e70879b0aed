"""bench/quickstart_numbers.py: the README's tables from the runs' metrics (means with their range over seeds, the
start once, the cuts at 77), the structure loss against ln B, and recipes whose start is trained afresh in the
script's own folder."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from finetune.config import load_recipe, recipe_to_dict

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import quickstart_numbers as qn  # noqa: E402


def _metrics(after: tuple[float, float], cut: tuple[float, float], start=(55.5, 52.0), structure=None) -> dict:
    def result(t2i, i2t):
        return {"synthetic": {"t2i": {"R@1": t2i, "R@5": t2i + 30}, "i2t": {"R@1": i2t, "R@5": i2t + 30}}}

    history = [{"step": 5, "clip": 1.0}] + ([{"step": 5, qn.STRUCTURE: 4.4}, {"step": 250, qn.STRUCTURE: structure}]
                                           if structure else [])
    return {"before": result(*start), "after": result(*after), "after_at_base_length": result(*cut), "steps": 250,
            "history": history}


RUNS = {
    qn.QUICKSTART: {0: _metrics((62.5, 60.5), (23.4, 21.9), structure=2.76),
                    1: _metrics((59.4, 59.4), (19.0, 18.0), structure=2.70)},
    qn.CLIP_ONLY: {0: _metrics((61.3, 57.4), (19.5, 22.7)), 1: _metrics((60.9, 59.4), (20.5, 21.7))},
}


def test_the_readme_table_gives_means_with_their_range_and_the_start_once():
    rows = qn.recall_rows(RUNS, 248)
    assert rows[2] == "| start (`quickstart_pretrain.yaml`) | clip | 248 | 248 | 55.5 | 85.5 | 52.0 | 82.0 |"
    assert rows[3] == ("| `quickstart.yaml` | clip + StructXLIP | 250 | 248 | 61.0 (59.4–62.5) | 91.0 (89.4–92.5) "
                       "| 60.0 (59.4–60.5) | 90.0 (89.4–90.5) |")
    assert rows[4].startswith("| `quickstart.yaml` | clip + StructXLIP | 250 | cut at 77 | 21.2 (19.0–23.4) |")
    assert rows[6].startswith("| `quickstart_finetune_clip.yaml` | clip | 250 | cut at 77 | 20.0 (19.5–20.5) |")
    assert qn.fmt_range([58.6]) == "58.6"


def test_ahead_counts_and_the_structure_loss_against_chance():
    from seed_spread import recall_table

    ahead = qn.ahead_count(recall_table(RUNS), qn.QUICKSTART, qn.CLIP_ONLY)
    assert ahead == {"t2i": "ahead on 1, level on 0, behind on 1 of 2 seeds",
                     "i2t": "ahead on 1, level on 1, behind on 0 of 2 seeds"}
    loss = qn.structure_loss(RUNS[qn.QUICKSTART][0], 16)
    assert loss == {"step": 250, "last": 2.76, "chance_ln_batch": round(math.log(16), 3)}
    assert qn.structure_loss(RUNS[qn.CLIP_ONLY][0], 16) is None


def test_the_written_recipes_train_a_fresh_start_in_the_scripts_folder(tmp_path):
    start = qn.write_recipe(qn.START, tmp_path / "quickstart_pretrain.yaml", [f"output.dir={tmp_path / 'start'}"])
    path = qn.write_recipe(qn.QUICKSTART, tmp_path / "quickstart-seed2.yaml",
                           ["train.seed=2", f"output.dir={tmp_path / 'q2'}", f"model.init_from={start}",
                            "eval.compare_with=[]", "eval.seed_spread=null"])
    written, shipped = (recipe_to_dict(load_recipe(p)) for p in (path, ROOT / qn.QUICKSTART))
    assert written["model"]["init_from"] == str(start) and written["train"]["seed"] == 2
    assert recipe_to_dict(load_recipe(start))["output"]["dir"] == str(tmp_path / "start")
    for d in (written, shipped):
        d["model"].pop("init_from"), d["train"].pop("seed"), d["output"].pop("dir")
        d["eval"].pop("compare_with"), d["eval"].pop("seed_spread")
        d.pop("source", None), d.pop("description", None)
    assert written == shipped


@pytest.mark.slow
def test_a_small_sweep_runs_end_to_end_from_an_empty_folder(tmp_path):
    """Two seeds of a 2-step quickstart on 64 scenes (the start's batch), scored on 16: every run is trained (none
    reused from runs/), and the JSON holds the README table and the per-seed table."""
    out = tmp_path / "numbers.json"
    result = qn.main(["--seeds", "0", "1", "--runs", str(tmp_path / "runs"), "--out", str(out),
                      "--set", "train.max_steps=2", "--set", "data.train.size=64",
                      "--set", "eval.sets=[{name: synthetic, split: test, size: 16, seed: 1}]"])
    assert [r["status"] for r in result["runs"]] == ["trained"] * 4
    assert (tmp_path / "runs" / "quickstart_pretrain" / "final").is_dir()
    assert json.loads(out.read_text())["readme_table"][2].startswith("| start (`quickstart_pretrain.yaml`) | clip | 2 |")
    assert "| mean |" in result["seed_table"]
