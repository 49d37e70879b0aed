"""The source registry, spec parsing, the generic local formats and validation (skip / raise)."""

from __future__ import annotations

import io
import json
import logging

import datasets
import numpy as np
import PIL.Image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from finetune.data.sources import (
    DataError,
    LoadedSource,
    SourceSpec,
    available_sources,
    load_source,
    register_source,
)


def _png(colour=(200, 10, 10), size=(6, 4), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new(mode, size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- specs and registry


def test_parse_name_and_mapping():
    assert SourceSpec.parse("docci") == SourceSpec(name="docci")
    assert SourceSpec.parse("docci:goal") == SourceSpec(name="docci", protocol="goal")
    spec = SourceSpec.parse({"name": "jsonl", "path": "/d/x.jsonl", "limit": 5, "caption_column": "text"})
    assert (spec.name, spec.path, spec.limit, spec.caption_column, spec.seed) == ("jsonl", "/d/x.jsonl", 5, "text", 0)
    assert SourceSpec.parse(spec) is spec


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"name": "jsonl", "captions_column": "x"}, "unknown data source key 'captions_column'.*did you mean 'caption_column'"),
        ({"name": "synthetic", "size": "10"}, "'size' must be an integer or null, got str"),
        ({"name": "synthetic", "size": True}, "'size' must be an integer"),
        ({"name": "synthetic", "size": 0}, "'size' must be positive"),
        ({"name": "synthetic", "limit": 0}, "'limit' must be positive"),
        ({"name": "synthetic", "options": [1]}, "'options' must be a mapping"),
        ({"path": "/data"}, "needs a 'name'"),
        ({"name": ""}, "must not be empty"),
        (3, "a name .* or a mapping"),
    ],
)
def test_parse_errors_name_the_key(value, message):
    with pytest.raises(DataError, match=message):
        SourceSpec.parse(value)


def test_unknown_source_lists_registered_ones():
    with pytest.raises(DataError, match=r"unknown data source 'synthetc' \(did you mean 'synthetic'\?\); registered sources: .*csv.*imagefolder.*jsonl.*parquet.*synthetic"):
        load_source("synthetc")
    names = available_sources()
    assert {"synthetic", "jsonl", "csv", "parquet", "imagefolder"} <= set(names)
    assert all(isinstance(d, str) and d for d in names.values())


@register_source("test-protocols", description="a test source with protocols", protocols=("full", "small"))
def _build_protocol_source(spec: SourceSpec) -> datasets.Dataset:
    count = 3 if spec.protocol == "full" else 1
    # a benchmark-style builder: its own column names, no ids, undecoded bytes
    return datasets.Dataset.from_dict({"img": [_png()] * count, "text": [f"caption {i}" for i in range(count)]})


def test_protocols_default_first_and_builder_columns_are_renamed():
    loaded = load_source({"name": "test-protocols", "image_column": "img", "caption_column": "text"})
    assert isinstance(loaded, LoadedSource) and loaded.protocol == "full"
    assert set(loaded.dataset.column_names) == {"image", "caption", "id"}
    assert loaded.dataset["id"] == ["0", "1", "2"]
    assert loaded.dataset[0]["image"].mode == "RGB"
    small = load_source({"name": "test-protocols", "protocol": "small", "image_column": "img", "caption_column": "text"})
    assert len(small.dataset) == 1 and small.protocol == "small"
    with pytest.raises(DataError, match="no protocol 'tiny'; protocols: full, small"):
        load_source({"name": "test-protocols", "protocol": "tiny"})
    with pytest.raises(DataError, match="no image column 'image'; columns: img, text. Set image_column"):
        load_source("test-protocols")
    with pytest.raises(DataError, match="has no protocols"):
        load_source({"name": "synthetic", "size": 2, "protocol": "x"})


# --------------------------------------------------------------------------- generic formats


def test_jsonl_with_relative_paths_and_caption_lists(tmp_path):
    _write(tmp_path / "images" / "a.png", _png((255, 0, 0)))
    _write(tmp_path / "images" / "b.png", _png((0, 0, 255)))
    rows = [
        {"image": "images/a.png", "caption": ["A red block.", "Red."]},
        {"image": "images/b.png", "caption": ["", "A blue block."]},
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    loaded = load_source({"name": "jsonl", "path": str(tmp_path / "data.jsonl")}, cache_dir=str(tmp_path / "cache"))

    data = loaded.dataset
    assert data["id"] == ["0", "1"]
    assert data["caption"] == ["A red block.", "A blue block."]
    assert data["captions"] == [["A red block.", "Red."], ["", "A blue block."]]
    assert data[0]["image"].getpixel((0, 0)) == (255, 0, 0)
    assert data[1]["image"].getpixel((0, 0)) == (0, 0, 255)
    assert loaded.skipped == 0 and loaded.info["num_examples"] == 2 and len(loaded.info["ids_sha256"]) == 64


def test_jsonl_folder_with_splits_and_ids(tmp_path):
    image = _write(tmp_path / "img.png", _png())
    for split, names in (("train", ["t1", "t2"]), ("test", ["x1"])):
        lines = [json.dumps({"key": n, "path": str(image), "text": f"caption {n}"}) for n in names]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines))

    spec = {"name": "jsonl", "path": str(tmp_path), "split": "train", "image_column": "path",
            "caption_column": "text", "id_column": "key"}
    loaded = load_source(spec, cache_dir=str(tmp_path / "cache"))

    assert loaded.dataset["id"] == ["t1", "t2"]
    assert loaded.dataset["caption"] == ["caption t1", "caption t2"]
    with pytest.raises(DataError, match="no .*jsonl.* files for split 'valid'"):
        load_source({**spec, "split": "valid"}, cache_dir=str(tmp_path / "cache"))


def test_csv_with_custom_columns(tmp_path):
    _write(tmp_path / "pics" / "one.png", _png((0, 255, 0)))
    (tmp_path / "pairs.csv").write_text("file,description,uid\npics/one.png,A green square.,17\n")

    loaded = load_source(
        {"name": "csv", "path": str(tmp_path / "pairs.csv"), "image_column": "file",
         "caption_column": "description", "id_column": "uid"},
        cache_dir=str(tmp_path / "cache"),
    )

    assert loaded.dataset["id"] == ["17"]
    assert loaded.dataset[0]["caption"] == "A green square."
    assert loaded.dataset[0]["image"].getpixel((1, 1)) == (0, 255, 0)
    with pytest.raises(DataError, match="has no column 'caption'.*columns: file, description, uid. Set caption_column"):
        load_source({"name": "csv", "path": str(tmp_path / "pairs.csv"), "image_column": "file"},
                    cache_dir=str(tmp_path / "cache"))


def test_parquet_with_image_bytes(tmp_path):
    table = pa.table({"image": pa.array([_png((9, 9, 9)), _png((250, 250, 0))], pa.binary()),
                      "caption": ["Dark.", "Yellow."]})
    pq.write_table(table, tmp_path / "part-0.parquet")

    loaded = load_source({"name": "parquet", "path": str(tmp_path)}, cache_dir=str(tmp_path / "cache"))

    assert loaded.dataset["caption"] == ["Dark.", "Yellow."]
    assert loaded.dataset[1]["image"].getpixel((0, 0)) == (250, 250, 0)


def test_imagefolder_with_text_files(tmp_path):
    _write(tmp_path / "cat.png", _png((1, 1, 1)))
    (tmp_path / "cat.txt").write_text("A black cat.\n")
    _write(tmp_path / "sub" / "dog.jpg", _png((2, 2, 2)))
    (tmp_path / "sub" / "dog.txt").write_text("A dog.")
    _write(tmp_path / "uncaptioned.png", _png())

    loaded = load_source({"name": "imagefolder", "path": str(tmp_path)})

    assert loaded.dataset["id"] == ["cat", "sub/dog"]
    assert loaded.dataset["caption"] == ["A black cat.", "A dog."]
    assert loaded.skipped == 1 and loaded.skipped_examples[0]["id"] == "uncaptioned"
    assert loaded.skipped_examples[0]["reason"] == "empty caption"


def test_imagefolder_with_metadata_and_captions_json(tmp_path):
    meta = tmp_path / "meta"
    _write(meta / "a.png", _png())
    _write(meta / "b.png", _png())
    (meta / "metadata.jsonl").write_text(
        json.dumps({"file_name": "a.png", "text": "First."}) + "\n" + json.dumps({"file_name": "b.png", "text": "Second."})
    )
    loaded = load_source({"name": "imagefolder", "path": str(meta), "caption_column": "text"})
    assert loaded.dataset["id"] == ["a", "b"] and loaded.dataset["caption"] == ["First.", "Second."]
    with pytest.raises(DataError, match="metadata.jsonl: line 1 has no 'caption' key.*set caption_column"):
        load_source({"name": "imagefolder", "path": str(meta)})

    mapped = tmp_path / "mapped" / "test"
    _write(mapped / "x.png", _png())
    (mapped / "captions.json").write_text(json.dumps({"x": "By stem.", "gone.png": "A missing file."}))
    loaded = load_source({"name": "imagefolder", "path": str(tmp_path / "mapped"), "split": "test"})
    assert loaded.dataset["id"] == ["x"] and loaded.dataset["caption"] == ["By stem."]
    assert loaded.skipped == 1 and loaded.skipped_examples[0]["reason"] == "file not found"


def test_no_usable_examples_is_an_error(tmp_path):
    _write(tmp_path / "broken.png", b"")
    (tmp_path / "broken.txt").write_text("A caption.")
    with pytest.raises(DataError, match=r"no usable examples \(1 read, all skipped; first: id=broken: empty file"):
        load_source({"name": "imagefolder", "path": str(tmp_path)})


def test_path_errors(tmp_path):
    with pytest.raises(DataError, match="needs a path"):
        load_source("jsonl")
    with pytest.raises(DataError, match="does not exist"):
        load_source({"name": "csv", "path": str(tmp_path / "none.csv")})
    with pytest.raises(DataError, match="no images"):
        load_source({"name": "imagefolder", "path": str(tmp_path)})


# --------------------------------------------------------------------------- validation


@pytest.fixture()
def messy_folder(tmp_path):
    """A JSONL source with every kind of problem a real dataset has."""
    folder = tmp_path / "messy"
    good = _write(folder / "good.png", _png((10, 20, 30)))
    rgba = np.zeros((4, 4, 4), np.uint8)  # fully transparent: must come out white, not black
    buffer = io.BytesIO()
    PIL.Image.fromarray(rgba, mode="RGBA").save(buffer, format="PNG")
    _write(folder / "rgba.png", buffer.getvalue())
    buffer = io.BytesIO()
    PIL.Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(buffer, format="JPEG", quality=100)
    _write(folder / "cmyk.jpg", buffer.getvalue())
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.full((4, 4), 65535, np.uint16)).save(buffer, format="PNG")
    _write(folder / "deep.png", buffer.getvalue())
    _write(folder / "corrupt.png", b"\x89PNG\r\n\x1a\n garbage")
    _write(folder / "empty.png", b"")
    rows = [
        ("good", "good.png", "A good image."),
        ("rgba", "rgba.png", "A transparent image."),
        ("cmyk", "cmyk.jpg", "A CMYK image."),
        ("deep", "deep.png", "A 16-bit image."),
        ("corrupt", "corrupt.png", "A corrupt file."),
        ("missing", "missing.png", "A missing file."),
        ("empty", "empty.png", "An empty file."),
        ("blank", str(good), "   "),
    ]
    lines = [json.dumps({"id": i, "image": p, "caption": c}) for i, p, c in rows]
    (folder / "data.jsonl").write_text("\n".join(lines))
    return folder


def test_skip_counts_bad_examples_and_converts_odd_modes(messy_folder, tmp_path, caplog):
    spec = {"name": "jsonl", "path": str(messy_folder / "data.jsonl")}
    with caplog.at_level(logging.WARNING, logger="finetune.data.sources"):
        loaded = load_source(spec, cache_dir=str(tmp_path / "cache"))

    assert loaded.skipped == 4
    assert loaded.dataset["id"] == ["good", "rgba", "cmyk", "deep"]
    reasons = {e["id"]: e["reason"] for e in loaded.skipped_examples}
    assert set(reasons) == {"corrupt", "missing", "empty", "blank"}
    assert "not a readable image" in reasons["corrupt"]
    assert reasons["missing"] == "file not found"
    assert reasons["empty"] == "empty file (0 bytes)"
    assert reasons["blank"] == "empty caption"
    assert next(e for e in loaded.skipped_examples if e["id"] == "missing")["path"].endswith("missing.png")
    assert loaded.info["num_read"] == 8 and loaded.info["num_examples"] == 4
    assert "skipped 4 of 8 examples" in caplog.text and "id=corrupt" in caplog.text

    images = {row["id"]: row["image"] for row in loaded.dataset}
    assert all(image.mode == "RGB" for image in images.values())
    assert images["good"].getpixel((0, 0)) == (10, 20, 30)
    assert images["rgba"].getpixel((0, 0)) == (255, 255, 255)
    assert all(abs(a - b) <= 3 for a, b in zip(images["cmyk"].getpixel((0, 0)), (255, 0, 0)))
    assert images["deep"].getpixel((0, 0)) == (255, 255, 255)


def test_raise_names_the_id_and_path(messy_folder, tmp_path):
    spec = {"name": "jsonl", "path": str(messy_folder / "data.jsonl")}
    with pytest.raises(DataError, match=r"id='corrupt' \(image .*corrupt.png\): not a readable image.*on_error: skip"):
        load_source(spec, on_error="raise", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="on_error must be one of skip, raise"):
        load_source(spec, on_error="ignore")


def test_limit_and_full_validation(tmp_path):
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (256, 256, 3), dtype=np.uint8)).save(buffer, "JPEG")
    data = buffer.getvalue()
    _write(tmp_path / "whole.jpg", data)
    _write(tmp_path / "cut.jpg", data[: len(data) // 2])  # header intact, body truncated
    rows = [{"image": n, "caption": "A photo."} for n in ("whole.jpg", "cut.jpg", "whole.jpg")]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    spec = {"name": "jsonl", "path": str(tmp_path / "d.jsonl")}
    cache = str(tmp_path / "cache")

    quick = load_source(spec, cache_dir=cache)  # the header probe decodes a JPEG without its end marker
    assert quick.skipped == 1 and "truncated" in quick.skipped_examples[0]["reason"]
    full = load_source(spec, cache_dir=cache, validate="full")
    assert full.skipped == 1 and "truncated" in full.skipped_examples[0]["reason"]
    assert full.dataset["id"] == ["0", "2"]
    limited = load_source({**spec, "limit": 1}, cache_dir=cache, validate="full")
    assert limited.dataset["id"] == ["0"] and limited.skipped == 0


# --------------------------------------------------------------------------- JSON rows of the wrong kind


def _jsonl_lines(tmp_path, lines: list[str], name: str = "data.jsonl") -> str:
    _write(tmp_path / "a.png", _png((255, 0, 0)))
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _row(caption) -> str:
    return json.dumps({"image": "a.png", "caption": caption})


def test_a_number_caption_is_named_as_a_number_not_as_empty(tmp_path):
    path = _jsonl_lines(tmp_path, [_row("A red square."), _row(42), _row(None), _row(True)])
    loaded = load_source({"name": "jsonl", "path": path}, cache_dir=str(tmp_path / "cache"))
    assert loaded.dataset["id"] == ["0"] and loaded.skipped == 3
    assert [e["reason"] for e in loaded.skipped_examples] == [
        "line 2: the caption is a number (42), not text", "line 3: the caption is null, not text",
        "line 4: the caption is a boolean (true), not text"]
    assert loaded.skipped_ids == ["data.jsonl:2", "data.jsonl:3", "data.jsonl:4"]
    with pytest.raises(DataError, match=r"data\.jsonl: line 2: the caption is a number \(42\), not text\. Fix the "
                                        r"file, or set data\.on_error: skip"):
        load_source({"name": "jsonl", "path": path}, on_error="raise", cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("order", ["string first", "list first"])
def test_caption_lists_mixed_with_strings_are_all_kept(tmp_path, order):
    rows = [_row("A red square."), _row(["A red block.", "Red."]), _row(["", "Crimson."])]
    if order == "list first":
        rows = rows[1:] + rows[:1]
    loaded = load_source({"name": "jsonl", "path": _jsonl_lines(tmp_path, rows)}, on_error="raise",
                         cache_dir=str(tmp_path / "cache"))
    by_id = dict(zip(loaded.dataset["id"], zip(loaded.dataset["caption"], loaded.dataset["captions"])))
    expected = {"A red square.": ["A red square."], "A red block.": ["A red block.", "Red."],
                "Crimson.": ["", "Crimson."]}
    assert loaded.skipped == 0 and sorted(by_id) == ["0", "1", "2"]
    assert {caption: captions for caption, captions in by_id.values()} == expected
    bad = _jsonl_lines(tmp_path, [_row("A red square."), _row(["fine", 7])], name="bad.jsonl")
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2: caption 1 of the list is a number \(7\), not text"):
        load_source({"name": "jsonl", "path": bad}, on_error="raise", cache_dir=str(tmp_path / "cache"))


def test_one_bad_json_line_is_named_and_follows_on_error(tmp_path):
    path = _jsonl_lines(tmp_path, [_row("One."), '{"image": "a.png", "caption": "cut off', _row("Three."),
                                   '{"image": "a.png", "caption": "bad \\ud800 escape"}'])
    loaded = load_source({"name": "jsonl", "path": path}, cache_dir=str(tmp_path / "cache"))
    assert loaded.dataset["id"] == ["0", "2"] and loaded.dataset["caption"] == ["One.", "Three."]  # ids: row numbers
    assert loaded.skipped_ids == ["data.jsonl:2", "data.jsonl:4"]
    reasons = [e["reason"] for e in loaded.skipped_examples]
    assert reasons[0] == "line 2, column 31: not valid JSON (Unterminated string)"
    assert reasons[1] == ("line 4: the caption holds a lone surrogate (U+D800, an unpaired \\u escape), which is "
                          "not valid text")
    with pytest.raises(DataError, match=r"data\.jsonl: line 2, column 31: not valid JSON \(Unterminated "
                                        r"string\)\. Fix"):
        load_source({"name": "jsonl", "path": path}, on_error="raise", cache_dir=str(tmp_path / "cache"))


def test_an_empty_jsonl_says_it_is_empty(tmp_path):
    path = _jsonl_lines(tmp_path, [])
    with pytest.raises(DataError, match=r"no readable rows in '.*data\.jsonl' \(the file is empty\); give a file with "
                                        r"one JSON object per line"):
        load_source({"name": "jsonl", "path": path}, cache_dir=str(tmp_path / "cache"))
    path = _jsonl_lines(tmp_path, ["{oops", _row(5)], name="bad.jsonl")
    with pytest.raises(DataError, match=r"no readable rows in '.*bad\.jsonl' \(every row unreadable; first: line 1, "
                                        r"column 2: not valid JSON"):
        load_source({"name": "jsonl", "path": path}, cache_dir=str(tmp_path / "cache"))


def test_imagefolder_metadata_rows_of_the_wrong_kind(tmp_path):
    _write(tmp_path / "a.png", _png())
    _write(tmp_path / "b.png", _png())
    lines = [json.dumps({"file_name": "a.png", "text": 3}), "{not json",
             json.dumps({"file_name": "b.png", "text": ["Two.", "Captions."]})]
    (tmp_path / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    loaded = load_source({"name": "imagefolder", "path": str(tmp_path), "caption_column": "text"})
    assert loaded.dataset["id"] == ["b"] and loaded.dataset["captions"] == [["Two.", "Captions."]]
    assert [e["reason"] for e in loaded.skipped_examples] == [
        "line 1: the caption is a number (3), not text", "line 2, column 2: not valid JSON (Expecting property name "
        "enclosed in double quotes)"]


def test_a_non_text_caption_in_a_table_names_its_type():
    from finetune.data.sources import _caption_problem

    assert _caption_problem(7) == "the caption is a number (7), not text"
    assert _caption_problem(None) == "the caption is null, not text"
