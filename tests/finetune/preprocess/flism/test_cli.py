"""``python -m finetune.preprocess.flism`` (``xlipkit pairs``): top-3 pairs, a bad source, the module entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.cli.pairs import main
from tests.finetune.preprocess.flism.stubs import REPO

pytestmark = pytest.mark.usefixtures("quiet_datasets")


@pytest.mark.slow
def test_pairs_cli_top3_and_a_bad_source(tmp_path, capsys):
    from finetune.models.registry import save_tiny

    tiny = save_tiny("tiny-clip", tmp_path / "tiny-clip")
    out = tmp_path / "p.jsonl"
    code = main(["{name: synthetic, size: 3, options: {image_size: 32}}", str(out), "--model", str(tiny),
                 "--detector", "none", "--pairs", "3", "--weighting", "weighted"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 9 and rows[0]["id"].endswith("#0") and rows[2]["id"].endswith("#2")
    assert sum(r["weight"] for r in rows[:3]) == pytest.approx(1.0, abs=1e-5)
    # each line names its image (training groups the image's pairs by it) and the image's size
    assert [r["image_id"] for r in rows[:3]] == [rows[0]["id"][:-2]] * 3
    assert (rows[0]["width"], rows[0]["height"]) == (32, 32)
    assert main([str(tmp_path / "missing.jsonl"), str(out), "--model", str(tiny)]) == 2
    assert "does not exist" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "finetune.preprocess.flism", "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "IMAGES_AND_CAPTIONS" in proc.stdout
