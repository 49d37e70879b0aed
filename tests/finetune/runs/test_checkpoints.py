"""The one listing of checkpoints (:func:`finetune.runs.checkpoints.list_checkpoints`), which the save (the newest
kept, the superseded removed), the resume (``latest``) and the run-folder check (a resume suggested) all read."""

from __future__ import annotations

from finetune.runs.checkpoints import checkpoint_step, list_checkpoints
from tests.finetune.runs.tiny_runs import checkpoint


def test_checkpoints_are_listed_by_step_and_only_complete_ones_by_default(tmp_path):
    run = tmp_path / "run"
    for step in (10, 2, 9):
        checkpoint(run, step)
    ckpt = run / "checkpoints"
    (ckpt / "step-12").mkdir()  # its save was interrupted before train_state.json: not complete
    (ckpt / "step-14.123@host.tmp").mkdir()  # a save in progress (or killed)
    (ckpt / "step-x").mkdir()
    (ckpt / "step-3").write_text("a file, not a folder")
    (ckpt / "notes").mkdir()
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-2", "step-9", "step-10"]  # by step, not by name
    assert [p.name for p in list_checkpoints(ckpt, complete=False)] == ["step-2", "step-9", "step-10", "step-12"]
    assert [checkpoint_step(p) for p in list_checkpoints(str(ckpt))] == [2, 9, 10]
    assert list_checkpoints(tmp_path / "nothing") == [] and list_checkpoints(tmp_path / "nothing", complete=False) == []
