"""The ``xlipkit`` console script (finetune/cli): each command is its module's command line under one name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.cli import train as train_command
from finetune.cli.main import COMMANDS, main

REPO = Path(__file__).resolve().parents[3]

# What a user types after `xlipkit CMD`: the options each command's --help must name (its module's own).
OPTIONS = {
    "train": ["recipe", "overrides", "--list", "--schema", "--trust-recipe-code"],
    "eval": ["MODEL_OR_RUN", "--sets", "--protocol", "--scorer", "--rerank-top-k", "--zeroshot", "--templates",
             "--out", "--trust-recipe-code", "--trust-recipe-imports"],
    "push": ["run_dir", "--repo-id", "--public", "--revision", "--merge", "--stage-only"],
    "export": ["run_dir", "out_dir", "--format", "--overwrite"],
    "preview": ["recipe", "overrides", "--n", "--out", "--trust-recipe-code"],
    "pairs": ["IMAGES_AND_CAPTIONS", "OUT", "--model", "--detector", "--method", "--pairs", "--weighting",
              "--no-default"],
    "superpixels": ["RECIPE", "OUT", "overrides", "--workers", "--device", "--batch-size", "--overwrite"],
    "validate": ["recipe", "overrides"],
    "download": ["recipe", "overrides", "--dry-run"],
    "copy": ["name", "dest", "--force"],
    "recipes": ["-h"],
    "schema": ["-h"],
}


def test_the_commands_are_the_documented_ones():
    assert sorted(COMMANDS) == sorted(OPTIONS)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_command_help_exits_0_under_its_xlipkit_name_and_names_its_options(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: xlipkit {name} "), out[:200]
    missing = [opt for opt in OPTIONS[name] if opt not in out]
    assert not missing, f"`xlipkit {name} --help` does not name {missing}:\n{out}"


def test_top_level_help_lists_every_command_and_no_arguments_is_a_usage_error(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert f"  {name}" in out and command.summary in out
    assert main([]) == 2
    assert "usage: xlipkit" in capsys.readouterr().err


def test_an_unknown_command_exits_2_with_the_closest_name(capsys):
    assert main(["trian", "recipes/quickstart.yaml"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'; did you mean 'train'?" in err


def test_recipes_lists_every_shipped_recipe_as_run_py_list_does(capsys):
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    shipped = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert names == shipped and "quickstart" in names
    assert train_command.main(["--list"]) == 0
    assert capsys.readouterr().out == listed


def test_schema_prints_the_recipe_json_schema(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["properties"]) >= {"model", "adapter", "data", "objective", "train", "eval", "output", "hub"}
    with pytest.raises(SystemExit) as exc:
        main(["schema", "extra"])  # takes no arguments
    assert exc.value.code == 2


@pytest.mark.parametrize("case", ["unknown_key", "missing_file", "bad_override"])
def test_train_gives_the_same_recipe_error_and_exit_status_as_run_py(case, tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    if case == "unknown_key":
        recipe.write_text("model:\n  name_or_path: tiny-clip\ntrain:\n  lrr: 1.0e-5\n")
        argv = [str(recipe)]
    elif case == "missing_file":
        argv = [str(tmp_path / "nope.yaml")]
    else:
        argv = [str(REPO / "recipes" / "quickstart.yaml"), "train.lr=-1"]
    status = main(["train", *argv])
    xlipkit_err = capsys.readouterr().err
    assert status == train_command.main(argv) == 2
    assert capsys.readouterr().err == xlipkit_err
    assert xlipkit_err.startswith("recipe error: ")
    assert {"unknown_key": "train.lrr", "missing_file": "nope.yaml", "bad_override": "train.lr"}[case] in xlipkit_err


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.parametrize("argv", [
    ["push", "runs/x", "--repo-id", "me/x", "--token", "mysecret-4f2a9c"],
    ["push", "runs/x", "--repo-id", "me/x", "--token=mysecret-4f2a9c"],
    ["export", "runs/x", "out", "--hf-token", "mysecret-4f2a9c"],
    ["train", "r.yaml", "--bogus", "hub.token=mysecret-4f2a9c"],
    ["train", "r.yaml", "--bogus", "hub={token: mysecret-4f2a9c, push: true}"],
])
def test_a_usage_error_never_echoes_a_token(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "error: unrecognized arguments: " in err
    assert "mysecret-4f2a9c" not in err and "***" in err, err


def test_python_m_finetune_cli_is_the_form_accelerate_launch_m_starts(tmp_path):
    """``accelerate launch -m finetune.cli train RECIPE`` starts ``python -m finetune.cli train RECIPE`` in each
    process: a bad recipe exits 2 with the recipe error, as ``python finetune/run.py`` does."""
    bad = tmp_path / "nope.yaml"
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", "train", str(bad)], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"recipe error: recipe file not found: {bad}"), proc.stderr


@pytest.mark.slow
def test_accelerate_launch_m_finetune_cli_train_runs_the_command_in_its_process(tmp_path):
    """The documented multi-GPU form, with one process: the child is `python -m finetune.cli train ...`, which
    stops on the bad recipe with its message; the launcher reports the child's failure as its own exit 1."""
    bad = tmp_path / "nope.yaml"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "-m", "finetune.cli", "train", str(bad)],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)
    assert f"recipe error: recipe file not found: {bad}" in proc.stderr, proc.stderr[-3000:]
    assert "'-m', 'finetune.cli', 'train'" in proc.stderr  # the launcher's report names the module it ran
    assert proc.returncode == 1


def test_the_installed_xlipkit_script(tmp_path):
    """The ``[project.scripts]`` entry, once ``pip install -e .`` has written it beside the interpreter."""
    script = shutil.which("xlipkit", path=str(Path(sys.executable).parent)) or shutil.which("xlipkit")
    if not script:
        pytest.skip(f"no installed `xlipkit` script beside {sys.executable} or on PATH (run `pip install -e .`)")
    proc = subprocess.run([script, "recipes"], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "quickstart " in proc.stdout and "structxlip_docci " in proc.stdout
    bad = tmp_path / "nope.yaml"
    proc = subprocess.run([script, "train", str(bad)], capture_output=True, text=True, env=_env(), cwd=REPO,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"recipe error: recipe file not found: {bad}"), proc.stderr


#: what no command's ``--help`` may import: the model, data and drawing libraries (`xlipkit push --help` took 18 s
#: when it imported them before parsing)
HEAVY = ("torch", "transformers", "open_clip", "accelerate", "datasets", "numpy", "PIL", "cv2", "matplotlib")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_help_parses_before_importing_the_model_libraries(name):
    """`xlipkit COMMAND --help` in a fresh interpreter: the modules it imported are counted, and none of them is a
    heavy library. A count, not seconds: the time of an import depends on the machine and its load."""
    code = ("import sys\nfrom finetune.cli.main import main\n"
            f"try:\n    main([{name!r}, '--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
            "print(len(sys.modules), heavy, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    modules, heavy = proc.stderr.strip().splitlines()[-1].split(" ", 1)
    assert heavy == "[]", f"xlipkit {name} --help imported {heavy}"
    assert int(modules) < 400, f"xlipkit {name} --help imported {modules} modules"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "preview"])
def test_overrides_are_accepted_after_options(command, tmp_path, monkeypatch):
    """`xlipkit preview RECIPE --n 8 key=value` (an override after an option) reads the override, as
    `RECIPE key=value --n 8` does."""
    import finetune.cli.preview as preview

    seen = []
    monkeypatch.setattr(preview, "preview_recipe",
                        lambda recipe, n, out, objective: seen.append((recipe, n)) or Path(out))
    monkeypatch.setattr("finetune.training.recipe.run_recipe", lambda recipe, **kw: seen.append((recipe, None)) or 0)
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    options = ["--n", "3", "--out", str(tmp_path / "p.png")] if command == "preview" else []
    for argv in ([recipe, *options, "train.lr=1.0e-5", "train.seed=7"],
                 [recipe, "train.lr=1.0e-5", *options, "train.seed=7"]):
        assert main([command, *argv]) == 0
        got, n = seen.pop()
        assert (got.train.lr, got.train.seed) == (1.0e-5, 7)
        assert n == (3 if command == "preview" else None)


def test_the_pairs_command_defaults_are_flism_own():
    """`xlipkit pairs` repeats FLISM's default detector and SAM checkpoint so that its `--help` imports no model
    code: they stay the library's."""
    from finetune.cli import pairs
    from finetune.preprocess.flism import detectors

    assert (pairs.PAPER_DETECTOR, pairs.LISM_SAM) == (detectors.PAPER_DETECTOR, detectors.LISM_SAM)
