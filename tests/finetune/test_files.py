"""finetune/files.py: files and folders xlipkit writes through temp names get the user's umask, not mkstemp's 0600 /
mkdtemp's 0700; a folder put in place of another (``replace_dir``, what ``export`` / ``push --stage-only
--overwrite`` and the model saves use)."""

import os
import stat

import pytest

from finetune.files import replace_dir


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_recipe_dump_preview_download_and_extract_follow_the_umask(tmp_path, umask_022):
    import tarfile

    from finetune.config import dump_recipe, load_recipe
    from finetune.data.download import extract, fetch

    recipe = dump_recipe(load_recipe("recipes/quickstart_clip.yaml"), tmp_path / "run" / "recipe.yaml")
    assert _mode(recipe) == 0o644

    payload = tmp_path / "payload.txt"
    payload.write_text("hello")
    archive = tmp_path / "src" / "data.tar"
    archive.parent.mkdir()
    with tarfile.open(archive, "w") as tar:
        tar.add(payload, arcname="data/payload.txt")
    got = fetch(archive.as_uri(), None, cache_dir=tmp_path / "cache")
    assert _mode(got) == 0o644
    folder = extract(got)
    assert _mode(folder) == 0o755


def test_apply_umask_gives_every_file_and_folder_the_umask(tmp_path):
    from finetune.files import apply_umask

    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    for name in ("model.safetensors", "sub/extra.safetensors"):
        (folder / name).write_bytes(b"x")
        os.chmod(folder / name, 0o600)  # what safetensors writes whatever the umask
    os.chmod(folder / "sub", 0o700)
    old = os.umask(0o027)
    try:
        apply_umask(folder)
    finally:
        os.umask(old)
    assert _mode(folder) == _mode(folder / "sub") == 0o750
    assert _mode(folder / "model.safetensors") == _mode(folder / "sub" / "extra.safetensors") == 0o640


@pytest.mark.slow
@pytest.mark.parametrize(("adapter", "umask", "file_mode", "dir_mode"),
                         [("full", 0o022, 0o644, 0o755), ("lora", 0o022, 0o644, 0o755), ("lora", 0o077, 0o600, 0o700)])
def test_saved_weight_files_follow_the_umask(tmp_path, adapter, umask, file_mode, dir_mode):
    from finetune.models import apply_adapter, load_model, save_finetuned

    model = load_model("tiny-clip")
    if adapter == "lora":
        apply_adapter(model, {"type": "lora", "r": 2, "alpha": 4})
    old = os.umask(umask)
    try:
        folder = save_finetuned(model, tmp_path / "final")
    finally:
        os.umask(old)
    weights = sorted(folder.rglob("*.safetensors"))
    assert weights
    assert {p.name: _mode(p) for p in folder.rglob("*") if p.is_file()} == {
        p.name: file_mode for p in folder.rglob("*") if p.is_file()}
    assert _mode(folder) == dir_mode


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
