"""`model.init_from` and `eval.compare_with`: a recipe's run starts from another run's final/, reused when that run
is current (same resolved recipe, same start), trained first otherwise; clear errors for bad references."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from accelerate.state import AcceleratorState, GradientState

from finetune.config import load_recipe
from finetune.models.registry import save_tiny
from finetune.training.upstream import PrerequisiteError, chain_hash, ensure, reference_hash

REPO = Path(__file__).resolve().parents[3]


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny("tiny-clip", tmp_path_factory.mktemp("model") / "tiny-clip")


def _recipe(path: Path, tiny: Path, out: Path, *, lr: float = 1e-3, init_from: str | None = None,
            seed: int = 100, compare_with: list[str] | None = None) -> Path:
    """A tiny recipe: 2 steps of the clip loss on 8 synthetic scenes of 32 px, evaluated on 8 test scenes."""
    model = {"name_or_path": str(tiny), "max_text_len": 248, "kps": {"keep": 20, "freeze_kept": False}}
    if init_from:
        model["init_from"] = init_from
    recipe = {
        "model": model,
        "data": {"train": {"name": "synthetic", "split": "train", "size": 8, "seed": seed,
                           "options": {"image_size": 32}}, "num_workers": 0},
        "eval": {"sets": [{"name": "synthetic", "split": "test", "size": 8, "seed": 1,
                           "options": {"image_size": 32}}], "batch_size": 8, "compare_base_length": True,
                 "compare_with": compare_with or []},
        "objective": {"base": "clip"},
        "train": {"lr": lr, "batch_size": 4, "max_steps": 2, "warmup_steps": 0, "checkpoint_every": 0,
                  "trackers": [], "mixed_precision": "no"},
        "output": {"dir": str(out)},
    }
    path.write_text("# tiny test recipe\n" + yaml.safe_dump(recipe))
    return path


def _run(path: Path, *overrides: str) -> int:
    from finetune.training import run_recipe

    _reset_accelerate()
    return run_recipe(load_recipe(path, list(overrides)))


def _metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


@pytest.mark.slow
def test_init_from_trains_the_start_once_reuses_it_and_retrains_it_when_its_recipe_changes(tiny, tmp_path):
    pre = _recipe(tmp_path / "pre.yaml", tiny, tmp_path / "runs" / "pre")
    fine = _recipe(tmp_path / "fine.yaml", tiny, tmp_path / "runs" / "fine", seed=0, init_from=str(pre))

    assert _run(fine) == 0  # the start does not exist yet: trained first
    first = _metrics(tmp_path / "runs" / "fine")
    assert first["init_from"]["status"] == "trained"
    assert first["init_from"]["hash"] == reference_hash(str(pre), "model.init_from")
    pre_metrics = _metrics(tmp_path / "runs" / "pre")
    # the fine-tune starts from the pretrained final/: its score before training is the start's score after
    assert first["before"]["synthetic"]["t2i"] == pre_metrics["after"]["synthetic"]["t2i"]
    stamp = (tmp_path / "runs" / "pre" / "final").stat().st_mtime_ns

    assert _run(fine, f"output.dir={tmp_path / 'runs' / 'fine2'}") == 0  # same recipe: reused, not retrained
    second = _metrics(tmp_path / "runs" / "fine2")
    assert second["init_from"]["status"] == "reused"
    assert (tmp_path / "runs" / "pre" / "final").stat().st_mtime_ns == stamp
    assert second["before"] == first["before"]
    assert "- started from: `" in (tmp_path / "runs" / "fine2" / "report.md").read_text()

    _recipe(pre, tiny, tmp_path / "runs" / "pre", lr=2e-3)  # the start's recipe changed: retrained
    assert _run(fine, f"output.dir={tmp_path / 'runs' / 'fine3'}") == 0
    third = _metrics(tmp_path / "runs" / "fine3")
    assert third["init_from"]["status"] == "trained"
    assert third["init_from"]["hash"] != first["init_from"]["hash"]
    assert yaml.safe_load((tmp_path / "runs" / "pre" / "recipe.yaml").read_text())["train"]["lr"] == 2e-3
    assert third["before"] != first["before"]


@pytest.mark.slow
def test_a_changed_start_makes_a_dependent_run_stale(tiny, tmp_path):
    """A -> B -> C: C reuses B only while B was trained from the A that is current now."""
    a = _recipe(tmp_path / "a.yaml", tiny, tmp_path / "runs" / "a")
    b = _recipe(tmp_path / "b.yaml", tiny, tmp_path / "runs" / "b", init_from=str(a))
    c = _recipe(tmp_path / "c.yaml", tiny, tmp_path / "runs" / "c", seed=0, init_from=str(b))
    assert _run(c) == 0
    assert _metrics(tmp_path / "runs" / "b")["init_from"]["status"] == "trained"
    _recipe(a, tiny, tmp_path / "runs" / "a", lr=3e-3)
    assert _run(c, f"output.dir={tmp_path / 'runs' / 'c2'}") == 0
    assert _metrics(tmp_path / "runs" / "c2")["init_from"]["status"] == "trained"  # B again, from the new A
    assert _metrics(tmp_path / "runs" / "b")["init_from"]["status"] == "trained"


@pytest.mark.slow
def test_compare_with_puts_both_runs_in_the_report(tiny, tmp_path):
    pre = _recipe(tmp_path / "pre.yaml", tiny, tmp_path / "runs" / "pre")
    other = _recipe(tmp_path / "other.yaml", tiny, tmp_path / "runs" / "other", seed=0, init_from=str(pre))
    fine = _recipe(tmp_path / "fine.yaml", tiny, tmp_path / "runs" / "fine", seed=0, init_from=str(pre),
                   lr=2e-3, compare_with=[str(other)])
    assert _run(fine) == 0
    metrics = _metrics(tmp_path / "runs" / "fine")
    assert metrics["init_from"]["status"] == "trained"
    assert [c["status"] for c in metrics["compare_with"]] == ["trained"]
    assert _metrics(tmp_path / "runs" / "other")["init_from"]["status"] == "reused"  # the same start
    report = (tmp_path / "runs" / "fine" / "report.md").read_text()
    section = report[report.index("## Comparison"):]
    rows = [line for line in section.splitlines() if line.startswith(f"| {fine}") or line.startswith(f"| {other}")]
    assert len(rows) == 4  # each run read up to 248 tokens and cut at 77
    other_t2i = _metrics(tmp_path / "runs" / "other")["after"]["synthetic"]["t2i"]["R@1"]
    assert f"| {other} | clip | 2 | 248 | {other_t2i:.1f} |" in section


def test_missing_reference_folder_without_final_and_cycles_are_clear_errors(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    never = lambda *a, **k: pytest.fail("nothing may be trained")  # noqa: E731
    with pytest.raises(PrerequisiteError, match=r"model.init_from: 'nope.yaml' not found .*current directory"):
        ensure("nope.yaml", "model.init_from", never)
    (tmp_path / "half").mkdir()
    with pytest.raises(PrerequisiteError, match=r"run folder 'half' has no final/"):
        ensure("half", "model.init_from", never)
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    _recipe(a, tiny, tmp_path / "runs" / "a", init_from=str(b))
    _recipe(b, tiny, tmp_path / "runs" / "b", init_from=str(a))
    with pytest.raises(PrerequisiteError, match=r"cycle of model.init_from: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        ensure(str(a), "model.init_from", never)
    _recipe(a, tiny, tmp_path / "runs" / "a", init_from=str(a))
    with pytest.raises(PrerequisiteError, match="cycle"):
        chain_hash(load_recipe(a))


def test_run_reports_a_bad_init_from_as_a_recipe_error(tiny, tmp_path, capsys):
    from finetune.cli.train import main

    fine = _recipe(tmp_path / "fine.yaml", tiny, tmp_path / "runs" / "fine", init_from=str(tmp_path / "none.yaml"))
    assert main([str(fine)]) == 2
    assert "recipe error: model.init_from:" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "fine").exists()


def test_a_run_folder_is_used_as_it_is(tiny, tmp_path):
    folder = tmp_path / "done"
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "xlipkit.json").write_text("{}")
    got = ensure(str(folder), "model.init_from", lambda *a, **k: pytest.fail("a folder is never trained"))
    assert got.status == "folder" and got.final == folder / "final"
    before = reference_hash(str(folder), "model.init_from")
    os.utime(folder / "final" / "xlipkit.json", ns=(1, 1))
    assert reference_hash(str(folder), "model.init_from") != before


def test_quickstart_pretraining_fine_tuning_and_test_scenes_are_disjoint():
    from finetune.data.synthetic import synthetic_scenes

    pre = load_recipe(REPO / "recipes" / "quickstart_pretrain.yaml")
    fine = load_recipe(REPO / "recipes" / "quickstart.yaml")
    clip = load_recipe(REPO / "recipes" / "quickstart_finetune_clip.yaml")
    assert fine.model.init_from == clip.model.init_from == "recipes/quickstart_pretrain.yaml"
    assert fine.data.train == clip.data.train  # the comparison fine-tunes on the same scenes
    specs = [pre.data.train, fine.data.train, fine.eval.sets[0]]
    scenes = [synthetic_scenes(300, s["seed"], split=s["split"]) for s in specs]
    captions = [set(d["caption"]) for d in scenes]
    images = [{im["bytes"] for im in d.with_format("arrow")["image"].to_pylist()} for d in scenes]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not captions[i] & captions[j], (specs[i], specs[j])
            assert not images[i] & images[j], (specs[i], specs[j])


@pytest.mark.slow
def test_two_processes_train_the_start_together_then_fine_tune_from_it(tiny, tmp_path):
    """Under a multi-process launch every process runs the prerequisite the way the run itself runs (one DDP
    run of 2 processes), then all of them start from its final/. The line that says the start is trained first
    reaches the terminal (the logging is set up before the prerequisites), as INFO, not WARNING: once, from the
    main process (the others log warnings only)."""
    import subprocess
    import sys

    pre = _recipe(tmp_path / "pre.yaml", tiny, tmp_path / "runs" / "pre")
    fine = _recipe(tmp_path / "fine.yaml", tiny, tmp_path / "runs" / "fine", seed=0, init_from=str(pre))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "finetune" / "run.py"), str(fine)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pre_metrics, fine_metrics = _metrics(tmp_path / "runs" / "pre"), _metrics(tmp_path / "runs" / "fine")
    assert pre_metrics["num_processes"] == fine_metrics["num_processes"] == 2
    assert fine_metrics["init_from"]["status"] == "trained"
    assert fine_metrics["before"]["synthetic"] == pre_metrics["after"]["synthetic"]
    [line] = [x for x in proc.stderr.splitlines() if "model.init_from: training" in x]
    assert " INFO model.init_from: training " in line and f"{tmp_path / 'runs' / 'pre'} holds no finished run" in line
    assert " WARNING " not in proc.stderr.split("model.init_from: training")[0]


def test_keys_added_to_the_toolkit_since_a_run_do_not_make_it_stale(tiny, tmp_path):
    """A run folder written before a recipe key existed (the key absent from its recipe.yaml) is still current
    when the key is at its default; a real change still makes it stale."""
    from finetune.config import dump_recipe
    from finetune.training.upstream import _current

    path = _recipe(tmp_path / "pre.yaml", tiny, tmp_path / "runs" / "pre")
    recipe = load_recipe(path)
    run_dir = tmp_path / "runs" / "pre"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "metrics.json").write_text("{}")
    dump_recipe(recipe, run_dir / "recipe.yaml")
    written = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert written["model"].pop("options", "absent") is None  # as a run from before the key
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(written))

    assert _current(run_dir, recipe, None) == (True, "")
    changed = load_recipe(path, ["train.lr=0.5"])
    current, why = _current(run_dir, changed, None)
    assert not current and "train.lr" in why


def test_training_a_prerequisite_on_a_first_run_is_info_and_replacing_a_run_is_a_warning(tiny, tmp_path, caplog):
    """A first quickstart trains its start and comparison as expected steps (INFO); a run that replaces what is in
    the prerequisite's folder says so as a WARNING."""
    pre = _recipe(tmp_path / "pre.yaml", tiny, tmp_path / "runs" / "pre")

    def fake_run(recipe, chain=()):
        (Path(recipe.output.dir) / "final").mkdir(parents=True, exist_ok=True)
        return 0

    with caplog.at_level("INFO", logger="xlipkit"):
        ensure(str(pre), "eval.compare_with[0]", fake_run)
    [record] = [r for r in caplog.records if "training" in r.getMessage()]
    assert record.levelname == "INFO" and "eval.compare_with[0]: training" in record.getMessage()
    caplog.clear()
    with caplog.at_level("INFO", logger="xlipkit"):
        ensure(str(pre), "eval.compare_with[0]", fake_run)  # a final/ without metrics.json: not a finished run
    [record] = [r for r in caplog.records if "training" in r.getMessage()]
    assert record.levelname == "WARNING"


def test_find_current_looks_without_training(tiny, tmp_path):
    from finetune.training.upstream import find_current

    pre = _recipe(tmp_path / "pre.yaml", tiny, tmp_path / "runs" / "pre")
    assert find_current(str(pre), "model.init_from") is None
    assert not (tmp_path / "runs" / "pre").exists()
    folder = tmp_path / "given"
    (folder / "final").mkdir(parents=True)
    found = find_current(str(folder), "model.init_from")
    assert found.status == "folder" and found.final == folder / "final"
    with pytest.raises(PrerequisiteError, match="not found"):
        find_current(str(tmp_path / "nope.yaml"), "model.init_from")

