"""Captions that are not UTF-8 name their file and line and follow ``data.on_error``; duplicate
ids in a source are reported."""

from __future__ import annotations

import json
import logging

import PIL.Image
import pytest

from finetune.data.bad_rows import decode_utf8
from finetune.data.sources import DataError, load_source


def _images(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        PIL.Image.new("RGB", (8, 8), (40 * i, 20, 200)).save(folder / f"{name}.png")


def test_decode_utf8_names_the_line_column_and_byte(tmp_path):
    data = "first line\nun caf\u00e9 noir".encode("latin-1")
    with pytest.raises(DataError, match=r"c\.txt: line 2, column 7: not UTF-8 \(byte 0xe9\)"):
        decode_utf8(data, tmp_path / "c.txt")
    assert decode_utf8("caf\u00e9".encode("utf-8-sig"), "x") == "caf\u00e9"


def test_latin1_txt_caption_beside_an_image_is_skipped_with_its_id(tmp_path):
    _images(tmp_path, ["a", "b", "c"])
    (tmp_path / "a.txt").write_text("A red square.", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes("Un caf\u00e9 cr\u00e8me.".encode("latin-1"))
    (tmp_path / "c.txt").write_text("A caf\u00e9 in UTF-8.", encoding="utf-8")
    src = load_source({"name": "imagefolder", "path": str(tmp_path)})
    assert src.dataset["id"] == ["a", "c"] and src.dataset["caption"][1] == "A caf\u00e9 in UTF-8."
    assert src.skipped == 1 and src.skipped_ids == ["b"]
    entry = src.skipped_examples[0]
    assert entry["path"] == str(tmp_path / "b.txt") and "line 1, column 7: not UTF-8 (byte 0xe9)" in entry["reason"]
    assert src.info["num_read"] == 3


def test_latin1_txt_caption_with_raise_names_the_file(tmp_path):
    _images(tmp_path, ["a", "b"])
    (tmp_path / "a.txt").write_text("A red square.", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes("Un caf\u00e9.".encode("latin-1"))
    with pytest.raises(DataError, match=r"b\.txt: line 1, column 7: not UTF-8 .*data\.on_error: skip"):
        load_source({"name": "imagefolder", "path": str(tmp_path)}, on_error="raise")


def _jsonl(tmp_path, latin1_row: int) -> str:
    _images(tmp_path, ["a", "b", "c"])
    lines = []
    for i, name in enumerate("abc"):
        line = json.dumps({"id": name, "image": f"{name}.png", "caption": f"Caf\u00e9 {name}."}, ensure_ascii=False)
        lines.append(line.encode("latin-1" if i == latin1_row else "utf-8"))
    path = tmp_path / "set.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


@pytest.mark.parametrize("name", ["jsonl", "imagefolder-metadata"])
def test_latin1_jsonl_row_is_skipped_naming_the_line(tmp_path, name):
    path = _jsonl(tmp_path, latin1_row=1)
    if name == "jsonl":
        spec = {"name": "jsonl", "path": path}
    else:
        lines = (tmp_path / "set.jsonl").read_bytes().replace(b'"image"', b'"file_name"')
        (tmp_path / "metadata.jsonl").write_bytes(lines)
        spec = {"name": "imagefolder", "path": str(tmp_path), "id_column": "id"}
    src = load_source(spec)
    assert src.dataset["id"] == ["a", "c"] and src.dataset["caption"] == ["Caf\u00e9 a.", "Caf\u00e9 c."]
    assert src.skipped == 1 and src.skipped_ids[0].endswith(".jsonl:2")
    assert "line 2, column" in src.skipped_examples[0]["reason"]
    with pytest.raises(DataError, match=r"\.jsonl: line 2, column \d+: not UTF-8 \(byte 0xe9\)"):
        load_source(spec, on_error="raise")


def test_duplicate_ids_are_reported(tmp_path, caplog):
    _images(tmp_path, ["a", "b"])
    rows = [{"id": "x", "image": "a.png", "caption": "one"}, {"id": "x", "image": "b.png", "caption": "two"},
            {"id": "y", "image": "b.png", "caption": "three"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING):
        src = load_source({"name": "jsonl", "path": str(path)})
    assert len(src.dataset) == 3
    assert "1 duplicate ids (first: 'x' (2x))" in caplog.text
    with pytest.raises(DataError, match=r"duplicate ids \(first: 'x' \(2x\)\).*id_column"):
        load_source({"name": "jsonl", "path": str(path)}, on_error="raise")
