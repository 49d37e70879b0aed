"""Reading a remote shard without hanging: an fsspec file (``s3://``, ``https://``, ``gs://``, ...) or the output of a
``pipe:`` command, each read bounded by a timeout (``data.read_timeout_s``), and a failed read described by its cause
(:func:`read_failure`): timed out, connection refused, TLS failed, not found, access denied.

Two bounds, so that a stalled server or a command that never ends stops a run with an error naming the shard instead
of leaving it silent (issue 40: a stalled HTTP server held a read for 602 s):

- the filesystem's own socket timeouts where it has them (aiohttp's ``sock_connect`` / ``sock_read`` for
  ``http(s)://``, botocore's ``connect_timeout`` / ``read_timeout`` for ``s3://``), set unless the recipe's
  ``storage_options`` set them;
- every blocking call on the file (opening it, each read of up to :data:`READ_CHUNK` bytes) waits at most the timeout
  for its answer (:class:`TimedFile`), whatever the filesystem; a ``pipe:`` command that gives no output for that
  long, or does not exit that long after its output ended, is killed with the processes it started
  (:class:`PipeReader`).
"""

from __future__ import annotations

import os
import queue
import select
import signal
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable
from typing import IO, Any

__all__ = ["READ_CHUNK", "PipeReader", "ReadTimeout", "TimedFile", "read_failure", "with_timeouts"]

#: the most bytes one bounded read asks for: a read of more is split, so that the timeout bounds the wait for each
#: piece (a slow but live link is not cut: it must bring 8 MiB per timeout, 140 KB/s at the default 60 s)
READ_CHUNK = 8 << 20
_ERROR_TAIL = 500


class ReadTimeout(TimeoutError):
    """A remote read or a ``pipe:`` command that gave no data within the timeout."""


def with_timeouts(url: str, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``options`` (fsspec's keyword arguments) with the filesystem's socket timeouts set to ``timeout_s`` where the
    recipe did not set them: aiohttp's ``sock_connect`` / ``sock_read`` for ``http(s)://``, botocore's
    ``connect_timeout`` / ``read_timeout`` for ``s3://``."""
    scheme = url.split("://", 1)[0].lower()
    out = dict(options)
    if scheme in ("http", "https"):
        import aiohttp

        client = dict(out.get("client_kwargs") or {})
        client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s))
        out["client_kwargs"] = client
    elif scheme in ("s3", "s3a"):
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout_s)
        config.setdefault("read_timeout", timeout_s)
        out["config_kwargs"] = config
    return out


class _Worker:
    """One daemon thread that runs a file's blocking calls, so that the caller waits for each at most a timeout (a
    call that never returns leaves the thread behind, which the process does not wait for when it exits)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="xlipkit-remote-read").start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, box, done = job
            try:
                box.append((True, fn(*args)))
            except BaseException as error:  # handed to the caller
                box.append((False, error))
            done.set()

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float, what: str) -> Any:
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self.jobs.put((fn, args, box, done))
        if not done.wait(timeout_s):
            raise ReadTimeout(f"{what}: no answer for {timeout_s:g} s (data.read_timeout_s)")
        ok, value = box[0]
        if ok:
            return value
        raise value

    def stop(self) -> None:
        self.jobs.put(None)


class TimedFile:
    """A remote binary file whose blocking calls (the open, each read of up to :data:`READ_CHUNK` bytes, a seek, the
    close) wait at most ``timeout_s`` each (:class:`ReadTimeout` after that).

    Args:
        opener: returns the open file (called under the timeout: an fsspec open asks the server for the size).
        timeout_s: the longest wait for one call.
    """

    def __init__(self, opener: Callable[[], IO[bytes]], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._worker = _Worker()
        self._closed = False
        try:
            self.file = self._worker.call(opener, (), timeout_s, "opening it")
        except BaseException:
            self._worker.stop()
            raise

    def read(self, n: int = -1) -> bytes:
        if n == 0:
            return b""
        if 0 < n <= READ_CHUNK:
            return self._worker.call(self.file.read, (n,), self.timeout_s, "reading it")
        chunks, left = [], n
        while left != 0:
            data = self._worker.call(self.file.read, (READ_CHUNK if left < 0 else min(left, READ_CHUNK),),
                                     self.timeout_s, "reading it")
            if not data:
                break
            chunks.append(data)
            left = -1 if left < 0 else left - len(data)
        return b"".join(chunks)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._worker.call(self.file.seek, (offset, whence), self.timeout_s, "seeking in it")

    def tell(self) -> int:
        return self.file.tell()

    def seekable(self) -> bool:
        return self.file.seekable()

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._worker.call(self.file.close, (), self.timeout_s, "closing it")
        except ReadTimeout:
            pass  # nothing more is read from it
        finally:
            self._worker.stop()

    def __enter__(self) -> "TimedFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # size, mode, ... of the file (pyarrow asks)
        return getattr(self.__dict__["file"], name)


class PipeReader:
    """The standard output of ``pipe:COMMAND`` as a read-only binary file. The command runs in a shell, in its own
    process group, its standard error read as it comes (the end kept for the error message); a read that gets no
    output for ``timeout_s`` kills the group (:class:`ReadTimeout`), and closing
    checks the command's exit status (a failed ``aws s3 cp`` or ``curl`` is an error naming the command, not a short
    shard), killing a command still running ``timeout_s`` after its output ended.

    Args:
        command: the shell command (after ``pipe:``).
        timeout_s: the longest wait for output, and for the exit after the output ended.
    """

    def __init__(self, command: str, timeout_s: float) -> None:
        self.command = command
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.fd = self.proc.stdout.fileno()
        self.eof = False
        self._closed = False
        self._stderr = bytearray()  # its last bytes, read as they come: a full stderr pipe would stop the command
        self._drain = threading.Thread(target=self._read_stderr, daemon=True, name="xlipkit-pipe-stderr")
        self._drain.start()

    def _read_stderr(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read1(1 << 16), b""):
            self._stderr += chunk
            del self._stderr[:-_ERROR_TAIL * 4]

    def read(self, n: int = -1) -> bytes:
        chunks, left = [], n
        while left != 0 and not self.eof:
            ready, _, _ = select.select([self.fd], [], [], self.timeout_s)
            if not ready:
                self._kill()
                raise ReadTimeout(f"pipe:{self.command} gave no output for {self.timeout_s:g} s "
                                  "(data.read_timeout_s); it was stopped")
            data = os.read(self.fd, 1 << 20 if left < 0 else min(left, 1 << 20))
            if not data:
                self.eof = True
                break
            chunks.append(data)
            if left > 0:
                break  # a short read: the caller asks again
        return b"".join(chunks)

    def seekable(self) -> bool:
        return False

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the shell and what it started
        except (ProcessLookupError, PermissionError):
            pass

    def close(self, *, check: bool = True) -> None:
        """Close the output; with ``check`` (the shard was read to its end) raise when the command failed."""
        if self._closed:
            return
        self._closed = True
        check = check and self.eof  # a reader that stopped early ends the command
        if not check and self.proc.poll() is None:
            self._kill()
        self.proc.stdout.close()
        try:
            self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
            self.proc.wait()
            if check:
                raise ReadTimeout(f"pipe:{self.command} did not exit {self.timeout_s:g} s after its output ended "
                                  "(data.read_timeout_s); it was stopped") from None
            return
        finally:
            self._kill()  # what the command left running in its group
            self._drain.join(self.timeout_s)
            self.proc.stderr.close()
        status = self.proc.returncode
        err = bytes(self._stderr).decode("utf-8", "replace").strip()
        if check and status != 0:
            tail = f": {err[-_ERROR_TAIL:]}" if err else ""
            raise OSError(f"pipe:{self.command} exited with status {status}{tail}")


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes and contexts, outermost first (fsspec wraps a refused connection or a TLS failure in
    ``FileNotFoundError(url)``)."""
    seen: list[BaseException] = []
    todo = [error]
    while todo and len(seen) < 16:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, *[a for a in getattr(e, "args", ()) if isinstance(a, BaseException)],
                 getattr(e, "os_error", None)]
    return [e for e in seen if e is not None]


def _status(e: BaseException) -> tuple[int | None, str]:
    """``(HTTP status, service error code)`` of an aiohttp / botocore error, as far as it says."""
    status = getattr(e, "status", None) if isinstance(getattr(e, "status", None), int) else None
    response = getattr(e, "response", None)
    code = ""
    if isinstance(response, dict):
        code = str((response.get("Error") or {}).get("Code") or "")
        status = status or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return status, code


_TIMEOUT_NAMES = ("Timeout", "TimeoutError")
_NOT_FOUND_CODES = ("NoSuchKey", "NoSuchBucket", "NotFound", "404")
_DENIED_CODES = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "Forbidden", "403",
                 "InvalidToken", "AuthorizationHeaderMalformed")


def read_failure(error: BaseException, timeout_s: float) -> str:
    """Why a remote read failed, in words that say what to check: ``timed out``, ``the connection was refused``,
    ``TLS failed``, ``not found``, ``access denied``, ``no credentials``, or the error itself."""
    chain = _chain(error)
    names = [type(e).__name__ for e in chain]
    if any(isinstance(e, (ReadTimeout, socket.timeout)) for e in chain):
        return f"timed out: {next(e for e in chain if isinstance(e, (ReadTimeout, socket.timeout)))}"
    if any(isinstance(e, TimeoutError) or any(t in n for t in _TIMEOUT_NAMES) for e, n in zip(chain, names)):
        return (f"timed out: the server gave no data for {timeout_s:g} s (data.read_timeout_s); is it overloaded "
                "or stalled?")
    tls = next((e for e, n in zip(chain, names) if isinstance(e, ssl.SSLError) or "Certificate" in n or "SSL" in n),
               None)
    if tls is not None:
        root = next((e for e in reversed(chain) if isinstance(e, ssl.SSLError)), tls)
        return (f"TLS failed ({getattr(root, 'reason', None) or root}): the server's certificate is not trusted "
                "(self-signed, or another host's) or it does not speak TLS; fix the server's certificate, or give "
                "the CA bundle (SSL_CERT_FILE / AWS_CA_BUNDLE)")
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return "the connection was refused: nothing listens at that host and port (is the server up, the port right?)"
    if any(isinstance(e, socket.gaierror) for e in chain):
        return "the host name does not resolve (check the URL, the network and DNS)"
    if any(isinstance(e, ConnectionResetError) for e in chain):
        return ("the server closed the connection (an https server given as http://, or a server that hung up); "
                "check the URL's scheme and the server")
    for e in chain:
        status, code = _status(e)
        if status == 404 or code in _NOT_FOUND_CODES:
            return f"not found (HTTP 404{', ' + code if code else ''}): check the URL"
        if status in (401, 403) or code in _DENIED_CODES:
            return (f"access denied (HTTP {status or 403}{', ' + code if code else ''}): check the credentials "
                    "(the filesystem's usual places, or data.train.options.storage_options) and their rights")
        if status is not None and status >= 400:
            what = "a server error: retry later, or check the server" if status >= 500 else "check the URL"
            return f"the server answered HTTP {status}{' (' + code + ')' if code else ''}: {what}"
    option = next((e for e in chain if isinstance(e, TypeError) and "keyword argument" in str(e)), None)
    if option is not None:
        return (f"an option the filesystem does not take ({option}): check data.train.options.storage_options "
                "(fsspec's keyword arguments of this URL's filesystem)")
    if any(n in ("ClientPayloadError", "IncompleteRead", "ContentLengthError", "ResponseStreamingError")
           for n in names):
        return ("the transfer broke off before the end of the shard (the server or the network closed it): check "
                "the server; a retry may work")
    if any(n == "NoCredentialsError" for n in names):
        return ("no credentials: set them where the filesystem reads them (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                "~/.aws, an instance role) or pass anon: true in data.train.options.storage_options for public data")
    if isinstance(error, FileNotFoundError):
        return "not found: check the URL"
    return f"{type(error).__name__}: {error}"
