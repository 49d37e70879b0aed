"""How a stream's shards are read (issue 40): a ``pipe:`` command runs only when the user allowed the recipe's code
(``Recipe.trust_code``, carried to every data-loader worker by the opened stream); a remote read cannot hang (a stalled
HTTP server, a command that never ends: ``data.read_timeout_s``) and a failed one names the shard and its cause
(timed out, refused, TLS, not found); a shard rewritten with the same sample count is found on resume; a shard that
is no tar at all (0 bytes, garbage) is counted as skipped. Every server here is local (127.0.0.1, moto's S3)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import ipaddress
import json
import os
import socket
import ssl
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.config import RecipeError, load_recipe
from finetune.data.sources import DataError
from finetune.data.streams import ExampleStream, StreamLoader, open_stream
from finetune.data.streams.index import build_index, changed_shards
from finetune.data.streams.source import ShardSet
from finetune.data.streams.urls import ReadPolicy, open_shard
from tests.finetune.data.test_stream_sources import _upload, s3_server  # noqa: F401 - the fixture
from tests.finetune.data.test_streams import _record, _scenes, write_webdataset

TRUSTED = ReadPolicy(commands=True)
QUICK = ReadPolicy(timeout_s=1.0)


@pytest.fixture(autouse=True)
def _quiet_datasets(monkeypatch):
    monkeypatch.setattr("datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def _one_process() -> SimpleNamespace:
    return SimpleNamespace(num_processes=1, process_index=0, is_main_process=True,
                           main_process_first=contextlib.nullcontext)


def _recipe(tmp_path: Path, *overrides: str, trust: bool = False):
    path = tmp_path / "r.yaml"
    path.write_text("# a stream recipe\ntrain: {max_steps: 2}\neval: {sets: []}\n", encoding="utf-8")
    return load_recipe(path, list(overrides), trust_imports=trust)


def _finishes(fn, limit_s: float = 60.0):
    """Run ``fn`` in a thread; return what it raised (None when it returned), failing the test if it hangs."""
    box: list = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as error:  # handed to the test
            box.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert box, f"still waiting after {limit_s:.0f} s: the read hangs"
    return box[0]


# --------------------------------------------------------------------------- pipe: commands and trust


def test_a_pipe_command_runs_only_when_the_user_allowed_the_recipe_code(tmp_path, monkeypatch):
    """Issue 40: ``data.train.urls='pipe:touch pwned; cat shard.tar # s3://x'`` ran under ``xlipkit train`` with no
    trust given and created the file."""
    from finetune.training.inputs import load_data

    shard = write_webdataset(tmp_path, _scenes(4), 4)[0]
    monkeypatch.chdir(tmp_path)
    url = f"pipe:touch pwned; cat {shard} # s3://x"
    recipe = _recipe(tmp_path, f"data.train={{name: webdataset, urls: '{url}'}}")
    assert recipe.trust_code is False
    with pytest.raises(DataError, match=r"data\.train\.urls holds a pipe: command .*pass --trust-recipe-code"):
        load_data(recipe, _one_process())
    from finetune.training.preflight import preflight  # validate and train: before anything slow

    assert "runs a command to read each shard" in (preflight(recipe, "r.yaml", output=False).message() or "")
    with pytest.raises(DataError, match="--trust-recipe-code"):
        open_stream(recipe.data.train)  # the default: no commands
    with pytest.raises(DataError, match="--trust-recipe-code"):
        with open_shard(url):
            pass
    index_file = {"name": "webdataset", "urls": str(shard), "options": {"index": "pipe:touch pwned; echo {}"}}
    with pytest.raises(DataError, match=r"data\.train\.options\.index holds a pipe: command"):
        open_stream(index_file)
    assert not (tmp_path / "pwned").exists()
    trusted = _recipe(tmp_path, f"data.train={{name: webdataset, urls: '{url}'}}", trust=True)
    assert load_data(trusted, _one_process()).stream_index.total == 4
    assert (tmp_path / "pwned").exists()


def test_no_recipe_key_can_allow_commands(tmp_path):
    with pytest.raises(RecipeError, match="trust_code"):
        _recipe(tmp_path, "trust_code=true")
    path = tmp_path / "t.yaml"
    path.write_text("# r\ntrust_code: true\ntrain: {max_steps: 2}\n", encoding="utf-8")
    with pytest.raises(RecipeError, match="trust_code"):
        load_recipe(path)
    with pytest.raises(DataError, match=r"unknown option\(s\) commands"):
        open_stream({"name": "webdataset", "urls": "pipe:cat x.tar", "options": {"commands": True}})


def test_the_trust_travels_with_the_stream_into_data_loader_workers(tmp_path):
    scenes = _scenes(8)
    paths = write_webdataset(tmp_path, scenes, 4)
    spec = {"name": "webdataset", "urls": [f"pipe:cat {p}" for p in paths], "shuffle_buffer": 0}

    def ids(source: ShardSet) -> list[str]:
        loader = StreamLoader(ExampleStream(source, spec), batch_size=2, collate_fn=_record, num_workers=2)
        it = iter(loader)
        try:
            return sorted(i for _ in range(4) for i in next(it)["ids"])
        except DataError as error:
            message = str(error)
        finally:
            it.close()  # the workers stop here, not when a later test collects them
            gc.collect()
        raise DataError(message)

    trusted = open_stream(spec, policy=TRUSTED)
    assert ids(trusted) == sorted(s["id"] for s in scenes)
    untrusted = ShardSet(trusted.spec, trusted.index)  # the same shards, counted, but no trust given
    with pytest.raises(DataError, match="--trust-recipe-code"):
        ids(untrusted)


# --------------------------------------------------------------------------- remote reads that cannot hang


@pytest.fixture
def stalled_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    stop.set()
    for conn in held:
        conn.close()
    server.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def slow_site(tmp_path):
    """An HTTP server on 127.0.0.1 serving two shards; ``stall.tar`` sends its headers and 1 KB, then stalls."""
    site = tmp_path / "site"
    write_webdataset(site, _scenes(8), 4)
    release = threading.Event()

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802 - http.server's name
            if "stall" not in self.path:
                return super().do_GET()
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b"\0" * 1024)
            self.wfile.flush()
            release.wait(120)

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", site
    release.set()
    server.shutdown()
    server.server_close()


def test_a_stalled_server_times_out_naming_the_url(stalled_server):
    url = f"http://127.0.0.1:{stalled_server}/shard-00000.tar"
    error = _finishes(lambda: open_stream({"name": "webdataset", "urls": url}, policy=QUICK))
    assert isinstance(error, DataError), error
    assert f"cannot read shard {url}: timed out" in str(error), str(error)


def test_a_server_that_stalls_inside_a_shard_times_out_naming_it(slow_site):
    base, site = slow_site
    good = [f"{base}/shard-00000.tar", f"{base}/shard-00001.tar"]
    source = open_stream({"name": "webdataset", "urls": good, "shuffle_buffer": 0}, policy=QUICK)
    (site / "stall.tar").write_bytes((site / "shard-00000.tar").read_bytes())  # counted as the first shard
    stalled = ShardSet(source.spec, source.index.for_urls([f"{base}/stall.tar", good[1]]), policy=QUICK)
    stream = ExampleStream(stalled)
    error = _finishes(lambda: next(iter(stream)))
    assert isinstance(error, DataError), error
    assert f"cannot read shard {base}/stall.tar: timed out" in str(error), str(error)


def test_a_pipe_command_that_never_ends_times_out(tmp_path):
    shard = write_webdataset(tmp_path, _scenes(4), 4)[0]
    policy = ReadPolicy(commands=True, timeout_s=1.0)
    for command in ("sleep 300", f"cat {shard}; sleep 300"):  # no output; output, then no end
        started = time.monotonic()
        error = _finishes(lambda: open_stream({"name": "webdataset", "urls": f"pipe:{command}"}, policy=policy))
        assert isinstance(error, DataError), error
        assert f"pipe:{command} gave no output for 1 s (data.read_timeout_s); it was stopped" in str(error)
        assert time.monotonic() - started < 60


def test_a_pipe_command_that_writes_much_to_stderr_is_read_and_its_error_named(tmp_path):
    """Hostile round 4: a command writing over 64 kB to its standard error (``curl -v``) stopped on the full pipe,
    and the read timed out (without a timeout it would have hung)."""
    shard = write_webdataset(tmp_path, _scenes(4), 4)[0]
    policy = ReadPolicy(commands=True, timeout_s=5.0)
    chatty = f"pipe:head -c 300000 /dev/zero | tr '\\0' x >&2; cat {shard}"
    error = _finishes(lambda: open_stream({"name": "webdataset", "urls": chatty}, policy=policy))
    assert error is None, error
    failing = f"pipe:head -c 300000 /dev/zero | tr '\\0' x >&2; cat {shard}; echo the-last-words >&2; exit 3"
    with pytest.raises(DataError, match=r"exited with status 3: x*the-last-words"):
        open_stream({"name": "webdataset", "urls": failing}, policy=policy)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(datetime.datetime(2020, 1, 1))
            .not_valid_after(datetime.datetime(2040, 1, 1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return folder / "cert.pem", folder / "key.pem"


@pytest.fixture
def tls_server(tmp_path):
    class Nothing(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    cert, key = _self_signed(tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Nothing)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_refused_tls_and_not_found_are_told_apart(slow_site, tls_server):
    """Issue 40: a TLS mismatch and a refused connection were both ``FileNotFoundError: URL``."""
    base, _ = slow_site
    refused = f"http://127.0.0.1:{_free_port()}/shard-00000.tar"
    cases = {
        refused: "the connection was refused: nothing listens at that host and port",
        f"https://127.0.0.1:{tls_server}/shard-00000.tar": r"TLS failed \(.*CERTIFICATE_VERIFY_FAILED.*\): the "
                                                           r"server's certificate is not trusted",
        f"{base}/missing.tar": r"not found \(HTTP 404\)",
        f"http://127.0.0.1:{tls_server}/shard-00000.tar": "the server closed the connection",
    }
    for url, cause in cases.items():
        with pytest.raises(DataError) as info:
            open_stream({"name": "webdataset", "urls": url}, policy=QUICK)
        assert f"cannot read shard {url}: " in str(info.value), str(info.value)
        assert __import__("re").search(cause, str(info.value)), str(info.value)
    with pytest.raises(DataError) as info:  # a password in the URL is never shown
        open_stream({"name": "webdataset", "urls": refused.replace("//", "//me:pa55word@")}, policy=QUICK)
    assert "pa55word" not in str(info.value) and "http://***@127.0.0.1" in str(info.value)


def test_server_errors_unknown_options_and_broken_transfers_are_named(tmp_path):
    """Hostile round 4: an HTTP 500 and an option aiohttp does not take were both "not found"."""
    shard = write_webdataset(tmp_path, _scenes(4), 4)[0]
    data = shard.read_bytes()

    class Odd(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):  # noqa: N802 - http.server's name
            self.send_response(500 if "error" in self.path else 200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()

        def do_GET(self):  # noqa: N802
            self.do_HEAD()
            if "short" in self.path:
                self.wfile.write(data[: len(data) // 2])  # then the connection closes

    server = ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        cases = [({"urls": f"{base}/error.tar"}, r"the server answered HTTP 500: a server error"),
                 ({"urls": f"{base}/x.tar", "options": {"storage_options": {"key": "AKIAIOSFODNN7EXAMPLE"}}},
                  r"an option the filesystem does not take .*'key'.*check data\.train\.options\.storage_options"),
                 ({"urls": f"{base}/short.tar"}, "the transfer broke off before the end of the shard")]
        for entry, cause in cases:
            with pytest.raises(DataError, match=rf"cannot read shard {base}/\w+\.tar: {cause}"):
                open_stream({"name": "webdataset", **entry}, policy=QUICK)
    finally:
        server.shutdown()
        server.server_close()


def test_s3_reads_time_out_and_name_a_missing_key(tmp_path, s3_server, stalled_server):  # noqa: F811
    _upload(s3_server, "bucket", write_webdataset(tmp_path, _scenes(4), 4))
    with pytest.raises(DataError, match=r"cannot read shard s3://bucket/nothing\.tar: not found"):
        open_stream({"name": "webdataset", "urls": "s3://bucket/nothing.tar"}, policy=QUICK)
    stalled = {"name": "webdataset", "urls": "s3://bucket/shard-00000.tar",
               "options": {"storage_options": {"endpoint_url": f"http://127.0.0.1:{stalled_server}"}}}
    error = _finishes(lambda: open_stream(stalled, policy=QUICK))
    assert isinstance(error, DataError) and "cannot read shard s3://bucket/shard-00000.tar: timed out" in str(error)


def test_the_read_timeout_is_a_recipe_key(tmp_path):
    from finetune.training.inputs import read_policy

    assert read_policy(_recipe(tmp_path)) == ReadPolicy(commands=False, timeout_s=60.0)
    assert read_policy(_recipe(tmp_path, "data.read_timeout_s=5", trust=True)) == ReadPolicy(True, 5.0)
    for bad in ("0", "1e9"):
        with pytest.raises(RecipeError, match=r"data\.read_timeout_s"):
            _recipe(tmp_path, f"data.read_timeout_s={bad}")


# --------------------------------------------------------------------------- shards that changed or are no tar


def _rewrite_same_count(shard: Path) -> None:
    """The shard written again with as many samples, other captions (another crawl of the same ids)."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w") as tar:
        for member, data in members:
            if member.name.endswith(".txt"):
                data = b"a different caption for " + data
                member.size = len(data)
            tar.addfile(member, __import__("io").BytesIO(data))


def test_a_resume_after_a_shard_was_rewritten_with_the_same_count_is_refused(tmp_path, caplog):
    from finetune.training.inputs import resumed_index

    paths = write_webdataset(tmp_path / "shards", _scenes(8), 4)
    urls = str(tmp_path / "shards" / "shard-{00000..00001}.tar")
    recipe = _recipe(tmp_path, f"data.train={{name: webdataset, urls: '{urls}'}}")
    saved = open_stream(recipe.data.train).index.to_json()  # what a checkpoint's stream_index.json holds
    assert all(s["head_sha256"] and s["bytes"] == p.stat().st_size for s, p in zip(saved["shardlist"], paths))
    assert resumed_index(recipe, saved, tmp_path).counts == [4, 4]  # unchanged: resumes
    _rewrite_same_count(paths[1])
    assert build_index([str(p) for p in paths], "webdataset").counts == [4, 4]  # the count cannot tell
    with pytest.raises(DataError, match=r"train\.resume: 1 shard\(s\) of data\.train changed since the checkpoint .*"
                                        r"shard-00001\.tar: [\d,]+ bytes, now [\d,]+.*train\.resume_ignore_changes"):
        resumed_index(recipe, saved, tmp_path)
    same_size = _recipe(tmp_path, f"data.train={{name: webdataset, urls: '{urls}'}}")
    saved = open_stream(same_size.data.train).index.to_json()
    data = bytearray(paths[0].read_bytes())
    data[600:603] = b"XYZ"  # the first image's bytes: same size, other content
    paths[0].write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard-00000\.tar: its first 64 KiB differ"):
        resumed_index(same_size, saved, tmp_path)
    ignoring = _recipe(tmp_path, f"data.train={{name: webdataset, urls: '{urls}'}}", "train.resume_ignore_changes=true")
    assert resumed_index(ignoring, saved, tmp_path).counts == [4, 4]
    assert "1 shard(s) changed since the checkpoint was saved" in caplog.text


def test_a_saved_index_masks_url_credentials_and_matches_re_signed_urls(tmp_path, slow_site):
    base, site = slow_site
    urls = [f"{base}/shard-00000.tar?sig=first-signature", f"{base}/shard-00001.tar?sig=first-signature"]
    index = open_stream({"name": "webdataset", "urls": urls}, policy=QUICK).index
    saved = json.dumps(index.to_json())
    assert "first-signature" not in saved and "sig=***" in saved
    later = [u.replace("first", "second") for u in urls]  # signed again: the same shards
    loaded = type(index).from_json(json.loads(saved), "webdataset", where="stream_index.json")
    assert loaded.matches(later) and loaded.for_urls(later).urls == later
    assert changed_shards(loaded.for_urls(later), policy=QUICK) == []
    (site / "garbage.tar").write_bytes(os.urandom(1024))  # a broken shard: named in the stream's report
    spec = {"name": "webdataset", "urls": [*later, f"{base}/garbage.tar?sig=second-signature"], "shuffle_buffer": 0}
    stream = ExampleStream(open_stream(spec, policy=QUICK), spec)
    assert len([e for _, e in zip(range(8), stream)]) == 8
    report = json.dumps({"report": stream.report(), "state": stream.state_dict()})
    assert "second-signature" not in report and f"{base}/garbage.tar?sig=***" in report


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_that_is_no_tar_is_counted_as_skipped(tmp_path, num_workers):
    """Issue 40: a not-a-tar or 0-byte shard was warned about but ``skipped_shard_count`` stayed 0."""
    scenes = _scenes(8)
    good = write_webdataset(tmp_path, scenes, 4)
    (tmp_path / "empty.tar").write_bytes(b"")
    (tmp_path / "garbage.tar").write_bytes(os.urandom(2048))
    urls = [str(good[0]), str(tmp_path / "empty.tar"), str(good[1]), str(tmp_path / "garbage.tar")]
    spec = {"name": "webdataset", "urls": urls, "shuffle_buffer": 0}
    source = open_stream(spec)
    assert source.index.counts == [4, 0, 4, 0] and len(source.index.broken) == 2
    loader = StreamLoader(ExampleStream(source, spec), batch_size=2, collate_fn=_record, num_workers=num_workers)
    it = iter(loader)
    ids = [i for _ in range(4) for i in next(it)["ids"]]  # one epoch
    assert sorted(ids) == sorted(s["id"] for s in scenes)
    report = loader.report()
    assert report["skipped_shard_count"] == 2, report
    assert sorted(e["shard"] for e in report["skipped_shards"]) == sorted(urls[1::2])
    reasons = {e["shard"]: e["reason"] for e in report["skipped_shards"]}
    assert "without the tar end-of-archive block" in reasons[urls[1]] and "damaged tar header" in reasons[urls[3]]
