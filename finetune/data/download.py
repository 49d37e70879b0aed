"""Download benchmark files into the datasets cache, verify them, and unpack archives atomically.

Benchmarks that are not loadable from the hub (DESIGN 4, "Datasets") are fetched from their
official URLs into ``datasets.config.HF_DATASETS_CACHE / "xlipkit"``:

- :func:`fetch` streams a URL (``http(s)://``, ``file://`` or ``hf://datasets/ORG/NAME/FILE``)
  with a tqdm progress bar into a temporary file, checks its sha256 and only then moves it into
  place with ``os.replace``; a checksum mismatch raises :class:`ChecksumError` and leaves nothing behind.
- :func:`extract` unpacks a ``.tar``, ``.tar.gz``/``.tgz`` or ``.zip`` into a temporary folder and
  renames it into place, so that a present folder is always a complete one.

Where no official checksum is published, the expected sha256 is ``None``: the file's sha256 is then
computed, written next to it (``<file>.sha256``) and reported with a warning, not verified.
Concurrent processes (``accelerate launch`` with several ranks) serialise on a file lock, so only
one of them downloads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zipfile
from pathlib import Path

from filelock import FileLock
from tqdm.auto import tqdm

from finetune.files import give_user_permissions

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")


class ChecksumError(ValueError):
    """A downloaded file's sha256 differs from the expected one (nothing was kept)."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder downloads and extracted archives live in.

    Args:
        cache_dir: explicit folder; ``None`` uses ``datasets.config.HF_DATASETS_CACHE / "xlipkit"``
            (so ``HF_DATASETS_CACHE`` / ``HF_HOME`` move it).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "xlipkit"


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _target_path(url: str, root: Path, filename: str | None) -> Path:
    parsed = urllib.parse.urlparse(url)
    name = filename or Path(urllib.parse.unquote(parsed.path)).name
    if not name:
        raise ValueError(f"cannot name the download of {url!r}: pass filename=...")
    # Two URLs may end in the same file name; the URL's hash keeps them apart.
    url_key = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return root / "downloads" / url_key / name


def cached_download(url: str, *, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """Where :func:`fetch` keeps ``url`` when it is already downloaded (for ``hf://``: in the hub cache), else
    ``None``; nothing is downloaded.

    Args:
        url: as for :func:`fetch`.
        cache_dir: as for :func:`fetch`.
    """
    if url.startswith("hf://"):
        from huggingface_hub import try_to_load_from_cache

        parts = url[len("hf://"):].split("/")
        repo_type = "dataset" if parts[0] == "datasets" else "model"
        found = try_to_load_from_cache("/".join(parts[1:3]), "/".join(parts[3:]), repo_type=repo_type)
        return Path(found) if isinstance(found, str) else None
    target = _target_path(url, cache_root(cache_dir), None)
    return target if target.is_file() else None


def _verify(path: Path, expected: str | None, url: str) -> str:
    """Return ``path``'s sha256; raise :class:`ChecksumError` when it differs from ``expected``."""
    actual = sha256_of(path)
    if expected is not None and actual.lower() != expected.lower():
        raise ChecksumError(
            f"checksum mismatch for {url}: expected sha256 {expected}, got {actual}. The download "
            "was discarded; retry, or check that the URL still serves the same file (a changed "
            "upstream file needs an updated checksum)."
        )
    return actual


def _record_unverified(path: Path, actual: str, url: str) -> None:
    """Write ``<file>.sha256`` (atomically) and report a digest that nothing could verify."""
    sidecar = path.with_name(path.name + ".sha256")
    tmp = sidecar.with_name(sidecar.name + ".part")
    tmp.write_text(actual + "\n")
    os.replace(tmp, sidecar)
    warnings.warn(
        f"{url}: no official checksum is known; the downloaded file has sha256 {actual} "
        f"(recorded in {sidecar}, not verified)",
        stacklevel=3,
    )


def _stream_to(url: str, handle, desc: str) -> None:
    request = urllib.request.Request(url, headers={"User-Agent": "xlipkit"})
    try:
        response = urllib.request.urlopen(request)  # noqa: S310 - fetch checked the scheme
    except (urllib.error.URLError, OSError) as error:
        raise ConnectionError(
            f"could not download {url}: {error}. Check the network, or download the file by hand "
            "and pass its folder as `path:`"
        ) from error
    with response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc) as bar:
            for chunk in iter(lambda: response.read(CHUNK_BYTES), b""):
                handle.write(chunk)
                bar.update(len(chunk))


def _offline() -> bool:
    """True when ``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` is set (read at call time)."""
    import datasets.config

    flags = (os.environ.get("HF_DATASETS_OFFLINE", ""), os.environ.get("HF_HUB_OFFLINE", ""))
    return datasets.config.HF_DATASETS_OFFLINE or any(
        flag.strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags
    )


def _fetch_hub(url: str, sha256: str | None) -> Path:
    """``hf://datasets/ORG/NAME/FILE[@REVISION]`` through huggingface_hub (its cache, its token)."""
    from huggingface_hub import hf_hub_download

    rest = url[len("hf://") :]
    parts = rest.split("/")
    if len(parts) < 4 or parts[0] not in ("datasets", "models"):
        raise ValueError(
            f"hub URL {url!r} must look like hf://datasets/ORG/NAME/PATH/IN/REPO "
            "(or hf://models/...)"
        )
    repo_type = "dataset" if parts[0] == "datasets" else "model"
    repo_id, revision = "/".join(parts[1:3]), None
    if "@" in repo_id:
        repo_id, revision = repo_id.split("@", 1)
    path = Path(
        hf_hub_download(repo_id, "/".join(parts[3:]), repo_type=repo_type, revision=revision)
    )
    # The hub cache belongs to huggingface_hub: a mismatch is reported, its blob is left to it.
    actual = _verify(path, sha256, url)
    if sha256 is None:
        warnings.warn(
            f"{url}: no official checksum is known; the file has sha256 {actual}", stacklevel=3
        )
    return path


def fetch(
    url: str,
    sha256: str | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    desc: str | None = None,
    filename: str | None = None,
) -> Path:
    """Download ``url`` once into the cache and return the local file.

    The file is streamed with a progress bar into a temporary file in the destination folder, its
    sha256 compared with ``sha256`` and only then renamed into place (``os.replace``); on a mismatch
    or any error the temporary file is removed. A file already in the cache is returned without a
    download when it matches ``sha256`` (or when ``sha256`` is ``None``).

    Args:
        url: ``http://``, ``https://``, ``file://`` or ``hf://datasets/ORG/NAME/FILE`` (the last
            through ``huggingface_hub.hf_hub_download``, which keeps it in the hub cache).
        sha256: expected hex digest, or ``None`` when no official one is known (then the digest
            is recorded next to the file and reported with a warning, not verified).
        cache_dir: cache folder; default ``HF_DATASETS_CACHE / "xlipkit"``.
        desc: progress-bar label (default: the file name).
        filename: local file name (default: the URL's last path component).

    Returns:
        Path of the verified local file.

    Raises:
        ChecksumError: the downloaded file's sha256 differs from ``sha256``.
        ConnectionError: the URL could not be read, or offline mode (``HF_DATASETS_OFFLINE``
            / ``HF_HUB_OFFLINE``) forbids a download that is not cached.
        ValueError: unsupported URL scheme.
    """
    scheme = urllib.parse.urlparse(url).scheme
    if scheme == "hf":
        return _fetch_hub(url, sha256)
    if scheme not in ("http", "https", "file"):
        raise ValueError(f"unsupported URL {url!r}: use http(s)://, file:// or hf://datasets/...")
    target = _target_path(url, cache_root(cache_dir), filename)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.exists():
            if sha256 is None or sha256_of(target).lower() == sha256.lower():
                return target
            logger.warning("cached %s does not match the expected sha256; downloading again",
                           target)
        if scheme != "file" and _offline():
            raise ConnectionError(
                f"{url} is not in the cache ({target}) and HF_DATASETS_OFFLINE / HF_HUB_OFFLINE "
                "forbid downloads: unset them, or set the source's `path:` to a local copy"
            )
        fd, tmp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".part"
        )
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as handle:
                _stream_to(url, handle, desc or target.name)
            actual = _verify(tmp, sha256, url)
            give_user_permissions(tmp)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if sha256 is None:
            _record_unverified(target, actual, url)
    return target


def _archive_stem(archive: Path) -> str:
    name = archive.name
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise ValueError(
        f"{archive} is not a supported archive: expected a name ending in "
        f"{', '.join(ARCHIVE_SUFFIXES)}"
    )


def _unpack(archive: Path, into: Path) -> None:
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zipped:
            for member in zipped.namelist():
                resolved = (into / member).resolve()
                if not resolved.is_relative_to(into.resolve()):
                    raise ValueError(
                        f"{archive}: member {member!r} would be written outside the folder"
                    )
            zipped.extractall(into)
        return
    with tarfile.open(archive) as tarred:
        if hasattr(tarfile, "data_filter"):
            try:
                tarred.extractall(into, filter="data")
            except tarfile.FilterError as error:
                raise ValueError(
                    f"{archive}: unsafe member, it would be written outside the folder or is a "
                    f"link out of it ({error})"
                ) from error
        else:  # Python < 3.10.12 / 3.11.4: refuse members that leave the folder
            for member in tarred.getmembers():
                resolved = (into / member.name).resolve()
                if not resolved.is_relative_to(into.resolve()) or member.issym() or member.islnk():
                    raise ValueError(
                        f"{archive}: unsafe member {member.name!r}, it would be written outside "
                        "the folder or is a link"
                    )
            tarred.extractall(into)


def extract(archive: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """Unpack an archive into a folder, atomically, once.

    The archive is unpacked into a temporary sibling folder that is renamed to ``dest`` when
    complete, so an existing ``dest`` is always a full extraction (and is returned as is). Members
    that would land outside the folder (``..``, absolute paths, links) are refused.

    Args:
        archive: ``.tar``, ``.tar.gz``/``.tgz`` or ``.zip`` file.
        dest: target folder; default: next to the archive, named after it without the suffix.

    Returns:
        The folder holding the archive's content.

    Raises:
        FileNotFoundError: the archive does not exist.
        ValueError: unsupported suffix or an unsafe member.
    """
    archive = Path(archive)
    if not archive.is_file():
        raise FileNotFoundError(f"archive {archive} does not exist")
    stem = _archive_stem(archive)
    dest = Path(dest) if dest is not None else archive.with_name(stem)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if dest.is_dir():
            return dest
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part"))
        try:
            _unpack(archive, tmp)
            give_user_permissions(tmp)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def fetch_archive(
    url: str,
    sha256: str | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    desc: str | None = None,
) -> Path:
    """:func:`fetch` an archive and :func:`extract` it next to the download; returns the folder."""
    return extract(fetch(url, sha256, cache_dir=cache_dir, desc=desc))
