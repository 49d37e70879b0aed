"""bench/loop.py keeps working: its cases run on the CPU with the families' tiny configs through the real
Trainer and data path, and its CPU figures are computed and written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import loop  # noqa: E402


def _check(result: dict, cases: list[str]) -> None:
    assert [r["case"] for r in result["cases"]] == cases and not result["skipped"]
    for r in result["cases"]:
        assert r["loop_samples_per_s"] > 0 and r["bare_samples_per_s"] > 0 and r["loop_vs_bare"] > 0
        assert 0 <= r["data_wait_share"] <= 1 and r["steady_steps"] >= 2
        assert r["flops_per_sample_g"] > 0 and r["bare_tflops"] > 0
        assert r["loop_reads"] >= 3  # step 1, the logging steps and the last step: the loop's only reads
    assert result["device"].startswith("cpu") and result["torch"] and result["transformers"]


def test_one_case_runs_on_the_cpu_and_writes_its_results(tmp_path):
    out = tmp_path / "loop.json"
    result = loop.main(["--tiny", "--device", "cpu", "--cases", "clip-248", "--steps", "6", "--log-every", "2",
                        "--out", str(out)])
    _check(result, ["clip-248"])
    saved = json.loads(out.read_text())
    assert saved["cases"][0]["text_len"] == 248 and saved["settings"]["tiny"] is True


@pytest.mark.slow
def test_every_case_runs_on_the_cpu(tmp_path):
    result = loop.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "loop.json")])
    _check(result, [c.name for c in loop.CASES])
    assert result["summary"]["clip_248_vs_77_bare"] is not None


@pytest.mark.slow
def test_cpu_figures_are_ratios_against_a_baseline_of_the_same_run(tmp_path):
    out = tmp_path / "loop_cpu.json"
    result = loop.main(["--cpu-figures", "--rounds", "1", "--cpu-batch", "8", "--cpu-batches", "2",
                        "--overhead-steps", "60", "--out", str(out)])
    d, o = result["data_path"], result["loop_overhead"]
    assert d["ratio_best"] == pytest.approx(d["best"]["new"] / d["best"]["baseline"])
    assert len(d["samples_per_s_per_worker"]["baseline"]) == len(d["samples_per_s_per_worker"]["new"]) == 1
    assert d["ratio_per_worker_cpu_s"] > 0 and d["ratio_median_of_rounds"] > 0
    assert o["trainer_ms_per_step"] > 0 and o["bare_ms_per_step"] > 0
    assert json.loads(out.read_text())["data_path"]["workers"] == 1


def test_every_case_names_its_models_as_random_registry_configs():
    """The GPU command builds each case's real-size model from the registry: a bare real-size name is refused
    (random weights must be asked for), which the CPU cases, on tiny configs, would never show."""
    from finetune.models.registry import RANDOM_PREFIX, random_config

    for case in loop.CASES:
        for name in (case.model, case.tiny):
            assert name.startswith(RANDOM_PREFIX), (case.name, name)
            assert random_config(name[len(RANDOM_PREFIX):], "auto") is not None, name
