"""The embedded synthetic scenes: determinism, schema, caption lengths, late facts, ground truth."""

from __future__ import annotations

import collections

import datasets
import numpy as np
import open_clip
import pytest

from finetune.data.sources import DataError, load_source
from finetune.data.synthetic import COLOURS, POSITIONS, synthetic_scenes
from finetune.data.text import split_sentences


@pytest.fixture(scope="module")
def test_scenes():
    return synthetic_scenes(256, 0, split="test")


@pytest.fixture(scope="module")
def tokenizer():
    return open_clip.get_tokenizer("ViT-B-32")  # the real CLIP BPE, shipped with open_clip


@pytest.mark.slow
def test_same_seed_same_bytes_and_prefix_stable():
    a = synthetic_scenes(40, 7)
    b = synthetic_scenes(40, 7)
    longer = synthetic_scenes(60, 7)
    assert a["caption"] == b["caption"]
    assert [x["bytes"] for x in a.cast_column("image", datasets.Image(decode=False))["image"]] == [
        x["bytes"] for x in b.cast_column("image", datasets.Image(decode=False))["image"]
    ]
    assert longer["caption"][:30] == a["caption"][:30]  # the last family of `a` may be cut short
    assert synthetic_scenes(40, 8)["caption"] != a["caption"]


def test_schema_and_images(test_scenes):
    assert test_scenes.column_names == ["id", "image", "caption", "sentences", "objects", "group"]
    assert len(test_scenes) == 256 and len(set(test_scenes["id"])) == 256
    example = test_scenes[0]
    assert example["image"].mode == "RGB" and example["image"].size == (64, 64)
    assert isinstance(example["caption"], str) and example["caption"]
    assert 3 <= len(example["objects"]) <= 5
    big = synthetic_scenes(3, 0, image_size=96, min_objects=5, max_objects=5)
    assert big[0]["image"].size == (96, 96)
    assert all(len(objects) == 5 for objects in big["objects"])


def test_train_and_test_splits_differ():
    train = set(synthetic_scenes(500, 0, split="train")["caption"])
    test = set(synthetic_scenes(200, 0, split="test")["caption"])
    assert not train & test


def test_caption_token_lengths(test_scenes, tokenizer):
    lengths = np.array([len(tokenizer.encode(c)) + 2 for c in test_scenes["caption"]])  # + start/end tokens
    assert lengths.min() >= 60 and lengths.max() <= 125
    assert 85 <= np.median(lengths) <= 110
    assert (lengths > 77).mean() >= 0.8  # most captions do not fit CLIP's 77 tokens


def test_facts_that_separate_scenes_come_after_77_tokens(test_scenes, tokenizer):
    captions = test_scenes["caption"]
    assert len(set(captions)) == len(captions)  # every scene is distinct in full
    truncated = [bytes(row) for row in tokenizer(captions, context_length=77).numpy()]
    counts = collections.Counter(truncated)
    blind = sum(counts[t] > 1 for t in truncated)
    # a 77-token encoder sees the same text for these scenes: only reading further separates them
    assert blind / len(captions) >= 0.35
    assert len(set(bytes(r) for r in tokenizer(captions, context_length=248).numpy())) == len(captions)
    # such scenes share a family (same background and first objects) but not their images
    by_prefix = collections.defaultdict(set)
    for group, t in zip(test_scenes["group"], truncated):
        by_prefix[t].add(group)
    assert all(len(groups) == 1 for groups in by_prefix.values())


def test_objects_match_sentences_boxes_and_pixels(test_scenes):
    for example in test_scenes.select(range(64)):
        sentences, objects, image = example["sentences"], example["objects"], np.asarray(example["image"])
        assert " ".join(sentences) == example["caption"]
        assert split_sentences(example["caption"]) == sentences
        cells = set()
        for obj in objects:
            sentence = sentences[obj["sentence_index"]]
            for word in (obj["shape"], obj["colour"], obj["size"]):
                assert word in sentence
            assert any(position in sentence.lower() for position in POSITIONS)
            x1, y1, x2, y2 = obj["box"]
            assert 0 <= x1 < x2 <= 64 and 0 <= y1 < y2 <= 64
            cells.add(((x1 + x2) // 2 * 3 // 64, (y1 + y2) // 2 * 3 // 64))
            if obj["shape"] in ("circle", "square", "diamond", "hexagon", "star", "cross"):
                centre = image[(y1 + y2) // 2, (x1 + x2) // 2]
                assert tuple(centre) == COLOURS[obj["colour"]]
        assert len(cells) == len(objects)  # one object per grid cell
        assert len({o["sentence_index"] for o in objects}) == len(objects)
        assert "shapes" in sentences[-1]  # the whole-scene sentence closes the caption


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 0}, "size"),
        ({"size": 4, "split": "valid"}, "unknown split"),
        ({"size": 4, "min_objects": 1}, "min_objects"),
        ({"size": 4, "min_objects": 4, "max_objects": 3}, "min_objects"),
        ({"size": 4, "max_objects": 10}, "max_objects"),
        ({"size": 4, "image_size": 8}, "image_size"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic_scenes(**kwargs)


def test_registered_as_a_source():
    loaded = load_source({"name": "synthetic", "split": "test", "size": 12, "seed": 3, "options": {"image_size": 48}})
    assert loaded.skipped == 0 and len(loaded.dataset) == 12 and loaded.split == "test"
    assert loaded.dataset[0]["image"].size == (48, 48)
    assert loaded.dataset["caption"] == synthetic_scenes(12, 3, split="test", image_size=48)["caption"]
    with pytest.raises(DataError, match="unknown option.*imagesize.*image_size"):
        load_source({"name": "synthetic", "size": 2, "options": {"imagesize": 32}})
    with pytest.raises(DataError, match="no split 'val'.*train, test"):
        load_source({"name": "synthetic", "size": 2, "split": "val"})
