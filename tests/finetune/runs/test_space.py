"""Room for a run (:mod:`finetune.runs.space`): what a run will hold on disk at its peak, sizes as people read them,
and a folder too small for the run refused before anything is written."""

from __future__ import annotations

import pytest

from finetune.runs.space import estimate_run_bytes, size_text
from tests.finetune.mounts import require_mount, tmpfs
from tests.finetune.runs.tiny_runs import run, tiny_recipe

pytestmark = pytest.mark.usefixtures("own_log_handlers")


def test_sizes_read_in_binary_units_up_to_tib():
    assert [size_text(n) for n in (0, 1023, 1024, 1536, 5 * 2**20, 3 * 2**30 // 2, 2**40, 2048 * 2**40)] == [
        "0 bytes", "1023 bytes", "1.0 KiB", "1.5 KiB", "5.0 MiB", "1.5 GiB", "1.0 TiB", "2048.0 TiB"]


def test_estimate_run_bytes():
    full = estimate_run_bytes(model_bytes=1000, trainable_bytes=1000, trainable_numel=250, full=True,
                              checkpoints_written=5, keep=2)
    assert full["final"] == 1000 and full["checkpoint"] == 1000 + 8 * 250 and full["checkpoints"] == 3
    assert full["total"] == 3 * 3000 + 3 * 3000 // 20 + 16 * 2**20  # 3 checkpoints while the 3rd is written
    lora = estimate_run_bytes(model_bytes=1000, trainable_bytes=40, trainable_numel=10, full=False,
                              checkpoints_written=0, keep=2)
    assert lora["final"] == 40 and lora["checkpoints"] == 0 and lora["total"] == 40 + 2 + 16 * 2**20


@pytest.mark.slow
def test_no_room_for_the_run_exits_2_and_leaves_nothing(tmp_path, tiny_model, monkeypatch, capsys):
    import shutil as shutil_module

    out = tmp_path / "run"
    real = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: real(p)._replace(free=5 * 2**20))
    recipe = tiny_recipe(tmp_path, tiny_model, out, "train.checkpoint_every=1", "train.keep_checkpoints=2")
    assert run(recipe) == 2
    err = capsys.readouterr().err
    assert f"recipe error: output.dir '{out}' has 5.0 MiB free, but about" in err
    assert "(final/ " in err and " + 2 checkpoints x " in err and "Traceback" not in err
    assert not out.exists()  # nothing of the refused run stays to block the next one


@pytest.mark.slow
def test_a_small_tmpfs_is_refused_and_a_large_enough_one_is_not(tmp_path, tiny_model, capsys):
    with tmpfs(tmp_path / "small", "8m") as small:
        require_mount(small)
        out = small.path / "run"
        assert run(tiny_recipe(tmp_path, tiny_model, out)) == 2
        assert "has 8.0 MiB free, but about" in capsys.readouterr().err
        assert list(small.path.iterdir()) == []
    with tmpfs(tmp_path / "large", "96m") as large:
        out = large.path / "run"
        assert run(tiny_recipe(tmp_path, tiny_model, out, "train.checkpoint_every=1")) == 0
        assert (out / "final").is_dir() and (out / "metrics.json").is_file()
