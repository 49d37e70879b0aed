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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from finetune.credentials import masked_credentials
from finetune.data.images import DataError
from finetune.data.spec import SourceSpec
from finetune.data.streams.remote import PipeReader, TimedFile, read_failure, with_timeouts

__all__ = ["DEFAULT_READ_TIMEOUT_S", "MAX_SHARD_URLS", "REMOTE_EXTRA", "TRUST_FLAG", "ReadPolicy", "check_commands",
           "command_refusal", "expand_urls", "failure", "is_remote", "open_shard", "shard_urls", "storage_options"]

#: the command-line flag that allows a recipe's code: ``objective.import`` modules and ``pipe:`` shard commands
TRUST_FLAG = "--trust-recipe-code"
#: ``data.read_timeout_s``'s default: the longest a remote read waits for an answer
DEFAULT_READ_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ReadPolicy:
    """How a stream's shards may be read, from the command line and the recipe (not from the data entry): it travels
    with the opened stream into every data-loader worker, and no recipe key sets ``commands``.

    Attributes:
        commands: ``pipe:`` commands may run (the user passed :data:`TRUST_FLAG`: ``Recipe.trust_code``).
        timeout_s: the longest a remote read or a ``pipe:`` command may keep a reader waiting
            (``data.read_timeout_s``).
    """

    commands: bool = False
    timeout_s: float = DEFAULT_READ_TIMEOUT_S

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
#: the packages each URL scheme needs, all in the ``remote`` extra (``pip install -e ".[remote]"``)
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
        if any(_masked_url(f) for f in files):
            raise DataError(
                f"data source {spec.name!r}: data.train.urls holds a credential masked as '***' "
                f"({next(f for f in files if _masked_url(f))}): a run wrote this recipe with the credentials of its "
                "URLs masked; give the URLs again with their credentials (data.train.urls=...), or give the "
                "credentials where the filesystem reads them")
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
    masked = masked_credentials(options, ("storage_options",))
    if masked:
        raise DataError(
            f"data.train.options.{'.'.join(map(str, masked[0]))} is '***': the credential was masked when a run wrote "
            "this recipe (recipe.yaml never holds one). Set it where the filesystem reads it (AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, ~/.aws, GOOGLE_APPLICATION_CREDENTIALS) and remove the key, or give it again on "
            "the command line (key=value)")
    return dict(options)


def _masked_url(url: str) -> bool:
    return "://***@" in url or "=***" in url


def _fsspec_open(url: str, options: dict[str, Any]) -> IO[bytes]:
    try:
        import fsspec

        return fsspec.open(url, "rb", **options).open()
    except ImportError as error:
        scheme = url.split("://", 1)[0]
        package = REMOTE_EXTRA.get(scheme, f"the fsspec filesystem for {scheme}://")
        raise DataError(f"reading {scheme}:// shards needs {package} ({error}): pip install -e '.[remote]' in the clone") \
            from None
    except TypeError as error:  # a filesystem option it does not take
        raise DataError(f"cannot open {url}: {error}; check data.train.options.storage_options") from None


def command_refusal(url: str, key: str = "data.train.urls") -> DataError:
    """The error for a ``pipe:`` command the user did not allow (:attr:`ReadPolicy.commands`), naming ``key``."""
    return DataError(
        f"{key} holds a pipe: command ({url!r}), which runs in a shell on this machine; a recipe's commands (and the "
        f"modules it names) run only when you allow them on the command line: pass {TRUST_FLAG} if you wrote or "
        "checked this recipe, or give the shards as paths or URLs (s3://, https://, ...)")


def check_commands(spec: SourceSpec, policy: "ReadPolicy") -> None:
    """Refuse a stream entry whose ``urls`` or ``options.index`` is a ``pipe:`` command when the user did not allow
    the recipe's commands (``policy.commands``), before anything is read or run.

    Raises:
        DataError: naming the key, the command and :data:`TRUST_FLAG`.
    """
    if policy.commands:
        return
    urls = [] if spec.urls is None else [spec.urls] if isinstance(spec.urls, str) else list(spec.urls)
    for url in urls:
        if str(url).startswith("pipe:"):
            raise command_refusal(str(url))
    index = spec.options.get("index")
    if isinstance(index, str) and index.startswith("pipe:"):
        raise command_refusal(index, "data.train.options.index")


@contextlib.contextmanager
def open_shard(url: str, options: dict[str, Any] | None = None,
               policy: "ReadPolicy | None" = None) -> Iterator[IO[bytes]]:
    """One shard opened for binary reading: a local file, an fsspec URL (with ``options``, the filesystem's keyword
    arguments) or ``pipe:COMMAND`` (its standard output; its exit status is checked when the shard is read to its
    end). Remote reads wait at most ``policy.timeout_s`` for each answer
    (:mod:`~finetune.data.streams.remote`); a ``pipe:`` command runs only when ``policy.commands`` allows it.

    Raises:
        DataError: a URL scheme whose package is missing (naming ``pip install -e '.[remote]'``), a ``pipe:``
            command not allowed.
        OSError: the shard cannot be opened or read; a ``pipe:`` command that failed;
            :class:`~finetune.data.streams.remote.ReadTimeout` (an ``OSError``) for a read past the timeout.
    """
    policy = policy or ReadPolicy()
    if url.startswith("pipe:"):
        if not policy.commands:
            raise command_refusal(url)
        reader = PipeReader(url[len("pipe:"):], policy.timeout_s)
        finished = False
        try:
            yield reader
            finished = True
        finally:
            reader.close(check=finished)
        return
    if not is_remote(url):
        with open(_local(url), "rb") as handle:
            yield handle
        return
    options = with_timeouts(url, options or {}, policy.timeout_s)
    with TimedFile(lambda: _fsspec_open(url, options), policy.timeout_s) as handle:
        yield handle


def failure(name: str, url: str, error: BaseException, policy: "ReadPolicy | None" = None) -> DataError:
    """The error for a shard that could not be read: the source, the shard (its credentials masked) and the cause in
    words (:func:`~finetune.data.streams.remote.read_failure`: timed out, refused, TLS, not found, access denied)."""
    if isinstance(error, DataError):
        return error
    why = read_failure(error, (policy or ReadPolicy()).timeout_s) if is_remote(url) else \
        f"{type(error).__name__}: {error}"
    return DataError(f"data source {name!r}: cannot read shard {url}: {why}")
