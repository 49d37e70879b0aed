"""The set-up and run lines of the README and docs/getting-started.md hold where they are shown (issue 33): each
pinned package is the version constraints.txt pins and pyproject allows, each extra and file named exists, the
CPU-index line cannot stop the block on a machine that reaches PyPI only, every `accelerate launch`, `python
finetune/run.py` and `xlipkit` line parses with the real parsers and loads its recipe, and (slow) the install
line resolves against this environment with pip, offline."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/getting-started.md")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def _commands(page: str) -> list[str]:
    """Every shell command of the page's bash blocks: continuation lines joined, comments dropped, split at
    `&&`, `||` and `;`."""
    text = (REPO / page).read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            out += [c.strip() for c in re.split(r"&&|\|\||;", line) if c.strip()]
    return out


def _blocks(page: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (REPO / page).read_text(encoding="utf-8"), re.S)


@pytest.mark.parametrize("page", PAGES)
def test_each_pinned_package_is_the_constraint_and_within_pyproject(page):
    pins, ranges = _constraints(), {Requirement(d).name.lower(): Requirement(d) for d in PYPROJECT["project"]
                                    ["dependencies"]}
    seen = 0
    for command in _commands(page):
        if not command.startswith("pip install"):
            continue
        for word in shlex.split(command)[2:]:
            if "==" in word:
                name, version = word.split("==")
                name = name.lower()
                seen += 1
                assert pins.get(name) == version, f"{page}: `{word}` is not constraints.txt's {name}=={pins.get(name)}"
                assert Version(version) in ranges[name].specifier, f"{page}: {word} outside pyproject's {ranges[name]}"
    assert seen >= 2, f"{page} pins torch and torchvision for the CPU build"


@pytest.mark.parametrize("page", PAGES)
def test_the_extras_and_files_the_install_lines_name_exist(page):
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    installs = [shlex.split(c) for c in _commands(page) if c.startswith("pip install")]
    assert installs
    for words in installs:
        for i, word in enumerate(words):
            if word in ("-c", "-r"):
                assert (REPO / words[i + 1]).is_file(), f"{page}: {words[i + 1]} does not exist"
            if word == "-e":
                named = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", words[i + 1])
                assert named, f"{page}: `-e {words[i + 1]}` is not the clone"
                assert set((named.group(1) or "").split(",")) - {""} <= extras, f"{page}: unknown extra in {word}"


@pytest.mark.parametrize("page", PAGES)
def test_a_line_that_needs_download_pytorch_org_cannot_stop_the_block(page):
    """Where only PyPI is reachable the CPU-index line fails (`No matching distribution found for cuda-bindings`):
    it must fail fast (no retries) and hand over to the next line with a message, never end the set-up there."""
    cpu_lines = [b for b in _blocks(page) if "download.pytorch.org" in b]
    assert cpu_lines, f"{page} offers the CPU build"
    for block in cpu_lines:
        joined = block.replace("\\\n", " ")
        [line] = [x for x in joined.splitlines() if "download.pytorch.org" in x]
        assert "--retries 0" in line and "|| echo" in line, line
        after = joined.split(line, 1)[1]
        assert 'pip install -e ".[dev]" -c constraints.txt' in after, "the install goes on after the CPU line"


def _run_lines() -> list[tuple[str, list[str]]]:
    return [(page, shlex.split(c)) for page in PAGES for c in _commands(page)
            if c.startswith(("accelerate launch", "python finetune/run.py", "xlipkit "))]


@pytest.mark.slow
def test_every_run_line_parses_and_its_recipe_loads():
    """`accelerate launch ... finetune/run.py RECIPE`, `python finetune/run.py RECIPE` and `xlipkit CMD ...` as
    shown: the launcher's parser, the command's own parser, the recipe file and its overrides."""
    import importlib

    from accelerate.commands.launch import launch_command_parser

    from finetune.cli.main import COMMANDS
    from finetune.config import load_recipe

    lines = _run_lines()
    assert any(words[0] == "accelerate" for _, words in lines) and any(words[0] == "xlipkit" for _, words in lines)
    for page, words in lines:
        if words[0] == "accelerate":
            args = launch_command_parser().parse_args(words[2:])
            script, rest = args.training_script, args.training_script_args
            if args.config_file:
                assert (REPO / args.config_file).is_file(), f"{page}: {args.config_file}"
            if args.module:  # -m finetune.cli train RECIPE
                assert script == "finetune.cli", words
                words = ["xlipkit", *rest]
            else:
                assert script == "finetune/run.py" and (REPO / script).is_file(), words
                words = ["xlipkit", "train", *rest]
        elif words[0] == "python":
            words = ["xlipkit", "train", *words[2:]]
        command = COMMANDS[words[1]]
        module = importlib.import_module(command.module)
        argv = [command.subcommand, *words[2:]] if command.subcommand else list(words[2:])
        if command.fixed is not None:
            assert argv == [], f"{page}: xlipkit {words[1]} takes no arguments"
            continue
        parser = module._parser(f"xlipkit {words[1]}")
        try:
            args = parser.parse_args(argv) if command.subcommand else parser.parse_intermixed_args(argv)
        except SystemExit:
            pytest.fail(f"{page}: `{shlex.join(words)}` does not parse")
        recipe = getattr(args, "recipe", None)
        if recipe and recipe.startswith("recipes/"):
            load_recipe(REPO / recipe, list(getattr(args, "overrides", [])))


def _environment_holds_the_constraints() -> bool:
    for name, version in _constraints().items():
        try:
            if Version(metadata.version(name)).public != Version(version).public:
                return False
        except metadata.PackageNotFoundError:
            return False
    return True


@pytest.mark.slow
def test_the_install_line_resolves_against_this_environment_offline():
    """`pip install -e ".[dev]" -c constraints.txt` as the README gives it, resolved by pip with --dry-run, offline
    (--no-index, no build isolation): pyproject's ranges, its extras and constraints.txt's pins agree, and this
    environment (installed by that line) satisfies them; only the project itself would be installed."""
    if not _environment_holds_the_constraints():
        pytest.skip("this environment was not installed with -c constraints.txt")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "-e", ".[dev]", "-c", "constraints.txt"], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [would] = [x for x in proc.stdout.splitlines() if x.startswith("Would install")]
    assert would.split()[2:] == [f"xlipkit-{PYPROJECT['project']['version']}"], would
