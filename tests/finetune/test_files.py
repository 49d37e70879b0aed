"""finetune/files.py: a folder put in place of another (``replace_dir``, what ``export`` / ``push --stage-only
--overwrite`` and the model saves use)."""

from __future__ import annotations

from finetune.files import replace_dir


def test_replacing_a_symbolic_link_leaves_no_stale_link_and_keeps_what_it_pointed_to(tmp_path):
    """Issue 40: ``--overwrite`` onto a link left a stale ``.explink.old-*`` link beside the new folder."""
    pointed = tmp_path / "pointed"
    pointed.mkdir()
    (pointed / "kept.txt").write_text("kept")
    for name, link_to in (("explink", pointed), ("dangling", tmp_path / "nowhere")):
        link = tmp_path / name
        link.symlink_to(link_to)
        new = tmp_path / f"new-{name}"
        new.mkdir()
        (new / "written.txt").write_text("new")
        replace_dir(new, link)
        assert not link.is_symlink() and (link / "written.txt").read_text() == "new"
    assert (pointed / "kept.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "explink", "pointed"]
