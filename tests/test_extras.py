"""ultralytics (AGPL-3.0) is the `regions` extra of this Apache-2.0 toolkit (issue 33): the package and every recipe
that does not use FastSAM or an ultralytics detector work without it, and one that does stops at once, before
anything slow, with the command that installs it. ultralytics is hidden in a subprocess by a meta-path finder
that refuses it (it is installed here: `dev` pulls the extra so that its own tests run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from finetune.extras import EXTRAS, MissingExtraError, has_extra, require_extra

ROOT = Path(__file__).resolve().parents[1]

#: prepended to every subprocess: ultralytics cannot be imported, as in an install without the extra
HIDE_ULTRALYTICS = textwrap.dedent("""
    import importlib.abc, sys

    class _NoUltralytics(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ultralytics" or name.startswith("ultralytics."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoUltralytics())
""")


def _run_hidden(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", HIDE_ULTRALYTICS + textwrap.dedent(code), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_pyproject_keeps_ultralytics_in_the_regions_extra_and_dev_pulls_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("ultralytics")]
    extras = project["optional-dependencies"]
    assert [d for d in extras["regions"] if d.startswith("ultralytics")]
    pulled = {name for d in extras["dev"] if d.startswith("xlipkit[")
              for name in d.removeprefix("xlipkit[").rstrip("]").split(",")}
    assert "regions" in pulled  # CI installs .[dev]: the FastSAM / YOLO tests run there
    assert set(EXTRAS) <= set(extras)
    assert project["license"] == {"text": "Apache-2.0"}
    licence = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence and "APPENDIX: How to apply the Apache License" in licence


def test_require_extra_names_the_extra_and_its_licence(monkeypatch):
    assert has_extra("regions")  # installed here
    require_extra("regions", "x")  # no error
    monkeypatch.setattr("finetune.extras.importlib.util.find_spec", lambda name: None)
    assert not has_extra("regions")
    with pytest.raises(MissingExtraError, match=r'^objective.terms.x needs ultralytics, which is not installed: '
                                                r'pip install -e "\.\[regions\]" in the clone '
                                                r'\(the `regions` extra, AGPL-3.0'):
        require_extra("regions", "objective.terms.x")
    assert issubclass(MissingExtraError, ValueError)  # a run reports it as a recipe error


@pytest.mark.slow
def test_the_package_and_recipes_without_fastsam_work_without_ultralytics():
    """Imports, recipe loading and objectives of recipes that do not use the extra, with ultralytics hidden; the
    StructXLIP and FAST-GOAL terms build without it when no FastSAM checkpoint or .pt detector is set."""
    result = _run_hidden("""
        import importlib, sys
        for name in ["finetune", "losses", "finetune.cli.train", "finetune.preprocess.regions", "finetune.preprocess.flism",
                     "finetune.objectives.structxlip", "finetune.objectives.fastgoal", "finetune.evaluation",
                     "finetune.cli.main"]:
            importlib.import_module(name)
        from finetune.config import load_recipe
        from finetune.objectives import build_objective
        for recipe in ["recipes/quickstart.yaml", "recipes/fastgoal_docci.yaml", "recipes/fastgoal_tiny_synthetic.yaml",
                       "recipes/grm_tiny_synthetic.yaml", "recipes/flair_tiny_synthetic.yaml"]:
            build_objective(load_recipe(recipe).objective)
        build_objective(load_recipe("recipes/structxlip_docci.yaml",
                                    ["objective.terms.structxlip.regions.checkpoint=null"]).objective)
        assert "ultralytics" not in sys.modules
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.slow
def test_a_recipe_that_needs_the_extra_stops_before_anything_slow():
    """structxlip_docci (FastSAM regions) and fastgoal_docci with an ultralytics detector: `finetune/run.py` exits 2
    with `recipe error:` and the install command, before any data, model or run folder (no FileNotFoundError for the
    FastSAM file the extra would read: the extra comes first)."""
    result = _run_hidden("""
        import json, sys
        from finetune.config import load_recipe
        from finetune.extras import MissingExtraError
        from finetune.objectives import build_objective
        messages = []
        for path, overrides in [("recipes/structxlip_docci.yaml", []),
                                ("recipes/fastgoal_docci.yaml", ["objective.terms.fastgoal.regions.detector=yolov8x.pt"])]:
            try:
                build_objective(load_recipe(path, overrides).objective)
            except MissingExtraError as exc:
                messages.append(str(exc))
        print(json.dumps(messages))
    """)
    assert result.returncode == 0, result.stderr
    messages = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(messages) == 2
    assert messages[0].startswith("objective.terms.structxlip.regions.checkpoint (FastSAM regions) needs ultralytics")
    assert messages[1].startswith("objective.terms.fastgoal.regions.detector (an ultralytics YOLO checkpoint) needs")
    assert all('pip install -e ".[regions]" in the clone' in m for m in messages)

    out_dir = ROOT / "runs" / "test_extras_never_written"
    run = _run_hidden("""
        import runpy, sys
        sys.argv = ["finetune/run.py", *sys.argv[1:]]
        runpy.run_path("finetune/run.py", run_name="__main__")
    """, "recipes/structxlip_docci.yaml", f"output.dir={out_dir}", timeout=120)
    assert run.returncode == 2, run.stderr
    error = run.stderr[run.stderr.index("recipe error:"):]  # every missing thing at once (training/preflight.py)
    assert 'pip install -e ".[regions]" in the clone' in error, run.stderr
    assert "Traceback" not in run.stderr
    assert not out_dir.exists()


@pytest.mark.slow
def test_the_flism_command_names_the_extra_for_an_ultralytics_detector(tmp_path):
    result = _run_hidden("""
        import sys
        from finetune.cli.pairs import main
        sys.exit(main(sys.argv[1:]))
    """, "synthetic", str(tmp_path / "pairs.jsonl"), "--detector", "yolov8x.pt", "--model", "tiny-clip", timeout=120)
    assert result.returncode == 2, result.stderr
    assert 'regions.detector: \'yolov8x.pt\' (an ultralytics YOLO checkpoint) needs ultralytics' in result.stderr
    assert 'pip install -e ".[regions]" in the clone' in result.stderr


@pytest.mark.slow
def test_the_tests_of_the_extra_skip_without_it():
    """The suite runs without the extra: the FastSAM and YOLO tests skip instead of failing."""
    result = _run_hidden("""
        import sys
        import pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-m", "not slow",
                              "tests/finetune/preprocess/test_regions.py", "tests/finetune/preprocess/flism/test_detectors.py"]))
    """, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " skipped" in result.stdout.splitlines()[-1], result.stdout[-2000:]


def test_every_install_command_shown_is_the_clone_form():
    """xlipkit is not on PyPI: no message, recipe or page says `pip install "xlipkit[NAME]"`; each says
    `pip install -e ".[NAME]"` (run in the clone)."""
    import re

    shown = re.compile(r"""pip install\s+["']?xlipkit\[""")
    files = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("recipes/*.yaml"),
             *ROOT.glob("finetune/**/*.py"), *ROOT.glob("losses/**/*.py"), *ROOT.glob("configs/**/*.yaml")]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in files
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if shown.search(line)]
    assert found == []
