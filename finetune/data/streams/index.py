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
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from finetune.data.images import DataError
from finetune.data.streams.tar import ShardEndedEarly, count_samples
from finetune.data.streams.urls import is_remote, open_shard

__all__ = ["EpochOrder", "ShardIndex", "WIDS_VERSION", "build_index", "parquet_row_groups"]

logger = logging.getLogger(__name__)

WIDS_VERSION = 1
_SCAN_THREADS = 16


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
    """

    kind: str
    urls: list[str]
    counts: list[int]
    broken: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Samples in one epoch (every shard once)."""
        return sum(self.counts)

    def to_json(self) -> dict[str, Any]:
        """The index in webdataset's ``wids`` shard-index form (with ``broken`` beside it)."""
        return {"wids_version": WIDS_VERSION, "kind": self.kind, "broken": self.broken,
                "shardlist": [{"url": u, "nsamples": n} for u, n in zip(self.urls, self.counts)]}

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
        return cls(data.get("kind", kind), urls, counts, dict(data.get("broken") or {}))

    def matches(self, urls: list[str]) -> bool:
        """Whether the index describes exactly these shards (the same urls in the same order)."""
        return self.urls == list(urls)

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


def _count(url: str, kind: str, options: dict[str, Any]) -> tuple[int, str | None]:
    """(samples, why the shard ends early or None) of one shard."""
    with open_shard(url, options) as handle:
        if kind == "parquet":
            return sum(parquet_row_groups(handle)), None
        try:
            return count_samples(handle), None
        except ShardEndedEarly as broken:
            return broken.samples, broken.reason


def build_index(urls: list[str], kind: str, options: dict[str, Any] | None = None, *,
                name: str = "webdataset") -> ShardIndex:
    """Count every shard's samples (see the module); threads for remote shards.

    Raises:
        DataError: a shard that cannot be opened or read (naming it and why).
    """
    options = options or {}
    started = time.perf_counter()

    def one(url: str) -> tuple[int, str | None]:
        try:
            return _count(url, kind, options)
        except DataError:
            raise
        except Exception as error:  # OS, fsspec, pyarrow errors: name the shard
            raise DataError(f"data source {name!r}: cannot read shard {url}: {type(error).__name__}: {error}") from None

    threads = min(_SCAN_THREADS, len(urls)) if any(is_remote(u) for u in urls) else 1
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(one, urls))
    else:
        results = [one(u) for u in urls]
    index = ShardIndex(kind, list(urls), [n for n, _ in results],
                       {u: why for u, (_, why) in zip(urls, results) if why})
    seconds = time.perf_counter() - started
    if seconds > 30:
        logger.warning("counted the samples of %d shards in %.0f s; data.train.options.index: FILE (a wids shard "
                       "index, written into every checkpoint as stream_index.json) skips this count", len(urls), seconds)
    return index


def load_index_file(path: str, kind: str, options: dict[str, Any] | None = None) -> ShardIndex:
    """A ``wids`` shard index from a local path or URL (``data.train.options.index``)."""
    try:
        with open_shard(path, options) as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(f"data.train.options.index: cannot read {path}: {error}") from None
    return ShardIndex.from_json(data, kind, where=f"data.train.options.index ({path})")
