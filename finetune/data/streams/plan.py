"""Who reads which samples of an epoch: the epoch split by samples over every reader (process x data-loader worker),
and a position that survives a change of cluster size.

An epoch is the sequence of sample positions ``0 .. N-1`` (the shards in the epoch's order, each shard's samples in
order: :class:`~finetune.data.streams.index.EpochOrder`). Reader ``k`` of ``R`` reads one contiguous run of it
(:func:`fresh_share`): ``N // R`` samples, or one more for ``N % R`` readers, and which readers get the one more
rotates with the epoch, so that after any number of epochs no reader has read more than one sample more than another.
This is webdataset's ``wids`` way (split by samples from an index of sample counts) rather than by shards: every
sample is read exactly once per epoch however uneven the shards, and every reader's epoch has the same length
(give or take one sample), so all readers reach the end of an epoch together.

A reader's position is how many positions of its share it has passed in its order (``done``). A run resumed with the
same readers continues each share where it stood. A run resumed with another number of readers pools what every
old reader had left of each epoch in flight (:func:`remaining`) and splits it again by count (:func:`split`): nothing
of the epoch is skipped or read twice; the batches differ from those an uninterrupted run would have made.

With ``shuffle_buffer: S > 1`` a reader reads its share in blocks of ``S`` samples and gives each block in an order
drawn from ``seed``, the epoch and the block's first position (:func:`block_order`): an exact, resumable shuffle
within blocks (a resume reads the current block again, at most ``S`` samples, and passes over what it gave).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

__all__ = ["Intervals", "block_order", "consumed", "fresh_share", "length", "normalise", "positions", "remaining",
           "reader_blocks", "split", "subtract", "take"]

Intervals = list[tuple[int, int]]


def normalise(intervals: Iterable[tuple[int, int]]) -> Intervals:
    """Sorted, merged, non-empty ``[a, b)`` intervals."""
    out: Intervals = []
    for a, b in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: Intervals) -> int:
    """The number of positions in ``intervals``."""
    return sum(b - a for a, b in intervals)


def positions(intervals: Intervals) -> Iterator[int]:
    """Every position of ``intervals``, in order."""
    for a, b in intervals:
        yield from range(a, b)


def take(intervals: Intervals, n: int) -> Intervals:
    """The first ``n`` positions of ``intervals`` (in their order), as intervals."""
    out: Intervals = []
    for a, b in intervals:
        if n <= 0:
            break
        out.append((a, min(b, a + n)))
        n -= b - a
    return out


def subtract(intervals: Intervals, taken: Intervals) -> Intervals:
    """``intervals`` less ``taken`` (both normalised)."""
    out: Intervals = []
    taken = normalise(taken)
    for a, b in normalise(intervals):
        for c, d in taken:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def fresh_share(total: int, readers: int, reader: int, epoch: int) -> Intervals:
    """Reader ``reader``'s contiguous run of an epoch of ``total`` positions split over ``readers`` (see the module:
    the ``total % readers`` readers that get one more rotate with the epoch)."""
    q, r = divmod(total, readers)

    def size(k: int) -> int:
        return q + (1 if (k - epoch * r) % readers < r else 0)

    start = sum(size(k) for k in range(reader))
    return [(start, start + size(reader))] if size(reader) else []


def split(intervals: Intervals, readers: int) -> list[Intervals]:
    """``intervals`` cut, in order, into ``readers`` consecutive parts of ``len // readers`` positions (one more for
    the first ``len % readers``)."""
    q, r = divmod(length(intervals), readers)
    parts: list[Intervals] = []
    queue = list(intervals)
    for k in range(readers):
        want = q + (1 if k < r else 0)
        part: Intervals = []
        while want and queue:
            a, b = queue.pop(0)
            n = min(want, b - a)
            part.append((a, a + n))
            if a + n < b:
                queue.insert(0, (a + n, b))
            want -= n
        parts.append(part)
    return parts


def block_order(share: Intervals, start: int, size: int, seed: int, epoch: int) -> list[int]:
    """The positions of the block of ``share`` that begins at its ``start``-th position (``size`` long, shorter at
    the end), in the order a reader gives them: shuffled from ``seed``, ``epoch`` and the block's first position (the
    same order whichever reader reads the block), or as they are when ``size`` <= 1."""
    block = list(positions(take(_drop(share, start), size)))
    if size > 1 and block:
        random.Random(f"{seed}:{epoch}:{block[0]}").shuffle(block)
    return block


def _drop(intervals: Intervals, n: int) -> Intervals:
    out: Intervals = []
    for a, b in intervals:
        if n >= b - a:
            n -= b - a
            continue
        out.append((a + n, b))
        n = 0
    return out


def reader_blocks(share: Intervals, done: int, block: int, seed: int,
                  epoch: int) -> Iterator[tuple[Intervals, list[int] | None]]:
    """A reader's share from its ``done``-th position on, as ``(positions to read, order to give them in)``: without a
    block shuffle one piece, the rest of the share in order (``None``); with one, each block (the first without the
    positions already given)."""
    if block <= 1:
        rest = _drop(share, done)
        if rest:
            yield rest, None
        return
    start = done - done % block
    skip = done - start
    while start < length(share):
        order = block_order(share, start, block, seed, epoch)[skip:]
        skip = 0
        yield normalise((p, p + 1) for p in order), order
        start += block


def consumed(share: Intervals, done: int, block: int, seed: int, epoch: int) -> Intervals:
    """The positions of ``share`` a reader has passed after ``done`` of them (whole blocks, then the given part of
    the current block)."""
    if block <= 1:
        return take(share, done)
    whole = done - done % block
    given = block_order(share, whole, block, seed, epoch)[:done - whole]
    return normalise(take(share, whole) + [(p, p + 1) for p in given])


def remaining(readers: list[dict], block: int, seed: int, total: int) -> dict[int, Intervals]:
    """What every old reader had left of each epoch in flight, pooled: ``{epoch: intervals}`` from the slowest
    reader's epoch to the fastest one's (an epoch no old reader reached is fresh, not listed).

    Args:
        readers: each old reader's ``{"epoch", "done", "shares": {epoch: intervals}, "reader", "readers"}``
            (an epoch missing from ``shares`` is that reader's :func:`fresh_share`).
        block: ``shuffle_buffer`` (> 1: the block shuffle's order says which positions were given).
        seed: the stream's seed.
        total: positions in an epoch.
    """
    first = min(r["epoch"] for r in readers)
    last = max(r["epoch"] for r in readers)
    left: dict[int, Intervals] = {}
    for epoch in range(first, last + 1):
        pool: Intervals = []
        for r in readers:
            share = _share_of(r, epoch, total)
            if r["epoch"] < epoch:
                pool += share
            elif r["epoch"] == epoch:
                pool += subtract(share, consumed(share, r["done"], block, seed, epoch))
        left[epoch] = normalise(pool)
    return left


def _share_of(reader: dict, epoch: int, total: int) -> Intervals:
    explicit = reader.get("shares") or {}
    if str(epoch) in explicit:
        return [tuple(x) for x in explicit[str(epoch)]]
    return fresh_share(total, reader["readers"], reader["reader"], epoch)
