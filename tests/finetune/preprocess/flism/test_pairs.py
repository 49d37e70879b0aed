"""FLISM's pairs file (GLIT100k-style): written with resume, read back one example per image."""

from __future__ import annotations

import json

import datasets
import pytest

from finetune.data.text import split_sentences
from finetune.preprocess.flism.pairs import pairs_by_image, write_pairs
from tests.finetune.preprocess.flism.stubs import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_datasets")


def test_write_pairs_writes_a_jsonl_that_data_train_reads_and_resumes(tmp_path):
    from finetune.data.sources import load_source

    model = tiny_model(tmp_path)
    source = {"name": "synthetic", "size": 6, "seed": 0, "options": {"image_size": 32}}
    out = tmp_path / "pairs" / "glit.jsonl"
    counts = write_pairs(source, out, model, batch_size=4, progress=False)
    assert counts == {"images": 6, "skipped": 0, "pairs": 6}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    scenes = load_source(source).dataset
    assert [r["id"] for r in rows] == list(scenes["id"])
    for row, caption in zip(rows, scenes["caption"]):
        assert row["caption"] == caption
        assert split_sentences(caption)[row["sentence_index"]] == row["sentence"]
        assert row["candidates"] == 5 and len(row["box"]) == 4 and -1 <= row["similarity"] <= 1
    loaded = load_source({"name": "jsonl", "path": str(out)}).dataset
    assert len(loaded) == 6 and {"box", "sentence_index", "similarity"} <= set(loaded.column_names)
    assert loaded[0]["image"].size == (32, 32)
    # an interrupted run: the last image's line half written and not in the done-list
    done = out.with_name(out.name + ".done")
    done.write_text("".join(i + "\n" for i in list(scenes["id"])[:4]))
    text = out.read_text().splitlines()
    out.write_text("\n".join(text[:5]) + "\n" + text[5][:20])
    again = write_pairs(source, out, model, batch_size=4, progress=False)
    assert again == {"images": 2, "skipped": 4, "pairs": 2}
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert write_pairs(source, out, model, progress=False)["images"] == 0


def _pair_lines(rows: list[dict]) -> datasets.Dataset:
    base = {"image": "unused.png", "sentence": "s", "candidates": 5}
    return datasets.Dataset.from_list([{**base, **r} for r in rows])


def test_pairs_by_image_groups_an_images_lines_with_their_weights():
    """A pairs file's lines -> one example per image: its most similar lines first, the file's weights renormalised
    over the pairs kept, padding with weight 0, as select_pairs gives them in a recipe."""
    lines = _pair_lines([
        {"id": "a#0", "image_id": "a", "caption": "A. B. C.", "box": [0, 0, 4, 4], "sentence_index": 2,
         "similarity": 0.5, "weight": 0.5},
        {"id": "b", "image_id": "b", "caption": "D.", "box": [1, 1, 2, 2], "sentence_index": 0, "similarity": 0.9,
         "weight": 1.0},
        {"id": "a#1", "image_id": "a", "caption": "A. B. C.", "box": [1, 0, 4, 4], "sentence_index": 0,
         "similarity": 0.3, "weight": 0.3},
        {"id": "a#2", "image_id": "a", "caption": "A. B. C.", "box": [2, 0, 4, 4], "sentence_index": 1,
         "similarity": 0.2, "weight": 0.2},
    ])
    grouped, info = pairs_by_image(lines, pairs=3)
    assert info == {"lines": 4, "images": 2, "most_pairs_per_image": 3}
    assert grouped["id"] == ["a", "b"] and grouped["caption"] == ["A. B. C.", "D."]
    assert grouped["flism_num_pairs"] == [3, 1]
    assert grouped["flism_pair_sentence"] == [[2, 0, 1], [0, 0, 0]]
    assert grouped["flism_pair_weight"][0] == pytest.approx([0.5, 0.3, 0.2])
    assert grouped["flism_pair_weight"][1] == [1.0, 0.0, 0.0]
    assert grouped["flism_pair_box"][1] == [[1.0, 1.0, 2.0, 2.0]] * 3
    assert not {"box", "sentence_index", "weight", "image_id"} & set(grouped.column_names)
    # regions.pairs: 2 keeps the two most similar, their weights renormalised
    two, _ = pairs_by_image(lines, pairs=2)
    assert two["flism_pair_sentence"][0] == [2, 0] and two["flism_pair_weight"][0] == pytest.approx([0.625, 0.375])
    # a file without image_id (an older one): the id without write_pairs' "#p" names the image
    old, info = pairs_by_image(lines.remove_columns(["image_id"]), pairs=3)
    assert old["id"] == ["a", "b"] and info["images"] == 2
    # without a weight column: uniform
    plain, _ = pairs_by_image(lines.remove_columns(["weight"]), pairs=3)
    assert plain["flism_pair_weight"][0] == pytest.approx([1 / 3] * 3)


def test_pairs_by_image_rejects_an_image_with_two_captions_and_a_bad_box():
    from finetune.data.images import DataError

    rows = [{"id": "a#0", "image_id": "a", "caption": "One.", "box": [0, 0, 4, 4], "sentence_index": 0,
             "similarity": 0.5, "weight": 1.0},
            {"id": "a#1", "image_id": "a", "caption": "Another.", "box": [0, 0, 4, 4], "sentence_index": 0,
             "similarity": 0.4, "weight": 1.0}]
    with pytest.raises(DataError, match="'a#0' and 'a#1' name the image 'a' with different captions"):
        pairs_by_image(_pair_lines(rows))
    with pytest.raises(DataError, match="line 'a#0' has box \\[0, 0, 4\\]; a box is 4 numbers"):
        pairs_by_image(_pair_lines([{**rows[0], "box": [0, 0, 4]}]))
