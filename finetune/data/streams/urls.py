"""Where a stream's shards are and how one is opened: brace patterns (:func:`expand_urls`), the shard files of a
recipe entry (:func:`shard_urls`), and one shard opened for reading (:func:`open_shard`) from a local path, an fsspec
URL (``s3://``, ``gs://``, ``https://``, ``hf://``, ...) or a ``pipe:COMMAND`` (webdataset's way to stream through
``aws s3 cp ... -`` or ``curl -s ...``).

Credentials are never read or printed here: fsspec's filesystems take them from their usual places (botocore's
chain for ``s3://``: ``AWS_*`` variables, ``~/.aws``, instance roles; ``AWS_ENDPOINT_URL`` for another S3 server;
google-auth for ``gs://``), and ``data.train.options.storage_options`` passes options to the filesystem.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from finetune.data.images import DataError
from finetune.data.spec import SourceSpec

__all__ = ["MAX_SHARD_URLS", "REMOTE_EXTRA", "expand_urls", "is_remote", "open_shard", "shard_urls", "storage_options"]

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
#: the packages each URL scheme needs, all in ``pip install xlipkit[remote]``
#: the most shard urls a stream's patterns may expand to: 10 million, 100 billion examples at 10,000 a shard (the
#: largest public sets, LAION-5B and DataComp-12.8B, hold about 1.3 million); a range past it is refused before it is
#: expanded (``{0..99999999999}`` filled 4 GB and raised MemoryError)
MAX_SHARD_URLS = 10_000_000
REMOTE_EXTRA = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp",
                "az": "adlfs", "abfs": "adlfs"}


def expand_urls(urls: str | list[str]) -> list[str]:
    """Expand webdataset / braceexpand-style patterns into the list of shard urls.

    ``{00000..00099}`` is a numeric range (zero-padded to the width of its bounds when one starts with
    ``0``; descending when the first bound is larger), ``{a,b,c}`` alternatives; several braces in one
    pattern multiply out, left to right. A list expands each pattern in order.

    Args:
        urls: a pattern or a list of patterns (``"shards/{00000..00002}.tar"``).
    Returns:
        the urls, in order (``["shards/00000.tar", "shards/00001.tar", "shards/00002.tar"]``).
    Raises:
        DataError: an empty pattern list; patterns that expand to more than :data:`MAX_SHARD_URLS` urls (counted
            before anything is expanded).
    """
    patterns = [urls] if isinstance(urls, str) else list(urls)
    total = sum(_count_one(pattern) for pattern in patterns)
    if total > MAX_SHARD_URLS:
        raise DataError(f"data.train.urls expands to {total:,} shard urls, more than the {MAX_SHARD_URLS:,} a stream "
                        f"may list; check its brace ranges (a digit too many?): {patterns[:3]!r}")
    out: list[str] = []
    for pattern in patterns:
        out.extend(_expand_one(pattern))
    if not out:
        raise DataError("data.train.urls is empty: give a shard pattern like shards/{00000..00099}.tar")
    return out


def _count_one(pattern: str) -> int:
    """How many urls :func:`_expand_one` makes of ``pattern``, without making them."""
    match = _BRACE.search(pattern)
    if match is None:
        return 1
    body, tail = match.group(1), pattern[match.end():]
    numeric = _RANGE.match(body)
    choices = (abs(int(numeric.group(2)) - int(numeric.group(1))) + 1 if numeric
               else len(body.split(",")) if "," in body else 1)
    return choices * _count_one(tail)


def _expand_one(pattern: str) -> list[str]:
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end():]
    numeric = _RANGE.match(body)
    if numeric:
        first, last = numeric.group(1), numeric.group(2)
        a, b = int(first), int(last)
        padded = any(len(s.lstrip("-")) > 1 and s.lstrip("-").startswith("0") for s in (first, last))
        width = max(len(first), len(last)) if padded else 0
        step = 1 if b >= a else -1
        choices = [str(i).zfill(width) for i in range(a, b + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:  # not a brace expression: keep it literally
        return [head + "{" + body + "}" + rest for rest in _expand_one(tail)]
    tails = _expand_one(tail)
    return [head + choice + rest for choice in choices for rest in tails]


def is_remote(url: str) -> bool:
    """Whether ``url`` is read through fsspec or a command (``s3://``, ``https://``, ``pipe:``), not a local path."""
    return url.startswith("pipe:") or ("://" in url and not url.startswith("file://"))


def _local(url: str) -> str:
    return str(Path(url.removeprefix("file://")).expanduser())


def shard_urls(spec: SourceSpec, extension: str) -> list[str]:
    """The shard files of a webdataset / parquet stream: ``urls`` expanded (local ones checked to exist), or the files
    under ``path``.

    Raises:
        DataError: missing local shards (naming the first and how many), neither or both of urls and path.
    """
    from finetune.data.formats import _data_files

    if spec.urls is not None:
        if spec.path is not None:
            raise DataError(f"data source {spec.name!r}: set either urls or path, not both")
        files = [u if is_remote(u) else _local(u) for u in expand_urls(spec.urls)]
        missing = [f for f in files if not is_remote(f) and not Path(f).is_file()]
        if missing:
            raise DataError(
                f"data source {spec.name!r}: {len(missing)} of {len(files)} shard files do not exist (first: "
                f"{missing[0]!r}); check data.train.urls ({spec.urls!r})")
        return files
    if spec.path is None:
        raise DataError(f"data source {spec.name!r} needs urls (shard files, e.g. shards/{{00000..00099}}{extension}) "
                        "or a path (a file or a folder of them)")
    return [str(p) for p in _data_files(spec, (extension,))]


def storage_options(spec: SourceSpec) -> dict[str, Any]:
    """``data.train.options.storage_options``: keyword arguments of the fsspec filesystem (``endpoint_url``,
    ``anon``, ``client_kwargs``, ...); credentials belong in the filesystem's usual places, not in a recipe."""
    options = spec.options.get("storage_options", {}) or {}
    if not isinstance(options, dict):
        raise DataError(f"data source {spec.name!r}: options.storage_options must be a mapping of fsspec filesystem "
                        f"options (e.g. {{endpoint_url: http://127.0.0.1:9000}}), got {type(options).__name__}")
    return dict(options)


class _PipeReader:
    """The standard output of ``pipe:COMMAND`` as a read-only binary file; closing it checks the command's exit
    status (a failed ``aws s3 cp`` or ``curl`` is an error naming the command, not a short shard)."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stream = self.proc.stdout
        self.eof = False

    def read(self, n: int = -1) -> bytes:
        data = self.stream.read(n)
        if not data and n != 0:
            self.eof = True
        return data

    def seekable(self) -> bool:
        return False

    def close(self, *, check: bool = True) -> None:
        check = check and self.eof  # a reader that stopped early ends the command
        if not check and self.proc.poll() is None:
            self.proc.kill()
        self.stream.close()
        err = self.proc.stderr.read().decode("utf-8", "replace").strip()
        self.proc.stderr.close()
        status = self.proc.wait()
        if check and status != 0:
            raise OSError(f"pipe:{self.command} exited with status {status}" + (f": {err[-500:]}" if err else ""))


def _fsspec_open(url: str, options: dict[str, Any]) -> IO[bytes]:
    try:
        import fsspec

        return fsspec.open(url, "rb", **options).open()
    except ImportError as error:
        scheme = url.split("://", 1)[0]
        package = REMOTE_EXTRA.get(scheme, f"the fsspec filesystem for {scheme}://")
        raise DataError(f"reading {scheme}:// shards needs {package} ({error}): pip install 'xlipkit[remote]'") \
            from None
    except TypeError as error:  # a filesystem option it does not take
        raise DataError(f"cannot open {url}: {error}; check data.train.options.storage_options") from None


@contextlib.contextmanager
def open_shard(url: str, options: dict[str, Any] | None = None) -> Iterator[IO[bytes]]:
    """One shard opened for binary reading: a local file, an fsspec URL (with ``options``, the filesystem's keyword
    arguments) or ``pipe:COMMAND`` (its standard output; its exit status is checked when the shard is read to its
    end).

    Raises:
        DataError: a URL scheme whose package is missing (naming ``pip install 'xlipkit[remote]'``).
        OSError: the shard cannot be opened or read; a ``pipe:`` command that failed.
    """
    if url.startswith("pipe:"):
        reader = _PipeReader(url[len("pipe:"):])
        finished = False
        try:
            yield reader
            finished = True
        finally:
            reader.close(check=finished)
        return
    handle = _fsspec_open(url, options or {}) if is_remote(url) else open(_local(url), "rb")
    with handle:
        yield handle
