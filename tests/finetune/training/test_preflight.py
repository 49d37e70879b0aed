"""One check before a run (finetune/training/preflight.py): `xlipkit validate R` exits 0 exactly when `xlipkit train R`
passes its checks, and `xlipkit preview R` (no run folder of its own) agrees but for `output.dir`, on every shipped
recipe and on the refused cases of docs/guides/reliability.md; a recipe's own code runs only with
`--trust-recipe-code`, and never under `validate` or `download`; `validate` prints each missing thing once; `download`
cannot fetch from a host `validate` found unreachable. In process: the run and the preview are stopped where they would
start, so nothing trains or loads."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from finetune.cli import download as download_command
from finetune.cli import preview as preview_command
from finetune.cli import train as train_command
from finetune.cli import validate as validate_command
from finetune.training import assets

REPO = Path(__file__).resolve().parents[3]
NOT_CACHED = "xlipkit-tests/never-cached-model"
SHIPPED = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _from_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # shipped recipes name recipes/..., as users run them from the clone
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assets._probes.clear()


@dataclass
class Outcome:
    """The exit status of each command on the same arguments, what it printed, and whether it got as far as the run
    (the preview) would start."""

    validate: int
    validate_text: str
    train: int
    train_text: str
    started: bool
    preview: int | None = None
    preview_text: str = ""


def _commands(monkeypatch, capsys, argv: list[str], *, trust: bool = False, preview: bool = True) -> Outcome:
    """`validate`, `train` (`--trust-recipe-code` with ``trust``) and `preview` on ``argv``; the run and the preview
    drawing are replaced by a stop that records that they were reached."""
    import logging

    import finetune.training.recipe as recipe_module

    for logger in (logging.getLogger(), logging.getLogger("xlipkit")):  # none left writing to an earlier test's stderr
        monkeypatch.setattr(logger, "handlers", [])
    reached: list[str] = []
    monkeypatch.setattr(recipe_module, "run_recipe", lambda recipe, **kw: reached.append("train") or 0)
    monkeypatch.setattr(preview_command, "preview_recipe", lambda recipe, **kw: reached.append("preview") or Path("p"))
    flags = ["--trust-recipe-code"] if trust else []
    capsys.readouterr()  # what the test printed before (fixtures made by other libraries' loggers) is not theirs
    v = validate_command.main(list(argv))
    v_out, v_err = capsys.readouterr()
    t = train_command.main([*argv, *flags])
    t_out, t_err = capsys.readouterr()
    assert (t == 0) == (reached == ["train"]), (t, reached, t_err[-2000:])
    outcome = Outcome(v, v_out + v_err, t, t_err, t == 0)
    if preview:
        outcome.preview = preview_command.main([*argv, *flags])
        outcome.preview_text = "".join(capsys.readouterr())
        assert (outcome.preview == 0) == (reached[-1:] == ["preview"]), outcome.preview_text[-2000:]
    for text in (outcome.validate_text, outcome.train_text, outcome.preview_text):
        assert "Traceback" not in text, text
    return outcome


def _tiny(folder: Path, name: str = "recipe.yaml", **sections) -> Path:
    """A tiny recipe that needs nothing from outside: a registry model with random weights, synthetic scenes."""
    recipe = {"model": {"name_or_path": "random:tiny-clip"},
              "data": {"train": {"name": "synthetic", "split": "train", "size": 8, "seed": 0,
                                 "options": {"image_size": 32}}},
              "eval": {"sets": []}, "objective": {"base": "clip"},
              "train": {"batch_size": 4, "max_steps": 2, "warmup_steps": 0, "trackers": []},
              "output": {"dir": str(folder / "run")}}
    for section, values in sections.items():
        recipe[section].update(values)
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# a tiny test recipe\n" + yaml.safe_dump(recipe))
    return path


# ---------------------------------------------------------------------------------------------- every shipped recipe
@pytest.mark.parametrize("name", SHIPPED)
def test_validate_train_and_preview_agree_on_every_shipped_recipe_offline(name, tmp_path, monkeypatch, capsys):
    """As shipped, offline, with an empty cache: the recipes that run on the embedded data (quickstart*, *tiny*)
    pass all three; every other one is refused by all three (its model, data or checkpoints are not here)."""
    argv = [f"recipes/{name}", f"data.cache_dir={tmp_path}", f"output.dir={tmp_path / 'run'}"]
    got = _commands(monkeypatch, capsys, argv)
    embedded = name.startswith("quickstart") or "tiny" in name
    assert got.validate == got.train == got.preview == (0 if embedded else 2), got
    if not embedded:
        assert "recipe error: " in got.validate_text and got.train_text.startswith("recipe error: ")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from tests.recipes.shipped import Project

    root = tmp_path_factory.mktemp("project")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLIPKIT_CACHE", str(root / "cache"))
        yield Project(root)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_on_fixtures_passes_validate_train_and_preview(name, project, monkeypatch, capsys):
    """With its data at fixtures and its model at a tiny checkpoint (tests/recipes/shipped.py, what the slow
    as-shipped runs use), every shipped recipe passes all three: the check asks only for what the run reads."""
    from tests.recipes.shipped import as_shipped_overrides, enter

    overrides = as_shipped_overrides(REPO / "recipes" / name, project)
    enter(monkeypatch, project)
    got = _commands(monkeypatch, capsys, [f"recipes/{name}", *overrides])
    assert got.validate == got.train == got.preview == 0, got


# ------------------------------------------------------------------------- the refused cases of the reliability guide
def _own_report(tmp: Path) -> list[str]:
    notes = tmp / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("my own notes\n")
    return [str(_tiny(tmp)), f"output.dir={notes}"]


def _recipe_in_its_output(tmp: Path) -> list[str]:
    return [str(_tiny(tmp, "out/recipe.yaml", output={"dir": str(tmp / "out")}))]


def _finished_run(tmp: Path) -> list[str]:
    (tmp / "run" / "final").mkdir(parents=True)
    (tmp / "run" / "metrics.json").write_text("{}")
    return [str(_tiny(tmp))]


def _large_recipe(tmp: Path) -> list[str]:
    path = _tiny(tmp)
    path.write_text(path.read_text() + "#" * (2 << 20) + "\n")
    return [str(path)]


def _many_overrides(tmp: Path) -> list[str]:
    return [str(_tiny(tmp)), *["train.lr=1e-3"] * 1_001]


def _token_in_a_bad_override(tmp: Path) -> list[str]:
    return [str(_tiny(tmp)), "hub={token: hf_planted_token_abcdef, bogus: 1}"]


def _damaged_weights(tmp: Path) -> list[str]:
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    return [str(_tiny(tmp)), f"model.name_or_path={model}"]


def _broken_link_data(tmp: Path) -> list[str]:
    (tmp / "captions.jsonl").symlink_to(tmp / "gone.jsonl")
    return [str(_tiny(tmp)), f"data.train={{name: jsonl, path: {tmp / 'captions.jsonl'}}}"]


def _shards(tmp: Path, urls: str) -> list[str]:
    return [str(_tiny(tmp)), f"data.train={{name: webdataset, urls: '{urls}'}}", "data.num_workers=0"]


def _stream_without_max_steps(tmp: Path) -> list[str]:
    from tests.recipes.shipped import write_dreamlip_webdataset

    write_dreamlip_webdataset(tmp / "shards", n_shards=2, per_shard=4)
    return [*_shards(tmp, f"{tmp}/shards/{{00000..00001}}.tar"), "train.max_steps=null", "train.epochs=1"]


def _warmup_past_the_run(tmp: Path) -> list[str]:
    return [str(_tiny(tmp)), "train.warmup_steps=1000"]


#: (setup, exit status of all three, what every refusal says); the output.dir cases are not preview's
CASES = {
    "own report as output.dir": (_own_report, 2, "holds report.md but no run"),
    "recipe kept in its output.dir": (_recipe_in_its_output, 2, "is the recipe.yaml of output.dir"),
    "finished run in output.dir": (_finished_run, 2, "holds a finished run"),
    "recipe over 1 MiB": (_large_recipe, 2, "more than the 1,048,576 a recipe may hold"),
    "over 1,000 overrides": (_many_overrides, 2, "1,001 command-line overrides"),
    "token in a bad override": (_token_in_a_bad_override, 2, "token: ***"),
    "damaged model weights": (_damaged_weights, 2, "model.safetensors: the file is empty"),
    "broken link as the data file": (_broken_link_data, 2, "captions.jsonl does not exist"),
    "shards that are not there": (lambda tmp: (tmp / "shards").mkdir() or _shards(tmp, f"{tmp}/shards/{{0..3}}.tar"),
                                  2, "4 of 4 shard files do not exist"),
    "a brace range of 10^11 shards": (lambda tmp: _shards(tmp, f"{tmp}/s-{{00000000000..99999999999}}.tar"), 2,
                                      "expands to 100,000,000,000 shard urls"),
    "a stream without train.max_steps": (_stream_without_max_steps, 2, "set train.max_steps"),
    "warm-up past the run (a warning)": (_warmup_past_the_run, 0, ""),
}
OUTPUT_CASES = {"own report as output.dir", "recipe kept in its output.dir", "finished run in output.dir"}


@pytest.mark.parametrize("case", list(CASES))
def test_validate_train_and_preview_refuse_the_same_cases(case, tmp_path, monkeypatch, capsys):
    setup, status, says = CASES[case]
    started = time.monotonic()
    got = _commands(monkeypatch, capsys, setup(tmp_path))
    assert time.monotonic() - started < 60  # refused from the recipe, not after 4 GB of shard urls
    assert got.validate == got.train == status, got
    assert got.preview == (0 if case in OUTPUT_CASES else status), got  # a preview writes no run folder
    for text in (got.validate_text, got.train_text):
        assert says in text, text[-3000:]
        assert "hf_planted_token_abcdef" not in text


def test_a_folder_another_run_writes_into_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    """One run per folder: while another process holds output.dir's lock (its owner record names it), validate and
    train refuse, naming that process, as the run's lock does (the preflight used to say the folder "holds another
    run" and suggest output.overwrite). The other processes of a launch (RANK, or SLURM_PROCID under srun) do not
    ask: their main process holds that lock for them, and they must reach the run to meet it."""
    import json
    import subprocess

    from filelock import FileLock

    from finetune.files import process_tag
    from finetune.runs.lock import LOCK_NAME, OWNER_NAME

    out = tmp_path / "run"
    out.mkdir()
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    other = subprocess.Popen(["sleep", "60"])  # the other run's process: alive, on this host
    try:
        with FileLock(str(out / LOCK_NAME)):
            (out / OWNER_NAME).write_text(json.dumps({"pid": other.pid, "host": process_tag().partition("@")[2],
                                                      "command": "finetune/run.py other.yaml"}))
            got = _commands(monkeypatch, capsys, [str(_tiny(tmp_path))])
            ranks = []
            for name in ("RANK", "SLURM_PROCID"):
                with monkeypatch.context() as env:
                    env.setenv(name, "1")
                    ranks.append(_commands(monkeypatch, capsys, [str(_tiny(tmp_path))], preview=False))
    finally:
        other.kill()
        other.wait()
    assert got.validate == got.train == 2 and got.preview == 0, got
    for text in (got.validate_text, got.train_text):
        assert f"is in use by another run: PID {other.pid} on " in text and "finetune/run.py other.yaml" in text
    assert [(r.validate, r.train) for r in ranks] == [(0, 0), (0, 0)], ranks


def test_the_shipped_shard_form_pipe_cat_passes_the_shard_check_when_trusted(tmp_path, monkeypatch, capsys):
    """`pipe:cat /abs/shard-{..}.tar` (docs/guides/scaling.md): the shards are not looked for as local files (the
    folder check of before took `pipe:cat /abs` for a folder); the command runs only with --trust-recipe-code, so
    `validate` and `train` without it refuse it naming the option, and `train` with it passes."""
    from tests.recipes.shipped import write_dreamlip_webdataset

    write_dreamlip_webdataset(tmp_path / "shards", n_shards=2, per_shard=4)
    argv = _shards(tmp_path, f"pipe:cat {tmp_path}/shards/{{00000..00001}}.tar")
    got = _commands(monkeypatch, capsys, argv, preview=False)
    assert got.validate == got.train == 2, got
    for text in (got.validate_text, got.train_text):
        assert "runs a command to read each shard" in text and "--trust-recipe-code" in text
        assert "does not exist" not in text
    trusted = _commands(monkeypatch, capsys, argv, trust=True, preview=False)
    assert trusted.train == 0 and trusted.validate == 2, trusted  # validate never runs a recipe's command


# ---------------------------------------------------------------------------------------- a recipe's own code
PLANTED = '''
from pathlib import Path
Path({marker!r}).write_text("imported")
'''


def test_a_module_a_recipe_names_is_imported_only_by_train_with_the_flag(tmp_path, monkeypatch, capsys):
    """A module of objective.import that writes a file when imported: validate, download, preview and train without
    --trust-recipe-code refuse the recipe naming the module and the option, and the file is never written; train
    with the option imports it and reaches the run."""
    module = f"planted_{os.getpid()}_{time.monotonic_ns()}"
    marker = tmp_path / "imported.txt"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{module}.py").write_text(PLANTED.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    recipe = str(_tiny(tmp_path, objective={"base": "clip", "import": [module]}))
    try:
        got = _commands(monkeypatch, capsys, [recipe])
        assert download_command.main([recipe, "--dry-run"]) == 2
        download_text = "".join(capsys.readouterr())
        assert not marker.exists() and module not in sys.modules
        assert got.validate == got.train == got.preview == 2, got
        for text in (got.validate_text, got.train_text, got.preview_text, download_text):
            assert f"would import the module '{module}', which runs its code" in text, text
            assert "pass --trust-recipe-code to `xlipkit train`" in text
        trusted = _commands(monkeypatch, capsys, [recipe], trust=True, preview=False)
        assert marker.read_text() == "imported" and trusted.train == 0
    finally:
        sys.modules.pop(module, None)


def test_the_trust_option_is_named_alike_everywhere():
    from finetune.cli.arguments import TRUST_OPTION
    from finetune.cli.evaluate import _parser as eval_parser
    from finetune.config import TRUST_FLAG, TRUST_RULE

    assert TRUST_OPTION == TRUST_FLAG and TRUST_FLAG in TRUST_RULE
    for parser in (train_command._parser(), preview_command._parser(), eval_parser()):
        assert parser.parse_args(["r.yaml", "--trust-recipe-code"]).trust_recipe_code
        assert parser.parse_args(["r.yaml", "--trust-recipe-imports"]).trust_recipe_code  # the earlier name
        assert not parser.parse_args(["r.yaml"]).trust_recipe_code
    for command in (validate_command, download_command):  # they never run a recipe's code: no option to allow it
        with pytest.raises(SystemExit):
            command._parser("x").parse_args(["r.yaml", "--trust-recipe-code"])


# ------------------------------------------------------------------------------------ what the commands print
def test_validate_prints_each_missing_thing_once(tmp_path, capsys):
    """issue 41: `xlipkit validate recipes/structxlip_docci.yaml` printed its 6 missing things twice (24 lines)."""
    assert validate_command.main(["recipes/structxlip_docci.yaml", f"data.cache_dir={tmp_path}"]) == 2
    out, err = capsys.readouterr()
    text = out + err
    whats = ["hub model openai/clip-vit-base-patch16", "docci_descriptions.jsonlines", "docci_images.tar.gz",
             "Urban1k.zip", "dci files datasets/dci", "FastSAM checkpoint checkpoints/FastSAM-x.pt"]
    assert {what: text.count(what) for what in whats} == dict.fromkeys(whats, 1), text
    assert "needs 6 things that cannot be found or fetched (listed above under `missing`)" in err


def test_download_cannot_fetch_from_a_host_validate_found_unreachable(monkeypatch, capsys):
    """issue 41: `download --dry-run` said "would fetch" from a hub `validate` had just reported unreachable (a
    closed local port here): both give the same probe answer, and download says it cannot fetch."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    argv = ["recipes/quickstart_clip.yaml", f"model.name_or_path={NOT_CACHED}"]
    assert validate_command.main(argv) == 2
    assert "http://127.0.0.1:9 cannot be reached" in "".join(capsys.readouterr())
    assert download_command.main([argv[0], "--dry-run", argv[1]]) == 0  # overrides after the option, too
    out, err = capsys.readouterr()
    assert "would fetch" not in out, out
    assert f"cannot fetch   model.name_or_path: hub model {NOT_CACHED}: not in the local hub cache and " \
           "http://127.0.0.1:9 cannot be reached" in err
    assert list(assets._probes) == ["http://127.0.0.1:9"]  # one probe, shared


def test_download_cannot_fetch_a_checkpoint_from_an_unreachable_asset_host(tmp_path, monkeypatch, capsys):
    """FastSAM's checkpoint, which `download` fetches from the ultralytics assets: not "would fetch" when that host
    does not answer (a closed local port here)."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(assets, "_ULTRALYTICS_ASSETS", "http://127.0.0.1:9/assets/releases")
    checkpoint = tmp_path / "FastSAM-x.pt"
    argv = ["recipes/quickstart_clip.yaml", "--dry-run",
            f"objective.terms={{structxlip: {{regions: {{checkpoint: {checkpoint}}}}}}}"]
    assert download_command.main(argv) == 0
    out, err = capsys.readouterr()
    assert "would fetch" not in out, out
    assert f"cannot fetch   objective.terms.structxlip.regions.checkpoint: FastSAM checkpoint {checkpoint}" in err
    assert "now http://127.0.0.1:9 cannot be reached" in err


def test_the_offline_hint_of_download_repeats_the_overrides_but_a_token(capsys):
    argv = ["recipes/quickstart_clip.yaml", f"model.name_or_path={NOT_CACHED}", "hub.token=hf_planted_token_abcdef"]
    assert download_command.main(argv) == 1
    err = capsys.readouterr().err
    assert (f"run `xlipkit download recipes/quickstart_clip.yaml model.name_or_path={NOT_CACHED}` where the network "
            "can be reached") in err
    assert "hf_planted" not in err
