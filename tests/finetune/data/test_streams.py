"""Streams (finetune.data.streams): webdataset / parquet / hub-folder shards read back with the right ids,
captions and images; bad samples skipped and counted; brace expansion; the per-example term hook; shards split
by process (uneven counts, too few refused) and by data-loader worker (disjoint, once per epoch, exact resume,
counts and epochs carried back, F-CAST's superpixels computed in the workers); the trainer's stream branch
(max_steps, exact resume with workers); two processes on disjoint shards."""

from __future__ import annotations

import collections
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import PIL.Image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from finetune.data.sources import DataError, SourceSpec, load_source
from finetune.data.streams import ExampleStream, expand_urls, open_stream
from finetune.data.synthetic import synthetic_scenes

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _no_shutdown_sleep(monkeypatch):
    """datasets waits 5 s for pyarrow's reader threads whenever a parquet stream's iterator ends or is
    dropped (an epoch, an abandoned iterator): not needed for these few-kilobyte shards."""
    monkeypatch.setattr("datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def _scenes(n: int, seed: int = 0) -> list[dict]:
    """``n`` synthetic scenes as ``{"id", "png": bytes, "caption"}``."""
    ds = synthetic_scenes(n, seed, image_size=32).cast_column("image", __import__("datasets").Image(decode=False))
    return [{"id": r["id"], "png": r["image"]["bytes"], "caption": r["caption"]} for r in ds]


def write_webdataset(folder: Path, scenes: list[dict], per_shard: int, *, caption_as: str = "txt") -> list[Path]:
    """Tar shards ``shard-00000.tar`` ... of ``per_shard`` scenes: ``ID.png`` + ``ID.txt`` (or ``ID.json``)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for s, start in enumerate(range(0, len(scenes), per_shard)):
        path = folder / f"shard-{s:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for scene in scenes[start:start + per_shard]:
                text = scene["caption"] if caption_as == "txt" else json.dumps({"caption": scene["caption"], "n": 1})
                for ext, data in (("png", scene["png"]), (caption_as, text.encode("utf-8"))):
                    info = tarfile.TarInfo(f"{scene['id']}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards.append(path)
    return shards


def write_parquet(folder: Path, scenes: list[dict], per_shard: int, *, prefix: str = "part") -> list[Path]:
    """Parquet shards with columns ``key`` (the id), ``jpg`` (image bytes) and ``text`` (the caption)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for s, start in enumerate(range(0, len(scenes), per_shard)):
        rows = scenes[start:start + per_shard]
        table = pa.table({"key": [r["id"] for r in rows], "jpg": [r["png"] for r in rows],
                          "text": [r["caption"] for r in rows]})
        path = folder / f"{prefix}-{s:04d}.parquet"
        pq.write_table(table, path)
        shards.append(path)
    return shards


def _read(stream: ExampleStream, n: int) -> list[dict]:
    it = iter(stream)
    return [next(it) for _ in range(n)]


# --------------------------------------------------------------------------- urls and specs


def test_expand_urls_ranges_lists_and_padding():
    assert expand_urls("s/{00000..00002}.tar") == ["s/00000.tar", "s/00001.tar", "s/00002.tar"]
    assert expand_urls("a{1..3}") == ["a1", "a2", "a3"]
    assert expand_urls("a{3..1}") == ["a3", "a2", "a1"]
    assert expand_urls("{x,y}-{0..1}") == ["x-0", "x-1", "y-0", "y-1"]
    assert expand_urls(["p{8..10}", "q"]) == ["p8", "p9", "p10", "q"]
    assert expand_urls("lit{abc}") == ["lit{abc}"]
    assert len(expand_urls("shards/{00000..00099}.tar")) == 100
    assert expand_urls("shards/{00000..00099}.tar")[-1] == "shards/00099.tar"


def test_spec_stream_keys_and_errors():
    assert SourceSpec.parse({"name": "webdataset", "urls": "x/{0..1}.tar"}).is_stream
    assert SourceSpec.parse({"name": "hub", "path": "org/ds"}).is_stream
    assert SourceSpec.parse({"name": "parquet", "urls": ["a.parquet"]}).is_stream
    assert SourceSpec.parse({"name": "parquet", "path": "d", "streaming": True}).is_stream
    assert not SourceSpec.parse({"name": "parquet", "path": "d"}).is_stream
    spec = SourceSpec.parse({"format": "webdataset", "urls": "x/{0..1}.tar"})
    assert spec.name == "webdataset" and spec.is_stream
    assert SourceSpec.parse({"name": "parquet", "format": "parquet", "urls": "a.parquet"}).is_stream
    with pytest.raises(DataError, match="name 'parquet' and format 'webdataset'"):
        SourceSpec.parse({"name": "parquet", "format": "webdataset", "urls": "a.tar"})
    with pytest.raises(DataError, match="'format' must be one of webdataset, hub, parquet"):
        SourceSpec.parse({"format": "jsonl", "path": "a.jsonl"})
    with pytest.raises(DataError, match="cannot be streamed"):
        SourceSpec.parse({"name": "synthetic", "streaming": True})
    with pytest.raises(DataError, match="stream only"):
        SourceSpec.parse({"name": "webdataset", "urls": "a.tar", "streaming": False})
    with pytest.raises(DataError, match="'urls' must be"):
        SourceSpec.parse({"name": "webdataset", "urls": 3})
    with pytest.raises(DataError, match="shuffle_buffer"):
        SourceSpec.parse({"name": "webdataset", "urls": "a.tar", "shuffle_buffer": -1})
    with pytest.raises(DataError, match="only data.train can be a stream"):
        load_source({"name": "webdataset", "urls": "a.tar"})


def test_missing_shard_is_named(tmp_path):
    write_webdataset(tmp_path, _scenes(4), 2)
    with pytest.raises(DataError, match=r"1 of 3 shard files do not exist \(first: .*shard-00002.tar"):
        open_stream({"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00002}.tar")})


@pytest.mark.slow
def test_recipe_validates_stream_entry():
    from finetune.config import RecipeError, load_recipe

    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        "data.train={name: webdataset, urls: 'shards/{00000..00009}.tar', shuffle_buffer: 0}",
        "train.max_steps=5",
    ])
    spec = SourceSpec.parse(recipe.data.train)
    assert spec.is_stream and spec.urls == "shards/{00000..00009}.tar" and spec.shuffle_buffer == 0
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        "data.train={name: parquet, urls: [a.parquet, 'b-{0..1}.parquet'], streaming: true}", "train.max_steps=5",
    ])
    assert SourceSpec.parse(recipe.data.train).urls == ["a.parquet", "b-{0..1}.parquet"]
    with pytest.raises(RecipeError, match="shuffle_buffer"):
        load_recipe(REPO / "recipes" / "quickstart.yaml", ["data.train={name: hub, path: o/d, shuffle_buffer: x}"])


def test_keys_a_stream_does_not_use_are_refused(tmp_path):
    write_webdataset(tmp_path, _scenes(2), 2)
    with pytest.raises(DataError, match="limit is not used by a stream"):
        open_stream({"name": "webdataset", "urls": str(tmp_path / "shard-00000.tar"), "limit": 5})


def test_stream_recipe_without_max_steps_is_a_recipe_error(tmp_path, monkeypatch, capsys):
    from finetune.config import RecipeError, load_recipe
    from finetune.training import FinetuneRecipe, run_recipe

    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        "data.train={name: webdataset, urls: 'x.tar'}", "train.max_steps=null", "train.epochs=1",
        f"output.dir={tmp_path / 'run'}",
    ])

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load before the recipe error")

    monkeypatch.setattr("finetune.training.model.load_model", no_model)
    assert run_recipe(recipe) == 2  # refused by the preflight, as `xlipkit validate` refuses it
    err = capsys.readouterr().err
    assert err.startswith("recipe error: data.train is a stream") and "set train.max_steps" in err
    with pytest.raises(RecipeError, match="train.max_steps") as info:
        FinetuneRecipe(recipe)
    assert info.value.key == "train.max_steps"
    assert not (tmp_path / "run").exists()


def test_structxlip_local_loss_is_not_streamable_but_edges_and_lexicon_are():
    from finetune.objectives.structxlip import StructXLIPOptions, StructXLIPTerm, StructXLIPWeights

    with pytest.raises(ValueError, match=r"objective.terms.structxlip.weights.local: 0"):
        StructXLIPTerm().check_stream()
    term = StructXLIPTerm(StructXLIPOptions(weights=StructXLIPWeights(local=0.0)))
    term.check_stream()
    image = PIL.Image.new("RGB", (32, 32), (0, 0, 0))
    image.paste((255, 255, 255), (8, 8, 24, 24))
    out = term.stream_map({"image": image, "caption": "A red square on a black background."}, model=None)
    assert "red" not in out["filtered_caption"] and "square" in out["filtered_caption"]
    assert out["lexicon_removed"] and out["caption_words"] > 0
    edges = np.asarray(out["edges"])
    assert edges.shape == (32, 32) and edges.max() > 0 and edges[0, 0] == 0


def test_term_with_preprocess_but_no_stream_map_is_refused():
    from finetune.objectives.base import Term

    class Cached(Term):
        name = "cached"

        def preprocess(self, dataset, model, *, cache_dir=None, log=None):
            return dataset

    with pytest.raises(ValueError, match="'cached' preprocesses whole datasets"):
        Cached().check_stream()
    Term().check_stream()  # no preprocessing: streamable as is


# --------------------------------------------------------------------------- reading back


def test_webdataset_reads_back_ids_captions_images(tmp_path):
    scenes = _scenes(24)
    write_webdataset(tmp_path, scenes, 8)
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00002}.tar"), "shuffle_buffer": 0}
    stream = ExampleStream(open_stream(spec), spec)
    got = _read(stream, 24)
    assert [e["id"] for e in got] == [s["id"] for s in scenes]
    assert [e["caption"] for e in got] == [s["caption"] for s in scenes]
    for e, s in zip(got[:5], scenes):
        expected = np.asarray(PIL.Image.open(io.BytesIO(s["png"])).convert("RGB"))
        assert e["image"].mode == "RGB" and np.array_equal(np.asarray(e["image"]), expected)
    assert stream.read == 24 and stream.skipped == 0 and stream.epoch == 0


def test_webdataset_json_caption_and_epochs(tmp_path):
    scenes = _scenes(6)
    write_webdataset(tmp_path, scenes, 3, caption_as="json")
    spec = {"name": "webdataset", "path": str(tmp_path), "shuffle_buffer": 0}
    stream = ExampleStream(open_stream(spec), spec)
    got = _read(stream, 9)  # one and a half epochs
    assert [e["caption"] for e in got[:6]] == [s["caption"] for s in scenes]
    assert [e["id"] for e in got[6:]] == [s["id"] for s in scenes[:3]]
    assert stream.epoch == 1


def test_parquet_shards_with_column_mapping(tmp_path):
    scenes = _scenes(12)
    write_parquet(tmp_path, scenes, 4)
    spec = {"name": "parquet", "urls": str(tmp_path / "part-{0000..0002}.parquet"), "image_column": "jpg",
            "caption_column": "text", "id_column": "key", "shuffle_buffer": 0}
    got = _read(ExampleStream(open_stream(spec), spec), 12)
    assert [e["id"] for e in got] == [s["id"] for s in scenes]
    assert [e["caption"] for e in got] == [s["caption"] for s in scenes]
    assert got[3]["image"].size == (32, 32)


def test_parquet_missing_column_names_the_key(tmp_path):
    write_parquet(tmp_path, _scenes(4), 4)
    spec = {"name": "parquet", "urls": str(tmp_path / "part-0000.parquet"), "image_column": "jpg",
            "caption_column": "desc"}
    with pytest.raises(DataError, match=r"no caption column 'desc'; columns: key, jpg, text\. "
                                        r"Set data.train.caption_column"):
        _read(ExampleStream(open_stream(spec), spec), 1)


def test_hub_streaming_from_a_dataset_folder(tmp_path):
    scenes = _scenes(8)
    write_parquet(tmp_path / "repo" / "data", scenes, 4, prefix="train")
    spec = {"name": "hub", "path": str(tmp_path / "repo"), "split": "train", "image_column": "jpg",
            "caption_column": "text", "id_column": "key", "shuffle_buffer": 0}
    got = _read(ExampleStream(open_stream(spec), spec), 8)
    assert sorted(e["id"] for e in got) == sorted(s["id"] for s in scenes)


def test_shard_order_shuffles_per_epoch_and_split_by_node_is_disjoint(tmp_path):
    scenes = _scenes(24)
    write_webdataset(tmp_path, scenes, 3)  # 8 shards
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00007}.tar"), "seed": 3}
    epoch0 = [e["id"] for e in _read(ExampleStream(open_stream(spec), spec), 48)]
    assert sorted(epoch0[:24]) == sorted(s["id"] for s in scenes)
    assert epoch0[:24] != [s["id"] for s in scenes] and epoch0[:24] != epoch0[24:]
    parts = [[e["id"] for e in _read(ExampleStream(open_stream(spec, rank=r, world_size=2), spec), 12)]
             for r in range(2)]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(s["id"] for s in scenes)


# --------------------------------------------------------------------------- bad samples


def _with_bad_samples(tmp_path: Path) -> tuple[list[dict], dict]:
    scenes = _scenes(10)
    scenes[2] = {**scenes[2], "png": b"not an image at all"}
    scenes[5] = {**scenes[5], "caption": "   "}
    write_webdataset(tmp_path, scenes, 5)
    return scenes, {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00001}.tar"), "shuffle_buffer": 0}


def test_bad_samples_are_skipped_and_counted(tmp_path):
    scenes, spec = _with_bad_samples(tmp_path)
    stream = ExampleStream(open_stream(spec), spec)
    got = _read(stream, 8)
    assert [e["id"] for e in got] == [s["id"] for i, s in enumerate(scenes) if i not in (2, 5)]
    assert stream.skipped == 2 and stream.read == 10
    reasons = {e["id"]: e["reason"] for e in stream.skipped_examples}
    assert reasons[scenes[5]["id"]] == "empty caption"
    assert scenes[2]["id"] in reasons and stream.skipped_examples[0]["path"].endswith("shard-00000.tar")


def test_bad_sample_raises_with_on_error_raise(tmp_path):
    scenes, spec = _with_bad_samples(tmp_path)
    stream = ExampleStream(open_stream(spec), spec, on_error="raise")
    with pytest.raises(DataError, match=rf"id='{scenes[2]['id']}' \(shard .*shard-00000.tar\).*data.on_error: skip"):
        _read(stream, 3)


def test_a_stream_without_usable_examples_stops(tmp_path):
    scenes = [{**s, "caption": ""} for s in _scenes(3)]
    write_webdataset(tmp_path, scenes, 3)
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-00000.tar")}
    with pytest.raises(DataError, match="no usable examples in epoch 0"):
        _read(ExampleStream(open_stream(spec), spec), 1)


# --------------------------------------------------------------------------- state


def test_state_dict_resumes_exactly_across_epochs_and_skips(tmp_path):
    scenes, spec = _with_bad_samples(tmp_path)
    spec["shuffle_buffer"] = 1  # shard order reshuffled every epoch
    whole = ExampleStream(open_stream(spec), spec)
    full = [e["id"] for e in _read(whole, 30)]
    first = ExampleStream(open_stream(spec), spec)
    it = iter(first)
    head = [next(it)["id"] for _ in range(11)]  # into the second epoch
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ExampleStream(open_stream(spec), spec)
    resumed.load_state_dict(state)
    tail = [e["id"] for e in _read(resumed, 19)]
    assert head + tail == full
    assert (resumed.read, resumed.skipped, resumed.epoch) == (whole.read, whole.skipped, whole.epoch)
    assert whole.skipped >= 6 and state["epoch"] == 1 and state["skipped"] >= 2


@pytest.mark.parametrize("world_size", [1, 2])
def test_parquet_stream_resumes_exactly(tmp_path, world_size):
    write_parquet(tmp_path, _scenes(15), 5)  # 3 shards: with 2 processes, every other example
    spec = {"name": "parquet", "urls": str(tmp_path / "part-{0000..0002}.parquet"), "image_column": "jpg",
            "caption_column": "text", "id_column": "key"}

    def stream() -> ExampleStream:
        return ExampleStream(open_stream(spec, rank=world_size - 1, world_size=world_size), spec,
                             rank=world_size - 1, world_size=world_size)

    full = [e["id"] for e in _read(stream(), 20)]
    first = stream()
    it = iter(first)
    head = [next(it)["id"] for _ in range(7)]
    resumed = stream()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [e["id"] for e in _read(resumed, 13)] == full


def test_state_from_another_process_layout_is_refused(tmp_path):
    write_webdataset(tmp_path, _scenes(4), 2)
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00001}.tar")}
    state = ExampleStream(open_stream(spec), spec).state_dict()
    other = ExampleStream(open_stream(spec, rank=1, world_size=2), spec, rank=1, world_size=2)
    with pytest.raises(DataError, match=r"saved by reader 0 of 1 \(process 0 of 1\), this is reader 1 of 2: resume "
                                        "through the loader, which re-splits"):
        other.load_state_dict(state)


# --------------------------------------------------------------------------- processes and workers


def test_uneven_shards_are_split_by_samples_over_processes(tmp_path):
    """9 shards of 1 to 4 samples on 4 processes: each process reads 5 or 6 samples of an epoch (a split by samples
    from the shards' counts, not by shards), every sample exactly once, and the process that reads one more rotates
    with the epoch."""
    from finetune.data.streams import check_stream_shards, shard_layout

    sizes = [1, 4, 2, 3, 1, 4, 2, 3, 2]  # 22 samples
    scenes = _scenes(sum(sizes))
    _write_sized(tmp_path, scenes, sizes)
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00008}.tar"), "shuffle_buffer": 0}
    epochs = []
    for epoch in range(2):
        parts = []
        for r in range(4):
            stream = ExampleStream(open_stream(spec, rank=r, world_size=4), spec)
            stream.epoch = epoch
            (first, stop), = stream.share(epoch)
            parts.append([e["id"] for e in _read(stream, stop - first)])
        epochs.append([len(p) for p in parts])
        assert sorted(i for part in parts for i in part) == sorted(s["id"] for s in scenes)  # each sample once
    assert epochs == [[6, 6, 5, 5], [5, 5, 6, 6]]  # 22 = 4 x 5 + 2: the two readers with one more rotate
    assert parts[0] == [s["id"] for s in scenes[:5]]  # shards 0, 1 and the first sample... in order, no shuffle
    assert shard_layout(332, 8, 8, 3_320_000) == ("332 shards (3,320,000 samples) over 8 processes x 8 workers: "
                                                   "51,875 samples per reader")
    assert shard_layout(9, 4, 0, 22) == "9 shards (22 samples) over 4 processes: 5 or 6 samples per reader"
    assert check_stream_shards(spec, 10) == 9  # fewer shards than processes is fine now: samples are split
    with pytest.raises(DataError, match=r"has 22 samples for 23 readers.*Lower data.num_workers or add data"):
        _read(ExampleStream(open_stream(spec, rank=0, world_size=23), spec), 1)


def _write_sized(folder: Path, scenes: list[dict], sizes: list[int]) -> list[Path]:
    """Tar shards ``shard-00000.tar`` ... holding ``sizes[k]`` scenes each, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for k, n in enumerate(sizes):
        path = folder / f"shard-{k:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for scene in scenes[start:start + n]:
                for ext, data in (("png", scene["png"]), ("txt", scene["caption"].encode("utf-8"))):
                    info = tarfile.TarInfo(f"{scene['id']}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
        start += n
    return paths


def test_hub_stream_is_split_by_samples(tmp_path):
    scenes = _scenes(12)
    write_parquet(tmp_path / "repo" / "data", scenes, 4, prefix="train")  # 3 files
    spec = {"name": "hub", "path": str(tmp_path / "repo"), "split": "train", "image_column": "jpg",
            "caption_column": "text", "id_column": "key", "shuffle_buffer": 0}
    raws = [open_stream(spec, rank=r, world_size=2) for r in range(2)]
    assert [(raw.num_shards, raw.num_examples, raw.index.kind) for raw in raws] == [(3, 12, "parquet")] * 2
    parts = [{e["id"] for e in _read(ExampleStream(raw, spec), 6)} for raw in raws]
    assert not parts[0] & parts[1] and parts[0] | parts[1] == {s["id"] for s in scenes}
    (tmp_path / "json" / "data").mkdir(parents=True)
    (tmp_path / "json" / "data" / "train.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match="its data files are jsonl files; a hub stream reads parquet or webdataset"):
        open_stream({**spec, "path": str(tmp_path / "json")})


def _record(examples: list[dict]) -> dict:
    """collate_fn of the loader tests: each batch's ids, the process that made it, and the epochs its examples
    carry to the collate function (:data:`~finetune.data.collate.EPOCH_KEY`, which the training loop's collate
    function tells the objective)."""
    from finetune.data.collate import EPOCH_KEY

    return {"ids": [e["id"] for e in examples], "pid": os.getpid(), "epochs": sorted({e[EPOCH_KEY] for e in examples})}


def _loader(spec: dict, num_workers: int, **kwargs):
    from finetune.data.streams import StreamLoader

    return StreamLoader(ExampleStream(open_stream(spec), spec, **kwargs), batch_size=2, collate_fn=_record,
                        num_workers=num_workers)


def _batches(loader, n: int) -> list[dict]:
    it = iter(loader)
    out = []
    for _ in range(n):
        batch = next(it)
        out.append({**batch, "loader_epoch": loader.epoch})
    return out


def test_workers_read_disjoint_shards_once_per_epoch_and_resume_exactly(tmp_path):
    scenes = _scenes(24)
    write_webdataset(tmp_path, scenes, 3)  # 8 shards: 4 per worker
    shard_of = {s["id"]: k // 3 for k, s in enumerate(scenes)}
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00007}.tar"), "seed": 3}
    full = _batches(_loader(spec, 2), 24)  # two epochs of 12 batches
    pids = [b["pid"] for b in full]
    assert os.getpid() not in pids and len(set(pids)) == 2  # read, decoded and collated in two workers
    assert pids[0::2] == [pids[0]] * 12 and pids[1::2] == [pids[1]] * 12  # one batch from each in turn
    ids = [[i for b in full[e * 12:(e + 1) * 12] for i in b["ids"]] for e in range(2)]
    for epoch in ids:
        assert sorted(epoch) == sorted(s["id"] for s in scenes)  # every example exactly once per epoch
    assert ids[0] != ids[1]  # the shard order is reshuffled every epoch
    for e in range(2):  # no shard read by both workers
        by_worker = [{shard_of[i] for b in full[e * 12:(e + 1) * 12] if b["pid"] == pid for i in b["ids"]}
                     for pid in set(pids)]
        assert not by_worker[0] & by_worker[1] and len(by_worker[0]) == len(by_worker[1]) == 4
    assert [b["epochs"] for b in full] == [[0]] * 12 + [[1]] * 12  # the reader's epoch reached the collate function
    assert [b["loader_epoch"] for b in full] == [0] * 12 + [1] * 12


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_loader_resumes_exactly(tmp_path, num_workers):
    scenes, spec = _with_bad_samples(tmp_path)  # 2 shards of 5, one bad example in each: 8 per epoch
    spec.update(shuffle_buffer=1, seed=4)
    full = _batches(_loader(spec, num_workers), 10)  # 2.5 epochs
    first = _loader(spec, num_workers)
    head = _batches(first, 3)  # into the second epoch of one worker
    state = json.loads(json.dumps(first.state_dict()))
    assert first.report()["used"] == 6 and state["num_workers"] == num_workers
    resumed = _loader(spec, num_workers)
    resumed.load_state_dict(state)
    assert resumed.report() == first.report() and resumed.epoch == first.epoch  # a run resumed at its end
    tail = _batches(resumed, 7)
    assert [b["ids"] for b in head + tail] == [b["ids"] for b in full]
    assert [b["epochs"] for b in tail] == [b["epochs"] for b in full[3:]]
    assert [b["loader_epoch"] for b in tail] == [b["loader_epoch"] for b in full[3:]]
    report = resumed.report()
    assert (report["read"], report["used"], report["skipped"], report["epoch"]) == (25, 20, 5, 2)
    assert {e["id"] for e in report["skipped_examples"]} == {scenes[2]["id"], scenes[5]["id"]}


def test_workers_count_bad_samples_for_the_report(tmp_path):
    scenes, spec = _with_bad_samples(tmp_path)  # 2 shards of 5, one bad example in each
    loader = _loader(spec, 2)
    got = [i for b in _batches(loader, 4) for i in b["ids"]]
    assert sorted(got) == sorted(s["id"] for k, s in enumerate(scenes) if k not in (2, 5))
    report = loader.report()
    assert (report["read"], report["used"], report["skipped"]) == (10, 8, 2)
    assert {e["id"] for e in report["skipped_examples"]} == {scenes[2]["id"], scenes[5]["id"]}


def test_one_shard_is_read_by_every_worker_each_sample_once_per_epoch(tmp_path):
    write_webdataset(tmp_path, _scenes(6), 6)  # one shard of 6 for 3 workers: 2 samples each, by position
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-00000.tar")}
    loader = _loader(spec, 3)
    assert loader.num_workers == 3
    batches = _batches(loader, 6)  # two epochs
    assert len({b["pid"] for b in batches}) == 3
    for epoch in range(2):
        ids = [i for b in batches[3 * epoch:3 * epoch + 3] for i in b["ids"]]
        assert sorted(ids) == sorted(s["id"] for s in _scenes(6))
    assert [b["loader_epoch"] for b in batches] == [0, 0, 0, 1, 1, 1]


def test_resuming_with_another_number_of_workers_splits_what_is_left(tmp_path):
    scenes = _scenes(8)
    write_webdataset(tmp_path, scenes, 2)
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00003}.tar")}
    first = _loader(spec, 2)
    head = [i for b in _batches(first, 3) for i in b["ids"]]
    state = json.loads(json.dumps(first.state_dict()))
    with pytest.raises(DataError, match="with 2 data-loader worker.*with 1: load every process's position"):
        _loader(spec, 1).load_state_dict(state)
    resumed = _loader(spec, 1)
    assert resumed.load_states([state]) is True  # the layout changed
    tail = [i for b in _batches(resumed, 1) for i in b["ids"]]
    assert sorted(head + tail) == sorted(s["id"] for s in scenes)  # the epoch ends with nothing read twice
    assert resumed.report()["used"] == 8
    with pytest.raises(DataError, match="older xlipkit"):
        _loader(spec, 0).load_state_dict({"version": 2, "rank": 0, "world_size": 1, "epoch": 0, "loader": {}})


def test_fcast_superpixels_and_subcaption_epochs_are_computed_in_the_workers(tmp_path, monkeypatch):
    """F-CAST's superpixels (the model's preprocess_images) and sub-caption draws (the term's prepare, which
    depends on the epoch) run in the stream's workers, with the epoch of the examples they read."""
    import torch

    from finetune import load_model
    from finetune.data.collate import Collator
    from finetune.data.streams import StreamLoader
    from finetune.models.families.fcast import FCastModel
    from finetune.objectives.base import Objective
    from finetune.objectives.fcast import FCastOptions
    from finetune.objectives.planning import PlannedCollate
    from finetune.objectives.registry import build_term

    model = load_model("fcast-tiny", family="fcast")
    term, _ = build_term("fcast", FCastOptions(k=6, n_chunks=4))
    objective = Objective(None, [(term, 1.0)])
    objective.prepare_model(model)
    pids = tmp_path / "superpixel_pids.txt"
    original = FCastModel.superpixels_of_batch

    def recording(self, arrays):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(self, arrays)

    monkeypatch.setattr(FCastModel, "superpixels_of_batch", recording)
    scenes = _scenes(8)
    write_webdataset(tmp_path / "shards", scenes, 2)  # 4 shards, 2 per worker
    spec = {"name": "webdataset", "urls": str(tmp_path / "shards" / "shard-{00000..00003}.tar"), "shuffle_buffer": 0}
    stream = ExampleStream(open_stream(spec), spec, transform=lambda e: objective.stream_map(e, model))
    loader = StreamLoader(stream, batch_size=2, collate_fn=PlannedCollate(Collator(model, objective), objective, model),
                          num_workers=2)
    it = iter(loader)
    batches = [next(it) for _ in range(6)]  # epoch 0 (4 batches), then epoch 1
    workers = {int(line) for line in pids.read_text().split()}
    assert len(workers) == 2 and os.getpid() not in workers  # every superpixel map was computed in a worker
    labels = batches[0]["image_inputs"]["superpixels"]
    assert labels.shape[0] == 2 and labels.dtype == torch.int64 and labels.max() > 0
    by_id = {e["id"]: e for e in _read(ExampleStream(open_stream(spec), spec), 8)}
    for batch, epoch in ((batches[0], 0), (batches[4], 1)):
        term.set_epoch(epoch)
        expected = term.collate([term.prepare(by_id[i]) for i in batch["ids"]], model)
        assert torch.equal(batch["fcast_sub_ids"], expected["fcast_sub_ids"])
    term.set_epoch(0)
    epoch0 = term.collate([term.prepare(by_id[i]) for i in batches[4]["ids"]], model)
    assert not torch.equal(batches[4]["fcast_sub_ids"], epoch0["fcast_sub_ids"])  # the draws differ by epoch


# --------------------------------------------------------------------------- training on a stream


class _Stop(Exception):
    """Stands in for a killed run."""


def _stream_recipe(tiny: Path, urls: str, out: Path, *extra: str):
    from finetune.config import load_recipe

    return load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"model.name_or_path={tiny}", "model.dtype=null", "model.max_text_len=null",
        f"data.train={{name: webdataset, urls: '{urls}', seed: 5}}",
        "objective.terms.structxlip.weights.local=0",  # edge maps and lexicon per example; no regions
        "eval.sets=[]", "eval.compare_base_length=false", "train.batch_size=4", "train.trackers=[]",
        "train.mixed_precision=no", "train.log_every=1", "train.warmup_steps=2", f"output.dir={out}",
        "model.init_from=null", "eval.compare_with=[]", *extra,
    ])


def _run_recording(recipe, monkeypatch, stop_at: int | None = None) -> list[list[str]]:
    """Run ``recipe`` in this process; return the sample ids of every optimiser step it trains (raising
    :class:`_Stop` when step ``stop_at`` would start, as if the run were killed)."""
    from accelerate.state import AcceleratorState, GradientState

    from finetune.training import TrainStep, run_recipe

    seen: list[list[str]] = []
    original = getattr(TrainStep.forward_backward, "unrecorded", TrainStep.forward_backward)

    def recording(self, batch):
        if stop_at is not None and self.state.step + 1 == stop_at:
            raise _Stop
        seen.append(list(batch["ids"]))
        return original(self, batch)

    recording.unrecorded = original
    monkeypatch.setattr(TrainStep, "forward_backward", recording)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        assert run_recipe(recipe) == 0
    except _Stop:
        pass
    return seen


@pytest.mark.slow
def test_killed_stream_run_resumes_with_the_same_samples_and_losses(tmp_path, monkeypatch):
    from finetune.models.registry import save_tiny

    tiny = save_tiny("tiny-clip", tmp_path / "tiny")
    scenes = _scenes(24)
    scenes[9] = {**scenes[9], "caption": ""}  # a bad sample: 23 usable per epoch
    write_webdataset(tmp_path / "shards", scenes, 6)
    urls = str(tmp_path / "shards" / "shard-{00000..00003}.tar")
    steps = ["train.max_steps=8", "train.checkpoint_every=3", "data.num_workers=2"]  # 2 shards per worker

    whole = _run_recording(_stream_recipe(tiny, urls, tmp_path / "whole", *steps), monkeypatch)
    killed = _run_recording(_stream_recipe(tiny, urls, tmp_path / "run", *steps), monkeypatch, stop_at=8)
    assert len(killed) == 7 and not (tmp_path / "run" / "metrics.json").exists()
    resumed = _run_recording(_stream_recipe(tiny, urls, tmp_path / "run", *steps, "train.resume=latest"),
                             monkeypatch)

    assert len(whole) == 8 and all(len(ids) == 4 for ids in whole)
    assert killed[:6] + resumed == whole  # resumed from step-6, in the second epoch: steps 7 and 8 again
    # each worker's 12 samples of epoch 0 in its 3 batches; the worker with the bad one fills its third batch with
    # the first sample of its epoch 1 (a batch may span two epochs: nothing is dropped)
    first_six = [i for ids in whole[:6] for i in ids]
    assert set(first_six) == {s["id"] for k, s in enumerate(scenes) if k != 9} and len(first_six) == 24
    a = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    b = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert b["final_losses"] == a["final_losses"]
    assert [h["loss"] for h in b["history"]] == [h["loss"] for h in a["history"]]
    assert b["train_stream"]["skipped"] == a["train_stream"]["skipped"] == 1
    bad_shard = str(tmp_path / "shards" / "shard-00001.tar")
    assert b["skipped"]["train_examples"][0] == {"id": scenes[9]["id"], "path": bad_shard, "reason": "empty caption"}
    assert b["train_stream"]["epoch"] == 1 and b["train_stream"]["used"] == 32
    # per epoch, what the steps read (a user can check it): epoch 0 every usable sample once (the bad one was skipped
    # by its reader), epoch 1 the 9 samples of it the batches reached; the same for the killed and resumed run, and
    # the progress bar's epoch (32 of 24 samples)
    from finetune.training.epochs import ids_digest

    usable = [s["id"] for k, s in enumerate(scenes) if k != 9]
    assert [(e["epoch"], e["read"]) for e in a["epochs"]] == [(0, 23), (1, 9)]
    assert a["epochs"][0]["ids_digest"] == ids_digest(usable)
    second = collections.Counter(i for ids in whole for i in ids) - collections.Counter(usable)  # the 9 read again
    assert a["epochs"][1]["ids_digest"] == ids_digest(second.elements())
    assert b["epochs"] == a["epochs"] and b["epoch"] == a["epoch"] == round(32 / 24, 4)
    ckpt = tmp_path / "run" / "checkpoints" / "step-6" / "stream_state_0.json"
    state = json.loads(ckpt.read_text())
    assert (state["num_workers"], state["readers"], state["num_examples"]) == (2, 2, 24)
    assert [state["positions"][w]["yielded"] for w in ("0", "1")] == [12, 12]  # 3 batches of 4 from each worker
    # the stream position is part of the checkpoint's manifest: a changed byte is named on resume
    import hashlib

    from finetune.runs.checkpoints import checkpoint_problem

    manifest = json.loads((ckpt.parent / "train_state.json").read_text())["files"]
    assert manifest["stream_state_0.json"]["sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    ckpt.write_text(ckpt.read_text().replace('"version": 3', '"version": 4', 1))  # same size, other bytes
    assert checkpoint_problem(ckpt.parent).startswith("stream_state_0.json is damaged")


_TWO_PROCESS_SCRIPT = textwrap.dedent('''
    """Train on a webdataset stream in this process of a torchrun group; write the ids each step saw."""
    import json, sys
    from pathlib import Path

    from finetune.config import load_recipe
    from finetune.training import TrainStep, run_recipe

    out, tiny, urls = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    seen, where = [], {}
    original = TrainStep.forward_backward

    def recording(self, batch):
        seen.append(list(batch["ids"]))
        where.update(rank=self.accelerator.process_index, world_size=self.accelerator.num_processes)
        return original(self, batch)

    TrainStep.forward_backward = recording
    recipe = load_recipe(sys.argv[4], [
        f"model.name_or_path={tiny}", "model.dtype=null", "model.max_text_len=null",
        f"data.train={{name: webdataset, urls: '{urls}', shuffle_buffer: 0}}", "objective.terms={}",
        "eval.sets=[]", "eval.compare_base_length=false", "train.batch_size=4", "train.max_steps=3",
        "train.trackers=[]", "train.mixed_precision=no", "train.checkpoint_every=3", f"output.dir={out / 'run'}",
    ])
    status = run_recipe(recipe)
    (out / f"ids_{where['rank']}.json").write_text(json.dumps({**where, "ids": seen}))
    sys.exit(status)
''')


@pytest.mark.slow
def test_two_processes_read_disjoint_shards(tmp_path):
    from finetune.models.registry import save_tiny

    tiny = save_tiny("tiny-clip", tmp_path / "tiny")
    scenes = _scenes(24)
    shards = write_webdataset(tmp_path / "shards", scenes, 6)  # 4 shards: 2 per process
    shard_of = {s["id"]: k // 6 for k, s in enumerate(scenes)}
    script = tmp_path / "two_process.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(tmp_path), str(tiny), str(tmp_path / "shards" / "shard-{00000..00003}.tar"),
           str(REPO / "recipes" / "quickstart_clip.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads((tmp_path / f"ids_{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
    ids = [[i for step in r["ids"] for i in step] for r in records]
    assert all(len(step) == 2 for r in records for step in r["ids"]) and [len(x) for x in ids] == [6, 6]
    assert not set(ids[0]) & set(ids[1])
    shards_seen = [{shard_of[i] for i in x} for x in ids]
    assert shards_seen[0].isdisjoint(shards_seen[1])
    # the epoch's 24 samples split by position: process 0 reads 0-11, process 1 12-23 (shuffle_buffer 0: in order)
    assert ids[0] == [s["id"] for s in scenes[0:6]] and ids[1] == [s["id"] for s in scenes[12:18]]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["num_processes"] == 2 and metrics["train_stream"]["used"] == 12 and len(shards) == 4
    ckpt = tmp_path / "run" / "checkpoints" / "step-3"
    states = [json.loads((ckpt / f"stream_state_{r}.json").read_text()) for r in range(2)]
    assert [(s["rank"], s["world_size"], s["positions"]["0"]["yielded"]) for s in states] == [(0, 2, 6), (1, 2, 6)]


@pytest.mark.slow
def test_preview_of_a_stream_recipe(tmp_path):
    from finetune.models.registry import save_tiny
    from finetune.cli.preview import main

    tiny = save_tiny("tiny-clip", tmp_path / "tiny")
    write_webdataset(tmp_path / "shards", _scenes(4), 2)
    urls = str(tmp_path / "shards" / "shard-{00000..00001}.tar")
    heights = []
    for n in (1, 3):
        out = tmp_path / f"preview-{n}.png"
        # a stream trains train.max_steps steps: the preview checks the recipe as `xlipkit train` would
        assert main(["recipes/quickstart.yaml", f"model.name_or_path={tiny}", "train.max_steps=10",
                     "objective.terms.structxlip.weights.local=0", f"data.train={{name: webdataset, urls: '{urls}'}}",
                     "--n", str(n), "--out", str(out)]) == 0
        with PIL.Image.open(out) as png:
            assert png.width == 1600
            heights.append(png.height)
    assert heights[1] > 2.5 * heights[0]  # one row per streamed example


# --------------------------------------------------------------------------- broken shards and wrong column types


def _truncate_last_member(shard: Path) -> None:
    """Cut a tar shard in the middle of its last member's data (a copy or a download that stopped)."""
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-1]
    shard.write_bytes(shard.read_bytes()[:last.offset_data + last.size // 2])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_truncated_shard_is_skipped_counted_and_named(tmp_path, num_workers):
    """datasets raises ``tarfile.ReadError: unexpected end of data`` from inside its iterator, naming no shard: the
    sample it broke in is dropped, the rest of the shard skipped (counted, named in the report) and the next shards
    read, in every epoch."""
    scenes = _scenes(12)
    shards = write_webdataset(tmp_path, scenes, 3)  # 4 shards of 3 scenes
    _truncate_last_member(shards[1])  # scene 5's caption is cut: scenes 3 and 4 are read, 5 is lost
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00003}.tar"), "shuffle_buffer": 1, "seed": 2}
    loader = _loader(spec, num_workers)
    ids = [i for b in _batches(loader, 11) for i in b["ids"]]  # about two epochs of 11 usable scenes
    assert set(ids) == {s["id"] for k, s in enumerate(scenes) if k != 5}
    report = loader.report()
    assert report["skipped_shards"] == [{"shard": str(shards[1]),
                                         "reason": f"it ends inside the data of member {scenes[5]['id']}.txt"}]
    assert report["skipped_shard_count"] >= 1 and report["skipped"] == 0  # no example blamed for the shard


def test_a_truncated_shard_raises_naming_it_with_on_error_raise(tmp_path):
    shards = write_webdataset(tmp_path, _scenes(12), 3)
    _truncate_last_member(shards[2])
    spec = {"name": "webdataset", "urls": str(tmp_path / "shard-{00000..00003}.tar"), "shuffle_buffer": 0}
    with pytest.raises(DataError, match=r"shard .*shard-00002\.tar cannot be read to its end \(it ends inside the data "
                                        r"of member .*\.txt\): it is truncated or damaged.*data\.on_error: skip"):
        _batches(_loader(spec, 2, on_error="raise"), 6)


def _parquet_with_number_captions(folder: Path) -> list[Path]:
    scenes = _scenes(8)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(2):
        rows = scenes[s * 4:(s + 1) * 4]
        path = folder / f"part-{s:04d}.parquet"
        pq.write_table(pa.table({"key": [r["id"] for r in rows], "jpg": [r["png"] for r in rows],
                                 "text": [40 + i for i in range(4)]}), path)
        paths.append(path)
    return paths


@pytest.mark.slow
def test_a_caption_column_of_numbers_is_refused_by_its_type_and_named_example_by_example(tmp_path):
    from finetune.data.streams import check_stream_columns

    paths = _parquet_with_number_captions(tmp_path)
    spec = {"name": "parquet", "urls": str(tmp_path / "part-{0000..0001}.parquet"), "image_column": "jpg",
            "caption_column": "text", "id_column": "key"}
    with pytest.raises(DataError, match=rf"the caption column 'text' holds int64 values, not text \(in {paths[0]}\); "
                                        r"columns: key, jpg, text\. Set data\.train\.caption_column"):
        check_stream_columns(spec)
    # read anyway (a source whose types are known only example by example): the caption rules of map-style
    # sources name the cause in the loader's workers, and no example is "empty"
    with pytest.raises(DataError, match=r"found no usable examples in epoch 0 \(4 read, 4 skipped in all; the first "
                                        r"skipped: id='synthetic-train-s0-00000\d' in <stream>: the caption is a number "
                                        r"\(4\d\), not text"):
        _batches(_loader(spec, 2), 1)
    good = {**spec, "caption_column": "key"}  # strings: accepted
    check_stream_columns(good)
