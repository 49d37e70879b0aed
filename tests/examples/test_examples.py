"""The examples' command lines: --help prints help (and trains nothing), every option says what it does, and the
hub round trip's schedule fits its run."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _help(script: str) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / script), "--help"], capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _options(text: str) -> dict[str, str]:
    """``{--option: its description}`` from argparse's help (a description may start on the next line)."""
    found, last = {}, None
    for line in text.splitlines():
        match = re.match(r"^\s{2}(-\w, )?(--[\w-]+)(?: \S+)?(?:\s{2,}(.*))?$", line)
        if match:
            last = match.group(2)
            found[last] = (match.group(3) or "").strip()
        elif last and line.startswith(" " * 10) and not found[last]:
            found[last] = line.strip()
        elif not line.strip():
            last = None
    return found


@pytest.mark.parametrize(("script", "options"), [
    ("losses_in_a_plain_loop.py", {"--steps", "--batch-size", "--seed"}),
    ("custom_term.py", {"--steps", "--train-size", "--eval-size", "--model", "--out"}),
    ("hub_roundtrip.py", {"--repo-id", "--stage-only", "--steps", "--adapter", "--train-size", "--eval-size",
                          "--out", "--public"}),
])
@pytest.mark.slow
def test_help_prints_every_option_with_a_description_and_trains_nothing(script, options):
    text = _help(script)
    assert text.startswith("usage: ")
    # what training prints: the plain loop's recall and step lines, a run's recall table
    assert "held-out scenes before:" not in text and not re.search(r"^step +\d+ ", text, re.M)
    assert "Recall@K before training" not in text
    described = _options(text)
    assert options <= set(described), described
    assert all(described[o] for o in options), {o: described[o] for o in options if not described[o]}


def test_the_plain_loop_takes_its_options(capsys):
    spec = importlib.util.spec_from_file_location("plain_loop_example", REPO / "examples" / "losses_in_a_plain_loop.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example._parser().parse_args(["--steps", "2", "--batch-size", "8", "--seed", "3"])
    example.main(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    out = capsys.readouterr().out
    assert "step   0" in out and "step   1" in out and "step   2" not in out and "after:" in out


@pytest.mark.parametrize("steps", [2, 20, 300])
def test_the_hub_round_trips_warm_up_fits_its_steps(steps):
    from finetune.config import load_recipe

    spec = importlib.util.spec_from_file_location("hub_roundtrip_example", REPO / "examples" / "hub_roundtrip.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example._parser().parse_args(["--stage-only", "x", "--steps", str(steps)])
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", example.recipe_overrides(args))
    assert recipe.train.max_steps == steps and recipe.train.warmup_steps <= steps // 10
    assert recipe.model.name_or_path == "random:small-clip" and recipe.model.init_from is None
