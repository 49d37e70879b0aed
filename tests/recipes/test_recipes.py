"""Every recipe in `recipes/` validates, and runs a few steps on a tiny model and fixture data."""

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
from finetune.models.registry import save_tiny
from tests.finetune.data.fixtures import (
    write_coco_fixture,
    write_dci_fixture,
    write_docci_fixture,
    write_flickr30k_fixture,
    write_urban1k_fixture,
)
from tests.finetune.objectives.test_flair import DREAMLIP_FIELDS, write_dreamlip_shards

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


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


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixtures")
    return {
        "tiny-clip": save_tiny("tiny-clip", root / "tiny-clip"),
        "tiny-siglip": save_tiny("tiny-siglip", root / "tiny-siglip"),
        "docci": write_docci_fixture(root / "docci", n_train=8, n_test=6, n_qual_test=2),
        "dci": write_dci_fixture(root / "dci", n_train=3, n_valid=2, n_test=2),
        "urban1k": write_urban1k_fixture(root / "urban1k", 6),
        "tiny-flair": save_tiny("tiny-flair", root / "tiny-flair"),
        "dreamlip": write_dreamlip_shards(root / "dreamlip", fields=DREAMLIP_FIELDS),
        "flickr30k": write_flickr30k_fixture(root / "flickr30k", n_train=4, n_val=1, n_test=5),
        "coco": write_coco_fixture(root / "coco", 0, karpathy=(4, 1, 10)),
        "towers": _tiny_towers(root / "towers"),
        **_detector_fixtures(root),
    }


def _tiny_towers(folder):
    from finetune.models.vision_text import save_tiny_towers

    return save_tiny_towers(folder)


def _detector_fixtures(root: Path) -> dict:
    """Tiny random-weight detectors saved like real checkpoints: YOLOS (FAST-GOAL's FLISM), an ultralytics YOLO
    and a FastSAM-style segmenter (StructXLIP's regions)."""
    import torch
    from ultralytics import YOLO

    from finetune.preprocess.regions import preserve_thread_settings
    from tests.finetune.preprocess.tiny_detectors import save_tiny_yolo, save_tiny_yolos

    torch.manual_seed(0)
    with preserve_thread_settings():
        YOLO("yolov8n-seg.yaml").save(str(root / "fastsam-random.pt"))
    return {"yolos": save_tiny_yolos(root / "yolos"), "yolo": save_tiny_yolo(root / "yolo.pt"),
            "fastsam": root / "fastsam-random.pt"}


def _fixture_set(entry, fixtures) -> dict:
    spec = {"name": entry} if isinstance(entry, str) else dict(entry)
    name = spec["name"]
    if name == "docci_fg":
        spec["path"] = str(fixtures["docci"])
    elif name == "webdataset":  # FLAIR's DreamLIP shards: local ones with the same json fields
        spec["urls"] = fixtures["dreamlip"]
    elif name in ("docci", "dci", "urban1k", "flickr30k", "coco"):
        spec["path"] = str(fixtures[name])
        if name == "docci" and spec.get("protocol") not in (None, "test", "goal"):
            spec.pop("protocol")
    elif name == "synthetic":
        spec.update(size=8, options={"image_size": 32})
    return spec


def tiny_overrides(path: Path, fixtures: dict, out_dir: Path, *, detector: str = "yolos") -> list[str]:
    """Overrides that keep a recipe's method, objective and adapter but swap in a tiny saved model, fixture
    data and a few steps (and FAST-GOAL's detector: the tiny YOLOS, or the tiny ultralytics YOLO)."""
    raw = yaml.safe_load(path.read_text())
    model_name = str(raw.get("model", {}).get("name_or_path", ""))
    tiny = fixtures["tiny-siglip"] if "siglip" in model_name.lower() else fixtures["tiny-clip"]
    if "flair" in model_name.lower():
        tiny = fixtures["tiny-flair"]
    model = [f"model.name_or_path={tiny}"]
    if raw.get("model", {}).get("family") == "vision_text":  # GRM's ViT / Swin + BERT: tiny towers as hub ids
        swin = "swin" in str(raw["model"].get("vision", "")).lower()
        model = [f"model.vision={fixtures['towers']['swin' if swin else 'vit']}",
                 f"model.text={fixtures['towers']['bert']}"]
    if raw.get("model", {}).get("family") == "fcast":  # F-CAST: the tiny registry model of its own family
        model = ["model.name_or_path=fcast-tiny"]
    train = _fixture_set(raw.get("data", {}).get("train", {"name": "synthetic"}), fixtures)
    if train["name"] == "synthetic":
        train["size"] = 16
    sets = [_fixture_set(s, fixtures) for s in raw.get("eval", {}).get("sets", [])]
    terms = (raw.get("objective") or {}).get("terms") or {}
    extra = []
    regions = (terms.get("fastgoal") or {}).get("regions") or {}
    if "fastgoal" in terms and regions.get("method", "detector") == "detector":
        extra += [f"objective.terms.fastgoal.regions.detector={fixtures[detector]}",
                  "objective.terms.fastgoal.regions.threshold=0.0", "objective.terms.fastgoal.regions.imgsz=64"]
    if "structxlip" in terms and "fastgoal" in terms:
        extra += [f"objective.terms.structxlip.regions.checkpoint={fixtures['fastsam']}",
                  "objective.terms.structxlip.regions.imgsz=64"]
    return extra + [
        *model,
        "model.dtype=null",
        f"data.train={json.dumps(train)}",
        f"eval.sets={json.dumps(sets)}",
        "eval.batch_size=8",
        "data.num_workers=0",
        "train.max_steps=2",
        f"train.batch_size={2 if train['name'] == 'dci' else 4}",  # the DCI fixture has 3 training images
        "train.accumulation_steps=1",
        "train.mixed_precision=no",
        "train.checkpoint_every=0",
        "train.trackers=[]",
        f"output.dir={out_dir}",
        "model.init_from=null",  # a start from another recipe: tests/finetune/test_prerequisites.py
        "eval.compare_with=[]",
    ] + _fcast_overrides(raw)


def _fcast_overrides(raw: dict) -> list[str]:
    """F-CAST recipes: the fixtures' plain captions, SLIC superpixels (no SFCN weights in tests)."""
    if "fcast" not in (raw.get("objective", {}).get("terms") or {}):
        return []
    out = ["objective.terms.fcast.caption_fields=null", "objective.terms.fcast.long_fields=null",
           "objective.terms.fcast.superpixels=null", "objective.terms.fcast.report_images=2"]
    if raw.get("data", {}).get("train", {}).get("name") in ("webdataset", "parquet", "hub"):  # shards: scenes
        out.append('data.train={"name": "synthetic", "size": 16, "options": {"image_size": 32}}')
    return out


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_on_tiny_model_and_fixtures(path, fixtures, tmp_path):
    from finetune.run import run

    out = tmp_path / "run"
    recipe = load_recipe(path, tiny_overrides(path, fixtures, out))
    terms = recipe.objective.terms
    if terms.get("structxlip") is not None and terms.get("fastgoal") is None:
        pytest.skip("StructXLIP recipes run end to end in tests/finetune/objectives/test_structxlip.py")
    _reset_accelerate()
    assert run(recipe) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2
    assert metrics["final_losses"] and all(math.isfinite(v) for v in metrics["final_losses"].values())
    if terms.get("fastgoal") is not None:
        assert {"fastgoal/local", "fastgoal/tsl"} <= set(metrics["final_losses"])
    assert len(metrics["after"]) == len(recipe.eval.sets)
    if recipe.eval.compare_base_length:
        assert set(metrics["after_at_base_length"]) == set(metrics["after"])
        assert "What reading past 77 tokens buys" in (out / "report.md").read_text()
    assert (out / "report.md").is_file() and (out / "plots" / "loss.png").is_file()
    assert (out / "final" / "xlipkit.json").is_file()
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["max_steps"] == 2
    if "fcast" in recipe.objective.terms:
        assert (out / "plots" / "fcast_hierarchy.png").is_file() and (out / "plots" / "fcast_attention.png").is_file()
    if "grm" in recipe.objective.terms:  # the GRM head is saved with the model; rSum is reported
        assert (out / "final" / "xlipkit_inference.json").is_file()
        assert all(r["rsum"] >= 0 for r in metrics["after"].values())


@pytest.mark.slow
def test_fastgoal_recipe_with_an_ultralytics_yolo_detector(fixtures, tmp_path):
    """FAST-GOAL's FLISM with `regions.detector: <a .pt file>` (the ultralytics path) runs a recipe end to end."""
    from finetune.run import run

    path = ROOT / "recipes" / "fastgoal_docci.yaml"
    out = tmp_path / "run"
    recipe = load_recipe(path, tiny_overrides(path, fixtures, out, detector="yolo"))
    assert str(recipe.objective.terms["fastgoal"].regions.detector).endswith("yolo.pt")
    _reset_accelerate()
    assert run(recipe) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"fastgoal/local", "fastgoal/tsl"} <= set(metrics["final_losses"])
    assert metrics["terms"]["fastgoal"]["flism"]["images"] == 8


@pytest.mark.slow
def test_longclip_docci_through_accelerate_launch(fixtures, tmp_path):
    path = ROOT / "recipes" / "longclip_docci.yaml"
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
           str(ROOT / "finetune" / "run.py"), str(path), *tiny_overrides(path, fixtures, out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["after"]) >= {"docci", "urban1k", "dci"}
    assert metrics["after"]["docci"]["n_images"] == 6  # the DOCCI test split of the fixture
    assert "Recall@K before -> after training" in proc.stdout


def test_bad_recipe_exits_2_with_a_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("# bad\ntrain:\n  lr: 1e-3\n  batchsize: 8\n")
    proc = subprocess.run([sys.executable, str(ROOT / "finetune" / "run.py"), str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "batch_size" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(RecipeError):
        load_recipe(bad)


def test_run_help_and_list():
    proc = subprocess.run([sys.executable, str(ROOT / "finetune" / "run.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "accelerate launch" in proc.stdout
    proc = subprocess.run([sys.executable, str(ROOT / "finetune" / "run.py"), "--list"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "quickstart" in proc.stdout and "longclip_docci" in proc.stdout
