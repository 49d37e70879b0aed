"""Hostile round 4 (issue 40, item 7): new cases on the surfaces of the round (remote shards, ``pipe:``, the
``validate`` / ``download`` / ``copy`` / ``superpixels`` commands, a resume after the data changed, secrets, limits),
each run for real on this machine with local servers only, and recorded as ``{id, surface, input, expected, observed,
held}`` in ``bench/results/hostile_round4.json``.

Run ``python bench/hostile_round4.py`` (about two minutes on a shared 2-core CPU); ``--only ID ...`` runs some cases.
A case "holds" when what was observed is what a user may rely on (the expected column); the failures found by the
first run of this file were fixed in the same branch (each with a test) and are listed in the report with the run
that found them; those of other sessions' scope are marked ``scope``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

from finetune.data.images import DataError  # noqa: E402
from finetune.data.streams import ExampleStream, open_stream  # noqa: E402
from finetune.data.streams.urls import ReadPolicy  # noqa: E402

CASES: list[tuple[str, str, str, str, str | None, Callable[[Path], tuple[str, bool]]]] = []
TRUSTED = ReadPolicy(commands=True, timeout_s=2.0)
QUICK = ReadPolicy(timeout_s=2.0)


def case(surface: str, given: str, expected: str, scope: str | None = None):
    """Register a case: ``fn(tmp) -> (observed, held)``; ``scope``: the other session whose work a failure is."""
    def register(fn):
        CASES.append((fn.__name__, surface, given, expected, scope, fn))
        return fn
    return register


def _scenes(n: int) -> list[dict]:
    from tests.finetune.data.test_streams import _scenes as scenes

    return scenes(n)


def _shards(folder: Path, n: int = 8, per: int = 4) -> list[Path]:
    from tests.finetune.data.test_streams import write_webdataset

    return write_webdataset(folder, _scenes(n), per)


def _error(fn: Callable[[], Any], limit: float = 60.0) -> str | None:
    """What ``fn`` raised, as text (None when it returned); ``"HANG"`` past ``limit`` seconds."""
    box: list = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as error:  # recorded
            box.append(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    return box[0] if box else "HANG"


def _cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "finetune.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@contextlib.contextmanager
def _site(folder: Path, handler: type | None = None):
    handler = handler or functools.partial(_Quiet, directory=str(folder))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _status_handler(status: int):
    class Status(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET  # noqa: N815

    return Status


def _recipe(folder: Path, *overrides: str, trust: bool = False):
    from finetune.config import load_recipe

    path = folder / "r.yaml"
    path.write_text("# hostile\ntrain: {max_steps: 2}\neval: {sets: []}\n", encoding="utf-8")
    return load_recipe(path, list(overrides), trust_imports=trust)


# ------------------------------------------------------------------------------------------------- pipe: commands


@case("pipe:", "pipe:true (exit 0, no output), trusted", "refused: the shards hold no samples")
def pipe_empty_output(tmp):
    err = _error(lambda: open_stream({"name": "webdataset", "urls": "pipe:true"}, policy=TRUSTED))
    return err or "opened", bool(err) and "no samples" in err or "end-of-archive" in (err or "")


@case("pipe:", "pipe:head -c 3000 /dev/urandom (not a tar), trusted", "a broken shard, named; no hang")
def pipe_garbage(tmp):
    err = _error(lambda: open_stream({"name": "webdataset", "urls": "pipe:head -c 3000 /dev/urandom"},
                                     policy=TRUSTED))
    return err or "opened", err is not None and err != "HANG"


@case("pipe:", "urls: [LOCAL shard, 'pipe:touch pwned2; cat LOCAL'], no trust",
      "refused naming the pipe: url, the file never created")
def pipe_in_a_list(tmp):
    shards = _shards(tmp / "s")
    urls = [str(shards[0]), f"pipe:touch {tmp / 'pwned2'}; cat {shards[1]}"]
    err = _error(lambda: open_stream({"name": "webdataset", "urls": urls}))
    return err or "opened", "--trust-recipe-code" in (err or "") and not (tmp / "pwned2").exists()


@case("pipe:", "PIPE:touch pwned3 (upper case), no trust", "not a command: a missing local file; nothing runs")
def pipe_upper_case(tmp):
    err = _error(lambda: open_stream({"name": "webdataset", "urls": f"PIPE:touch {tmp / 'pwned3'}"}))
    return err or "opened", "do not exist" in (err or "") and not (tmp / "pwned3").exists()


@case("pipe:", "' pipe:touch pwned4' (a leading space), no trust", "a missing local file; nothing runs")
def pipe_leading_space(tmp):
    err = _error(lambda: open_stream({"name": "webdataset", "urls": f" pipe:touch {tmp / 'pwned4'}"}))
    return err or "opened", err is not None and not (tmp / "pwned4").exists()


@case("pipe:", "pipe:cat shard-{00000..00001}.tar (a brace range in a command), trusted", "two shards, 8 samples")
def pipe_brace_range(tmp):
    _shards(tmp / "s")
    source = open_stream({"name": "webdataset", "urls": f"pipe:cat {tmp}/s/shard-{{00000..00001}}.tar"},
                         policy=TRUSTED)
    return f"{source.num_shards} shards, {source.num_examples} samples", source.num_examples == 8


@case("pipe:", "a command writing 300 kB to stderr before the shard, trusted", "read; not a timeout")
def pipe_chatty_stderr(tmp):
    shard = _shards(tmp / "s")[0]
    err = _error(lambda: open_stream({"name": "webdataset", "urls": f"pipe:head -c 300000 /dev/zero >&2; cat {shard}"},
                                     policy=TRUSTED))
    return err or "opened", err is None


@case("pipe:", "a command killed by SIGKILL after its output, trusted", "an error naming the status")
def pipe_killed(tmp):
    shard = _shards(tmp / "s")[0]
    err = _error(lambda: open_stream({"name": "webdataset", "urls": f"pipe:cat {shard}; kill -9 $$"},
                                     policy=TRUSTED))
    return err or "opened", "exited with status -9" in (err or "")


@case("pipe:", "a command that ends its output and keeps running (sleep 300 in the background), trusted",
      "read within the timeout; the background process killed with the group")
def pipe_background_child(tmp):
    shard = _shards(tmp / "s")[0]
    marker = tmp / "alive"
    cmd = f"(sleep 300; touch {marker}) >/dev/null 2>&1 & cat {shard}"
    started = time.monotonic()
    err = _error(lambda: open_stream({"name": "webdataset", "urls": f"pipe:{cmd}"}, policy=TRUSTED))
    for _ in range(50):  # a killed process is listed until the kernel has run its exit (a loaded machine: a moment)
        alive = subprocess.run(["pgrep", "-f", f"sleep 300; touch {marker}"], capture_output=True).returncode == 0
        if not alive:
            break
        time.sleep(0.1)
    return f"{err or 'opened'} in {time.monotonic() - started:.1f} s; background alive: {alive}", err is None and \
        not alive


@case("pipe:", "a pipe: command hanging in a data-loader worker (index given, so the count does not read it)",
      "the worker's read times out; the error names the shard in the training process")
def pipe_hang_in_worker(tmp):
    from finetune.data.streams import StreamLoader

    (tmp / "index.json").write_text(json.dumps({"wids_version": 1, "shardlist": [
        {"url": "pipe:sleep 300", "nsamples": 4}]}))
    spec = {"name": "webdataset", "urls": "pipe:sleep 300", "options": {"index": str(tmp / "index.json")},
            "shuffle_buffer": 0}
    loader = StreamLoader(ExampleStream(open_stream(spec, policy=TRUSTED), spec), batch_size=2,
                          collate_fn=lambda ex: {"ids": [e["id"] for e in ex]}, num_workers=1)
    it = iter(loader)
    err = _error(lambda: next(it), 120)
    it.close()
    return err or "a batch", "gave no output for 2 s" in (err or "") and "pipe:sleep 300" in (err or "")


# ------------------------------------------------------------------------------------------------- remote shards


@case("remote", "http URL with ?sig=SECRET to a refused port", "refused, named, the signature masked")
def refused_signed(tmp):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    err = _error(lambda: open_stream({"name": "webdataset", "urls": f"http://127.0.0.1:{port}/x.tar?sig=S3CR3Tsig"},
                                     policy=QUICK))
    return err or "opened", "sig=***" in (err or "") and "S3CR3Tsig" not in err and "refused" in err


@case("remote", "http server answering 403", "access denied, named")
def http_403(tmp):
    with _site(tmp, _status_handler(403)) as base:
        err = _error(lambda: open_stream({"name": "webdataset", "urls": f"{base}/x.tar"}, policy=QUICK))
    return err or "opened", "access denied" in (err or "")


@case("remote", "http server answering 500", "an error naming the URL and the status")
def http_500(tmp):
    with _site(tmp, _status_handler(500)) as base:
        err = _error(lambda: open_stream({"name": "webdataset", "urls": f"{base}/x.tar"}, policy=QUICK))
    return err or "opened", f"{base}/x.tar" in (err or "") and "500" in err


@case("remote", "http server that cuts a shard short (Content-Length larger than the body)",
      "the shard named as broken or unreadable; no hang")
def http_truncated(tmp):
    shard = _shards(tmp / "s")[0]
    data = shard.read_bytes()

    class Short(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])

        def do_HEAD(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()

    with _site(tmp, Short) as base:
        err = _error(lambda: open_stream({"name": "webdataset", "urls": f"{base}/x.tar"}, policy=QUICK))
    return err or "opened", err is not None and err != "HANG" and f"{base}/x.tar" in err


@case("remote", "http server that sends 1 byte per second (alive but slow), read_timeout_s=2",
      "timed out naming the shard (each piece must arrive within the timeout)")
def http_drip(tmp):
    class Drip(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "10000")
            self.end_headers()

        def do_GET(self):  # noqa: N802
            self.do_HEAD()
            with contextlib.suppress(OSError):
                for _ in range(30):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(1)

    with _site(tmp, Drip) as base:
        err = _error(lambda: open_stream({"name": "webdataset", "urls": f"{base}/x.tar"}, policy=QUICK), 90)
    return err or "opened", "timed out" in (err or "")


@case("remote", "https://user:PASSWORD@host that does not resolve (.invalid)", "named, the password masked")
def unresolvable(tmp):
    err = _error(lambda: open_stream({"name": "webdataset", "urls": "https://me:PA55W0RD@shards.invalid/x.tar"},
                                     policy=QUICK))
    return err or "opened", "PA55W0RD" not in (err or "x") and "https://***@shards.invalid/x.tar" in err


@case("remote", "storage_options {key: X} for an https:// url (an option aiohttp does not take)",
      "an error naming storage_options, the key masked")
def http_bad_option(tmp):
    _shards(tmp / "site")
    with _site(tmp / "site") as base:
        err = _error(lambda: open_stream({"name": "webdataset", "urls": f"{base}/shard-00000.tar",
                                          "options": {"storage_options": {"key": "AKIAIOSFODNN7EXAMPLE"}}},
                                         policy=QUICK))
    return err or "opened", err is not None and "AKIAIOSFODNN7EXAMPLE" not in err and "storage_options" in err


@case("remote", "data.read_timeout_s=1e30 / 0 / -1 / 'abc'", "each refused naming the key")
def timeout_bounds(tmp):
    from finetune.config import RecipeError

    out = []
    for bad in ("1e30", "0", "-1", "abc"):
        try:
            _recipe(tmp, f"data.read_timeout_s={bad}")
            out.append(f"{bad}: accepted")
        except RecipeError as error:
            out.append(f"{bad}: {'named' if 'data.read_timeout_s' in str(error) else 'unnamed'}")
    return "; ".join(out), all(o.endswith("named") and "unnamed" not in o for o in out)


@case("remote", "file:// URL of a local shard", "read as a local file")
def file_url(tmp):
    shard = _shards(tmp / "s")[0]
    source = open_stream({"name": "webdataset", "urls": f"file://{shard}"})
    return f"{source.num_examples} samples", source.num_examples == 4


@case("remote", "s3:// with no credentials anywhere (moto endpoint, AWS_* unset)", "an error saying no credentials")
def s3_no_credentials(tmp):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    code = ("import os; from finetune.data.streams import open_stream; from finetune.data.streams.urls import "
            "ReadPolicy\ntry:\n open_stream({'name': 'webdataset', 'urls': 's3://b/x.tar', 'options': "
            "{'storage_options': {'endpoint_url': 'http://127.0.0.1:9'}}}, policy=ReadPolicy(timeout_s=2))\n"
            "except Exception as e: print(e)")
    env.update(PYTHONPATH=str(REPO), AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    text = (out.stdout + out.stderr).strip().splitlines()[-1] if (out.stdout + out.stderr).strip() else ""
    return text, "no credentials" in text or "refused" in text


# ------------------------------------------------------------------------------------------------- secrets


@case("secrets", "storage_options.key=AKIA... override plus a bad key (train.bogus=1)", "the error masks the key id")
def secret_in_error(tmp):
    from finetune.config import RecipeError

    try:
        _recipe(tmp, "data.train.options.storage_options.key=AKIAIOSFODNN7EXAMPLE", "train.bogus=1")
        return "accepted", False
    except RecipeError as error:
        return str(error)[:200], "AKIAIOSFODNN7EXAMPLE" not in str(error)


@case("secrets", "an override of the wrong type holding a URL password (data.train.urls={a: https://u:PW@h})",
      "the error masks the password")
def url_password_in_error(tmp):
    from finetune.config import RecipeError

    try:
        _recipe(tmp, "data.train={name: webdataset, urls: {a: 'https://u:PW0RD99@h/x.tar'}}")
        return "accepted", False
    except (RecipeError, DataError) as error:
        return str(error)[:200], "PW0RD99" not in str(error)


@case("secrets", "GCS token given as a service-account mapping under storage_options.token",
      "recipe.yaml shows token: '***'; the private key nowhere")
def gcs_token_mapping(tmp):
    from finetune.config import dump_recipe

    recipe = _recipe(tmp, "data.train={name: webdataset, urls: 'gs://b/x.tar', options: {storage_options: "
                          "{token: {type: service_account, private_key: PRIVKEY123456, client_email: a@b}}}}")
    text = dump_recipe(recipe, tmp / "run" / "recipe.yaml").read_text()
    return [line.strip() for line in text.splitlines() if "token" in line][0], "PRIVKEY123456" not in text


@case("secrets", "an eval set whose path is https://u:PASSWORD@host/x.jsonl", "recipe.yaml masks the password")
def eval_path_password(tmp):
    from finetune.config import dump_recipe

    recipe = _recipe(tmp, "eval.sets=[{name: jsonl, path: 'https://u:EVALPW123@h/x.jsonl'}]")
    text = dump_recipe(recipe, tmp / "run" / "recipe.yaml").read_text()
    return [line.strip() for line in text.splitlines() if "path" in line][0], "EVALPW123" not in text


@case("secrets", "a password that is literally '***' (a masked recipe.yaml run again)",
      "refused before anything is read, naming the key")
def masked_credential_run(tmp):
    err = _error(lambda: open_stream({"name": "webdataset", "urls": "s3://b/x.tar",
                                      "options": {"storage_options": {"secret": "***"}}}, policy=QUICK))
    return err or "opened", "storage_options.secret is '***'" in (err or "")


@case("secrets", "a masked signed URL (…?sig=***) from a run's recipe.yaml", "refused, saying the URL was masked")
def masked_url_run(tmp):
    err = _error(lambda: open_stream({"name": "webdataset", "urls": "https://h/x.tar?sig=***"}, policy=QUICK))
    return err or "opened", "masked" in (err or "")


@case("secrets", "push --stage-only of a run folder written before masking (plain key/secret in recipe.yaml, "
                 "metrics.json, xlipkit.json)", "no file of the staged folder holds them")
def stage_old_run(tmp):
    import yaml

    from finetune.hub.upload import stage_upload
    from finetune.models.finetuned import load_model, save_finetuned
    from finetune.models.registry import save_tiny

    tiny = save_tiny("tiny-clip", tmp / "tiny")
    run = tmp / "run"
    creds = {"key": "AKIAIOSFODNN7EXAMPLE", "secret": "OLDSECRETVALUE1234"}
    recipe = {"model": {"name_or_path": str(tiny)}, "data": {"train": {"name": "webdataset", "urls": "s3://b/x.tar",
              "options": {"storage_options": creds}}}, "hub": {}}
    save_finetuned(load_model(str(tiny)), run / "final", recipe=recipe)
    (run / "recipe.yaml").write_text("# old\n" + yaml.safe_dump(recipe))
    (run / "metrics.json").write_text(json.dumps({"recipe": recipe, "train_stream": {"skipped_shards": [
        {"shard": "https://u:OLDSECRETVALUE1234@h/x.tar", "reason": "r"}]}}))
    staged = stage_upload(run, tmp / "staged", repo_id="me/x")
    leaks = [str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()
             and any(v.encode() in p.read_bytes() for v in creds.values())]
    return f"files holding a credential: {leaks}", not leaks


@case("secrets", "a 1 MiB recipe value of 'a-a-...-token' in an error message", "masked in under a few seconds")
def masking_hostile_text(tmp):
    from finetune.config.secrets import mask_secrets

    started = time.monotonic()
    err = _error(lambda: mask_secrets("a-" * (1 << 19) + "token: x"), 120)
    return f"{err or 'masked'} in {time.monotonic() - started:.1f} s", err is None


# ---------------------------------------------------------------------------------------- resume after the data changed


def _index(tmp: Path, urls: Any) -> tuple[Any, dict]:
    recipe = _recipe(tmp, f"data.train={{name: webdataset, urls: {json.dumps(urls)}}}")
    return recipe, open_stream(recipe.data.train).index.to_json()


@case("resume", "a shard deleted since the checkpoint", "refused naming the missing shard")
def resume_deleted(tmp):
    from finetune.training.inputs import resumed_index

    shards = _shards(tmp / "s")
    recipe, saved = _index(tmp, [str(p) for p in shards])
    shards[1].unlink()
    err = _error(lambda: resumed_index(recipe, saved, tmp))
    return err or "resumed", "do not exist" in (err or "")


@case("resume", "a shard added to data.train.urls since the checkpoint", "refused: other shards")
def resume_added(tmp):
    from finetune.training.inputs import resumed_index

    shards = _shards(tmp / "s", 12)
    recipe, saved = _index(tmp, [str(p) for p in shards[:2]])
    more = _recipe(tmp, f"data.train={{name: webdataset, urls: {json.dumps([str(p) for p in shards])}}}")
    err = _error(lambda: resumed_index(more, saved, tmp))
    return err or "resumed", "other shards" in (err or "")


@case("resume", "a shard's last image changed in place (same size, first 64 KiB the same)",
      "not found: the fingerprint reads the first 64 KiB only (a documented limit)")
def resume_tail_change(tmp):
    from finetune.training.inputs import resumed_index

    shards = _shards(tmp / "s")
    recipe, saved = _index(tmp, [str(p) for p in shards])
    data = bytearray(shards[0].read_bytes())
    data[-1500] ^= 0xFF  # inside the last member's data (the shard is < 64 KiB here: the head covers it)
    shards[0].write_bytes(bytes(data))
    err = _error(lambda: resumed_index(recipe, saved, tmp))
    small = len(data) <= 64 << 10
    return (err or "resumed") + f" (shard of {len(data)} bytes)", (err is not None) if small else err is None


@case("resume", "the same shards behind a symbolic link to a copy (identical bytes)", "resumes")
def resume_symlink_copy(tmp):
    from finetune.training.inputs import resumed_index

    shards = _shards(tmp / "s")
    recipe, saved = _index(tmp, [str(p) for p in shards])
    copy = tmp / "copy.tar"
    copy.write_bytes(shards[0].read_bytes())
    shards[0].unlink()
    shards[0].symlink_to(copy)
    err = _error(lambda: resumed_index(recipe, saved, tmp))
    return err or "resumed", err is None


@case("resume", "a pipe: shard whose command now gives other bytes (same count), trusted",
      "refused: its first bytes differ")
def resume_pipe_changed(tmp):
    from finetune.config import load_recipe
    from finetune.training.inputs import resumed_index

    shards = _shards(tmp / "s")
    path = tmp / "r.yaml"
    path.write_text("# r\ntrain: {max_steps: 2}\neval: {sets: []}\n")
    recipe = load_recipe(path, [f"data.train={{name: webdataset, urls: 'pipe:cat {shards[0]}'}}"], trust_imports=True)
    saved = open_stream(recipe.data.train, policy=TRUSTED).index.to_json()
    from tests.finetune.data.test_stream_reads import _rewrite_same_count

    _rewrite_same_count(shards[0])
    err = _error(lambda: resumed_index(recipe, saved, tmp))
    return err or "resumed", "changed since the checkpoint" in (err or "")


@case("resume", "an index saved before fingerprints existed (no head_sha256) and a changed shard",
      "resumes without a check (documented)")
def resume_old_index(tmp):
    from finetune.training.inputs import resumed_index

    shards = _shards(tmp / "s")
    recipe, saved = _index(tmp, [str(p) for p in shards])
    for entry in saved["shardlist"]:
        entry.pop("head_sha256")
        entry.pop("bytes")
    from tests.finetune.data.test_stream_reads import _rewrite_same_count

    _rewrite_same_count(shards[0])
    err = _error(lambda: resumed_index(recipe, saved, tmp))
    return err or "resumed", err is None


# ------------------------------------------------------------------------------------------------- commands


@case("validate", "xlipkit validate of a recipe whose data.train.urls is 'pipe:touch pwned5; ...'",
      "never runs the command; says train will need --trust-recipe-code",
      scope="preflight (issue 38): validate loads recipes with load_recipe's default trust_imports=True until the "
            "--trust-recipe-code flag lands; check_stream_recipe then refuses the command")
def validate_pipe(tmp):
    shard = _shards(tmp / "s")[0]
    (tmp / "r.yaml").write_text(f"# r\ndata:\n  train: {{name: webdataset, urls: 'pipe:touch {tmp}/pwned5; cat "
                                f"{shard}'}}\ntrain: {{max_steps: 2}}\neval: {{sets: []}}\n")
    out = _cli("validate", str(tmp / "r.yaml"), cwd=tmp)
    said = "trust-recipe-code" in out.stdout + out.stderr
    return f"exit {out.returncode}; mentions the flag: {said}; ran: {(tmp / 'pwned5').exists()}", \
        not (tmp / "pwned5").exists() and said


@case("download", "xlipkit download of a recipe with 'pipe:touch pwned6; ...' urls", "never runs the command")
def download_pipe(tmp):
    (tmp / "r.yaml").write_text(f"# r\ndata:\n  train: {{name: webdataset, urls: 'pipe:touch {tmp}/pwned6'}}\n"
                                "train: {max_steps: 2}\neval: {sets: []}\n")
    out = _cli("download", str(tmp / "r.yaml"), "--dry-run", cwd=tmp)
    return f"exit {out.returncode}; ran: {(tmp / 'pwned6').exists()}", not (tmp / "pwned6").exists()


@case("copy", "xlipkit copy quickstart DEST where DEST is a symbolic link to a folder", "copied inside the folder")
def copy_into_linked_folder(tmp):
    (tmp / "real").mkdir()
    (tmp / "link").symlink_to(tmp / "real")
    out = _cli("copy", "quickstart", str(tmp / "link"), cwd=tmp)
    return f"exit {out.returncode}", out.returncode == 0 and (tmp / "real" / "quickstart.yaml").is_file()


@case("copy", "xlipkit copy quickstart.yml (another extension)", "exit 2, the closest names")
def copy_yml(tmp):
    out = _cli("copy", "quickstart.yml", str(tmp / "x.yaml"), cwd=tmp)
    return f"exit {out.returncode}: {out.stderr.strip()[:160]}", out.returncode == 2 and "quickstart" in out.stderr


@case("copy", "xlipkit copy '' (an empty name)", "exit 2, no traceback")
def copy_empty(tmp):
    out = _cli("copy", "", str(tmp / "x.yaml"), cwd=tmp)
    return f"exit {out.returncode}: {out.stderr.strip()[:160]}", out.returncode == 2 and "Traceback" not in out.stderr


@case("copy", "xlipkit copy quickstart DIR, where DIR/quickstart.yaml is a link to /etc/hostname-like file",
      "refused; the linked file untouched")
def copy_link_inside_folder(tmp):
    (tmp / "dir").mkdir()
    victim = tmp / "victim.txt"
    victim.write_text("keep")
    (tmp / "dir" / "quickstart.yaml").symlink_to(victim)
    out = _cli("copy", "quickstart", str(tmp / "dir"), cwd=tmp)
    return f"exit {out.returncode}", out.returncode == 2 and victim.read_text() == "keep"


@case("superpixels", "OUT a symbolic link to the input shards' folder", "refused (paths resolved), inputs unchanged")
def superpixels_linked_out(tmp):
    from finetune.cli.superpixels import _check_out

    shards = _shards(tmp / "s")
    (tmp / "out").symlink_to(tmp / "s")
    try:
        _check_out(tmp / "out", [str(p) for p in shards], [p.name for p in shards])
        return "accepted", False
    except ValueError as error:
        return str(error)[:160], "folder of the input shards" in str(error)


@case("superpixels", "OUT the parent of the input folder (inputs in OUT/s/)", "accepted: the copies go beside")
def superpixels_parent_out(tmp):
    from finetune.cli.superpixels import _check_out

    shards = _shards(tmp / "s")
    _check_out(tmp, [str(p) for p in shards], [p.name for p in shards])
    return "accepted", True


@case("superpixels", "OUT holding notes.txt (not a shard name), no manifest", "accepted; notes.txt kept")
def superpixels_other_file(tmp):
    from finetune.cli.superpixels import _check_out

    shards = _shards(tmp / "s")
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("mine")
    _check_out(tmp / "out", [str(p) for p in shards], [p.name for p in shards])
    return "accepted", (tmp / "out" / "notes.txt").read_text() == "mine"


@case("superpixels", "OUT with a superpixels.json that is not JSON, shards of the same names",
      "refused naming the manifest")
def superpixels_bad_manifest(tmp):
    from finetune.cli.superpixels import MANIFEST, _read_manifest

    (tmp / MANIFEST).write_text("{not json")
    try:
        _read_manifest(tmp / MANIFEST)
        return "accepted", False
    except ValueError as error:
        return str(error)[:160], "superpixels.json" in str(error)


@case("superpixels", "xlipkit superpixels R OUT --workers 0", "exit 2, names --workers")
def superpixels_workers_zero(tmp):
    recipe = REPO / "recipes" / "fcast_tiny_synthetic.yaml"
    shards = _shards(tmp / "s")
    urls = f"data.train={{name: webdataset, urls: '{shards[0]}'}}"
    out = _cli("superpixels", str(recipe), str(tmp / "out"), urls, "--workers", "0", cwd=tmp)
    return f"exit {out.returncode}: {out.stderr.strip()[-160:]}", out.returncode == 2 and "--workers" in out.stderr


@case("superpixels", "data.train.urls 'pipe:touch pwned7; cat SHARD' with no --trust-recipe-code",
      "refused before any shard is read; the command never runs",
      scope="preflight (issue 38): superpixels loads recipes with load_recipe's default trust_imports=True until "
            "the --trust-recipe-code flag lands; precompute then refuses the command (check_commands)")
def superpixels_pipe(tmp):
    recipe = REPO / "recipes" / "fcast_tiny_synthetic.yaml"
    shard = _shards(tmp / "s")[0]
    urls = f"data.train={{name: webdataset, urls: 'pipe:touch {tmp}/pwned7; cat {shard}'}}"
    out = _cli("superpixels", str(recipe), str(tmp / "out"), urls, cwd=tmp)
    return f"exit {out.returncode}; ran: {(tmp / 'pwned7').exists()}", not (tmp / "pwned7").exists()


# ------------------------------------------------------------------------------------------------- limits


@case("limits", "a shard URL with a 100 kB query string holding token=", "opened or refused in seconds, masked")
def long_query(tmp):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x.tar?token=" + "T" * 100_000
    err = _error(lambda: open_stream({"name": "webdataset", "urls": url}, policy=QUICK))
    return (err or "opened")[:120], err is not None and err != "HANG" and "T" * 50 not in err


@case("limits", "2,000 shard URLs, each a local file, 500 of them 0-byte", "counted; the 500 named as broken")
def many_broken(tmp):
    shard = _shards(tmp / "s", 4, 4)[0]
    (tmp / "empty.tar").write_bytes(b"")
    urls = [str(shard) if i % 4 else str(tmp / "empty.tar") for i in range(2000)]
    source = open_stream({"name": "webdataset", "urls": urls})
    return f"{source.num_examples} samples, {len(source.index.broken)} broken urls", source.num_examples == 6000


@case("limits", "batch_size=2 with accumulation_steps=2 and the clip loss", "refused: each loss sees 1 example")
def batch_accumulation(tmp):
    from finetune.training.preflight import preflight

    recipe = _recipe(tmp, "train.batch_size=2", "train.accumulation_steps=2")
    problems = preflight(recipe, "r.yaml", output=False).message() or ""
    return problems[:160], "gives each loss 1 example" in problems


#: the cases that failed when first run on this branch, what they showed then, and the commit that fixed them
FOUND = {
    "pipe_chatty_stderr": "timed out: the command stopped on its full stderr pipe (64 kB) and gave no output for 3 s; "
                          "fixed by draining stderr as it comes (finetune/data/streams/remote.py)",
    "masking_hostile_text": "hub.token's key pattern took 40 s on 32 kB of 'a-a-...token' (quadratic; 1 MiB: hours); "
                            "the URL-query and URL-user patterns were quadratic too (5.9 s on 48 kB of '&sig...'); "
                            "fixed by taking names whole and testing them apart (finetune/config/secrets.py, "
                            "finetune/credentials.py)",
    "http_500": "'not found: check the URL' for an HTTP 500; fixed in read_failure",
    "http_bad_option": "'not found: check the URL' for storage_options {key: ...} on an https:// URL (aiohttp's "
                       "TypeError); fixed in read_failure",
    "http_truncated": "'ClientPayloadError: Response payload is not completed' (named, but not in words); fixed in "
                      "read_failure",
    "superpixels_pipe": "exit 0 and the command ran: superpixels loaded its recipe trusted (load_recipe's default "
                        "then); holds since main's preflight made load_recipe untrusted by default, precompute "
                        "refusing the command (check_commands) before the model loads",
    "validate_pipe": "exit 0, 'a valid recipe', no word of the trust flag: check_stream_recipe now refuses the "
                     "command without trust; validate still trusts every recipe until the flag lands (preflight)",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case ids to run")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "hostile_round4.json"))
    args = parser.parse_args()
    results = []
    for ident, surface, given, expected, scope, fn in CASES:
        if args.only and ident not in args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            try:
                observed, held = fn(Path(tmp))
            except BaseException as error:  # a case that crashed is a failure, recorded
                observed, held = f"crashed: {type(error).__name__}: {error}"[:400], False
        results.append({"id": ident, "surface": surface, "input": given, "expected": expected,
                        "observed": str(observed)[:400], "held": bool(held),
                        "seconds": round(time.monotonic() - started, 1),
                        **({"scope": scope} if scope and not held else {})})
        print(f"{'held ' if held else 'FAIL '} {ident}: {str(observed)[:150]}", flush=True)
    if not args.only:
        for result in results:
            if result["id"] in FOUND:
                result["failed_when_first_run"] = FOUND[result["id"]]
        Path(args.out).write_text(json.dumps({
            "cases": len(results), "held": sum(r["held"] for r in results),
            "failed": sum(not r["held"] for r in results),
            "failed_when_first_run": len(FOUND) + sum(not r["held"] and r["id"] not in FOUND for r in results),
            "machine": "the shared 2-core development CPU; local servers only (127.0.0.1, moto not needed)",
            "results": results}, indent=2) + "\n")
    print(f"{sum(r['held'] for r in results)} of {len(results)} held")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
