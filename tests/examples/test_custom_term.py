"""examples/custom_term.py: a loss term and a scorer from outside the package train and evaluate the model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_custom_term_and_scorer_train_and_rank(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "custom_term.py"), "--steps", "2", "--train-size", "64",
         "--eval-size", "16", "--model", "random:tiny-clip", "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    # the user's term trained next to the base, under its own logged name
    assert set(metrics["final_losses"]) >= {"clip", "tokenwise", "loss"}
    first = metrics["history"][0]
    assert first["loss"] == pytest.approx(first["clip"] + 0.5 * first["tokenwise"], rel=1e-5)
    # the user's scorer ranked the evaluation, before and after
    for when in ("before", "after"):
        result = metrics[when]["synthetic"]
        assert result["scorer"] == "tokenwise"
        assert 0.0 <= result["t2i"]["R@1"] <= 100.0
    assert metrics["recipe"]["objective"]["import"] == ["custom_term"]
