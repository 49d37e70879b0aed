"""Images that pass the quick check but fail later, and images too large to accept, follow
``data.on_error`` wherever they are decoded: validation, training, evaluation."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import PIL.Image
import pytest

from finetune.data import images as images_module
from finetune.data.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DataError,
    ImageReadError,
    max_image_pixels,
    probe_image,
    read_image,
    set_max_image_pixels,
)
from finetune.data.skipping import SKIPPED_KEY, SkippingDataset, SkipReportingCollate
from finetune.data.sources import load_source


def _jpeg(seed: int = 0, size: int = 48) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def truncated_jpeg(path, seed: int = 0):
    """A JPEG cut in the middle of its body: the header check and ``verify()`` pass."""
    data = _jpeg(seed)
    path.write_bytes(data[: len(data) // 2])
    return path


def oversized_png(path, width: int = 14000, height: int = 13000):
    """A 1-bit PNG of ``width x height`` pixels: a few tens of KB on disk."""
    PIL.Image.new("1", (width, height)).save(path)
    return path


@pytest.fixture
def pixel_limit():
    yield
    set_max_image_pixels(DEFAULT_MAX_IMAGE_PIXELS)


def _jsonl_set(tmp_path, bad: dict[str, str]) -> str:
    """Four good JPEGs a..d plus the given bad files, as a jsonl source."""
    rows = []
    for i, name in enumerate("abcd"):
        (tmp_path / f"{name}.jpg").write_bytes(_jpeg(i))
        rows.append({"id": name, "image": f"{name}.jpg", "caption": f"caption {name}"})
    for id_, file in bad.items():
        rows.append({"id": id_, "image": file, "caption": f"caption {id_}"})
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------------------- probe / read


def test_truncated_jpeg_passes_verify_but_not_the_probe(tmp_path):
    path = truncated_jpeg(tmp_path / "t.jpg")
    with PIL.Image.open(path) as image:
        image.verify()  # what the quick check relied on: it passes
    with pytest.raises(ImageReadError, match=r"t\.jpg: corrupt image data .*truncated"):
        probe_image(str(path))
    with pytest.raises(ImageReadError, match=r"t\.jpg"):
        read_image(str(path))


def test_jpeg_with_trailing_bytes_after_the_end_marker_is_accepted(tmp_path):
    path = tmp_path / "trailing.jpg"
    path.write_bytes(_jpeg() + b"camera maker data")
    assert probe_image(str(path)).size == (48, 48)


def test_oversized_png_is_an_image_read_error_not_a_decompression_bomb(tmp_path, pixel_limit):
    path = oversized_png(tmp_path / "big.png")
    assert path.stat().st_size < 300_000
    for check in (probe_image, read_image):
        with pytest.raises(ImageReadError, match=r"big\.png: too large .*data\.max_image_pixels"):
            check(str(path))


def test_max_image_pixels_is_the_limit_both_ways(tmp_path, pixel_limit):
    path = tmp_path / "wide.png"
    PIL.Image.new("RGB", (40, 30)).save(path)
    set_max_image_pixels(1199)
    assert max_image_pixels() == 1199
    with pytest.raises(ImageReadError, match=r"40x30 = 1,200 pixels, more than data\.max_image_pixels=1,199"):
        probe_image(str(path))
    set_max_image_pixels(1200)
    assert probe_image(str(path)).size == (40, 30)
    # a limit above PIL's own: PIL must not refuse what the recipe accepts (no warning either)
    big = oversized_png(tmp_path / "big.png")
    set_max_image_pixels(200_000_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_image(str(big)).size == (14000, 13000)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_image_pixels"):
            set_max_image_pixels(bad)


# ---------------------------------------------------------------------------- validation


def test_validation_skips_truncated_and_oversized_images_with_their_ids(tmp_path, pixel_limit):
    truncated_jpeg(tmp_path / "t.jpg")
    oversized_png(tmp_path / "big.png")
    path = _jsonl_set(tmp_path, {"trunc": "t.jpg", "bomb": "big.png"})
    src = load_source({"name": "jsonl", "path": path})
    assert sorted(src.dataset["id"]) == ["a", "b", "c", "d"]
    assert src.skipped == 2 and src.skipped_ids == ["trunc", "bomb"]
    reasons = {e["id"]: e["reason"] for e in src.skipped_examples}
    assert "truncated" in reasons["trunc"] and "too large" in reasons["bomb"]


@pytest.mark.parametrize(("bad", "file", "match"), [("trunc", "t.jpg", r"id='trunc' \(image .*t\.jpg\)"),
                                                     ("bomb", "big.png", r"id='bomb' \(image .*big\.png\): too large")])
def test_validation_with_raise_names_the_file(tmp_path, pixel_limit, bad, file, match):
    truncated_jpeg(tmp_path / "t.jpg")
    oversized_png(tmp_path / "big.png")
    path = _jsonl_set(tmp_path, {bad: file})
    with pytest.raises(DataError, match=match):
        load_source({"name": "jsonl", "path": path}, on_error="raise")


def test_full_validation_decodes_every_image(tmp_path, monkeypatch):
    path = _jsonl_set(tmp_path, {})
    decoded = []
    real = images_module.read_image

    def counting(src):
        decoded.append(src)
        return real(src)

    import finetune.data.sources as sources

    monkeypatch.setattr(sources, "read_image", counting)
    load_source({"name": "jsonl", "path": path}, validate="header")
    assert decoded == []
    load_source({"name": "jsonl", "path": path}, validate="full")
    assert len(decoded) == 4


# ---------------------------------------------------------------------------- training


def _validated_then_truncated(tmp_path):
    """A source validated while ``b.jpg`` was fine, whose file is then cut (it fails only on decode)."""
    src = load_source({"name": "jsonl", "path": _jsonl_set(tmp_path, {})})
    truncated_jpeg(tmp_path / "b.jpg", seed=1)
    return src.dataset


def test_training_rows_skip_an_image_that_fails_to_decode(tmp_path):
    dataset = _validated_then_truncated(tmp_path)
    rows = SkippingDataset(dataset, "skip")
    ids = [r["id"] for r in (rows[i] for i in range(4))]
    assert ids == ["a", "c", "c", "d"]  # b is replaced by the next readable row: batches keep their size
    row = rows[1]
    assert row["image"].mode == "RGB" and row["image"].size == (48, 48)
    assert row[SKIPPED_KEY] == [{"id": "b", "path": str(tmp_path / "b.jpg"), "reason": row[SKIPPED_KEY][0]["reason"]}]
    assert "truncated" in row[SKIPPED_KEY][0]["reason"]
    collate = SkipReportingCollate(lambda examples: {"ids": [e["id"] for e in examples],
                                                     "keys": sorted({k for e in examples for k in e})})
    batch = collate([rows[0], rows[1]])
    assert batch["ids"] == ["a", "c"] and SKIPPED_KEY not in batch["keys"]
    assert [e["id"] for e in batch[SKIPPED_KEY]] == ["b"]
    assert SKIPPED_KEY not in collate([rows[0], rows[2]])


def test_training_rows_raise_naming_the_file(tmp_path):
    rows = SkippingDataset(_validated_then_truncated(tmp_path), "raise")
    assert rows[0]["id"] == "a"
    with pytest.raises(DataError, match=r"training example id='b' \(image .*b\.jpg\): corrupt image data"):
        rows[1]


@pytest.mark.slow
def test_the_loop_counts_the_examples_skipped_in_loader_workers(tmp_path):
    import yaml
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    from finetune import load_model
    from finetune.config import load_recipe
    from finetune.objectives import ClipTerm, Objective
    from finetune.training import FinetuneRecipe, TrainModule, build_loop

    dataset = _validated_then_truncated(tmp_path)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"train": {"batch_size": 2, "max_steps": 4, "trackers": [],
                                                               "checkpoint_every": 0}}))
    cfg = load_recipe(tmp_path / "r.yaml").train
    torch_model = load_model("tiny-clip")
    objective = Objective(ClipTerm())
    loop = build_loop(acc, TrainModule(torch_model, objective), dataset, cfg, tmp_path / "run", on_error="skip",
                      num_workers=1)
    result = FinetuneRecipe.from_loop(loop).train()
    assert result.steps == 4
    assert [e["id"] for e in result.skipped_examples] == ["b"]
    assert "truncated" in result.skipped_examples[0]["reason"]


# ---------------------------------------------------------------------------- evaluation


@pytest.mark.slow
def test_evaluation_skips_or_raises_on_an_image_that_fails_to_decode(tmp_path):
    from finetune import load_model
    from finetune.evaluation import encode_for_retrieval

    model = load_model("tiny-clip")
    dataset = _validated_then_truncated(tmp_path)
    with pytest.raises(DataError, match=r"example 'b': cannot read image .*b\.jpg"):
        encode_for_retrieval(model, dataset, batch_size=3)
    emb = encode_for_retrieval(model, dataset, batch_size=3, on_error="skip")
    assert emb.image_embeds.shape[0] == 3 and emb.text_to_image.tolist() == [0, 1, 2]
    assert [e["id"] for e in emb.skipped_examples] == ["b"]
    kept = dataset.select([0, 2, 3])
    ref = encode_for_retrieval(model, kept, batch_size=3)
    assert (emb.image_embeds - ref.image_embeds).abs().max() < 1e-5
    assert (emb.text_embeds - ref.text_embeds).abs().max() < 1e-5


# ---------------------------------------------------------------------------- preprocessing


def _structxlip_edges_term():
    from finetune.objectives.structxlip import StructXLIPOptions, StructXLIPTerm, StructXLIPWeights

    return StructXLIPTerm(StructXLIPOptions(weights=StructXLIPWeights(local=0.0)))  # edge maps + lexicon only


def test_preprocessing_never_sees_an_image_that_fails_to_decode(tmp_path, monkeypatch):
    from finetune.data import skipping

    dataset = _validated_then_truncated(tmp_path)
    cache = str(tmp_path / "cache")
    term = _structxlip_edges_term()
    with pytest.raises(Exception, match="truncated"):  # the gap: StructXLIP's cached edge maps decode every image
        term.preprocess(dataset, None, cache_dir=cache)
    kept, skipped = skipping.drop_undecodable(dataset, on_error="skip", cache_dir=cache)
    assert kept["id"] == ["a", "c", "d"]
    assert [(e["id"], e["path"]) for e in skipped] == [("b", str(tmp_path / "b.jpg"))]
    assert "truncated" in skipped[0]["reason"]
    out = term.preprocess(kept, None, cache_dir=cache)
    assert out["id"] == ["a", "c", "d"] and len(out["edges"]) == 3
    # the check is cached: a second run decodes nothing
    calls = []
    monkeypatch.setattr(skipping, "read_image", lambda src: calls.append(src))
    again, skipped_again = skipping.drop_undecodable(dataset, on_error="skip", cache_dir=cache)
    assert calls == [] and again["id"] == ["a", "c", "d"] and skipped_again == skipped


def test_preprocessing_check_raises_naming_the_file_and_keeps_a_clean_set(tmp_path):
    from finetune.data.skipping import drop_undecodable

    clean = load_source({"name": "jsonl", "path": _jsonl_set(tmp_path, {})}).dataset
    same, skipped = drop_undecodable(clean, cache_dir=str(tmp_path / "cache"))
    assert skipped == [] and same._fingerprint == clean._fingerprint  # later caches still match
    truncated_jpeg(tmp_path / "c.jpg", seed=2)
    with pytest.raises(DataError, match=r"training example id='c' \(image .*c\.jpg\): corrupt image data"):
        drop_undecodable(clean, on_error="raise", cache_dir=str(tmp_path / "other"))
