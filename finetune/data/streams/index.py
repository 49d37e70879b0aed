"""How many samples each shard of a stream holds (:class:`ShardIndex`), the ground on which epochs are split by
samples rather than by shards.

The counts come from, in order: the index saved in the checkpoint a run resumes from (so the positions it saved keep
their meaning), ``data.train.options.index`` (a JSON file in webdataset's ``wids`` shard-index form,
``{"wids_version": 1, "shardlist": [{"url": ..., "nsamples": N}, ...]}``), or a scan made once at the start of a
run: a tar shard's headers (a seek past every member's data where the file can: local files and fsspec files; a
``pipe:`` shard is read through), a parquet shard's footer (``num_rows``). A scan also finds the tar shards that end
early (:class:`~finetune.data.streams.tar.ShardEndedEarly`): their samples before the break count, and the rest of
the shard is reported as skipped every epoch (or, with ``data.on_error: raise``, the run stops before the model
loads, naming the shard).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from finetune.credentials import mask_text
from finetune.data.images import DataError
from finetune.data.streams.tar import ShardEndedEarly, count_samples
from finetune.data.streams.remote import PipeReader, read_failure
from finetune.data.streams.urls import ReadPolicy, failure, is_remote, open_shard

__all__ = ["EpochOrder", "HEAD_BYTES", "ShardIndex", "WIDS_VERSION", "build_index", "changed_shards", "fingerprint",
           "parquet_row_groups"]

logger = logging.getLogger(__name__)

WIDS_VERSION = 1
_SCAN_THREADS = 16
#: the bytes at the start of a shard whose digest (with its size) identifies its content: a tar shard's first
#: headers and first sample, a parquet file's magic and first pages; read once per shard, never the whole of one
HEAD_BYTES = 64 << 10


def parquet_row_groups(handle: Any) -> list[int]:
    """The row counts of a parquet file's row groups (its footer only)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(handle).metadata
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


@dataclass
class ShardIndex:
    """The shards of a stream and how many samples each holds.

    Attributes:
        kind: ``webdataset`` (tar shards) or ``parquet``.
        urls: every shard, in the recipe's order.
        counts: the samples of each shard (for a broken tar shard, the whole samples before its break).
        broken: ``{url: reason}`` of the tar shards that end early.
        fingerprints: what identifies each shard's content (:func:`fingerprint`: its size and the digest of its
            first :data:`HEAD_BYTES`), when it was counted here; None for an index read from a file without them.
    """

    kind: str
    urls: list[str]
    counts: list[int]
    broken: dict[str, str] = field(default_factory=dict)
    fingerprints: list[dict[str, Any]] | None = None

    @property
    def total(self) -> int:
        """Samples in one epoch (every shard once)."""
        return sum(self.counts)

    def to_json(self) -> dict[str, Any]:
        """The index in webdataset's ``wids`` shard-index form (with ``broken`` beside it and each shard's
        fingerprint in its entry), as a file holds it: the credentials inside its urls masked."""
        prints = self.fingerprints or [{} for _ in self.urls]
        return {"wids_version": WIDS_VERSION, "kind": self.kind,
                "broken": {mask_text(u): why for u, why in self.broken.items()},
                "shardlist": [{"url": mask_text(u), "nsamples": n, **p}
                              for u, n, p in zip(self.urls, self.counts, prints)]}

    @classmethod
    def from_json(cls, data: dict[str, Any], kind: str, *, where: str) -> "ShardIndex":
        """Read a ``wids`` shard index (``where`` names the file in errors)."""
        try:
            shards = data["shardlist"]
            urls = [str(s["url"]) for s in shards]
            counts = [int(s["nsamples"]) for s in shards]
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{where} is not a shard index: it needs shardlist: [{{url, nsamples}}, ...] ({error!r})") \
                from None
        if any(n < 0 for n in counts):
            raise DataError(f"{where}: a shard's nsamples is negative")
        prints = [{k: s[k] for k in ("bytes", "head_sha256") if k in s} for s in shards]
        return cls(data.get("kind", kind), urls, counts, dict(data.get("broken") or {}),
                   prints if all(p.get("head_sha256") for p in prints) else None)

    def matches(self, urls: list[str]) -> bool:
        """Whether the index describes exactly these shards (the same urls in the same order; the credentials inside
        them, masked in a saved index and re-signed between runs, are not compared)."""
        return [mask_text(u) for u in self.urls] == [mask_text(u) for u in urls]

    def for_urls(self, urls: list[str]) -> "ShardIndex":
        """This index over ``urls``, the shards it :meth:`matches` as the recipe gives them (with their credentials),
        for reading."""
        broken = {urls[i]: self.broken[u] for i, u in enumerate(self.urls) if u in self.broken}
        return ShardIndex(self.kind, list(urls), list(self.counts), broken, self.fingerprints)

    def order(self, epoch: int, seed: int, shuffle: bool) -> "EpochOrder":
        """The epoch's shard order: a permutation drawn from ``seed + epoch`` (``shuffle``) or the given order."""
        n = len(self.urls)
        perm = (torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist() if shuffle
                else list(range(n)))
        return EpochOrder(self, perm)


class EpochOrder:
    """One epoch's sample positions ``0 .. total-1``: the shards in the epoch's order, each shard's samples in order.

    Args:
        index: the shard index.
        perm: the shards' order (indices into ``index.urls``).
    """

    def __init__(self, index: ShardIndex, perm: list[int]) -> None:
        self.index = index
        self.perm = perm
        self.starts: list[int] = []
        total = 0
        for shard in perm:
            self.starts.append(total)
            total += index.counts[shard]
        self.total = total

    def segments(self, intervals: list[tuple[int, int]]) -> list[tuple[int, list[tuple[int, int]]]]:
        """``intervals`` of positions as ``(shard, [(first, stop), ...])`` runs inside one shard each, in order (local
        sample numbers), consecutive runs of one shard merged (it is opened once)."""
        out: list[tuple[int, list[tuple[int, int]]]] = []
        for a, b in intervals:
            while a < b:
                k = bisect.bisect_right(self.starts, a) - 1
                shard = self.perm[k]
                begin = self.starts[k]
                end = min(b, begin + self.index.counts[shard])  # bisect_right skips empty shards
                run = (a - begin, end - begin)
                if out and out[-1][0] == shard and out[-1][1][-1][1] <= run[0]:
                    out[-1][1].append(run)
                else:
                    out.append((shard, [run]))
                a = end
        return out


class _Counted:
    """A file read from its start after its first bytes were taken (``head``): gives them again, then the rest, and
    counts every byte it passes (the size of a shard read through, e.g. a ``pipe:`` command)."""

    def __init__(self, head: bytes, handle: Any) -> None:
        self.head, self.handle, self.passed = head, handle, 0

    def read(self, n: int = -1) -> bytes:
        if self.head:
            data = self.head if n < 0 or n >= len(self.head) else self.head[:n]
            self.head = self.head[len(data):]
            if n < 0:
                data += self.handle.read()
        else:
            data = self.handle.read(n)
        self.passed += len(data)
        return data

    def seekable(self) -> bool:
        return False


def _head(handle: Any) -> tuple[bytes, int | None]:
    """The first :data:`HEAD_BYTES` of an open shard and its size (None where the file cannot seek: a ``pipe:``
    command); a seekable file is left at its start."""
    chunks, left = [], HEAD_BYTES
    while left:
        data = handle.read(left)
        if not data:
            break
        chunks.append(data)
        left -= len(data)
    head = b"".join(chunks)
    if not getattr(handle, "seekable", lambda: False)():
        return head, None
    size = handle.seek(0, 2)
    handle.seek(0)
    return head, size


def _print(head: bytes, size: int | None) -> dict[str, Any]:
    return {"bytes": size, "head_sha256": hashlib.sha256(head).hexdigest()}


def fingerprint(url: str, options: dict[str, Any] | None = None, policy: ReadPolicy | None = None) -> dict[str, Any]:
    """What identifies a shard's content, read cheaply: ``{"bytes": size (None for a pipe: command),
    "head_sha256": digest of its first HEAD_BYTES}`` (one ranged read of a remote shard, not the whole of it)."""
    with open_shard(url, options, policy) as handle:
        if isinstance(handle, PipeReader):
            head = handle.read(HEAD_BYTES)
            while len(head) < HEAD_BYTES and (more := handle.read(HEAD_BYTES - len(head))):
                head += more
            if len(head) == HEAD_BYTES:  # the rest of the command's output is not needed
                handle.close(check=False)
            return _print(head, None)
        return _print(*_head(handle))


def _count(url: str, kind: str, options: dict[str, Any],
           policy: ReadPolicy | None) -> tuple[int, str | None, dict[str, Any]]:
    """(samples, why the shard ends early or None, fingerprint) of one shard."""
    with open_shard(url, options, policy) as handle:
        head, size = _head(handle)
        counted = handle if size is not None else _Counted(head, handle)
        if kind == "parquet":
            return sum(parquet_row_groups(counted)), None, _print(head, size)
        try:
            samples, why = count_samples(counted), None
        except ShardEndedEarly as broken:
            samples, why = broken.samples, broken.reason
        if size is None:  # read through: its size is what it gave, once it gave all of it
            _ = counted.read()
            size = counted.passed if handle.eof else None
        return samples, why, _print(head, size)


def changed_shards(index: ShardIndex, options: dict[str, Any] | None = None, policy: ReadPolicy | None = None,
                   *, name: str = "webdataset") -> list[str]:
    """The shards of ``index`` whose content changed since it was counted: its fingerprint (:func:`fingerprint`)
    differs, in words (``"s3://b/shard-00003.tar: 1,024,000 bytes, now 1,031,168"``). Empty when the index holds no
    fingerprints (an index file written elsewhere).

    Raises:
        DataError: a shard that cannot be read (naming it and why).
    """
    if not index.fingerprints:
        return []

    def one(url: str) -> dict[str, Any]:
        try:
            return fingerprint(url, options, policy)
        except Exception as error:  # OS, fsspec errors: name the shard
            raise failure(name, url, error, policy) from None

    now = _map(one, index.urls)
    out = []
    for url, then, current in zip(index.urls, index.fingerprints, now):
        if then.get("bytes") is not None and current["bytes"] is not None and then["bytes"] != current["bytes"]:
            out.append(f"{mask_text(url)}: {then['bytes']:,} bytes, now {current['bytes']:,}")
        elif then.get("head_sha256") != current["head_sha256"]:
            out.append(f"{mask_text(url)}: its first {HEAD_BYTES >> 10} KiB differ")
    return out


def _map(fn: Any, urls: list[str]) -> list[Any]:
    """``fn`` over ``urls``, in threads when a shard is remote."""
    threads = min(_SCAN_THREADS, len(urls)) if any(is_remote(u) for u in urls) else 1
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(fn, urls))
    return [fn(u) for u in urls]


def build_index(urls: list[str], kind: str, options: dict[str, Any] | None = None, *,
                name: str = "webdataset", policy: ReadPolicy | None = None) -> ShardIndex:
    """Count every shard's samples and take its fingerprint (see the module); threads for remote shards.

    Raises:
        DataError: a shard that cannot be opened or read (naming it and why).
    """
    options = options or {}
    started = time.perf_counter()

    def one(url: str) -> tuple[int, str | None, dict[str, Any]]:
        try:
            return _count(url, kind, options, policy)
        except Exception as error:  # OS, fsspec, pyarrow errors: name the shard and the cause
            raise failure(name, url, error, policy) from None

    results = _map(one, urls)
    index = ShardIndex(kind, list(urls), [n for n, _, _ in results],
                       {u: why for u, (_, why, _) in zip(urls, results) if why}, [p for _, _, p in results])
    seconds = time.perf_counter() - started
    if seconds > 30:
        logger.warning("counted the samples of %d shards in %.0f s; data.train.options.index: FILE (a wids shard "
                       "index, written into every checkpoint as stream_index.json) skips this count", len(urls), seconds)
    return index


def load_index_file(path: str, kind: str, options: dict[str, Any] | None = None,
                    policy: ReadPolicy | None = None) -> ShardIndex:
    """A ``wids`` shard index from a local path or URL (``data.train.options.index``)."""
    try:
        with open_shard(path, options, policy) as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except DataError:
        raise
    except (OSError, ValueError) as error:
        why = read_failure(error, (policy or ReadPolicy()).timeout_s) if is_remote(path) else str(error)
        raise DataError(f"data.train.options.index: cannot read {path}: {why}") from None
    return ShardIndex.from_json(data, kind, where=f"data.train.options.index ({path})")
