"""What a recipe needs before it runs (finetune/training/assets.py, listed with the upstream runs by
finetune/training/preflight.py) and the commands over it: `xlipkit validate`, `xlipkit download`, `xlipkit copy`, and
`xlipkit train` / `preview` refusing a recipe with everything missing at once (exit 2, `recipe error:`), before any
model or dataset loads."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from finetune.cli import copy as copy_command
from finetune.cli import download as download_command
from finetune.cli import preview as preview_command
from finetune.cli import train as train_command
from finetune.cli import validate as validate_command
from finetune.config import load_recipe
from finetune.data import benchmarks
from finetune.training import assets as assets_module
from finetune.training.preflight import recipe_needs

REPO = Path(__file__).resolve().parents[3]
NOT_CACHED = "xlipkit-tests/never-cached-model"


@pytest.fixture(autouse=True)
def _from_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # shipped recipes name recipes/..., as users run them from the clone
    assets_module._probes.clear()


def _no_run(monkeypatch):
    """Anything slow (training, a model load for the preview) fails the test if it starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("a run started although the recipe misses what it needs")

    import finetune.training.recipe as recipe_module

    monkeypatch.setattr(recipe_module, "run_recipe", refuse)
    monkeypatch.setattr(preview_command, "preview_recipe", refuse)


REAL = ["recipes/structxlip_docci.yaml", f"model.name_or_path={NOT_CACHED}"]
#: every missing thing of structxlip_docci offline: the model, DOCCI (train and test), Urban-1k, DCI, FastSAM
EXPECTED_KEYS = ["model.name_or_path", "data.train, eval.sets[0]", "eval.sets[1]", "eval.sets[2].path",
                 "objective.terms.structxlip.regions.checkpoint"]


@pytest.mark.parametrize("command", [train_command, preview_command])
def test_train_and_preview_list_every_missing_thing_at_once_with_exit_2(command, monkeypatch, tmp_path, capsys):
    _no_run(monkeypatch)
    status = command.main([*REAL, f"data.cache_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("recipe error: recipes/structxlip_docci.yaml needs "), err
    assert "Traceback" not in err
    listed = [line[4:].split(": ")[0] for line in err.splitlines() if line.startswith("  - ")]
    assert sorted(set(listed)) == sorted(EXPECTED_KEYS), err
    assert "HF_HUB_OFFLINE is set" in err and "xlipkit download recipes/structxlip_docci.yaml" in err
    assert "FastSAM-x.pt" in err and "SA-1B" in err


def test_validate_lists_found_to_download_and_missing_and_exits_2_when_something_is_missing(tmp_path, capsys):
    status = validate_command.main([*REAL, f"data.cache_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert status == 2
    assert "a valid recipe" in out and "\nmissing:\n" in out and NOT_CACHED in out
    assert "recipe error: recipes/structxlip_docci.yaml needs 6 things" in err and "listed above" in err


@pytest.mark.slow
def test_validate_of_the_quickstart_needs_nothing_from_outside(capsys):
    assert validate_command.main(["recipes/quickstart.yaml"]) == 0
    out = capsys.readouterr().out
    assert "missing" not in out and "recipes/quickstart_pretrain.yaml" in out


def test_validate_reports_a_bad_recipe_as_a_recipe_error(capsys):
    assert validate_command.main(["recipes/quickstart.yaml", "train.lrr=1"]) == 2
    assert capsys.readouterr().err.startswith("recipe error: ")


def test_a_cached_hub_model_is_ready_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--xlipkit-tests--cached" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--xlipkit-tests--cached" / "refs").mkdir()
    (tmp_path / "models--xlipkit-tests--cached" / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    recipe = load_recipe("recipes/quickstart_clip.yaml", ["model.name_or_path=xlipkit-tests/cached"])
    (need,) = [n for n in recipe_needs(recipe) if n.key == "model.name_or_path"]
    assert need.state == "ready" and str(snapshot) in need.how


def test_an_unreachable_hub_fails_fast_and_says_how_to_go_offline(monkeypatch):
    """Without HF_HUB_OFFLINE and with a hub that does not answer (a closed local port), a model that is not cached
    is missing after one probe of the host, and the message names HF_HUB_OFFLINE and `xlipkit download`."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    recipe = load_recipe("recipes/quickstart_clip.yaml", [f"model.name_or_path={NOT_CACHED}"])
    (need,) = [n for n in recipe_needs(recipe) if n.key == "model.name_or_path"]
    assert need.state == "missing"
    assert "http://127.0.0.1:9 cannot be reached" in need.how
    assert "set HF_HUB_OFFLINE=1" in need.how and "xlipkit download" in need.how
    assert list(assets_module._probes) == ["http://127.0.0.1:9"]


def _urban_zip(folder: Path) -> Path:
    archive = folder / "Urban1k.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("Urban1k/caption/1.txt", "a long caption")
        z.writestr("Urban1k/image/1.jpg", b"not read here")
    return archive


def test_download_fetches_what_validate_lists_and_then_it_is_ready(monkeypatch, tmp_path, capsys):
    """Urban-1k's official file (here a file:// copy) is `download` before, fetched by `xlipkit download` into the
    cache the run reads, and `ready` after; offline flags unset, as where the network can be reached."""
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setitem(benchmarks.OFFICIAL_FILES, "urban1k", (_urban_zip(tmp_path).as_uri(), None))
    cache = tmp_path / "cache"
    argv = ["recipes/quickstart_clip.yaml", "eval.sets=[{name: urban1k}]", f"data.cache_dir={cache}"]
    before = [n for n in recipe_needs(load_recipe(argv[0], argv[1:])) if n.key == "eval.sets[0]"]
    assert [n.state for n in before] == ["download"]
    assert download_command.main(argv) == 0, capsys.readouterr().err
    assert "fetching       eval.sets[0]: urban1k: Urban1k.zip" in capsys.readouterr().out
    after = [n for n in recipe_needs(load_recipe(argv[0], argv[1:])) if n.key == "eval.sets[0]"]
    assert [n.state for n in after] == ["ready"]
    assert (Path(after[0].how.removeprefix("in the cache: ")).read_bytes()
            == (tmp_path / "Urban1k.zip").read_bytes())


def test_download_offline_only_says_what_it_would_fetch(monkeypatch, tmp_path, capsys):
    def never(*args, **kwargs):
        raise AssertionError("downloaded while HF_HUB_OFFLINE is set")

    monkeypatch.setattr(assets_module, "fetch_need", never)
    status = download_command.main([*REAL, f"data.cache_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert status == 1
    assert f"would fetch    model.name_or_path: hub model {NOT_CACHED}" in out
    assert "would fetch    objective.terms.structxlip.regions.checkpoint" in out
    assert "HF_HUB_OFFLINE" in err and "nothing was downloaded" in err
    assert "cannot fetch   eval.sets[2].path: dci files" in err  # DCI: behind the SA-1B licence
    assert download_command.main([*REAL, f"data.cache_dir={tmp_path}", "--dry-run"]) == 0


def test_copy_writes_the_shipped_recipe_and_keeps_an_existing_file(tmp_path, capsys):
    dest = tmp_path / "my.yaml"
    assert copy_command.main(["structxlip_docci", str(dest)]) == 0
    shipped = (REPO / "recipes" / "structxlip_docci.yaml").read_bytes()
    assert dest.read_bytes() == shipped
    dest.write_text("# my edits\n")
    assert copy_command.main(["structxlip_docci.yaml", str(dest)]) == 2
    assert "exists" in capsys.readouterr().err and dest.read_text() == "# my edits\n"
    assert copy_command.main(["structxlip_docci", str(dest), "--force"]) == 0
    assert dest.read_bytes() == shipped
    assert copy_command.main(["quickstart", str(tmp_path)]) == 0
    assert (tmp_path / "quickstart.yaml").read_bytes() == (REPO / "recipes" / "quickstart.yaml").read_bytes()


def test_copy_of_an_unknown_recipe_names_the_closest(tmp_path, capsys):
    assert copy_command.main(["structxlip_doci", str(tmp_path / "x.yaml")]) == 2
    assert "did you mean structxlip_docci" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()
    assert not os.listdir(tmp_path)


def test_the_needs_of_a_run_built_on_are_listed_under_its_key(tmp_path):
    """model.init_from names a recipe whose run is not there: its own missing model is listed, under that key."""
    start = tmp_path / "start.yaml"
    text = (REPO / "recipes" / "quickstart_pretrain.yaml").read_text()
    text = text.replace("name_or_path: random:small-clip", f"name_or_path: {NOT_CACHED}")
    start.write_text(text.replace("dir: runs/quickstart_pretrain", f"dir: {tmp_path / 'start_run'}"))
    recipe = load_recipe("recipes/quickstart.yaml", [f"model.init_from={start}", "eval.compare_with=[]"])
    states = {n.key: n.state for n in recipe_needs(recipe)}
    assert states == {"model.init_from": "ready", "model.init_from -> model.name_or_path": "missing"}


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_lists_its_needs_offline_and_the_embedded_ones_need_nothing(path, tmp_path):
    """As shipped, offline, with an empty cache: every need has a key, a state and what to do; the recipes that run
    on the embedded data (quickstart*, *tiny*) need nothing that is missing."""
    recipe = load_recipe(f"recipes/{path}", [f"data.cache_dir={tmp_path}"])
    needs = recipe_needs(recipe)
    assert all(n.state in ("ready", "download", "missing") and n.key and n.how for n in needs)
    missing = [n.line() for n in needs if n.state == "missing"]
    if path.startswith("quickstart") or "tiny" in path:
        assert not missing, missing
    else:
        assert missing, f"{path} as shipped needs nothing from outside? {[n.line() for n in needs]}"


def test_eval_of_a_hub_model_that_cannot_be_had_fails_at_once_naming_hf_hub_offline(monkeypatch, capsys):
    from finetune.cli import evaluate as evaluate_command

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the library stays offline: it read the flag at import
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert evaluate_command.main([NOT_CACHED, "--sets", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot load {NOT_CACHED}: not in the local hub cache and http://127.0.0.1:9 "
                          "cannot be reached"), err
    assert f"hf download {NOT_CACHED}" in err and "set HF_HUB_OFFLINE=1" in err


def test_the_runs_early_checks_and_the_missing_things_come_in_one_message(tmp_path, capsys):
    """A stream that does not pass the fields F-CAST reads (a check the run makes before anything slow) and the
    shards, sets and SFCN weights that are missing: `xlipkit validate` and `xlipkit train` report all of them."""
    argv = ["recipes/fcast_cc3m_recap.yaml", "data.train.options={}", f"data.cache_dir={tmp_path}",
            f"output.dir={tmp_path / 'run'}"]
    for command in (validate_command, train_command):
        assert command.main(argv) == 2
        out, err = capsys.readouterr()
        assert "data.train.options.fields" in err and "json.longLLA_captions" in err
        assert "objective.terms.fcast.superpixels.checkpoint: SFCN weights" in out + err
        assert "data.train.urls" in out + err
    assert not (tmp_path / "run").exists()


def test_a_fastsam_checkpoint_is_missing_for_a_run_even_online_but_download_fetches_it(tmp_path):
    """A run never downloads `regions.checkpoint` (the term wants the file), so even where the assets can be reached
    it is missing for `train`; `xlipkit download` counts it among what it fetches."""
    recipe = load_recipe(REAL[0], [*REAL[1:], f"data.cache_dir={tmp_path}"])
    needs = {n.key: n for n in recipe_needs(recipe, plan_only=True)}  # as where every host answers
    fastsam = needs["objective.terms.structxlip.regions.checkpoint"]
    assert fastsam.state == "missing" and assets_module.fetchable(fastsam)
    assert "a run does not download it" in fastsam.how
    assert needs["model.name_or_path"].state == "download" and assets_module.fetchable(needs["model.name_or_path"])
    assert not assets_module.fetchable(needs["eval.sets[2].path"])  # DCI
