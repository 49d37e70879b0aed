"""The old module paths (issues 32 and 38): nothing in the repository uses one, and none is kept.

:data:`OLD_PATHS` is the table a maintainer updates imports with (old path -> new path). The forwarding shims of
issue 32 are deleted (issue 38): an old module does not import, and the entry points at the top of ``finetune/`` hold
no library names. The commands users type (``finetune/run.py RECIPE``,
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

#: old path -> new path (every old path is removed; no shim forwards it); the silent forwards are gone too:
#: ``finetune.models.registry``'s computed ``REGISTRY`` / ``ALIASES`` / ``FAMILY_CONFIGS`` and
#: ``finetune.training.checkpoint.resolve_resume`` (issue 38)
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
    "finetune.run_folder": "finetune.runs.folder (check_run_folder, clear_previous_run, clean_stale_temporaries, "
                           "check_eval_output), finetune.runs.lock (RunLock, lock_on_main_process), "
                           "finetune.runs.identity (continuation_view, recipe_hash, read_run_recipe, ...)",
    "finetune.resume": "finetune.runs.checkpoints (checkpoint_problem, file_manifest, ...), finetune.runs.resume "
                       "(find_checkpoint, check_continuation), finetune.runs.errors (CheckpointError)",
    "finetune.run_space": "finetune.runs.space (and check_writable)",
    "finetune.run_basics": "finetune.runs.errors (RunFolderError), finetune.runs.identity (differing_keys)",
    "finetune.training.checkpoint (list_checkpoints, stream_state_file, read_stream_states, read_stream_index, "
    "STREAM_INDEX, CHECKPOINT_PREFIX)": "finetune.runs.checkpoints",
    "finetune.training.checkpoint.resolve_resume": "finetune.runs.resume.find_checkpoint",
    "finetune.training.launch, finetune.training.failures": "finetune.training.ending",
    "finetune.models.registry (REGISTRY, ALIASES, FAMILY_CONFIGS)": "finetune.plugins.NAMED_CONFIGS (and "
                                                                   "finetune.models.registry's named_config, "
                                                                   "registry_names)",
    "finetune.training.trainer (Trainer)": "the loop is finetune.training.recipe.FinetuneRecipe.train over the parts "
                                           "of finetune.training.loop.build_loop (LoopParts); "
                                           "Trainer(acc, module, rows, collate_fn, cfg, run_dir).train() -> "
                                           "FinetuneRecipe.from_loop(build_loop(acc, module, rows, cfg, run_dir, "
                                           "collate_fn=...)).train(); Trainer.maybe_resume -> "
                                           "LoopParts.checkpoints.resume (finetune.training.checkpoint.Checkpoints)",
    "finetune.training.trainer (TrainModule, train_step, _step, _warm_up)": "finetune.training.step (TrainModule; "
                                                                           "TrainStep.__call__, .forward_backward, "
                                                                           ".warm_up)",
    "finetune.training.trainer (TrainResult)": "finetune.training.loop.TrainResult",
    "finetune.training.trainer (NonFiniteLossError, DivergedError, term_values, _read)": "finetune.training.progress "
                                                                                        "(Progress.read, .values)",
    "finetune.training.trainer (_batches, to_device, _note_skipped)": "finetune.training.batches (Batches.from_step, "
                                                                      "note_skipped; collate_stack)",
    "finetune.objectives.step_setup (StepSetup, setup_step)": "finetune.training.step_setup (setup_step(model, "
                                                              "objective, cfg, rows, device))",
    "finetune.objectives.step_setup.warmup_lengths": "finetune.objectives.shapes.BatchShapes.warmup_lengths",
    "finetune.data.streams.set_terms_epoch, StreamLoader(on_epoch=...)": "finetune.objectives.base.Objective.set_epoch "
                                                                         "(a stream's examples carry their epoch, "
                                                                         "finetune.data.collate.EPOCH_KEY, to "
                                                                         "PlannedCollate)",
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
    r"finetune[./](run_folder|resume|run_space|run_basics)\b",
    r"training[./]checkpoint import .*\b(list_checkpoints|stream_state_file|read_stream_\w+|STREAM_INDEX|"
    r"CHECKPOINT_PREFIX)\b",
    r"\bresolve_resume\b",
    r"finetune[./]training[./](launch|failures)\b",
    r"registry\.(REGISTRY|ALIASES|FAMILY_CONFIGS)\b|models\.registry import .*\b(REGISTRY|ALIASES|FAMILY_CONFIGS)\b",
    r"finetune[./]training[./]trainer\b|training import .*\bTrainer\b|\bTrainer\.\w+|\bTrainer\(",
    r"finetune[./]objectives[./]step_setup\b|\bset_terms_epoch\b|\bon_epoch=",
]
OLD = re.compile("|".join(f"(?:{p})" for p in _PATTERNS))

#: the entry points users type: files at the top of finetune/ that run a command and hold no library names (the
#: forwarding shims of issue 32 were deleted in issue 38: the project had no release that users imported them from)
ENTRY_POINTS = ("finetune/run.py", "finetune/evaluate.py", "finetune/preview.py")
EXEMPT = {"tests/test_old_paths.py", "tests/test_import_graph.py"}  # they name the old paths on purpose
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
                "from finetune.run_folder import RunLock", "finetune/resume.py", "import finetune.run_space",
                "from finetune.training.checkpoint import SaveFailedError, list_checkpoints",
                "checkpoint.resolve_resume(x)", "from finetune.training.launch import resume_command",
                "finetune/training/failures.py", "from finetune.models.registry import REGISTRY, build_model",
                "registry.FAMILY_CONFIGS", "from finetune.training.needs import recipe_needs",
                "finetune/training/prerequisites.py", "finetune.training.checks.check_room",
                "from finetune.training import Trainer", "from finetune.training import TrainModule, Trainer",
                "Trainer._step = recording", "trainer = Trainer(acc, module, rows, collate, cfg, run)",
                "from finetune.training.trainer import TrainModule", "import finetune.objectives.step_setup as s",
                "from finetune.data.streams import StreamLoader, set_terms_epoch", "StreamLoader(s, on_epoch=f)"):
        assert OLD.search(old), old
    for new in ("python -m finetune.evaluate runs/x", '[sys.executable, "-m", "finetune.evaluate", "--help"]',
                "accelerate launch finetune/run.py r.yaml",
                "python -m finetune.preview r.yaml", "from finetune.training import FinetuneRecipe, build_loop",
                "from finetune.training.step import TrainModule, TrainStep", "finetune.training.step_setup",
                "as transformers' Trainer logs its loss", "Objective.set_epoch",
                "finetune.evaluation.scorers.Scorer", "finetune/evaluation/scorers/grm.py",
                "from finetune.runs.lock import RunLock", "finetune.training.upstream",
                "from finetune.runs.resume import find_checkpoint", "finetune/runs/space.py",
                "from finetune.training.checkpoint import SaveFailedError, save_checkpoint",
                "from finetune.training.ending import stopped_or_failed",
                "finetune.training.preflight", "finetune/training/size_checks.py", "finetune.training.assets",
                "python -m finetune.hub push runs/x", "finetune.models.families.flair"):
        assert not OLD.search(new), new


@pytest.mark.parametrize("module, old", [("finetune.train", None), ("finetune.scorers", None),
                                         ("finetune.run", "RECIPES_DIR"), ("finetune.evaluate", "recall_at_k"),
                                         ("finetune.preview", "render_preview")])
def test_no_module_at_the_top_forwards_old_names(module, old):
    """The forwarding shims are gone (issue 38): an old module is not importable, an entry point holds no library
    name, and importing one warns about nothing."""
    sys.modules.pop(module, None)
    if old is None:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry = importlib.import_module(module)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    assert not hasattr(entry, old)
    assert module.replace(".", "/") + ".py" in ENTRY_POINTS


def test_the_top_of_finetune_holds_only_entry_points():
    """No forwarding, run-folder, resume or checkpoint module is left at the top of ``finetune/``."""
    top = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "finetune").glob("*.py"))
    ground = {"finetune/__init__.py", "finetune/plugins.py", "finetune/files.py", "finetune/extras.py",
              "finetune/threads.py", "finetune/credentials.py", "finetune/process_exit.py"}
    assert set(top) == ground | set(ENTRY_POINTS), top


@pytest.mark.parametrize("argv", [["finetune/run.py", "--help"], ["-m", "finetune.evaluate", "--help"],
                                  ["-m", "finetune.preview", "--help"], ["-m", "finetune.hub", "--help"],
                                  ["-m", "finetune.preprocess.flism", "--help"]])
@pytest.mark.slow
def test_the_commands_users_type_run_without_a_warning(argv):
    out = subprocess.run([sys.executable, "-W", "error::FutureWarning", *argv], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
