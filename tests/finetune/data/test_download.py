"""Downloads into the datasets cache: checksums, atomic writes, extraction (file:// URLs)."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from finetune.data import download
from finetune.data.download import ChecksumError, cache_root, extract, fetch, fetch_archive
from tests.finetune.data.fixtures import make_archive, write_urban1k_fixture


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


@pytest.fixture()
def payload(tmp_path: Path) -> Path:
    path = tmp_path / "source" / "descriptions.jsonlines"
    path.parent.mkdir()
    path.write_bytes(b'{"example_id": "test_00000"}\n' * 1000)
    return path


def test_fetch_file_url_into_cache_with_matching_checksum(tmp_path, payload):
    cache = tmp_path / "cache"
    local = fetch(payload.as_uri(), _sha(payload), cache_dir=cache, desc="docci")
    assert local.read_bytes() == payload.read_bytes()
    assert local.name == "descriptions.jsonlines"
    assert cache / "downloads" in local.parents
    assert _files(cache) == [local]


def test_fetch_reuses_the_cached_file_without_downloading_again(tmp_path, payload):
    cache = tmp_path / "cache"
    first = fetch(payload.as_uri(), _sha(payload), cache_dir=cache)
    payload.unlink()  # the source is gone: a second download would fail
    assert fetch(payload.as_uri(), _sha(first), cache_dir=cache) == first


def test_checksum_mismatch_raises_and_leaves_no_file(tmp_path, payload):
    cache = tmp_path / "cache"
    wrong = "0" * 64
    with pytest.raises(ChecksumError) as error:
        fetch(payload.as_uri(), wrong, cache_dir=cache)
    message = str(error.value)
    assert payload.as_uri() in message and wrong in message and _sha(payload) in message
    assert isinstance(error.value, ValueError)
    assert _files(cache) == []


def test_cached_file_with_wrong_checksum_is_downloaded_again(tmp_path, payload):
    cache = tmp_path / "cache"
    with pytest.warns(UserWarning, match="no official checksum"):
        local = fetch(payload.as_uri(), None, cache_dir=cache)
    local.write_bytes(b"corrupted")
    again = fetch(payload.as_uri(), _sha(payload), cache_dir=cache)
    assert again == local and again.read_bytes() == payload.read_bytes()


def test_unknown_checksum_is_recorded_and_reported(tmp_path, payload):
    cache = tmp_path / "cache"
    with pytest.warns(UserWarning, match=_sha(payload)):
        local = fetch(payload.as_uri(), None, cache_dir=cache)
    assert local.with_name(local.name + ".sha256").read_text().strip() == _sha(payload)


def test_same_file_name_from_two_urls_does_not_collide(tmp_path):
    cache = tmp_path / "cache"
    first, second = tmp_path / "a" / "data.json", tmp_path / "b" / "data.json"
    for path, text in ((first, "1"), (second, "2")):
        path.parent.mkdir()
        path.write_text(text)
    one = fetch(first.as_uri(), _sha(first), cache_dir=cache)
    two = fetch(second.as_uri(), _sha(second), cache_dir=cache)
    assert one != two and one.read_text() == "1" and two.read_text() == "2"


def test_unreachable_url_and_unsupported_scheme_give_clear_errors(tmp_path):
    with pytest.raises(ConnectionError, match="missing.zip"):
        fetch((tmp_path / "missing.zip").as_uri(), None, cache_dir=tmp_path / "cache")
    assert _files(tmp_path / "cache") == []
    with pytest.raises(ValueError, match="unsupported URL"):
        fetch("ftp://example.org/x.zip", None, cache_dir=tmp_path / "cache")


def test_offline_mode_refuses_network_downloads_but_not_cached_or_local_files(
    tmp_path, payload, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConnectionError, match="HF_DATASETS_OFFLINE.*path:"):
        fetch("https://example.invalid/docci.jsonlines", None, cache_dir=tmp_path / "cache")
    assert _files(tmp_path / "cache") == []
    local = fetch(payload.as_uri(), _sha(payload), cache_dir=tmp_path / "cache")
    assert local.read_bytes() == payload.read_bytes()


def test_default_cache_is_under_the_datasets_cache(tmp_path, monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    assert cache_root() == tmp_path / "hf-datasets" / "xlipkit"
    assert cache_root(tmp_path / "mine") == tmp_path / "mine"


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_fetch_archive_extracts_once_into_a_folder(tmp_path, suffix):
    source = write_urban1k_fixture(tmp_path / "Urban1k", 3)
    archive = make_archive(source, tmp_path / f"Urban1k{suffix}")
    folder = fetch_archive(archive.as_uri(), _sha(archive), cache_dir=tmp_path / "cache")
    assert folder.name == "Urban1k"
    assert (folder / "caption" / "2.txt").read_text() == (source / "caption" / "2.txt").read_text()
    assert sorted(p.name for p in (folder / "image").iterdir()) == ["1.jpg", "2.jpg", "3.jpg"]
    (folder / "marker").write_text("kept")
    assert fetch_archive(archive.as_uri(), _sha(archive), cache_dir=tmp_path / "cache") == folder
    assert (folder / "marker").exists()  # an existing extraction is complete and reused


def test_extract_refuses_members_outside_the_folder(tmp_path):
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tarred:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 4
        tarred.addfile(info, io.BytesIO(b"evil"))
    with pytest.raises(ValueError, match="outside the folder"):
        extract(archive)
    assert not (tmp_path / "escaped.txt").exists()
    assert not (tmp_path / "evil").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_extract_rejects_unknown_suffix_and_missing_archive(tmp_path):
    plain = tmp_path / "data.json"
    plain.write_text("{}")
    with pytest.raises(ValueError, match="not a supported archive"):
        extract(plain)
    with pytest.raises(FileNotFoundError, match="nothing.zip"):
        extract(tmp_path / "nothing.zip")


def test_extract_zip_into_explicit_destination(tmp_path):
    archive = tmp_path / "x.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("inner/a.txt", "a")
    dest = extract(archive, tmp_path / "out")
    assert dest == tmp_path / "out" and (dest / "inner" / "a.txt").read_text() == "a"


def test_hub_urls_go_through_hf_hub_download_and_are_verified(tmp_path, monkeypatch, payload):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, *, repo_type=None, revision=None):
        calls.append((repo_id, filename, repo_type, revision))
        return str(payload)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    path = fetch("hf://datasets/BeichenZhang/Urban1k/Urban1k.zip", _sha(payload))
    assert path == payload
    fetch("hf://datasets/org/name@v1.0/sub/file.zip", _sha(payload))
    assert calls == [
        ("BeichenZhang/Urban1k", "Urban1k.zip", "dataset", None),
        ("org/name", "sub/file.zip", "dataset", "v1.0"),
    ]
    with pytest.raises(ChecksumError):
        fetch("hf://datasets/org/name/file.zip", "f" * 64)
    with pytest.raises(ValueError, match="hf://datasets/ORG/NAME"):
        fetch("hf://org/name", None)


def test_sha256_of_matches_hashlib(payload):
    assert download.sha256_of(payload) == _sha(payload)
