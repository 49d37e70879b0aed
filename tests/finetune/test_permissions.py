"""Files and folders xlipkit writes through temp names get the user's umask, not mkstemp's 0600 / mkdtemp's 0700."""

import os
import stat

import pytest


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
