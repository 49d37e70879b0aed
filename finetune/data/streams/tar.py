"""Webdataset tar shards read one sample at a time, with every way a shard can end early said so.

A webdataset shard is a tar archive whose members ``KEY.EXT`` group into samples by ``KEY`` (the part of the file name
before its first dot: ``a/b.c.jpg`` is sample ``a/b`` with the entry ``c.jpg``). Python's ``tarfile`` in stream mode
takes a header cut short for the end of the archive, so a shard cut inside a header reads as a complete shorter one
(issue 31: 10 of 16 samples, nothing reported). Here every header block is read whole, a tar ends only at its zero
end-of-archive block, and anything else (a short header, a member whose data stops, a bad header checksum, no end
block) raises :class:`ShardEndedEarly`, naming where, after the samples before the break were given.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from typing import IO

__all__ = ["ShardEndedEarly", "count_samples", "iter_samples", "sample_key"]

_BLOCK = 512
_KEY = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


class ShardEndedEarly(Exception):
    """A tar shard that stops before its end-of-archive block, or whose headers are damaged.

    Attributes:
        reason: where and how it broke, in words (``"it ends inside the header after member 7.png"``).
        samples: the whole samples read before the break.
    """

    def __init__(self, reason: str, samples: int, *, in_data: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.samples = samples
        #: the break is inside a member's data (that member's sample is lost), not between members
        self.in_data = in_data


def sample_key(name: str) -> tuple[str, str] | None:
    """``(key, entry)`` of a member name (``"x/0001.superpixels.png"`` -> ``("x/0001", "superpixels.png")``), or None
    for a name without an extension."""
    match = _KEY.match(name)
    return (match.group(1), match.group(2)) if match else None


def _read(f: IO[bytes], n: int) -> bytes:
    chunks, left = [], n
    while left:
        data = f.read(left)
        if not data:
            break
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


def _skip(f: IO[bytes], n: int) -> int:
    """Skip ``n`` bytes (a seek where the file can, else a read); the number actually passed."""
    if n and getattr(f, "seekable", lambda: False)():
        here = f.tell()
        end = f.seek(0, 2)
        f.seek(min(here + n, end))
        return min(n, end - here)
    passed = 0
    while passed < n:
        data = f.read(min(1 << 20, n - passed))
        if not data:
            break
        passed += len(data)
    return passed


def _members(f: IO[bytes], want: "callable") -> Iterator[tuple[str, bytes | None]]:
    """``(name, data)`` of every file member; ``data`` is None where ``want(name)`` is false (skipped unread).
    Raises ShardEndedEarly(reason, 0) at a break (``in_data`` inside a member); the caller counts samples."""
    last = "the first member"
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        block = _read(f, _BLOCK)
        if not block:
            raise ShardEndedEarly(f"it ends after {last} without the tar end-of-archive block", 0)
        if len(block) < _BLOCK:
            raise ShardEndedEarly(f"it ends inside the tar header after {last}", 0)
        if block.count(0) == _BLOCK:
            return
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as error:
            raise ShardEndedEarly(f"a damaged tar header after {last} ({error})", 0) from None
        padded = -(-info.size // _BLOCK) * _BLOCK
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME):
            data = _read(f, padded)
            if len(data) < padded:
                raise ShardEndedEarly(f"it ends inside an extended header after {last}", 0)
            if info.type == tarfile.GNUTYPE_LONGNAME:
                long_name = data[:info.size].rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type == tarfile.XHDTYPE:
                pax = _pax_records(data[:info.size])
            continue
        name = long_name or pax.get("path") or info.name
        size = int(pax.get("size", info.size))
        padded = -(-size // _BLOCK) * _BLOCK
        long_name, pax = None, {}
        if info.type not in _FILE_TYPES:
            if _skip(f, padded) < padded:
                raise ShardEndedEarly(f"it ends inside member {name}", 0, in_data=True)
            continue
        if want(name):
            data = _read(f, size)
            if len(data) < size or _skip(f, padded - size) < padded - size:
                raise ShardEndedEarly(f"it ends inside the data of member {name}", 0, in_data=True)
            yield name, data
        else:
            if _skip(f, padded) < padded:
                raise ShardEndedEarly(f"it ends inside the data of member {name}", 0, in_data=True)
            yield name, None
        last = f"member {name}"


def _pax_records(data: bytes) -> dict[str, str]:
    """The ``length key=value`` records of a pax extended header."""
    out, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def iter_samples(f: IO[bytes], *, start: int = 0, stop: int | None = None,
                 keep: "callable" = lambda index: True) -> Iterator[tuple[int, str, dict[str, bytes]]]:
    """The samples ``start <= index < stop`` of a webdataset tar (``(index, key, {entry: bytes})``), in order; the
    samples before ``start`` and those ``keep(index)`` rejects are passed over without reading their data (a seek
    where the file can). Members without an extension are ignored, as webdataset does.

    Raises:
        ShardEndedEarly: the shard breaks before ``stop`` (or, with ``stop`` None, before its end-of-archive block),
            with ``samples`` = the whole samples before the break.
    """
    index, key, entries = -1, None, {}
    reading = False

    def want(name: str) -> bool:
        parsed = sample_key(name)
        following = index + (parsed is not None and parsed[0] != key)
        return parsed is not None and following >= start and keep(following)

    try:
        for name, data in _members(f, want):
            parsed = sample_key(name)
            if parsed is None:
                continue
            if parsed[0] != key:
                if reading:
                    yield index, key, entries
                index, key = index + 1, parsed[0]
                if stop is not None and index >= stop:
                    return
                reading = index >= start and keep(index)
                entries = {}
            if reading and data is not None:
                entries[parsed[1]] = data
    except ShardEndedEarly as broken:
        whole = index + (not broken.in_data and key is not None)  # a break inside a member loses its sample
        if reading and not broken.in_data and key is not None:
            yield index, key, entries  # its members are whole; the example checks say whether it is usable
        raise ShardEndedEarly(broken.reason, max(0, whole), in_data=broken.in_data) from None
    if reading and key is not None and (stop is None or index < stop):
        yield index, key, entries


def count_samples(f: IO[bytes]) -> int:
    """The number of samples of a webdataset tar, reading headers only (a seek past every member's data where the
    file can).

    Raises:
        ShardEndedEarly: the shard breaks, with the whole samples before the break.
    """
    count, key = 0, None
    try:
        for name, _ in _members(f, lambda name: False):
            parsed = sample_key(name)
            if parsed is not None and parsed[0] != key:
                count, key = count + 1, parsed[0]
    except ShardEndedEarly as broken:
        raise ShardEndedEarly(broken.reason, count - broken.in_data if count else 0, in_data=broken.in_data) from None
    return count
