"""Rows a source builder cannot read (captions that are not UTF-8, ...) follow ``data.on_error``.

:func:`finetune.data.sources.load_source` opens a :func:`collecting` scope around the builder;
inside it a builder calls :func:`report_bad_row` for each row it cannot use: with
``on_error="raise"`` that raises a :class:`~finetune.data.images.DataError` naming the file and
line, with ``"skip"`` the row is recorded (and counted with the examples validation skips).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .images import DataError

__all__ = ["collecting", "report_bad_row", "decode_utf8", "read_utf8_text", "utf8_jsonl"]

_scope: contextvars.ContextVar[tuple[str, list[dict]] | None] = contextvars.ContextVar(
    "xlipkit_bad_rows", default=None)


@contextlib.contextmanager
def collecting(on_error: str) -> Iterator[list[dict]]:
    """Collect the rows reported by :func:`report_bad_row` while the block runs.

    Args:
        on_error: ``"skip"`` or ``"raise"``.
    Yields:
        the list the reports go to, as ``{"id", "path", "reason"}``.
    """
    reports: list[dict] = []
    token = _scope.set((on_error, reports))
    try:
        yield reports
    finally:
        _scope.reset(token)


def report_bad_row(id_: str, path: str, reason: str) -> None:
    """Report a row that cannot be used: raise (``on_error="raise"``, also outside a
    :func:`collecting` scope) or record it to be skipped.

    Raises:
        DataError: ``"{path}: {reason}"`` and how to skip such rows, with ``on_error="raise"``.
    """
    scope = _scope.get()
    if scope is None or scope[0] == "raise":
        raise DataError(f"{path}: {reason}. Fix the file, or set data.on_error: skip to skip and count such rows.")
    scope[1].append({"id": str(id_), "path": str(path), "reason": reason})


def decode_utf8(data: bytes, path: str | os.PathLike) -> str:
    """``data`` decoded as UTF-8 (a leading byte-order mark dropped).

    Raises:
        DataError: naming the file, the line and column and the offending byte, when ``data`` is
            not UTF-8 (e.g. a Latin-1 caption).
    """
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise DataError(f"{os.fspath(path)}: {_where_undecodable(data, error)}") from error


def _where_undecodable(data: bytes, error: UnicodeDecodeError) -> str:
    line = data.count(b"\n", 0, error.start) + 1
    column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
    byte = data[error.start:error.start + 1].hex()
    return (f"line {line}, column {column}: not UTF-8 (byte 0x{byte}); save the file as UTF-8 "
            "(e.g. `iconv -f latin1 -t utf-8`)")


def read_utf8_text(path: str | os.PathLike) -> str:
    """A text file's content as UTF-8; :class:`DataError` naming the file and line if it is not."""
    return decode_utf8(Path(path).read_bytes(), path)


def utf8_jsonl(file: Path, workdir: str | os.PathLike) -> Path:
    """``file`` itself when it is UTF-8; else, reporting each line that is not (as
    ``"FILE:LINE"``, see :func:`report_bad_row`), a copy without those lines under ``workdir``."""
    data = file.read_bytes()
    try:
        data.decode("utf-8")
        return file
    except UnicodeDecodeError:
        pass
    kept = []
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as error:
            column = error.start + 1
            report_bad_row(f"{file.name}:{number}", str(file),
                           f"line {number}, column {column}: not UTF-8 (byte 0x{line[error.start:error.start + 1].hex()}); "
                           "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")
            continue
        kept.append(line)
    handle, name = tempfile.mkstemp(prefix=file.stem + ".utf8-", suffix=file.suffix, dir=workdir)
    with os.fdopen(handle, "wb") as out:
        out.write(b"".join(kept))
    return Path(name)
