"""Where stream shards come from and how they end (finetune.data.streams: urls, tar, index, plan): shards cut inside a
tar header or a member counted and named (issue 31 item 7), pax names, every example once per epoch across workers on
uneven shards with the remainder carried into the next epoch, the exact block shuffle, a resume that reads only what
is left, a shard index file, and shards from ``pipe:`` commands, a local HTTP server and a local S3 server (moto's
server mode on 127.0.0.1; credentials from the environment, as botocore's chain reads them)."""

from __future__ import annotations

import collections
import functools
import io
import json
import os
import socket
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from finetune.data.sources import DataError
from finetune.data.streams import ExampleStream, StreamLoader, open_stream
from finetune.data.streams.tar import ShardEndedEarly, count_samples, iter_samples
from finetune.data.streams.urls import ReadPolicy
from tests.finetune.data.test_streams import _batches, _loader, _scenes, _write_sized, write_webdataset


@pytest.fixture(autouse=True)
def _quiet_datasets(monkeypatch):
    monkeypatch.setattr("datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def _cut_inside_header(shard: Path, member: int) -> None:
    """Cut a tar shard 100 bytes into the header of its ``member``-th member (a copy that stopped there)."""
    with tarfile.open(shard) as tar:
        offset = tar.getmembers()[member].offset
    shard.write_bytes(shard.read_bytes()[:offset + 100])


# --------------------------------------------------------------------------- shards that end early


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_cut_inside_a_tar_header_is_counted_and_named(tmp_path, num_workers):
    """Issue 31 item 7: tarfile takes a header cut short for the end of the archive, so this shard read as 10 whole
    samples of 16 with ``skipped_shard_count: 0``. It is now a broken shard like any other: counted, named, why."""
    scenes = _scenes(22)
    shards = write_webdataset(tmp_path, scenes[:16], 16) + write_webdataset(tmp_path / "b", scenes[16:], 6)
    _cut_inside_header(shards[0], 20)  # the first member of sample 10
    spec = {"name": "webdataset", "urls": [str(shards[0]), str(shards[1])], "shuffle_buffer": 0}
    loader = _loader(spec, num_workers)
    ids = [i for b in _batches(loader, 8) for i in b["ids"]]  # one epoch: 10 + 6 samples
    assert sorted(ids) == sorted(s["id"] for s in scenes[:10] + scenes[16:])
    report = loader.report()
    assert report["skipped_shard_count"] == 1
    assert report["skipped_shards"] == [{"shard": str(shards[0]),
                                         "reason": f"it ends inside the tar header after member {scenes[9]['id']}.txt"}]
    with pytest.raises(DataError, match=r"shard .*shard-00000\.tar cannot be read to its end \(it ends inside the tar "
                                        r"header after member .*\): it is truncated or damaged"):
        _batches(_loader(spec, num_workers, on_error="raise"), 8)


def test_tar_reader_finds_every_way_a_shard_ends_early_and_reads_pax_names(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for k in range(4):
            for ext, data in (("png", b"p" * 600), ("txt", f"caption {k}".encode())):
                info = tarfile.TarInfo(f"{'deep/' * 30}{k:03d}.{ext}")  # 180-character names: pax headers
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    samples = list(iter_samples(io.BytesIO(data)))
    assert [(i, key[-3:], sorted(e)) for i, key, e in samples] == [(k, f"{k:03d}", ["png", "txt"]) for k in range(4)]
    assert samples[2][2]["txt"] == b"caption 2" and count_samples(io.BytesIO(data)) == 4
    end = len(data.rstrip(b"\0"))
    whole = -(-end // 512) * 512
    cases = {  # where the copy stopped -> what the reader says, and how many whole samples it counts
        whole: ("without the tar end-of-archive block", 4),
        end - 5: ("inside the data of member", 3),
    }
    for cut, (words, count) in cases.items():
        with pytest.raises(ShardEndedEarly, match=words) as caught:
            count_samples(io.BytesIO(data[:cut]))
        assert caught.value.samples == count
    damaged = bytearray(data)
    damaged[1024 + 512 * 3 + 150] ^= 0xFF  # a byte of a later header's checksum field
    with pytest.raises(ShardEndedEarly, match="a damaged tar header"):
        count_samples(io.BytesIO(bytes(damaged)))


# --------------------------------------------------------------------------- epochs


def _epoch_of_example(stream_holder: list, example: dict) -> dict:
    info = torch.utils.data.get_worker_info()
    return {"epoch": (info.dataset if info is not None else stream_holder[0]).epoch}


def _recording(examples: list[dict]) -> dict:
    return {"seen": [(e["epoch"], e["id"]) for e in examples]}


@pytest.mark.parametrize("num_workers,shuffle_buffer", [(0, 1), (2, 1), (3, 4)])
def test_every_example_once_per_epoch_across_workers_on_uneven_shards(tmp_path, num_workers, shuffle_buffer):
    """23 samples in shards of 1 to 9 with 3 workers and batches of 2: each epoch's examples are exactly the 23, each
    once, whatever the shard sizes; a batch may hold the end of one epoch and the start of the next (23 does not
    divide into batches), nothing is dropped."""
    scenes = _scenes(23)
    _write_sized(tmp_path, scenes, [1, 7, 3, 9, 2, 1])
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00005}.tar"), "seed": 3,
            "shuffle_buffer": shuffle_buffer}
    holder: list = []
    stream = ExampleStream(open_stream(spec), spec, transform=functools.partial(_epoch_of_example, holder))
    holder.append(stream)
    loader = StreamLoader(stream, batch_size=2, collate_fn=_recording, num_workers=num_workers)
    it = iter(loader)
    seen = [pair for _ in range(36) for pair in next(it)["seen"]]  # 72 examples: 3 epochs and a little
    by_epoch = collections.defaultdict(list)
    for epoch, ident in seen:
        by_epoch[epoch].append(ident)
    for epoch in (0, 1, 2):
        assert sorted(by_epoch[epoch]) == sorted(s["id"] for s in scenes), epoch


def test_block_shuffle_is_exact_on_resume(tmp_path):
    scenes = _scenes(20)
    write_webdataset(tmp_path, scenes, 5)
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00003}.tar"), "seed": 1, "shuffle_buffer": 6}
    whole = [e["id"] for _, e in zip(range(45), ExampleStream(open_stream(spec), spec))]
    assert sorted(whole[:20]) == sorted(s["id"] for s in scenes)
    unbuffered = {**spec, "shuffle_buffer": 1}
    plain = [e["id"] for _, e in zip(range(20), ExampleStream(open_stream(unbuffered), unbuffered))]
    assert whole[:20] != plain  # shuffled within blocks, not only by shard
    first = ExampleStream(open_stream(spec), spec)
    it = iter(first)
    head = [next(it)["id"] for _ in range(27)]  # inside a block of the second epoch
    resumed = ExampleStream(open_stream(spec), spec)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [e["id"] for _, e in zip(range(18), resumed)] == whole


def test_a_resume_reads_only_what_is_left(tmp_path, monkeypatch):
    """Resuming after 175 of 200 examples reads the last 25 and the headers of the 5 before them in their shard (a
    seek past their data), where datasets' builder re-read most of the epoch (issue 30: 730 examples to resume after 700 of
    800)."""
    import contextlib

    import finetune.data.streams.source as source

    scenes = _scenes(20)
    paths = write_webdataset(tmp_path, scenes, 10)
    many = [str(paths[k % 2]) for k in range(20)]  # 20 shards of 10 (the two files listed ten times each)
    spec = {"name": "webdataset", "urls": many, "shuffle_buffer": 0}
    first = ExampleStream(open_stream(spec), spec)
    it = iter(first)
    for _ in range(175):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    read_bytes = []
    original = source.open_shard

    class Counting:
        def __init__(self, handle):
            self.handle = handle

        def read(self, n=-1):
            data = self.handle.read(n)
            read_bytes.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.handle, name)

    @contextlib.contextmanager
    def counting(url, options=None, policy=None):
        with original(url, options, policy) as handle:
            yield Counting(handle)

    monkeypatch.setattr(source, "open_shard", counting)
    resumed = ExampleStream(open_stream(spec, index=first.source.index), spec)
    resumed.load_state_dict(state)
    rest = [e["id"] for _, e in zip(range(25), resumed)]
    assert rest == [s["id"] for s in scenes[15:] + scenes[:10] + scenes[10:]]  # shards 17 (from its 6th), 18, 19
    epoch_bytes = sum(Path(p).stat().st_size for p in many)
    assert sum(read_bytes) < 0.15 * epoch_bytes  # under the last 3 of 20 shards: nothing of the 17 before


def test_a_shard_index_file_is_used_and_checked(tmp_path, monkeypatch):
    import finetune.data.streams.index as index

    scenes = _scenes(8)
    paths = write_webdataset(tmp_path, scenes, 4)
    (tmp_path / "index.json").write_text(json.dumps(
        {"wids_version": 1, "shardlist": [{"url": str(p), "nsamples": 4} for p in paths]}))
    monkeypatch.setattr(index, "count_samples", lambda f: pytest.fail("counted although an index was given"))
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00001}.tar"),
            "options": {"index": str(tmp_path / "index.json")}, "shuffle_buffer": 0}
    assert [e["id"] for _, e in zip(range(8), ExampleStream(open_stream(spec), spec))] == [s["id"] for s in scenes]
    other = {**spec, "urls": str(paths[0])}
    with pytest.raises(DataError, match="the shard index lists 2 shards that are not data.train's 1"):
        open_stream(other)


# --------------------------------------------------------------------------- where shards come from


def test_pipe_urls_stream_through_a_command(tmp_path):
    scenes = _scenes(8)
    paths = write_webdataset(tmp_path, scenes, 4)
    spec = {"name": "webdataset", "urls": [f"pipe:cat {p}" for p in paths], "shuffle_buffer": 0}
    trusted = ReadPolicy(commands=True)  # the user passed --trust-recipe-code
    stream = ExampleStream(open_stream(spec, rank=1, world_size=2, policy=trusted), spec)  # positions 4-7
    assert [e["id"] for _, e in zip(range(4), stream)] == [s["id"] for s in scenes[4:]]
    failing = {**spec, "urls": [f"pipe:cat {tmp_path / 'missing.tar'}"]}
    with pytest.raises(DataError, match=r"cannot read shard pipe:cat .*missing\.tar: OSError: pipe:cat .* exited with "
                                        r"status 1: cat: .*No such file"):
        open_stream(failing, policy=trusted)


@pytest.fixture
def http_shards(tmp_path):
    scenes = _scenes(12)
    write_webdataset(tmp_path / "site", scenes, 3)

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path / "site")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", scenes
    server.shutdown()
    server.server_close()


def test_https_style_shards_from_a_local_server(http_shards):
    base, scenes = http_shards
    spec = {"name": "webdataset", "urls": base + "/shard-{00000..00003}.tar", "shuffle_buffer": 0}
    parts = [[e["id"] for _, e in zip(range(6), ExampleStream(open_stream(spec, rank=r, world_size=2), spec))]
             for r in range(2)]
    assert parts == [[s["id"] for s in scenes[:6]], [s["id"] for s in scenes[6:]]]


@pytest.fixture
def s3_server(monkeypatch):
    """A real S3 API (moto's server mode) on 127.0.0.1, and botocore's environment pointing at it."""
    import moto.server as moto_server  # the dev extra installs moto[server] and s3fs: a missing one fails here
    import s3fs
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    # fsspec caches filesystems by their arguments, not by the environment: an S3FileSystem of an earlier test
    # would still point at that test's (stopped) server
    s3fs.S3FileSystem.clear_instance_cache()
    yield env
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


def _upload(env: dict, bucket: str, paths: list[Path]) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
    client.create_bucket(Bucket=bucket)
    for path in paths:
        client.upload_file(str(path), bucket, path.name)


def test_s3_shards_from_a_local_server(tmp_path, s3_server):
    scenes = _scenes(12)
    _upload(s3_server, "shards", write_webdataset(tmp_path, scenes, 3))
    spec = {"name": "webdataset", "urls": "s3://shards/shard-{00000..00003}.tar", "shuffle_buffer": 0}
    loader = _loader(spec, 2)
    ids = [i for b in _batches(loader, 6) for i in b["ids"]]
    assert sorted(ids) == sorted(s["id"] for s in scenes)
    with pytest.raises(DataError, match=r"cannot read shard s3://shards/nothing\.tar"):
        open_stream({**spec, "urls": "s3://shards/nothing.tar"})


@pytest.mark.slow
def test_a_run_on_s3_shards_resumes_exactly(tmp_path, s3_server, monkeypatch):
    from finetune.models.registry import save_tiny
    from tests.finetune.data.test_streams import _run_recording, _stream_recipe

    tiny = save_tiny("tiny-clip", tmp_path / "tiny")
    scenes = _scenes(24)
    _upload(s3_server, "train", write_webdataset(tmp_path / "shards", scenes, 6))
    urls = "s3://train/shard-{00000..00003}.tar"
    steps = ["train.max_steps=8", "train.checkpoint_every=3", "data.num_workers=2"]
    whole = _run_recording(_stream_recipe(tiny, urls, tmp_path / "whole", *steps), monkeypatch)
    killed = _run_recording(_stream_recipe(tiny, urls, tmp_path / "run", *steps), monkeypatch, stop_at=8)
    resumed = _run_recording(_stream_recipe(tiny, urls, tmp_path / "run", *steps, "train.resume=latest"),
                             monkeypatch)
    assert len(whole) == 8 and killed[:6] + resumed == whole
    assert sorted(i for ids in whole[:6] for i in ids) == sorted(s["id"] for s in scenes)  # epoch 0 once
    a = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    b = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [h["loss"] for h in b["history"]] == [h["loss"] for h in a["history"]]
    assert b["train_stream"]["used"] == a["train_stream"]["used"] == 32
    index = json.loads((tmp_path / "run" / "checkpoints" / "step-6" / "stream_index.json").read_text())
    assert [s["url"] for s in index["shardlist"]][0] == "s3://train/shard-00000.tar"
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in (tmp_path / "run" / "recipe.yaml").read_text()
