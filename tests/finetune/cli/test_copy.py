"""``xlipkit copy NAME [DEST]`` (issue 40): only the recipes of ``recipes/`` are copied (a NAME that is a path is
refused), a DEST that is a symbolic link is never written through (a dangling one created its target), and a DEST
that cannot be written is an error with exit status 2, not a traceback."""

from __future__ import annotations

import os

from finetune.cli import copy as copy_command
from finetune.cli.train import RECIPES_DIR
from tests.finetune.mounts import require_read_only_possible, tmpfs

SHIPPED = (RECIPES_DIR / "quickstart.yaml").read_bytes()


def test_a_name_that_is_a_path_is_refused(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.yaml").write_text("# someone's file\nsecret: 1\n")
    relative = os.path.relpath(elsewhere / "x", RECIPES_DIR)  # ../../elsewhere/x from recipes/
    for name in (relative, str(elsewhere / "x.yaml"), "../recipes/quickstart", ".hidden"):
        assert copy_command.main([name, str(tmp_path / "out.yaml")]) == 2, name
        assert "is a path, not the name of a shipped recipe" in capsys.readouterr().err
    assert not (tmp_path / "out.yaml").exists()


def test_a_symbolic_link_as_dest_is_never_written_through(tmp_path, capsys):
    dangling = tmp_path / "link.yaml"
    dangling.symlink_to(tmp_path / "nowhere" / "target.yaml")
    assert copy_command.main(["quickstart", str(dangling)]) == 2
    assert "is a symbolic link to" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()
    kept = tmp_path / "kept.yaml"
    kept.write_text("# mine\n")
    link = tmp_path / "to-kept.yaml"
    link.symlink_to(kept)
    assert copy_command.main(["quickstart", str(link)]) == 2
    assert copy_command.main(["quickstart", str(link), "--force"]) == 0  # the link is replaced, not followed
    assert kept.read_text() == "# mine\n" and not link.is_symlink() and link.read_bytes() == SHIPPED
    assert copy_command.main(["quickstart", str(dangling), "--force"]) == 0
    assert not dangling.is_symlink() and not (tmp_path / "nowhere").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_a_dest_that_cannot_be_written_is_exit_2(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    assert copy_command.main(["quickstart", str(tmp_path / "a-file" / "my.yaml")]) == 2
    err = capsys.readouterr().err
    assert "error: cannot write" in err and "Traceback" not in err
    with tmpfs(tmp_path / "ro") as folder:
        require_read_only_possible(folder)
        folder.read_only()
        assert copy_command.main(["quickstart", str(folder.path / "my.yaml")]) == 2
        assert "Read-only file system; give a DEST you can write" in capsys.readouterr().err
