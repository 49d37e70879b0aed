"""FLISM (FAST-GOAL III-A): candidates (default regions, YOLOS, ultralytics YOLO, SAM, dataset boxes), eq. 1-2
matching, kept pairs (Table VIII), the cache, statistics and preview, and the pairs CLI with resume."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import cv2
import datasets
import pytest
import torch
from PIL import Image, ImageDraw

from finetune.data.text import split_sentences
from finetune.preprocess.flism import (
    DatasetBoxes,
    FLISMMatcher,
    SamMasks,
    UltralyticsDetector,
    YolosDetector,
    build_proposer,
    candidate_boxes,
    compute_flism,
    flism_stats,
    main,
    mask_box,
    match_sentences,
    pairs_by_image,
    render_flism_preview,
    select_pairs,
    write_pairs,
)
from finetune.preprocess.regions import preserve_thread_settings
from tests.finetune.preprocess.tiny_detectors import save_tiny_sam, save_tiny_yolo, save_tiny_yolos

REPO = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.usefixtures("quiet_datasets")


@pytest.fixture(scope="module")
def detectors(tmp_path_factory):
    root = tmp_path_factory.mktemp("detectors")
    return {"yolos": save_tiny_yolos(root / "yolos"), "yolo": save_tiny_yolo(root / "yolo.pt"),
            "sam": save_tiny_sam(root / "sam")}


def _image(width: int = 80, height: int = 60) -> Image.Image:
    im = Image.new("RGB", (width, height), (255, 255, 255))
    ImageDraw.Draw(im).rectangle((10, 10, 40, 40), fill=(200, 0, 0))
    return im


# -- candidates ---------------------------------------------------------------------------------------
def test_candidates_are_found_boxes_then_quadrants_and_the_centre_box():
    boxes, kinds = candidate_boxes(80, 60, [(1, 2, 30, 40)])
    assert boxes == [(1.0, 2.0, 30.0, 40.0), (0.0, 0.0, 40.0, 30.0), (40.0, 0.0, 80.0, 30.0),
                     (0.0, 30.0, 40.0, 60.0), (40.0, 30.0, 80.0, 60.0), (20.0, 15.0, 60.0, 45.0)]
    assert kinds == ["found"] + ["default"] * 5
    # Table VII's "YOLO only": the detections alone; nothing at all: the whole image
    assert candidate_boxes(80, 60, [(1, 2, 30, 40)], default=False) == ([(1.0, 2.0, 30.0, 40.0)], ["found"])
    assert candidate_boxes(80, 60, [], default=False) == ([(0.0, 0.0, 80.0, 60.0)], ["whole_image"])


def test_match_sentences_takes_each_sentences_most_similar_crop():
    sentences = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    crops = torch.tensor([[3.0, 0.0], [1.0, 1.0], [0.0, -1.0]])
    index, sim = match_sentences(sentences, crops)
    assert index.tolist() == [0, 1, 1]
    assert torch.allclose(sim, torch.tensor([1.0, math.sqrt(0.5), 1.0]))
    with pytest.raises(ValueError, match="at least one candidate"):
        match_sentences(sentences, crops[:0])


def test_select_pairs_single_best_and_the_top3_weightings_of_table_viii():
    sentences, candidates, sims = [0, 1, 2, 3], [5, 2, 0, 1], [0.2, 0.6, 0.4, -0.1]
    (best,) = select_pairs(sentences, candidates, sims)
    assert (best.sentence, best.candidate, best.similarity, best.weight) == (1, 2, 0.6, 1.0)
    uniform = select_pairs(sentences, candidates, sims, pairs=3)
    assert [p.sentence for p in uniform] == [1, 2, 0] and [p.weight for p in uniform] == [1 / 3] * 3
    weighted = select_pairs(sentences, candidates, sims, pairs=3, weighting="weighted")
    assert [round(p.weight, 6) for p in weighted] == [0.5, round(0.4 / 1.2, 6), round(0.2 / 1.2, 6)]
    # fewer matched sentences than pairs: the last one repeats with weight 0
    short = select_pairs([4], [1], [0.3], pairs=3, weighting="weighted")
    assert [(p.sentence, p.weight) for p in short] == [(4, 1.0), (4, 0.0), (4, 0.0)]
    # similarities <= 0 only: uniform
    assert [p.weight for p in select_pairs([0, 1], [0, 0], [-0.2, -0.1], pairs=2, weighting="weighted")] == [0.5, 0.5]
    assert select_pairs([], [], []) == []
    with pytest.raises(ValueError, match="weighting"):
        select_pairs([0], [0], [0.1], weighting="softmax")


def test_mask_box_and_sam_area_filter():
    mask = torch.zeros(10, 20, dtype=torch.bool)
    mask[2:5, 3:9] = True
    assert mask_box(mask) == (3.0, 2.0, 9.0, 5.0)
    assert mask_box(torch.zeros(4, 4, dtype=torch.bool)) is None
    sam = SamMasks("unused", min_area=0.01, max_area=0.8)
    tiny = torch.zeros(10, 20, dtype=torch.bool)
    tiny[0, 0] = True                                # 0.5 %: dropped
    big = torch.ones(10, 20, dtype=torch.bool)
    big[0, 0] = False                                # 99.5 %: dropped
    medium = torch.zeros(10, 20, dtype=torch.bool)
    medium[:, :10] = True                            # 50 %
    assert sam.boxes_of_masks([tiny, mask, big, medium], 20, 10) == [(0.0, 0.0, 10.0, 10.0), (3.0, 2.0, 9.0, 5.0)]


# -- detectors through their checkpoint path -------------------------------------------------------
def test_yolos_detector_loads_a_saved_model_and_returns_boxes_in_original_pixels(detectors):
    from transformers import AutoImageProcessor, YolosForObjectDetection

    images = [_image(), _image(50, 90)]
    found = YolosDetector(str(detectors["yolos"]), threshold=0.0, max_boxes=3)(images)
    assert len(found) == 2 and all(1 <= len(f) <= 3 for f in found)
    for boxes, im in zip(found, images):
        assert all(0 <= x1 < x2 <= im.width and 0 <= y1 < y2 <= im.height for x1, y1, x2, y2 in boxes)
    # the best box is the processor's own post-processing of the model's output, scaled to the image
    model = YolosForObjectDetection.from_pretrained(detectors["yolos"]).eval()
    proc = AutoImageProcessor.from_pretrained(detectors["yolos"])
    with torch.no_grad():
        out = model(**proc(images=images, return_tensors="pt"))  # one padded batch, as the detector runs it
    res = proc.post_process_object_detection(out, threshold=0.0, target_sizes=[(60, 80), (90, 50)])[1]
    top = res["boxes"][res["scores"].argmax()].tolist()
    expected = (max(0.0, top[0]), max(0.0, top[1]), min(50.0, top[2]), min(90.0, top[3]))
    assert found[1][0] == pytest.approx(expected, abs=1e-4)
    # the threshold and the class filter
    assert YolosDetector(str(detectors["yolos"]), threshold=0.999)(images) == [[], []]
    with pytest.raises(ValueError, match="no class 'giraffe'"):
        YolosDetector(str(detectors["yolos"]), classes=["giraffe"])(images)
    with pytest.raises(ValueError, match="YOLOS"):
        YolosDetector(str(detectors["yolos"].parent / "missing"))(images)


def test_ultralytics_detector_restores_thread_counts(detectors):
    torch_threads, cv2_threads = torch.get_num_threads(), cv2.getNumThreads()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    try:
        detector = build_proposer("detector", detector=str(detectors["yolo"]), threshold=0.0, max_boxes=2, imgsz=64)
        assert isinstance(detector, UltralyticsDetector)
        found = detector([_image(), _image(50, 90)])
        assert torch.get_num_threads() == 1 and cv2.getNumThreads() == 1
    finally:
        torch.set_num_threads(torch_threads)
        cv2.setNumThreads(cv2_threads)
    assert len(found) == 2 and all(len(f) <= 2 for f in found)
    assert all(0 <= b[0] < b[2] <= 80 and 0 <= b[1] < b[3] <= 60 for b in found[0])
    assert detector.params()["checkpoint_sha256"] and detector.params()["threshold"] == 0.0
    with pytest.raises(FileNotFoundError, match="ultralytics assets"):
        UltralyticsDetector(detectors["yolo"].parent / "yolov8x.pt")


def test_ultralytics_detector_rejects_segmenters_and_unreadable_files(tmp_path):
    """A segmentation checkpoint (a DetectionModel subclass) is not taken for a detector; both errors name the
    recipe key."""
    segmenter = tmp_path / "segmenter.pt"
    with preserve_thread_settings():
        from ultralytics import YOLO

        YOLO("yolov8n-seg.yaml").save(str(segmenter))
    with pytest.raises(ValueError, match=r"regions.detector: .*holds a SegmentationModel, not a detection model"):
        UltralyticsDetector(segmenter, imgsz=64)([_image()])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="regions.detector: could not load"):
        UltralyticsDetector(garbage, imgsz=64)([_image()])


def test_sam_lism_candidates_through_the_mask_generation_pipeline(detectors):
    sam = SamMasks(str(detectors["sam"]), points_per_side=4, points_per_batch=16, min_area=0.0, max_area=1.0,
                   pred_iou_thresh=0.0, stability_score_thresh=0.0)
    (boxes,) = sam([_image()])
    assert boxes and all(0 <= x1 < x2 <= 80 and 0 <= y1 < y2 <= 60 for x1, y1, x2, y2 in boxes)
    strict = SamMasks(str(detectors["sam"]), points_per_side=4, points_per_batch=16, min_area=0.0, max_area=0.0,
                      pred_iou_thresh=0.0, stability_score_thresh=0.0)
    assert strict([_image()]) == [[]]  # no mask covers at most 0 % of the image


# -- matching over a dataset -----------------------------------------------------------------------
class _Colours:
    """Stub encoders: a crop's embedding is its mean colour; a sentence's is the colour it names."""

    COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "white": (1.0, 1.0, 1.0)}

    def images(self, crops: list[Image.Image]) -> torch.Tensor:
        means = [c.convert("RGB").resize((1, 1), Image.BOX).getpixel((0, 0)) for c in crops]
        return torch.tensor(means, dtype=torch.float32) / 255 + 1e-3

    def texts(self, texts: list[str]) -> torch.Tensor:
        out = []
        for t in texts:
            word = next((w for w in self.COLOURS if w in t.lower()), "white")
            out.append(torch.tensor(self.COLOURS[word]))
        return torch.stack(out)


def _scenes() -> datasets.Dataset:
    """Two images: a red square top left and a blue one bottom right on white, captions naming them."""
    rows = {"image": [], "caption": [], "objects": []}
    for k in range(2):
        im = Image.new("RGB", (64, 48), (255, 255, 255))
        draw = ImageDraw.Draw(im)
        draw.rectangle((2, 2, 21, 17), fill=(255, 0, 0))
        draw.rectangle((40, 28, 61, 45), fill=(0, 0, 255))
        rows["image"].append(im)
        rows["caption"].append("A plain green picture. There is a blue square at the bottom. A red square sits at the top."
                               if k == 0 else "A red square is in the corner.")
        rows["objects"].append([{"box": [2, 2, 22, 18], "sentence_index": 2 if k == 0 else 0},
                                {"box": [40, 28, 62, 46], "sentence_index": 1 if k == 0 else -1}])
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string"),
                                  "objects": datasets.List({"box": datasets.List(datasets.Value("int32")),
                                                            "sentence_index": datasets.Value("int32")})})
    return datasets.Dataset.from_dict(rows, features=features)


def test_matcher_matches_every_sentence_to_its_best_crop_and_keeps_the_best_pair():
    enc = _Colours()
    matcher = FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub")
    out = matcher(_scenes()[:])
    assert out["flism_num_candidates"] == [7, 7]  # 2 dataset boxes + 5 default regions
    assert out["flism_candidate_kinds"][0] == ["found", "found"] + ["default"] * 5
    assert out["flism_sentences"][0] == split_sentences("A plain green picture. There is a blue square at the bottom. "
                                                        "A red square sits at the top.")
    match = out["flism_sentence_match"][0]
    assert match[1] == 1 and match[2] == 0  # the blue sentence -> the blue square's box, the red one -> the red box
    assert out["flism_pair_box"][0][0] in ([40.0, 28.0, 62.0, 46.0], [2.0, 2.0, 22.0, 18.0])
    assert out["flism_pair_sentence"][0][0] in (1, 2)
    best = max(range(3), key=lambda s: out["flism_sentence_similarity"][0][s])
    assert out["flism_pair_sentence"][0] == [best] and out["flism_num_pairs"] == [1, 1]
    # with the dataset's links: a box goes with its own sentence; a sentence without an object is not matched
    linked = FLISMMatcher(DatasetBoxes(links=True), enc.images, enc.texts, model_id="stub")(_scenes()[:])
    assert linked["flism_num_candidates"] == [2, 2]
    assert linked["flism_sentence_match"][0] == [-1, 1, 0]
    assert math.isnan(linked["flism_sentence_similarity"][0][0])
    assert linked["flism_sentence_match"][1] == [0]


#: CLIP ViT-B/16's transform: shortest side to 224, centre crop 224 x 224, patches of 16
CLIP_GEOMETRY = {"mode": "shortest_center_crop", "size": 224, "crop": (224, 224), "patch_size": 16}


def _wide_scene() -> datasets.Dataset:
    """Issue 23's case: a 1000 x 500 image whose red object (10, 100, 240, 400) lies in the strip CLIP's centre crop
    cuts away (the crop keeps x 250-750)."""
    im = Image.new("RGB", (1000, 500), (255, 255, 255))
    ImageDraw.Draw(im).rectangle((10, 100, 239, 399), fill=(255, 0, 0))
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string"),
                                  "objects": datasets.List({"box": datasets.List(datasets.Value("int32")),
                                                            "sentence_index": datasets.Value("int32")})})
    return datasets.Dataset.from_dict({"image": [im], "caption": ["A red square stands on the left."],
                                       "objects": [[{"box": [10, 100, 240, 400], "sentence_index": 0}]]},
                                      features=features)


def test_candidates_the_models_centre_crop_cuts_away_are_dropped_and_the_rest_clipped(tmp_path):
    """FLISM keeps only what TSL can pool: candidates are clipped to the part of the image the model's resize and
    centre crop keep, and those with nothing left there are dropped; both counted per image and in the stats."""
    enc = _Colours()
    data = _wide_scene()
    # blind to the model's crop, the red object's box wins the red sentence: a pair TSL cannot pool
    blind = FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub")(data[:])
    assert blind["flism_pair_box"][0][0] == [10.0, 100.0, 240.0, 400.0]
    matcher = FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub", geometry=CLIP_GEOMETRY)
    out = matcher(data[:])
    assert out["flism_candidates_dropped"] == [1] and out["flism_candidates_clipped"] == [4]
    assert out["flism_candidates"][0] == [[250.0, 0.0, 500.0, 250.0], [500.0, 0.0, 750.0, 250.0],
                                          [250.0, 250.0, 500.0, 500.0], [500.0, 250.0, 750.0, 500.0],
                                          [250.0, 125.0, 750.0, 375.0]]  # quadrants clipped, the centre box as it was
    assert out["flism_candidate_kinds"][0] == ["default"] * 5
    x1, _, x2, _ = out["flism_pair_box"][0][0]
    assert 250 <= x1 < x2 <= 750
    # the object's own sentence link cannot be kept either: no pair rather than a box without patches
    linked = FLISMMatcher(DatasetBoxes(links=True), enc.images, enc.texts, model_id="stub",
                          geometry=CLIP_GEOMETRY)(data[:])
    assert linked["flism_num_pairs"] == [0] and linked["flism_candidates_dropped"] == [1]
    # no candidate left at all (YOLO only): the part of the image the model sees
    alone = FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub", default=False,
                         geometry=CLIP_GEOMETRY)(data[:])
    assert alone["flism_candidates"][0] == [[250.0, 0.0, 750.0, 500.0]]
    assert alone["flism_candidate_kinds"][0] == ["whole_image"]
    stats = flism_stats(compute_flism(data, matcher, cache_dir=tmp_path))
    counts = (stats["candidates_clipped"], stats["candidates_dropped"], stats["images_with_dropped_candidates"])
    assert counts == (4, 1, 1)
    # the model's geometry is part of the cache key
    assert matcher.params()["geometry"]["crop"] == (224, 224)
    assert FLISMMatcher(None, enc.images, enc.texts, model_id="stub").params()["geometry"] is None


def test_compute_flism_is_cached_and_keyed_by_its_parameters(tmp_path, caplog):
    enc = _Colours()
    data = _scenes()
    make = lambda pairs: FLISMMatcher(None, enc.images, enc.texts, model_id="stub", pairs=pairs)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        first = compute_flism(data, make(1), cache_dir=tmp_path)
        again = compute_flism(data, make(1), cache_dir=tmp_path)
        other = compute_flism(data, make(3), cache_dir=tmp_path)
    assert caplog.text.count("computing flism") == 2 and "reusing cached flism" in caplog.text
    assert first["flism_pair_box"] == again["flism_pair_box"]
    assert [len(p) for p in other["flism_pair_box"]] == [3, 3] and other["flism_num_pairs"] == [3, 1]
    assert first["flism_candidate_kinds"][0] == ["default"] * 5  # no detector: the default regions only


def test_stats_and_preview(tmp_path):
    enc = _Colours()
    data = compute_flism(_scenes(), FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub"),
                         cache_dir=tmp_path)
    stats = flism_stats(data)
    assert stats["images"] == 2 and stats["candidates_per_image"] == 7
    assert stats["found_share"] == pytest.approx(2 / 7) and stats["default_share"] == pytest.approx(5 / 7)
    assert sum(stats["similarity_histogram"]["counts"]) == 2 and stats["images_without_pairs"] == 0
    kept = [data[i]["flism_candidate_kinds"][data[i]["flism_pair_candidate"][0]] for i in range(2)]
    assert stats["kept_found_share"] == kept.count("found") / 2
    path = render_flism_preview([data[0], data[1]], tmp_path / "plots" / "flism.png")
    assert path.is_file() and Image.open(path).size[0] > 200


# -- the pairs file (GLIT100k-style) ---------------------------------------------------------------
def _tiny_model(tmp_path):
    from finetune import load_model
    from finetune.models.registry import save_tiny

    return load_model(str(save_tiny("tiny-clip", tmp_path / "tiny-clip")), max_text_len=248)


def test_write_pairs_writes_a_jsonl_that_data_train_reads_and_resumes(tmp_path):
    from finetune.data.sources import load_source

    model = _tiny_model(tmp_path)
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


def test_pairs_cli_top3_and_a_bad_source(tmp_path, capsys):
    from finetune.models.registry import save_tiny

    tiny = save_tiny("tiny-clip", tmp_path / "tiny-clip")
    out = tmp_path / "p.jsonl"
    code = main(["{name: synthetic, size: 3, options: {image_size: 32}}", str(out), "--model", str(tiny),
                 "--detector", "none", "--pairs", "3", "--weighting", "weighted"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 9 and rows[0]["id"].endswith("#0") and rows[2]["id"].endswith("#2")
    assert sum(r["weight"] for r in rows[:3]) == pytest.approx(1.0, abs=1e-5)
    # each line names its image (training groups the image's pairs by it) and the image's size
    assert [r["image_id"] for r in rows[:3]] == [rows[0]["id"][:-2]] * 3
    assert (rows[0]["width"], rows[0]["height"]) == (32, 32)
    assert main([str(tmp_path / "missing.jsonl"), str(out), "--model", str(tiny)]) == 2
    assert "does not exist" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "finetune.preprocess.flism", "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "IMAGES_AND_CAPTIONS" in proc.stdout


# -- FLISM with a trained model finds the described object -----------------------------------------
def _iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


#: quickstart_clip.yaml trained for this many steps (of its 248) still learns the scenes
KEY_TEST_STEPS = 120


@pytest.mark.slow
def test_flism_scored_by_a_trained_quickstart_model_picks_the_described_object(tmp_path):
    """recipes/quickstart_clip.yaml (fewer steps), then FLISM on held-out synthetic scenes with the scenes' object
    boxes as the detector's candidates (+ the 5 default regions), matched by the trained model: the crop FLISM
    matches to an object's sentence overlaps that object's true box (IoU > 0.5) far more often than a random
    candidate does. (The real detectors' path is tested above with tiny YOLOS / YOLO checkpoints.)"""
    from accelerate.state import AcceleratorState, GradientState

    from finetune.config import load_recipe
    from finetune.data.sources import load_source
    from finetune.models.adapters import load_finetuned
    from finetune.models.frozen import FrozenEncoders
    from finetune.run import run

    out = tmp_path / "run"
    recipe = load_recipe(REPO / "recipes" / "quickstart_clip.yaml", [
        f"train.max_steps={KEY_TEST_STEPS}", "eval.sets=[]", "train.trackers=[]", "train.checkpoint_every=0",
        "data.num_workers=0", f"output.dir={out}", f"data.cache_dir={tmp_path / 'cache'}"])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert run(recipe) == 0
    model = load_finetuned(str(out / "final")).eval()
    scenes = load_source({"name": "synthetic", "split": "test", "size": 96, "seed": 1}).dataset
    encoders = FrozenEncoders(model)
    matcher = FLISMMatcher(DatasetBoxes(links=False), encoders.images, encoders.texts, model_id="trained")
    hits = chance = n = best_hits = best_n = 0
    for start in range(0, len(scenes), 32):
        batch = scenes[start: start + 32]
        result = matcher(batch)
        for j, objects in enumerate(batch["objects"]):
            candidates = result["flism_candidates"][j]
            for obj in objects:
                s = obj["sentence_index"]
                chosen = candidates[result["flism_sentence_match"][j][s]]
                hits += _iou(chosen, obj["box"]) > 0.5
                chance += sum(_iou(c, obj["box"]) > 0.5 for c in candidates) / len(candidates)
                n += 1
            linked = {o["sentence_index"]: o["box"] for o in objects}
            pair_sentence = result["flism_pair_sentence"][j][0]
            if pair_sentence in linked:  # the single kept pair, when its sentence describes an object
                best_n += 1
                best_hits += _iou(result["flism_pair_box"][j][0], linked[pair_sentence]) > 0.5
    flism_rate, random_rate = hits / n, chance / n
    print(f"\nFLISM (quickstart_clip, {KEY_TEST_STEPS} steps): the matched crop overlaps the described object "
          f"(IoU > 0.5) for {flism_rate:.1%} of {n} object sentences; a random candidate: {random_rate:.1%}; the "
          f"kept pair, when its sentence names an object ({best_n} images): {best_hits / max(1, best_n):.1%}")
    # measured (2-core CPU, seed 0): 40.4 % of 411 object sentences vs 10.7 % for a random candidate (3.8x);
    # the kept single pair, when its sentence names an object (77 of 96 images): 28.6 %
    assert random_rate < 0.2  # one true box among 3-5 object boxes + 5 default regions
    assert flism_rate > 2.5 * random_rate
