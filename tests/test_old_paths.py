"""The old module paths (issue 32): nothing in the repository uses one, and the few kept for users warn.

:data:`OLD_PATHS` is the table a maintainer updates imports with (old path -> new path). A path that users may
have imported is a shim for one release: importing it raises a ``FutureWarning`` naming the new path, and its
old names still resolve to the moved objects. The commands users type (``finetune/run.py RECIPE``,
``python -m finetune.evaluate``, ``python -m finetune.preview``, ``python -m finetune.hub push``) run without one.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: old path -> new path (removed, or a warning shim where :data:`SHIMS` lists it)
OLD_PATHS = {
    "finetune.train": "finetune.training (trainer, optim, checkpoint, signals, meter, loaders)",
    "finetune.run (run, main, RECIPES_DIR)": "finetune.training.run_recipe, finetune.cli.train",
    "finetune.throughput": "finetune.training.throughput",
    "finetune.prerequisites, finetune.training.prerequisites": "finetune.training.upstream",
    "finetune.training.needs": "finetune.training.assets (Need, model_need, fetch_need; asset_needs), "
                               "finetune.training.preflight (recipe_needs, missing_message; preflight replaces "
                               "recipe_problems)",
    "finetune.training.checks": "finetune.training.size_checks (check_batch, check_room, check_warmup), "
                                "finetune.training.preflight (check_stream_recipe)",
    "finetune.evaluate (the library)": "finetune.evaluation (retrieval, encode, sets)",
    "finetune.zeroshot": "finetune.evaluation.zeroshot",
    "finetune.report": "finetune.evaluation.report",
    "finetune.scorers": "finetune.evaluation.scorers",
    "finetune.scorers_flair": "finetune.evaluation.scorers.flair",
    "finetune.hub (the module)": "finetune.hub.upload (the package finetune.hub re-exports push, export, ...)",
    "finetune.model_card": "finetune.hub.model_card",
    "finetune.preview (the library)": "finetune.cli.preview, finetune.objectives.structxlip.preview",
    "finetune.preprocess.flism.cli, finetune.preprocess.flism.main": "finetune.cli.pairs (main)",
    "finetune.preprocess.cache": "finetune.data.cache",
    "finetune.models.frozen": "finetune.preprocess.frozen",
    "finetune.models.atomic": "finetune.files",
    "finetune.data.streams.check_stream_recipe": "finetune.training.preflight.check_stream_recipe",
    "finetune.models.encoder": "finetune.models.core.encoder",
    "finetune.models.tokens": "finetune.models.core.tokens",
    "finetune.models.spans": "finetune.models.core.spans",
    "finetune.models.hf": "finetune.models.backends.hf",
    "finetune.models.openclip": "finetune.models.backends.openclip",
    "finetune.models.pooled_tower": "finetune.models.backends.pooled_tower",
    "finetune.models.activations": "finetune.models.backends.activations",
    "finetune.models.flair": "finetune.models.families.flair",
    "finetune.models.vision_text": "finetune.models.families.vision_text",
    "finetune.models.fcast": "finetune.models.families.fcast",
    "finetune.models.loading": "finetune.models.finetuned",
}

#: how each old path is written in code, docs, recipes and embedded scripts (dotted or as a file path); the
#: commands users type are not old paths
_PATTERNS = [
    r"finetune[./]train\b(?!ing)",
    r"(?<!-m )(?<!\"-m\", \")finetune\.run\b(?!\.py)",
    r"(?<!training[./])finetune[./](throughput|prerequisites)\b",
    r"finetune[./]training[./](needs|prerequisites|checks)\b",
    r"(?<!-m )(?<!\"-m\", \")finetune\.evaluate\b",
    r"finetune/evaluate\.py",
    r"finetune[./](zeroshot|report|model_card|scorers_flair)\b",
    r"finetune[./]scorers\b",
    r"finetune/hub\.py",
    r"(?<!-m )(?<!\"-m\", \")finetune\.preview\b",
    r"finetune/preview\.py",
    r"finetune[./]preprocess[./]flism[./]cli\b",
    r"finetune[./]preprocess[./]cache\b",
    r"finetune[./]models[./](frozen|atomic)\b",
    r"streams(\.| import )check_stream_recipe",
    r"finetune[./]models[./](encoder|tokens|spans|hf|openclip|pooled_tower|activations|flair|vision_text|fcast|"
    r"loading)\b",
]
OLD = re.compile("|".join(f"(?:{p})" for p in _PATTERNS))

#: the deprecation shims (they name the old paths they stand for) -> the new path their warning names
SHIMS = {"finetune/train.py": "finetune.training", "finetune/run.py": "finetune.training.run_recipe",
         "finetune/evaluate.py": "finetune.evaluation", "finetune/preview.py": "finetune.cli.preview",
         "finetune/scorers.py": "finetune.evaluation.scorers"}
EXEMPT = {*SHIMS, "tests/test_old_paths.py", "tests/test_import_graph.py"}  # the latter puts the shims on top
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".sh")


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): every text file under the repository
        return [p for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [REPO / line for line in out.stdout.splitlines()]


def test_the_repository_uses_no_old_path():
    """Code, embedded scripts, tests, bench, examples, docs and recipes name every module by its new path."""
    found = []
    for path in _tracked_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in EXEMPT or not rel.endswith(SUFFIXES) or rel == ".ci/run" or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            match = OLD.search(line)
            if match:
                found.append(f"{rel}:{number}: {match.group(0)}  ({line.strip()[:100]})")
    assert not found, "old paths (see OLD_PATHS for the new ones):\n" + "\n".join(found)


def test_the_pattern_finds_old_paths_and_leaves_the_commands():
    for old in ("from finetune.train import Trainer", "finetune/train.py", "import finetune.run as run",
                "from finetune.run import run", "finetune.scorers.Scorer", "finetune/scorers/grm.py",
                "from finetune.evaluate import recall_at_k", "finetune.models.loading.load_model",
                "from finetune.preprocess.cache import cached_map", "finetune.report.write_json_atomic",
                "from finetune.data.streams import check_stream_recipe", "finetune/models/flair.py",
                "from finetune.training.needs import recipe_needs", "finetune/training/prerequisites.py",
                "finetune.training.checks.check_room"):
        assert OLD.search(old), old
    for new in ("python -m finetune.evaluate runs/x", '[sys.executable, "-m", "finetune.evaluate", "--help"]',
                "accelerate launch finetune/run.py r.yaml",
                "python -m finetune.preview r.yaml", "from finetune.training import Trainer",
                "finetune.evaluation.scorers.Scorer", "finetune/evaluation/scorers/grm.py",
                "from finetune.run_folder import RunLock", "finetune.training.upstream",
                "finetune.training.preflight", "finetune/training/size_checks.py", "finetune.training.assets",
                "python -m finetune.hub push runs/x", "finetune.models.families.flair"):
        assert not OLD.search(new), new


@pytest.mark.parametrize("module, names", [
    ("finetune.train", ["Trainer", "TrainModule", "build_optimizer", "StepMeter", "save_checkpoint", "StopVote",
                        "EpochShuffleSampler"]),
    ("finetune.run", ["run", "main", "RECIPES_DIR"]),
    ("finetune.evaluate", ["recall_at_k", "evaluate_sets", "format_table", "main"]),
    ("finetune.preview", ["main", "preview_recipe", "render_preview", "save_png_atomic"]),
    ("finetune.scorers", ["Scorer", "register_scorer", "get_scorer", "CosineScorer"]),
])
def test_a_shim_warns_naming_the_new_path_and_forwards_its_old_names(module, names):
    sys.modules.pop(module, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shim = importlib.import_module(module)
    new = SHIMS[module.replace(".", "/") + ".py"]
    assert [w.category for w in caught] == [FutureWarning], [str(w.message) for w in caught]
    assert new in str(caught[0].message)
    for name in names:
        value = getattr(shim, name)
        home = getattr(shim, "MOVED", {}).get(name)
        if isinstance(home, tuple):  # finetune.run: (module, new name)
            assert value is getattr(importlib.import_module(home[0]), home[1]), name
        else:
            target = importlib.import_module(home or new)
            assert value is getattr(target, name), name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        shim.nothing  # noqa: B018


@pytest.mark.parametrize("argv", [["finetune/run.py", "--help"], ["-m", "finetune.evaluate", "--help"],
                                  ["-m", "finetune.preview", "--help"], ["-m", "finetune.hub", "--help"],
                                  ["-m", "finetune.preprocess.flism", "--help"]])
@pytest.mark.slow
def test_the_commands_users_type_run_without_a_warning(argv):
    out = subprocess.run([sys.executable, "-W", "error::FutureWarning", *argv], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
