"""Every recipe in `recipes/` validates, and runs as shipped (only its data and model size changed: fixtures in
the datasets' formats, its family's tiny model; see tests/recipes/shipped.py) for 2 steps and its evaluation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.state import AcceleratorState, GradientState

from finetune.config import RecipeError, list_recipes, load_recipe, recipe_json_schema, recipe_to_dict
from finetune.objectives import build_objective
from tests.recipes.shipped import (
    RECIPES,
    ROOT,
    STEPS,
    Project,
    allowed,
    as_shipped_overrides,
    changed_keys,
    clear_run,
    enter,
    output_dir,
)


def test_recipes_exist_and_list():
    names = [name for name, _ in list_recipes(ROOT / "recipes")]
    assert "quickstart" in names and "longclip_docci" in names
    assert all(desc for _, desc in list_recipes(ROOT / "recipes"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.train.lr > 0
    assert recipe.output.dir


@pytest.fixture(scope="module")
def recipe_schema():
    return recipe_json_schema()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_as_resolved_satisfies_the_json_schema(path, recipe_schema):
    """What editors check a recipe against (`run.py --schema`) accepts every shipped recipe."""
    jsonschema = pytest.importorskip("jsonschema")
    resolved = recipe_to_dict(load_recipe(path))
    jsonschema.Draft202012Validator(recipe_schema).validate(resolved)
    resolved["train"]["lrr"] = 1.0
    with pytest.raises(jsonschema.ValidationError, match="lrr"):
        jsonschema.Draft202012Validator(recipe_schema).validate(resolved)


@pytest.fixture(scope="session")
def project(tmp_path_factory):
    """The stand-in checkout every as-shipped run starts in (fixtures and tiny models made on first use)."""
    root = tmp_path_factory.mktemp("project")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLIPKIT_CACHE", str(root / "cache"))  # preprocessing cache: shared by the session's runs
        yield Project(root)


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_as_shipped_overrides_change_only_data_and_model(path, project):
    """The as-shipped harness changes a recipe's data paths, its model and the files it cannot have here, and
    no other key (batch size, workers, precision, steps, eval settings, term options stay as shipped)."""
    overrides = as_shipped_overrides(path, project)
    shipped, tested = recipe_to_dict(load_recipe(path)), recipe_to_dict(load_recipe(path, overrides))
    changed = changed_keys(shipped, tested)
    assert [k for k in changed if not allowed(k, path.stem)] == []
    for key in (k for k in changed if k.endswith(".size")):  # only the synthetic scenes' count
        entry = tested["data"]["train"] if key.startswith("data.") else tested["eval"]["sets"][int(key.split(".")[2])]
        assert entry["name"] == "synthetic", key
    keys = [o.partition("=")[0] for o in overrides]
    assert sorted({next(k for k in keys if c == k or c.startswith(k + ".")) for c in changed}) == sorted(keys)
    assert not allowed("train.batch_size") and not allowed("objective.terms.fcast.caption_fields")
    assert changed_keys({"a": [{"b": 1}]}, {"a": [{"b": 2}]}) == ["a.0.b"]


def _upstream(path: Path) -> list[Path]:
    """The recipes ``path`` builds on (``model.init_from``, ``eval.compare_with``) that are shipped recipes."""
    raw = yaml.safe_load(path.read_text())
    refs = [(raw.get("model") or {}).get("init_from"), *((raw.get("eval") or {}).get("compare_with") or [])]
    return [ROOT / ref for ref in refs if isinstance(ref, str) and (ROOT / ref) in RECIPES]


def _depth(path: Path) -> int:
    return 1 + max((_depth(up) for up in _upstream(path)), default=-1)


#: the recipes in the order their as-shipped runs go: the ones others build on first, so that a later run reuses
#: their (current) run folder as a user's run would, instead of training them again as its prerequisites
RUN_ORDER = sorted(RECIPES, key=lambda p: (_depth(p), p.stem))


def test_the_run_order_puts_each_recipe_after_the_recipes_it_builds_on():
    assert sorted(RUN_ORDER) == RECIPES
    for i, path in enumerate(RUN_ORDER):
        assert set(_upstream(path)) <= set(RUN_ORDER[:i]), path.stem
    quickstart = ROOT / "recipes" / "quickstart.yaml"
    assert set(_upstream(quickstart)) == {ROOT / "recipes" / "quickstart_pretrain.yaml",
                                         ROOT / "recipes" / "quickstart_finetune_clip.yaml"}


@pytest.mark.slow
@pytest.mark.parametrize("path", RUN_ORDER, ids=lambda p: p.stem)
def test_recipe_runs_as_shipped(path, project, monkeypatch, capsys):
    """Every shipped recipe, with only its data pointed at fixtures and its model at its family's tiny config,
    trains 2 steps and evaluates every set, from `finetune/run.py recipes/NAME.yaml` in a checkout. The runs it
    builds on went first (:data:`RUN_ORDER`): it reuses their run folders."""
    from finetune.cli.train import main

    overrides = as_shipped_overrides(path, project)
    out = output_dir(path, project)
    enter(monkeypatch, project)
    clear_run(out)
    _reset_accelerate()
    status = main([f"recipes/{path.name}", *overrides])
    assert status == 0, capsys.readouterr().err[-3000:]
    recipe = load_recipe(path, overrides)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == STEPS
    assert metrics["final_losses"] and all(math.isfinite(v) for v in metrics["final_losses"].values())
    # the run folder's recipe is the shipped one but for data and model
    written = recipe_to_dict(load_recipe(out / "recipe.yaml"))
    assert [k for k in changed_keys(recipe_to_dict(load_recipe(path)), written) if not allowed(k, path.stem)] == []
    ev = recipe.eval
    if ev.after:
        assert len(metrics["after"]) == len(ev.sets)
        assert all(r["n_images"] > 0 for r in metrics["after"].values())
    if ev.before:
        assert len(metrics["before"]) == len(ev.sets)
    if ev.compare_base_length:
        assert set(metrics["after_at_base_length"]) == set(metrics["after"])
        assert "What reading past 77 tokens buys" in (out / "report.md").read_text()
    assert (out / "report.md").is_file() and (out / "plots" / "loss.png").is_file()
    assert (out / "final" / "xlipkit.json").is_file()
    terms = recipe.objective.terms
    if terms.get("fastgoal") is not None:
        assert {"fastgoal/local", "fastgoal/tsl"} <= set(metrics["final_losses"])
    if terms.get("structxlip") is not None:
        assert any(k.startswith("structxlip/") for k in metrics["final_losses"])
    if terms.get("fcast") is not None:
        assert {"fcast/part", "fcast/whole"} <= set(metrics["final_losses"])
        assert (out / "plots" / "fcast_hierarchy.png").is_file() and (out / "plots" / "fcast_attention.png").is_file()
    if terms.get("flair") is not None:
        assert {"flair/tcs", "flair/mps"} <= set(metrics["final_losses"])
    if terms.get("grm") is not None:  # the GRM head is saved with the model; rSum is reported
        assert (out / "final" / "xlipkit_inference.json").is_file()
        assert all(r["rsum"] >= 0 for r in metrics["after"].values())
    if _is_stream(path):
        from finetune.data.sources import SourceSpec

        assert metrics["train_stream"]["format"] == SourceSpec.parse(recipe.data.train).name


@pytest.mark.slow
def test_fastgoal_recipe_with_an_ultralytics_detector(project, monkeypatch, capsys):
    """The route fastgoal_docci.yaml's header offers (`regions.detector=checkpoints/yolov8x.pt`): FLISM's boxes
    from an ultralytics checkpoint, the recipe otherwise as in test_recipe_runs_as_shipped."""
    from finetune.cli.train import main

    path = ROOT / "recipes" / "fastgoal_docci.yaml"
    overrides = [o for o in as_shipped_overrides(path, project) if "regions.detector" not in o]
    overrides.append(f"objective.terms.fastgoal.regions.detector={project.yolo()}")
    out = output_dir(path, project)
    enter(monkeypatch, project)
    clear_run(out)
    _reset_accelerate()
    assert main([f"recipes/{path.name}", *overrides]) == 0, capsys.readouterr().err[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"fastgoal/local", "fastgoal/tsl"} <= set(metrics["final_losses"])
    assert metrics["terms"]["fastgoal"]["flism"]["images"] == metrics["train_examples"]
    assert str(load_recipe(out / "recipe.yaml").objective.terms["fastgoal"].regions.detector).endswith("yolo.pt")


@pytest.mark.slow
def test_longclip_docci_through_accelerate_launch(project, tmp_path):
    """`accelerate launch finetune/run.py recipes/longclip_docci.yaml` on one CPU process. The subprocess
    cannot take the in-process step cap, so `train.max_steps=2` stops it: the epochs -> steps path is run by
    test_recipe_runs_as_shipped[longclip_docci]."""
    path = ROOT / "recipes" / "longclip_docci.yaml"
    out = output_dir(path, project)
    clear_run(out)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
           str(ROOT / "finetune" / "run.py"), f"recipes/{path.name}", *as_shipped_overrides(path, project),
           f"train.max_steps={STEPS}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "XLIPKIT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=project.root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["after"]) >= {"docci", "urban1k", "dci"}
    assert metrics["after"]["docci"]["n_images"] == 6  # the DOCCI test split of the fixture
    assert "Recall@K before -> after training" in proc.stdout


def _is_stream(path: Path) -> bool:
    train = (yaml.safe_load(path.read_text()).get("data") or {}).get("train")
    return isinstance(train, dict) and train.get("name") in ("webdataset", "parquet", "hub")


STREAM_RECIPES = [p for p in RECIPES if _is_stream(p)]


@pytest.mark.parametrize("path", STREAM_RECIPES, ids=lambda p: p.stem)
def test_stream_recipe_passes_the_fields_its_terms_read(path):
    """A stream recipe passes every caption field its term reads (issue 23, item 10: fcast_cc3m_recap did not,
    and its first batch raised after the pre-training evaluation); leaving fields out is a RecipeError naming
    the term's key and the fields, from the check that runs before anything slow."""
    from finetune.training.preflight import check_stream_recipe

    recipe = load_recipe(path)
    objective = build_objective(recipe.objective)
    check_stream_recipe(recipe, objective)
    reads = {name: key for term in objective.all_terms for name, key in term.example_fields().items()}
    assert reads, "a shipped stream recipe reads DreamLIP's pre-split caption fields"
    first, *rest = sorted(reads)
    with pytest.raises(RecipeError) as err:
        check_stream_recipe(load_recipe(path, [f"data.train.options.fields=[json.{first}]"]), objective)
    assert err.value.key == "data.train.options.fields"
    message = str(err.value)
    assert all(f"json.{name}" in message for name in rest) and f"json.{first}," not in message
    assert next(iter(reads.values())) in message and path.name in message


def test_a_stream_without_the_terms_fields_stops_before_anything_runs(tmp_path, capsys):
    """`finetune/run.py` exits 2 with the recipe error and writes nothing (no run folder, no evaluation)."""
    from finetune.cli.train import main

    out = tmp_path / "run"
    status = main([str(ROOT / "recipes" / "fcast_cc3m_recap.yaml"), "data.train.options={}", f"output.dir={out}"])
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    assert "recipe error" in err and "data.train.options.fields" in err and "json.longLLA_captions" in err
    assert not out.exists()


@pytest.mark.slow
def test_bad_recipe_exits_2_with_a_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("# bad\ntrain:\n  lr: 1e-3\n  batchsize: 8\n")
    proc = subprocess.run([sys.executable, str(ROOT / "finetune" / "run.py"), str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "batch_size" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(RecipeError):
        load_recipe(bad)


@pytest.mark.slow
def test_run_help_and_list(capsys):
    """`python finetune/run.py --help` as a script; `--list` through the same main, in this process."""
    from finetune.cli.train import main

    proc = subprocess.run([sys.executable, str(ROOT / "finetune" / "run.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "accelerate launch" in proc.stdout
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "quickstart" in out and "longclip_docci" in out
