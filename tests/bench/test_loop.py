"""bench/loop.py keeps working and cannot flatter: its cases run on the CPU with the families' tiny configs through
the run's own loop and data path, each in a process of its own, the bare step on batches neither the loop nor the bare
step saw; the budget skips and kills what does not fit and lists it; its CPU figures are computed and written."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import loop  # noqa: E402
import loop_case  # noqa: E402

WARMUP, STEADY, BARE_WARMUP, BATCH = 2, 4, 1, 4  # --tiny's defaults


def _check_case(r: dict) -> None:
    assert r["loop_samples_per_s"] > 0 and r["bare_samples_per_s"] > 0
    assert r["loop_vs_bare"] == pytest.approx(r["loop_samples_per_s"] / r["bare_samples_per_s"])
    assert 0 <= r["data_wait_share"] <= 1
    assert r["loop_steady_steps"] == r["bare_steady_steps"] == STEADY and r["loop_steady_from_step"] == WARMUP
    assert r["batch"] == BATCH
    f = r["flops"]  # a probe step counted at its text plan and at half its lengths: FLOPs per text token
    assert f["per_step_probe"] > 0 and f["per_computed_text_token"] > 0
    assert f["per_step_bare"] >= f["per_step_bare_real_tokens"] > 0  # padding's FLOPs taken out of the second
    assert r["bare_tflops"] == pytest.approx(f["per_step_bare"] * r["bare_samples_per_s"] / BATCH / 1e12)
    assert 0 <= r["text_tokens"]["bare_padding_share"] < 1
    assert r["bare_mfu"] is None and r["bare_mfu_real_tokens"] is None  # no peak known for a CPU
    assert r["attention"]["ran"] in ("flash", "math")
    assert r["attention"]["setting"] == ("torch" if r["case"].endswith("-torch-attention") else "auto")
    assert r["shapes"]["loop"]["new_attention_shapes_per_step"] == 0  # the warm-up ran every planned length
    assert r["shapes"]["bare"]["new_attention_shapes_per_step"] == 0
    assert r["shapes"]["loop"]["attention_calls_per_step"] > 0
    assert r["recompiles"] is None and r["compiled"] is False
    assert r["peak_rss_gib"] > 0 and r["peak_memory_gib"] is None


@pytest.fixture(scope="module")
def every_case(tmp_path_factory):
    """One ``--tiny`` run of every case on the CPU, shared by the tests that check different things of it."""
    out = tmp_path_factory.mktemp("loop") / "loop.json"
    return loop.main(["--tiny", "--device", "cpu", "--out", str(out)]), out


@pytest.mark.slow
def test_every_case_runs_on_the_cpu(every_case):
    result, out = every_case
    assert [r["case"] for r in result["cases"]] == [c.name for c in loop.CASES] and not result["skipped"]
    assert result["device"].startswith("cpu") and result["torch"] and result["transformers"]
    assert json.loads(out.read_text())["cases"] == result["cases"] and result["partial"] is False
    for r in result["cases"]:
        if not r["compiled"]:
            _check_case(r)
        assert r["batches"]["bare_rows_seen_before"] == 0
    assert result["summary"]["clip_248_vs_siglip2_bare"] == pytest.approx(
        result["cases"][0]["bare_samples_per_s"] / result["cases"][2]["bare_samples_per_s"])


@pytest.mark.slow
def test_cases_run_in_fresh_processes_on_unseen_batches(every_case):
    result, _ = every_case
    pids = [r["pid"] for r in result["cases"]]
    assert len(set(pids)) == len(loop.CASES) and os.getpid() not in pids  # one fresh process per case, not this one
    assert all(r["parent_pid"] == os.getpid() for r in result["cases"])
    for r in result["cases"]:
        loop_ids, bare_ids = r["batch_ids"]["loop"], r["batch_ids"]["bare"]
        assert len(loop_ids) == WARMUP + STEADY and len(bare_ids) == BARE_WARMUP + STEADY
        assert all(len(b) == BATCH for b in loop_ids + bare_ids)
        seen_loop = [i for b in loop_ids for i in b]
        seen_bare = [i for b in bare_ids for i in b]
        assert not set(seen_loop) & set(seen_bare)  # the bare step's batches are ones the loop never ran
        assert len(set(seen_bare)) == len(seen_bare)  # and each bare batch is used once


@pytest.mark.slow
def test_a_compiled_case_counts_its_recompiles(every_case):
    (r,) = [r for r in every_case[0]["cases"] if r["case"] == "clip-248-compiled"]
    assert r["compiled"] is True and r["shapes"]["loop"]["new_attention_shapes_per_step"] is None
    assert r["compile_backend"] == "aot_eager"  # --tiny: dynamo's graphs and guards without code generation
    rc = r["recompiles"]
    assert rc["graphs"]["after_loop_warmup"] > rc["graphs"]["after_build"]  # the warm-up compiled the blocks
    assert rc["loop_after_warmup"] == 0 and rc["bare_timed"] == 0  # every planned length compiled before step 1


@pytest.mark.slow
def test_the_budget_skips_and_kills_what_does_not_fit_and_lists_it(tmp_path):
    """No case starts without its estimate left; a case that runs past the budget is killed (with its process group)
    and listed, and the run still writes its results."""
    out = tmp_path / "loop.json"
    result = loop.main(["--tiny", "--device", "cpu", "--cases", "clip-248,siglip2", "--budget", "1",
                        "--case-s", "5", "--out", str(out)])
    assert not result["cases"] and [s["case"] for s in result["skipped"]] == ["clip-248", "siglip2"]
    assert all("budget left" in s["reason"] for s in result["skipped"])
    result = loop.main(["--tiny", "--device", "cpu", "--cases", "clip-248", "--budget", "5", "--case-s", "0.1",
                        "--out", str(out)])
    assert not result["cases"] and result["skipped"][0]["case"] == "clip-248"
    assert "ran past the budget" in result["skipped"][0]["reason"]
    assert json.loads(out.read_text())["skipped"] == result["skipped"]


def test_bad_options_are_refused_naming_them():
    with pytest.raises(SystemExit, match="unknown case.*'clip-999'"):
        loop.main(["--tiny", "--cases", "clip-248,clip-999"])
    with pytest.raises(SystemExit, match="--warmup must be at least 2"):
        loop.main(["--tiny", "--warmup", "1"])


def test_the_recorder_counts_attention_shapes_new_after_warm_up():
    """What the per-step shape figures rest on: every SDPA call noted by step and phase, new = seen in no earlier
    step of the loop or the bare step."""
    q = lambda n: torch.zeros(1, 2, n, 8)  # noqa: E731
    original = torch.nn.functional.scaled_dot_product_attention
    rec = loop_case.StepRecorder(sdpa=True)
    try:
        rec.phase = "warmup"  # the warm-up's shapes (8) are not new in any step
        torch.nn.functional.scaled_dot_product_attention(q(8), q(8), q(8), is_causal=True)
        for phase, lengths in (("loop", [4, 4, 5]), ("loop", [4]), ("loop", [6]), ("bare", [6, 8]), ("bare", [7, 7])):
            rec.begin(phase, {"ids": ["a"], "input_ids": torch.zeros(1, lengths[0])})
            for n in lengths:
                torch.nn.functional.scaled_dot_product_attention(q(n), q(n), q(n), is_causal=True)
    finally:
        rec.close()
    assert torch.nn.functional.scaled_dot_product_attention is original  # put back
    loop_window = rec.new_per_step("loop", 2, 3)  # steps 2 and 3: one new shape (6) in two steps
    assert loop_window["new_attention_shapes_per_step"] == 0.5 and loop_window["attention_calls_per_step"] == 1
    assert loop_window["new_input_shapes_per_step"] == 0.5
    bare_window = rec.new_per_step("bare", 1, 2)  # 6 was seen in the loop; 7 is new
    assert bare_window["new_attention_shapes_per_step"] == 0.5 and bare_window["attention_calls_per_step"] == 2
    assert rec.ids["loop"] == [["a"]] * 3


def test_the_data_is_written_in_chunks_with_unique_ids(tmp_path):
    folder = loop.write_scenes(tmp_path / "scenes", 5, image_size=32, processes=2, chunk=2)
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and len({r["id"] for r in rows}) == 5
    assert all((folder / r["image"]).is_file() and r["sentences"] and r["objects"] for r in rows)


def test_rows_suffice_for_unseen_batches_of_the_largest_case():
    settings = {"batch": 256, "batch_fixed": False, "warmup": 10, "steady": 40, "bare_warmup": 2}
    cases = [c for c in loop.CASES if c.name in ("clip-248", "flair")]
    assert loop.rows_needed(cases, settings) == 256 * (10 + 2 + 2 * 40 + 2)


def test_each_case_reads_only_its_own_rows_with_its_caption_lengths(tmp_path):
    """A case's training file holds the rows it reads (its batch times its steps), the scenes' own captions, or
    captions with COCO's or DOCCI's lengths for the cases that ask for them."""
    folder = loop.write_scenes(tmp_path / "scenes", 60, image_size=32)
    settings = {"batch": 4, "batch_fixed": True, "warmup": 2, "steady": 4, "bare_warmup": 1}
    by = {c.name: c for c in loop.CASES}
    plain = [json.loads(x) for x in loop.case_data(by["clip-248"], settings, folder).read_text().splitlines()]
    coco = [json.loads(x) for x in loop.case_data(by["grm-coco"], settings, folder).read_text().splitlines()]
    docci = [json.loads(x) for x in loop.case_data(by["clip-docci"], settings, folder).read_text().splitlines()]
    assert len(plain) == len(coco) == len(docci) == loop.case_rows(by["clip-248"], settings) == 4 * (2 + 1 + 8 + 2)
    scenes = [json.loads(x) for x in (folder / "train.jsonl").read_text().splitlines()]
    assert plain == scenes[:len(plain)] and [r["image"] for r in coco] == [r["image"] for r in plain]
    assert all(8 <= len(r["caption"].split()) <= 20 for r in coco)
    assert all(50 <= len(r["caption"].split()) <= 320 for r in docci)
    assert by["clip-docci-248"].buckets == [248] and set(loop.NEVER_MEASURED) <= set(by)


@pytest.mark.slow
def test_cpu_figures_are_ratios_against_a_baseline_of_the_same_run(tmp_path):
    out = tmp_path / "loop_cpu.json"
    result = loop.main(["--cpu-figures", "--rounds", "1", "--cpu-batch", "8", "--cpu-batches", "2",
                        "--overhead-steps", "60", "--out", str(out)])
    d, o = result["data_path"], result["loop_overhead"]
    assert d["ratio_best"] == pytest.approx(d["best"]["new"] / d["best"]["baseline"])
    assert len(d["samples_per_s_per_worker"]["baseline"]) == len(d["samples_per_s_per_worker"]["new"]) == 1
    assert d["ratio_per_worker_cpu_s"] > 0 and d["ratio_median_of_rounds"] > 0
    assert o["loop_ms_per_step"] > 0 and o["bare_ms_per_step"] > 0
    assert json.loads(out.read_text())["data_path"]["workers"] == 1


def test_every_case_names_its_models_as_random_registry_configs():
    """The GPU command builds each case's real-size model from the registry: a bare real-size name is refused
    (random weights must be asked for), which the CPU cases, on tiny configs, would never show."""
    from finetune.models.registry import RANDOM_PREFIX, random_config

    for case in loop.CASES:
        for name in (case.model, case.tiny):
            assert name.startswith(RANDOM_PREFIX), (case.name, name)
            assert random_config(name[len(RANDOM_PREFIX):], "auto") is not None, name
