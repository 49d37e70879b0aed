"""``xlipkit superpixels RECIPE OUT`` (finetune/cli/superpixels.py, issue 29 item 4): F-CAST's superpixels written
once into a copy of a recipe's webdataset shards, equal to the ones a run computes on the fly, and read back by the
stream so that the data workers compute none."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.recipes.shipped import ROOT, Project, as_shipped_overrides

RECIPE = ROOT / "recipes" / "fcast_cc3m_recap.yaml"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Project:
    return Project(tmp_path_factory.mktemp("superpixels_project"))


@pytest.fixture
def shipped(project, monkeypatch) -> list[str]:
    """fcast_cc3m_recap.yaml as shipped on DreamLIP fixture shards and fcast-tiny, SFCN (random weights) at the path
    the recipe names; the project root is the current directory."""
    monkeypatch.chdir(project.root)
    return as_shipped_overrides(RECIPE, project)


@pytest.fixture(scope="module")
def written(project, tmp_path_factory) -> dict:
    """The manifest of ``xlipkit superpixels`` run once on the shipped recipe's shards (read-only for the tests)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project.root)
        return _write(as_shipped_overrides(RECIPE, project), tmp_path_factory.mktemp("written") / "out")


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def _write(shipped: list[str], out: Path, *extra: str) -> dict:
    from finetune.cli.main import main

    assert main(["superpixels", str(RECIPE), str(out), *shipped, *extra]) == 0
    return json.loads((out / "superpixels.json").read_text())


def _model(shipped: list[str]):
    """The run's model with the run's superpixel settings (the recipe's term applied)."""
    from finetune.cli.superpixels import resolve_settings
    from finetune.config import load_recipe

    from finetune import load_model

    model = load_model("random:fcast-tiny", family="fcast")
    settings, side = resolve_settings(load_recipe(RECIPE, shipped))
    model.superpixels = settings
    return model


@pytest.mark.slow
def test_the_shards_hold_the_superpixels_a_run_computes_and_every_original_member(shipped, written, capsys):
    import PIL.Image

    from finetune.preprocess.superpixels import decode_entry, settings_stamp

    manifest = written
    out = Path(manifest["urls"]).parent
    source = [o.split("=", 1)[1].strip('"') for o in shipped if o.startswith("data.train.urls=")][0]
    assert manifest["settings"]["method"] == "sfcn" and manifest["image_size"] == 64
    assert manifest["shards"] == manifest["written"] == 4 and manifest["unreadable"] == 0
    assert manifest["urls"] == str(out / "{00000..00003}.tar") and manifest["source_urls"] == source
    model = _model(shipped)
    stamp = settings_stamp(model.superpixels, model.image_size)
    checked = 0
    for shard in ("00000.tar", "00003.tar"):
        original = _members(Path(source).parent / shard)
        copy = _members(out / shard)
        entries = {k: v for k, v in copy.items() if k.endswith(".superpixels.png")}
        assert {k: v for k, v in copy.items() if k not in entries} == original  # byte for byte
        keys = sorted({k.split(".", 1)[0] for k in original})
        assert sorted(entries) == [f"{k}.superpixels.png" for k in keys]
        images = [PIL.Image.open(__import__("io").BytesIO(original[f"{k}.jpg"])) for k in keys[:6]]
        on_the_fly = model.preprocess_images(images)["superpixels"].numpy()
        for key, labels in zip(keys, on_the_fly):
            np.testing.assert_array_equal(decode_entry(entries[f"{key}.superpixels.png"], stamp), labels)
            checked += 1
    assert checked == 12
    with tarfile.open(out / "00001.tar") as tar:  # each entry right after its sample's members
        names = tar.getnames()
    assert names[:3] == [names[0], names[0].replace(".jpg", ".json"), names[0].replace(".jpg", ".superpixels.png")]


@pytest.mark.slow
def test_a_second_run_keeps_written_shards_and_other_settings_need_another_folder(shipped, written, tmp_path, capsys):
    out = tmp_path / "out"
    _write(shipped, out, "--workers", "2")  # two processes write the shards one process wrote, byte for byte
    assert f"data.train.urls='{out / '{00000..00003}.tar'}'" in capsys.readouterr().out
    serial = Path(written["urls"]).parent
    for shard in ("00000.tar", "00001.tar", "00002.tar", "00003.tar"):
        assert (out / shard).read_bytes() == (serial / shard).read_bytes()
    (out / "00002.tar").unlink()  # as if interrupted before this shard was renamed into place
    again = _write(shipped, out)
    assert again["written"] == 1 and again["kept"] == 3 and (out / "00002.tar").is_file()
    from finetune.cli.main import main

    other = ("objective.terms.fcast.superpixels={method: sfcn, n_segments: 144, "
             "checkpoint: checkpoints/sfcn_bsds.safetensors}")
    assert main(["superpixels", str(RECIPE), str(out), *shipped, other]) == 2
    err = capsys.readouterr().err
    assert "holds shards written with other settings" in err and "--overwrite" in err
    assert _write(shipped, out, other, "--overwrite")["written"] == 4


def test_recipes_it_cannot_serve_are_refused_before_any_shard(tmp_path, monkeypatch, capsys):
    from finetune.cli.main import main

    monkeypatch.chdir(tmp_path)
    tiny = ROOT / "recipes" / "fcast_tiny_synthetic.yaml"
    assert main(["superpixels", str(tiny), str(tmp_path / "out")]) == 2
    assert "data.train is 'synthetic'" in capsys.readouterr().err
    urls = 'data.train={name: webdataset, urls: "shards/{00000..00001}.tar"}'
    (tmp_path / "shards").mkdir()
    for name in ("00000.tar", "00001.tar"):
        (tmp_path / "shards" / name).write_bytes(b"")
    assert main(["superpixels", str(tiny), str(tmp_path / "out"), urls, "--device", "cuda"]) == 2
    assert "superpixels.method slic runs on the CPU" in capsys.readouterr().err
    assert main(["superpixels", str(ROOT / "recipes" / "flair_cc3m_recap.yaml"), str(tmp_path / "out")]) == 2
    assert "no fcast term" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _stream(urls: str, model, objective, workers: int):
    from finetune.data.collate import Collator
    from finetune.data.streams import ExampleStream, StreamLoader, open_stream

    spec = {"name": "webdataset", "urls": urls, "shuffle_buffer": 0, "caption_column": "json.raw_caption"}
    stream = ExampleStream(open_stream(spec), spec, on_error="raise",
                           transform=lambda e: objective.stream_map(e, model))
    return StreamLoader(stream, batch_size=4, collate_fn=Collator(model, objective), num_workers=workers)


def _objective(model):
    from finetune.objectives.base import Objective
    from finetune.objectives.fcast import FCastOptions
    from finetune.objectives.registry import build_term

    term, _ = build_term("fcast", FCastOptions(k=4, n_chunks=4))
    objective = Objective(None, [(term, 1.0)])
    objective.prepare_model(model)
    return objective


@pytest.mark.slow
def test_a_stream_of_precomputed_shards_does_no_superpixel_work_in_its_workers(shipped, written, tmp_path,
                                                                              monkeypatch):
    from finetune.models.families.fcast import FCastModel
    from finetune.preprocess import superpixels as sp

    manifest = written
    model = _model(shipped)
    objective = _objective(model)
    expected = {}
    for batch in _stream(manifest["source_urls"], model, objective, 0):  # the original shards: computed here
        expected.update(zip(batch["ids"], batch["image_inputs"]["superpixels"]))
        if len(expected) == manifest["with_superpixels"]:  # every sample once
            break
    calls = tmp_path / "superpixel_calls.txt"

    def record(name, original):
        def recorded(*args, **kwargs):
            with open(calls, "a") as f:
                f.write(f"{os.getpid()} {name}\n")
            return original(*args, **kwargs)
        return recorded

    for owner, name in ((sp, "compute_superpixels"), (sp, "compute_superpixels_batch"), (sp, "slic_superpixels"),
                        (sp, "sfcn_superpixels_batch"), (FCastModel, "superpixels_of"),
                        (FCastModel, "superpixels_of_batch")):
        monkeypatch.setattr(owner, name, record(name, getattr(owner, name)))

    def four_batches(urls: str) -> list[dict]:
        loader = _stream(urls, model, objective, 2)
        assert loader.loader.num_workers == 2
        it = iter(loader)
        out = [next(it) for _ in range(4)]
        del it
        return out

    four_batches(manifest["source_urls"])  # the recording reaches the workers: the original shards are computed there
    pids = {int(line.split()[0]) for line in calls.read_text().splitlines()}
    assert len(pids) == 2 and os.getpid() not in pids
    calls.unlink()
    batches = four_batches(manifest["urls"])
    assert not calls.exists(), calls.read_text()  # no worker (nor this process) computed a superpixel map
    for batch in batches:
        labels = batch["image_inputs"]["superpixels"]
        assert labels.dtype == torch.int64 and labels.shape == (4, 64, 64)
        for ident, row in zip(batch["ids"], labels):
            assert torch.equal(row, expected[ident])


def test_entries_of_other_settings_stop_the_stream_naming_both(shipped, written):
    from finetune.data.images import DataError
    from finetune.preprocess.superpixels import settings_from

    manifest = written
    model = _model(shipped)
    objective = _objective(model)
    model.superpixels = settings_from({"method": "slic", "n_segments": 49})
    with pytest.raises(DataError, match=r"sample '00000000000' of .*00000\.tar: the precomputed superpixels were made "
                                        r"with .*sfcn.* but this run computes them with .*slic.*xlipkit superpixels"):
        next(iter(_stream(manifest["urls"], model, objective, 0)))


@pytest.mark.slow
def test_fcast_cc3m_recap_trains_as_shipped_on_its_precomputed_shards(project, written, monkeypatch, capsys, tmp_path):
    """The recipe header's route: `xlipkit superpixels` then the run on the new shards (only data.train.urls
    changes): it trains with its data workers (the recipe's 8, as many as the fixture's 4 shards allow), and no
    worker computes a superpixel map (the evaluation sets and the report's drawings, map-style, still compute theirs
    in this process)."""
    from accelerate.state import AcceleratorState, GradientState

    from finetune.models.families.fcast import FCastModel
    from finetune.cli.train import main
    from tests.recipes.shipped import STEPS, clear_run, enter, output_dir

    calls = tmp_path / "superpixel_calls.txt"
    original = FCastModel.superpixels_of_batch

    def recorded(self, arrays):
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(self, arrays)

    monkeypatch.setattr(FCastModel, "superpixels_of_batch", recorded)
    overrides = [o for o in as_shipped_overrides(RECIPE, project) if not o.startswith("data.train.urls=")]
    overrides.append(f"data.train.urls={written['urls']}")
    out = output_dir(RECIPE, project)
    enter(monkeypatch, project)
    clear_run(out)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert main([f"recipes/{RECIPE.name}", *overrides]) == 0, capsys.readouterr().err[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and {"fcast/part", "fcast/whole"} <= set(metrics["final_losses"])
    assert metrics["train_stream"]["num_workers"] >= 2  # the recipe's 8, capped by the 4 fixture shards
    pids = {int(line) for line in calls.read_text().split()} if calls.exists() else set()
    assert pids <= {os.getpid()}, f"data workers computed superpixels: {pids - {os.getpid()}}"


def test_the_model_takes_precomputed_labels_and_computes_only_the_missing_ones(monkeypatch):
    from finetune import load_model
    from finetune.data.synthetic import synthetic_scenes
    from finetune.models.families.fcast import FCastModel

    model = load_model("random:fcast-tiny", family="fcast")
    images = [r["image"] for r in synthetic_scenes(3, 0, image_size=80)]
    computed = model.preprocess_images(images)["superpixels"]
    given = np.full((64, 64), 7, dtype=np.int64)
    seen = []
    original = FCastModel.superpixels_of_batch
    monkeypatch.setattr(FCastModel, "superpixels_of_batch",
                        lambda self, arrays: seen.append(len(arrays)) or original(self, arrays))
    out = model.preprocess_images(images, superpixels=[given, None, given])
    assert seen == [1]  # only the image without labels
    assert torch.equal(out["superpixels"][0], torch.from_numpy(given))
    assert torch.equal(out["superpixels"][1], computed[1])
    with pytest.raises(ValueError, match=r"shape \(32, 32\) for a 64 x 64 image.*xlipkit superpixels"):
        model.preprocess_images(images[:1], superpixels=[np.zeros((32, 32), dtype=np.int64)])


# --------------------------------------------------------------------------- OUT checked before anything slow (#40)


def _input_shards(tmp_path: Path) -> list[Path]:
    from tests.finetune.data.test_streams import _scenes, write_webdataset

    return write_webdataset(tmp_path / "shards", _scenes(4), 2)


def test_out_may_not_be_the_input_folder_a_file_unwritable_or_hold_foreign_shards(tmp_path):
    """Issue 40: OUT = the input folder wrote superpixels.json into it and, with --overwrite, replaced the input
    shards; a foreign shard-00000.tar in OUT (no manifest) was kept and recommended for training; OUT a file or
    unwritable gave a traceback."""
    from finetune.cli.superpixels import _check_out
    from tests.finetune.mounts import require_read_only_possible, tmpfs

    shards = _input_shards(tmp_path)
    sources, names = [str(p) for p in shards], [p.name for p in shards]
    before = [p.read_bytes() for p in shards]
    for out, says in [(tmp_path / "shards", "is the folder of the input shards"),
                      (tmp_path / "shards" / ".." / "shards", "is the folder of the input shards"),
                      (shards[0], "is a file: give a folder"),
                      (shards[0] / "sub", "cannot create OUT")]:
        with pytest.raises(ValueError, match=says):
            _check_out(out, sources, names)
    assert [p.read_bytes() for p in shards] == before and not (tmp_path / "shards" / "superpixels.json").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / names[0]).write_bytes(b"not ours")
    with pytest.raises(ValueError, match=rf"holds {names[0]} that xlipkit superpixels did not write \(no "
                                         r"superpixels\.json\).*choose an empty OUT folder"):
        _check_out(foreign, sources, names)
    assert _check_out(tmp_path / "new", sources, names).is_dir()
    with tmpfs(tmp_path / "ro") as folder:
        require_read_only_possible(folder)
        folder.read_only()
        with pytest.raises(ValueError, match=r"cannot create OUT .*/ro/out: Read-only file system"):
            _check_out(folder.path / "out", sources, names)
        with pytest.raises(ValueError, match=r"OUT .*/ro cannot be written"):
            _check_out(folder.path, sources, names)


@pytest.mark.slow
def test_the_command_refuses_such_an_out_with_exit_2_and_takes_overrides_after_options(tmp_path, monkeypatch,
                                                                                      capsys):
    from finetune.cli.main import main

    shards = _input_shards(tmp_path)
    monkeypatch.chdir(tmp_path)
    tiny = str(ROOT / "recipes" / "fcast_tiny_synthetic.yaml")
    urls = f'data.train={{name: webdataset, urls: "{tmp_path}/shards/shard-{{00000..00001}}.tar"}}'
    before = [p.read_bytes() for p in shards]
    assert main(["superpixels", tiny, "shards", "--workers", "1", urls, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "error: OUT shards is the folder of the input shards" in err and "Traceback" not in err
    assert [p.read_bytes() for p in shards] == before and not (tmp_path / "shards" / "superpixels.json").exists()
    assert main(["superpixels", tiny, str(shards[0]), "--workers", "1", urls]) == 2
    assert "is a file" in capsys.readouterr().err
