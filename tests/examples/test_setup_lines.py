"""Every command the README, docs/index.md and docs/getting-started.md show in their bash blocks holds where it is
shown (issues 33 and 41): each install line installs from the clone with extras that exist and pins that are
constraints.txt's; the quickstart needs only the base install and its line is the in-process launch; the test
commands are the ones CI runs (.ci/run) and the quick subset comes first; every `accelerate launch`, `python
finetune/run.py` and `xlipkit` line parses with the real parsers and loads its recipe; every other command is one
of a known few; every relative link of the README and docs/index.md resolves in the source tree, anchors included;
the README stays short and docs/getting-started.md does not repeat it."""

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
PAGES = ("README.md", "docs/index.md", "docs/getting-started.md")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
BASE_INSTALL = "pip install -e . -c constraints.txt"
DEV_INSTALL = 'pip install -e ".[dev]" -c constraints.txt'
#: the first words of the commands these pages may show besides installs and runs, each checked below
OTHER_COMMANDS = ("python3 -m venv .venv", ". .venv/bin/activate", "echo ", "python -m pytest", "mkdocs serve",
                  "mkdocs build --strict")


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def _blocks(page: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (REPO / page).read_text(encoding="utf-8"), re.S)


def _commands(page: str) -> list[str]:
    """Every shell command of the page's bash blocks, in order: continuation lines joined, comments dropped, split
    at `&&`, `||` and `;`, leading variable assignments (`HF_HUB_OFFLINE=1 xlipkit ...`) dropped."""
    out = []
    for block in _blocks(page):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            for command in re.split(r"&&|\|\||;", line):
                command = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", command.strip())
                if command:
                    out.append(command)
    return out


def _ci_lines() -> list[str]:
    return [x.strip() for x in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
            if x.strip() and not x.startswith("#")]


# ------------------------------------------------------------------------------------------------ installs


@pytest.mark.parametrize("page", PAGES)
def test_each_pinned_package_is_the_constraint_and_within_pyproject(page):
    pins, ranges = _constraints(), {Requirement(d).name.lower(): Requirement(d) for d in PYPROJECT["project"]
                                    ["dependencies"]}
    for command in _commands(page):
        if not command.startswith("pip install"):
            continue
        for word in shlex.split(command)[2:]:
            if "==" in word:
                name, version = word.split("==")
                name = name.lower()
                assert pins.get(name) == version, f"{page}: `{word}` is not constraints.txt's {name}=={pins.get(name)}"
                assert Version(version) in ranges[name].specifier, f"{page}: {word} outside pyproject's {ranges[name]}"


@pytest.mark.parametrize("page", PAGES)
def test_every_install_line_installs_the_clone_with_extras_that_exist(page):
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    installs = [shlex.split(c) for c in _commands(page) if c.startswith("pip install")]
    assert installs, f"{page} shows no install line"
    for words in installs:
        for i, word in enumerate(words):
            if word in ("-c", "-r"):
                assert (REPO / words[i + 1]).is_file(), f"{page}: {words[i + 1]} does not exist"
            if word == "-e":
                named = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", words[i + 1])
                assert named, f"{page}: `-e {words[i + 1]}` is not the clone"
                assert set((named.group(1) or "").split(",")) - {""} <= extras, f"{page}: unknown extra in {word}"
                assert "-c" in words, f"{page}: `{shlex.join(words)}` without constraints.txt"
        if "-e" not in words:  # only the CPU build of torch is installed another way
            assert "download.pytorch.org" in " ".join(words), f"{page}: `{shlex.join(words)}` is not the clone"


@pytest.mark.parametrize("page", ("README.md", "docs/index.md"))
def test_the_set_up_is_the_base_install_then_the_in_process_quickstart(page):
    """The quickstart and every `xlipkit` command need the base install only (`dev` is for tests and docs), and the
    quickstart line is the fastest correct one: the run in the process you start, not `accelerate launch`."""
    first = _commands(page)[:4]
    assert first == ["python3 -m venv .venv", ". .venv/bin/activate", BASE_INSTALL,
                     "xlipkit train recipes/quickstart.yaml"], first


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _base_closure() -> set[str]:
    """The distributions the base install brings: pyproject's dependencies and, as installed here, theirs (extras
    left out)."""
    seen: set[str] = set()
    todo = [Requirement(d).name for d in PYPROJECT["project"]["dependencies"]]
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_the_package_imports_only_what_the_base_install_brings():
    """The quickstart and every `xlipkit` command run on the base install: every module finetune/ and losses/
    import is the standard library's, ours, or a distribution the base dependencies bring, except the extras'
    (regions: ultralytics; deepspeed; remote: aiohttp, s3fs, gcsfs), which are imported only where they run and
    asked for by finetune/extras.py and the preflight (tests/test_extras.py hides them). Checked on 2026-11-29 in a
    fresh venv with the base install: the quickstart's code path, eval, preview, copy, validate, download --dry-run."""
    import ast

    extras = {"ultralytics", "deepspeed", "aiohttp", "s3fs", "gcsfs"}
    closure, owners = _base_closure(), metadata.packages_distributions()
    outside = {}
    for path in [*(REPO / "finetune").rglob("*.py"), *(REPO / "losses").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            else:
                continue
            for name in names:
                if name in sys.stdlib_module_names or name in ("finetune", "losses", "__future__") or name in extras:
                    continue
                if not any(_canonical(d) in closure for d in owners.get(name, [])):
                    outside.setdefault(name, str(path.relative_to(REPO)))
    assert outside == {}, f"imported, but not brought by the base install: {outside}"


@pytest.mark.parametrize("page", PAGES)
def test_a_line_that_needs_download_pytorch_org_cannot_stop_the_block(page):
    """Where only PyPI is reachable the CPU-index line fails (`No matching distribution found for cuda-bindings`):
    it must fail fast (no retries) and hand over to the next line with a message, never end the set-up there."""
    for block in (b for b in _blocks(page) if "download.pytorch.org" in b):
        joined = block.replace("\\\n", " ")
        [line] = [x for x in joined.splitlines() if "download.pytorch.org" in x]
        assert "--retries 0" in line and "|| echo" in line, line
        assert BASE_INSTALL in joined.split(line, 1)[1], "the base install goes on after the CPU line"


# ------------------------------------------------------------------------------------------------ the tests


def test_the_readmes_test_commands_are_the_quick_subset_first_and_cis_own():
    """The README's test block installs `.[dev]` (as .ci/run does), shows the quick subset first and then the
    command .ci/run runs, word for word."""
    commands = _commands("README.md")
    tests = [c for c in commands if c.startswith("python -m pytest")]
    ci = _ci_lines()
    [ci_install] = [x for x in ci if x.startswith("pip install")]
    assert ci_install == DEV_INSTALL and DEV_INSTALL in commands, "README and .ci/run install the same"
    assert commands.index(DEV_INSTALL) < commands.index(tests[0])
    quick = shlex.split(tests[0])
    assert quick[quick.index("-m", 2) + 1] == "not slow", tests[0]
    assert ci[-1] in tests[1:], f".ci/run runs `{ci[-1]}`; the README shows {tests}"


@pytest.mark.parametrize("page", PAGES)
def test_every_test_and_docs_command_can_run_after_the_dev_install(page):
    """`-n N` needs pytest-xdist and `-m EXPR` names only declared markers; paths exist; mkdocs is in `dev`."""
    dev = " ".join(PYPROJECT["project"]["optional-dependencies"]["dev"])
    markers = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    for command in _commands(page):
        words = shlex.split(command)
        if command.startswith("python -m pytest"):
            if "-n" in words:
                assert "pytest-xdist" in dev
            if "-m" in words[3:]:
                expression = words[words.index("-m", 3) + 1]
                assert set(re.findall(r"\w+", expression)) - {"not", "and", "or"} <= markers, expression
            for word in words[3:]:
                if word.startswith("tests/"):
                    assert (REPO / word.split("::")[0]).exists(), f"{page}: {word}"
        elif command.startswith("mkdocs"):
            assert "mkdocs>=" in dev and (REPO / "mkdocs.yml").is_file()


@pytest.mark.parametrize("page", PAGES)
def test_every_command_shown_is_of_a_kind_these_tests_check(page):
    runs = ("accelerate launch", "python finetune/run.py", "xlipkit ", "pip install")
    for command in _commands(page):
        assert command.startswith(runs + OTHER_COMMANDS), f"{page}: `{command}` is checked by no test"


# ------------------------------------------------------------------------------------------------ run lines


def _run_lines() -> list[tuple[str, list[str]]]:
    """The run lines, with a file that an `xlipkit copy NAME DEST` line of the same page made read as the shipped
    recipe it copies."""
    lines = []
    for page in PAGES:
        copies: dict[str, str] = {}
        for command in _commands(page):
            if not command.startswith(("accelerate launch", "python finetune/run.py", "xlipkit ")):
                continue
            words = shlex.split(command)
            if words[:2] == ["xlipkit", "copy"] and len(words) > 3:
                copies[words[3]] = f"recipes/{words[2].removesuffix('.yaml')}.yaml"
            lines.append((page, [copies.get(w, w) for w in words]))
    return lines


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
        if words[1] == "copy":
            assert (REPO / "recipes" / f"{args.name.removesuffix('.yaml')}.yaml").is_file(), f"{page}: {args.name}"
        recipe = getattr(args, "recipe", None)
        if recipe and recipe.startswith("recipes/"):
            assert (REPO / recipe).is_file(), f"{page}: {recipe}"
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
@pytest.mark.parametrize("install", [BASE_INSTALL, DEV_INSTALL])
def test_the_install_lines_resolve_against_this_environment_offline(install):
    """The README's base and dev installs, resolved by pip with --dry-run, offline (--no-index, no build isolation):
    pyproject's ranges, its extras and constraints.txt's pins agree, and this environment (a dev install) satisfies
    them; only the project itself would be installed."""
    if not _environment_holds_the_constraints():
        pytest.skip("this environment was not installed with -c constraints.txt")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           *shlex.split(install)[2:]], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [would] = [x for x in proc.stdout.splitlines() if x.startswith("Would install")]
    assert would.split()[2:] == [f"xlipkit-{PYPROJECT['project']['version']}"], would


# ------------------------------------------------------------------------------------------------ the pages


def _slug(heading: str) -> str:
    """A heading's anchor as mkdocs' toc extension makes it (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", ("README.md", "docs/index.md"))
def test_every_link_resolves_in_the_source_tree(page):
    """A link a reader follows on GitHub or in an editor names a file of the clone (no page that exists only after
    `mkdocs build`), and its anchor a heading of that file."""
    path = REPO / page
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) >= 10
    for link in links:
        if re.match(r"\w+://", link):
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        assert resolved.exists(), f"{page}: {link} names no file of the clone"
        if anchor:
            assert anchor in _anchors(resolved), f"{page}: {link}: no heading `{anchor}` in {target or page}"


def test_the_readme_is_short():
    """The README is read in five minutes (issue 41: it had grown to 277 lines, 2,782 words); depth is in docs/."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150 and len(text.split()) <= 1_250


def _sentences(page: str) -> list[str]:
    text = re.sub(r"```.*?```", "", (REPO / page).read_text(encoding="utf-8"), flags=re.S)
    prose = " ".join(x for x in text.splitlines() if not x.startswith(("|", "#")))
    return [" ".join(s.split()) for s in re.split(r"(?<=[.:;])\s+", prose) if len(s.split()) >= 10]


def test_getting_started_does_not_repeat_the_readme():
    """No sentence of ten words or more of the README's prose is in docs/getting-started.md (issue 41: the page
    repeated most of the README word for word)."""
    guide = " ".join((REPO / "docs/getting-started.md").read_text(encoding="utf-8").split())
    repeated = [s for s in _sentences("README.md") if s in guide]
    assert repeated == []
