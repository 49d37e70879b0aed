"""``xlipkit export`` and ``xlipkit push --stage-only`` never delete what they were given: an output that is, holds or
lies inside the run (paths resolved, symbolic links followed) is refused, with or without ``--overwrite``, and
``--overwrite`` replaces only a folder that the same command wrote before (its marker file), never a folder of the
user's, of the other command, or one holding a run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from finetune.cli.hub import main
from finetune.hub import export, stage_upload
from finetune.hub.upload import MARKER_NAME
from tests.finetune.hub.hub_runs import make_run, snapshot

REPO_ID = "me/tiny-clip-long"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``runs/a`` (a LoRA run over ``tiny-clip``) and ``runs/b`` (another run beside it)."""
    root = tmp_path_factory.mktemp("project") / "runs"
    make_run(root / "a", "tiny-clip", "lora")
    make_run(root / "b", "tiny-clip", "lora", seed=1)
    return root


def _export(run: Path, out: Path, *extra: str) -> list[str]:
    return ["export", str(run), str(out), *extra]


def _stage(run: Path, out: Path, *extra: str) -> list[str]:
    return ["push", str(run), "--repo-id", REPO_ID, "--stage-only", str(out), *extra]


@pytest.mark.parametrize("command", [_export, _stage], ids=["export", "stage-only"])
@pytest.mark.parametrize("where", ["the run", "its final/", "the runs folder", "a new folder inside the run",
                                   "a link to the run", "a link to runs/", "the model folder given as source"])
def test_an_output_that_is_holds_or_lies_inside_the_source_is_refused(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture, command, where: str,
) -> None:
    run = runs / "a"
    source, out = {
        "the run": (run, run),
        "its final/": (run, run / "final"),
        "the runs folder": (run, runs),
        "a new folder inside the run": (run, run / "exported"),
        "a link to the run": (run, tmp_path / "link-to-run"),
        "a link to runs/": (run, tmp_path / "link-to-runs"),
        "the model folder given as source": (run / "final", run),
    }[where]
    (tmp_path / "link-to-run").symlink_to(run, target_is_directory=True)
    (tmp_path / "link-to-runs").symlink_to(runs, target_is_directory=True)
    before = snapshot(runs)
    for extra in ((), ("--overwrite",)):
        assert main(command(source, out, *extra)) == 2
        err = capsys.readouterr().err
        assert "the folder being read" in err and "give a folder outside it" in err, err
        assert snapshot(runs) == before  # runs/a and runs/b as they were
    assert not (run / "exported").exists()


@pytest.mark.parametrize("command", [_export, _stage], ids=["export", "stage-only"])
def test_overwrite_replaces_only_a_folder_this_command_wrote(runs: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture, command) -> None:
    run, out = runs / "a", tmp_path / "out"
    writer = "xlipkit export" if command is _export else "xlipkit push --stage-only"
    assert main(command(run, out)) == 0
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker == {"written_by": writer, "source": str(run.resolve())}
    first = snapshot(out)
    (out / "stale.txt").write_text("left from an earlier export")
    assert main(command(run, out)) == 2  # not empty, no --overwrite
    assert "not empty" in capsys.readouterr().err
    assert main(command(run, out, "--overwrite")) == 0  # this command wrote it: replaced, nothing of it kept
    assert snapshot(out).keys() == first.keys()

    # a folder of the user's (no marker), even one that looks like an export, is never replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    (mine / "notes.txt").write_text("keep me")
    assert main(command(run, mine, "--overwrite")) == 2
    assert f"holds no {MARKER_NAME}" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"

    # a marked folder that holds a run (copied or trained into it since) is never replaced
    (out / "nested").mkdir()
    make_run(out / "nested" / "run", "tiny-clip", "lora")
    held = snapshot(out)
    assert main(command(run, out, "--overwrite")) == 2
    assert "holds a run or model folder" in capsys.readouterr().err
    assert snapshot(out) == held


def test_overwrite_does_not_replace_what_the_other_command_wrote(runs: Path, tmp_path: Path) -> None:
    run = runs / "a"
    exported = export(run, tmp_path / "exported")
    staged = stage_upload(run, tmp_path / "staged", repo_id=REPO_ID)
    before = (snapshot(exported), snapshot(staged))
    with pytest.raises(FileExistsError, match="not written by xlipkit push --stage-only "
                                              r"\(xlipkit export wrote it\)"):
        stage_upload(run, exported, repo_id=REPO_ID, overwrite=True)
    with pytest.raises(FileExistsError, match=r"not written by xlipkit export \(xlipkit push --stage-only wrote it\)"):
        export(run, staged, overwrite=True)
    assert (snapshot(exported), snapshot(staged)) == before


def test_the_source_check_runs_before_the_model_loads(runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import finetune.hub.upload as upload

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(upload, "load_finetuned", no_load)
    with pytest.raises(ValueError, match="the folder being read"):
        export(runs / "a", runs, overwrite=True)
    with pytest.raises(ValueError, match="the folder being read"):
        stage_upload(runs / "a", runs / "a" / "final", repo_id=REPO_ID, merge=True, overwrite=True)
    assert os.path.isdir(runs / "a" / "final") and os.path.isdir(runs / "b" / "final")
