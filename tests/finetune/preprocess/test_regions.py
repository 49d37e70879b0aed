"""Regions (StructXLIP 3.2, D.3): default regions, crops, chunks, top-K, FastSAM loading, caching."""

from __future__ import annotations

import logging
import os

import cv2
import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from finetune.preprocess.edges import EdgeConfig, edge_map
from finetune.preprocess.regions import (
    FastSAMRegions,
    RegionMatcher,
    RegionProposals,
    compute_regions,
    crop_box,
    default_regions,
    preserve_thread_settings,
    split_chunks,
    topk_regions,
)


pytestmark = pytest.mark.usefixtures("quiet_datasets")


@pytest.fixture(scope="module")
def random_seg_checkpoint(tmp_path_factory) -> str:
    """An ultralytics segmentation model (YOLOv8n-seg, FastSAM-s's family) with random weights,
    saved as a checkpoint file so that FastSAMRegions runs the real loading path."""
    path = tmp_path_factory.mktemp("fastsam") / "random-seg.pt"
    with preserve_thread_settings():  # importing ultralytics drops OpenCV's threads
        pytest.importorskip("ultralytics")  # the `regions` extra
        from ultralytics import YOLO

        torch.manual_seed(0)
        YOLO("yolov8n-seg.yaml").save(str(path))
    return str(path)


def _two_colour_image(width: int = 64, height: int = 32) -> Image.Image:
    """Left half red, right half blue: crops of either half are told apart by their mean colour."""
    arr = np.zeros((height, width, 3), np.uint8)
    arr[:, : width // 2, 0] = 255
    arr[:, width // 2 :, 2] = 255
    return Image.fromarray(arr)


def test_default_regions_are_quadrants_and_centre():
    assert default_regions(100, 60) == [
        (0.0, 0.0, 50.0, 30.0),
        (50.0, 0.0, 100.0, 30.0),
        (0.0, 30.0, 50.0, 60.0),
        (50.0, 30.0, 100.0, 60.0),
        (25.0, 15.0, 75.0, 45.0),
    ]
    with pytest.raises(ValueError, match="positive"):
        default_regions(0, 10)


def test_crop_box_rounds_outwards_clips_and_never_empties():
    image = Image.fromarray(np.arange(10 * 20, dtype=np.uint8).reshape(10, 20))
    crop = crop_box(image, (2.5, 1.2, 7.1, 4.0))
    assert crop.size == (6, 3)  # x 2..8, y 1..4
    np.testing.assert_array_equal(np.asarray(crop), np.asarray(image)[1:4, 2:8])
    assert crop_box(image, (-5, -5, 50, 50)).size == (20, 10)
    assert crop_box(image, (19.5, 9.5, 19.5, 9.5)).size == (1, 1)
    with pytest.raises(ValueError, match="x1, y1, x2, y2"):
        crop_box(image, (1, 2, 3))


def test_split_chunks_at_sentence_delimiters():
    assert split_chunks("A cat sits; a dog runs. It is 3.5 m tall! Why? ") == [
        "A cat sits",
        "a dog runs",
        "It is 3.5 m tall",
        "Why",
    ]
    assert split_chunks("") == [] and split_chunks(" . ; ") == []


def test_split_chunks_take_sentences_from_the_one_splitter():
    # abbreviations and a lower-case continuation stay in their sentence, a line break or </s> ends one
    assert split_chunks("Mr. Lee waves. the mat. Trees...\nA pond</s>A duck; it swims") == [
        "Mr. Lee waves. the mat",
        "Trees",
        "A pond",
        "A duck",
        "it swims",
    ]


def test_topk_regions_on_hand_made_embeddings():
    chunks = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.2]])
    regions = torch.tensor([[0.0, 1.0], [3.0, 0.0], [1.0, 0.9], [-1.0, 0.0]])
    indices, scores = topk_regions(chunks, regions, k=2)
    assert indices.tolist() == [[1, 2], [0, 2], [2, 0]]
    n = np.hypot(1, 0.9)
    expected = [[1.0, 1 / n], [1.0, 0.9 / n], [(1 + 1.2 * 0.9) / (np.hypot(1, 1.2) * n), 1.2 / np.hypot(1, 1.2)]]
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-6)
    # k larger than the number of regions: k' = R
    indices, scores = topk_regions(chunks, regions[:1], k=3)
    assert indices.shape == (3, 1) and scores.shape == (3, 1)
    with pytest.raises(ValueError, match=r"\(M, D\)"):
        topk_regions(chunks, torch.zeros(4, 3))


class FixedSegmenter:
    """Left half, right half and whole image for every image."""

    def __init__(self) -> None:
        self.calls = 0

    def params(self) -> dict:
        return {"segmenter": "fixed-halves"}

    def __call__(self, images):
        self.calls += len(images)
        out = []
        for image in images:
            w, h = (float(v) for v in image.size)
            out.append(RegionProposals([(0.0, 0.0, w / 2, h), (w / 2, 0.0, w, h), (0.0, 0.0, w, h)], False))
        return out


def _mean_colour(crops):
    """(n, 2) embedding = mean red and mean blue of each crop."""
    means = [np.asarray(c, dtype=np.float32).mean(axis=(0, 1)) for c in crops]
    return torch.tensor(np.stack([[m[0], m[2]] for m in means]))


_WORDS = {"left": [1.0, 0.0], "right": [0.0, 1.0], "all": [1.0, 1.0]}


def _text_embed(texts):
    return torch.tensor([_WORDS[t.split()[0].lower()] for t in texts])


def test_region_matcher_pairs_each_chunk_with_its_most_similar_regions():
    matcher = RegionMatcher(FixedSegmenter(), _mean_colour, _text_embed, model_id="hand-made", k=2, match_on="image")
    out = matcher({"image": [_two_colour_image()], "filtered_caption": ["Left part here. Right part; all of it."]})
    assert out["region_boxes"] == [[[0.0, 0.0, 32.0, 32.0], [32.0, 0.0, 64.0, 32.0], [0.0, 0.0, 64.0, 32.0]]]
    assert out["region_fallback"] == [False]
    assert out["chunks"] == [["Left part here", "Right part", "all of it"]]
    # left -> left half then whole image; right -> right half then whole; all -> whole then a half
    assert out["chunk_topk"][0][0] == [0, 2]
    assert out["chunk_topk"][0][1] == [1, 2]
    assert out["chunk_topk"][0][2][0] == 2
    np.testing.assert_allclose(out["chunk_topk_scores"][0][0][0], 1.0, rtol=1e-6)


def test_region_matcher_uses_edge_crops_and_handles_captions_without_chunks():
    seen = []

    def encode_images(crops):
        seen.extend(crops)
        return torch.ones(len(crops), 2)

    image = _two_colour_image()
    matcher = RegionMatcher(
        FixedSegmenter(), encode_images, _text_embed, model_id="m", k=3, edge_cfg=EdgeConfig(low=10, high=20)
    )
    out = matcher({"image": [image, image], "filtered_caption": ["", "left."]})
    assert out["chunks"] == [[], ["left"]]
    assert out["chunk_topk"][0] == [] and len(out["chunk_topk"][1][0]) == 3
    expected_edges = edge_map(image, EdgeConfig(low=10, high=20))
    np.testing.assert_array_equal(np.asarray(seen[0]), np.asarray(crop_box(expected_edges, (0, 0, 32, 32))))
    with pytest.raises(KeyError, match="filtered_caption"):
        matcher({"image": [image], "caption": ["x"]})
    with pytest.raises(ValueError, match="match_on"):
        RegionMatcher(FixedSegmenter(), encode_images, _text_embed, model_id="m", match_on="both")


def _image_dataset(n: int = 3) -> datasets.Dataset:
    features = datasets.Features({"image": datasets.Image(), "filtered_caption": datasets.Value("string")})
    images = [_two_colour_image(64 + 8 * i, 32) for i in range(n)]
    captions = ["Left side. Right side.", "all of it", ""][:n]
    return datasets.Dataset.from_dict({"image": images, "filtered_caption": captions}, features=features)


def test_compute_regions_is_cached_and_reused(tmp_path, caplog):
    segmenter = FixedSegmenter()
    matcher = RegionMatcher(segmenter, _mean_colour, _text_embed, model_id="m", k=1, match_on="image")
    first = compute_regions(_image_dataset(), matcher, cache_dir=tmp_path, batch_size=2)
    assert segmenter.calls == 3
    assert first.column_names == [
        "image", "filtered_caption", "region_boxes", "region_fallback", "chunks", "chunk_topk", "chunk_topk_scores",
    ]
    assert first[0]["chunk_topk"] == [[0], [1]]
    assert first[2]["chunks"] == [] and first[2]["chunk_topk"] == []

    with caplog.at_level(logging.INFO, logger="xlipkit"):
        second = compute_regions(_image_dataset(), matcher, cache_dir=tmp_path, batch_size=2)
    assert segmenter.calls == 3
    assert "reusing cached regions" in caplog.text
    assert second["chunk_topk"] == first["chunk_topk"]

    other = RegionMatcher(segmenter, _mean_colour, _text_embed, model_id="m", k=2, match_on="image")
    compute_regions(_image_dataset(), other, cache_dir=tmp_path, batch_size=2)
    assert segmenter.calls == 6  # k changed: recomputed


def test_fastsam_missing_checkpoint_says_how_to_get_one(tmp_path):
    pytest.importorskip("ultralytics")  # without the `regions` extra, that is what FastSAMRegions says first
    with pytest.raises(FileNotFoundError, match="FastSAM-s.pt or FastSAM-x.pt.*regions.checkpoint"):
        FastSAMRegions(tmp_path / "FastSAM-s.pt")
    (tmp_path / "ok.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="min_area"):
        FastSAMRegions(tmp_path / "ok.pt", min_area=0.9, max_area=0.1)


def test_fastsam_rejects_files_that_are_not_segmentation_checkpoints(tmp_path):
    detector = tmp_path / "detector.pt"
    with preserve_thread_settings():
        pytest.importorskip("ultralytics")  # the `regions` extra
        from ultralytics import YOLO

        YOLO("yolov8n.yaml").save(str(detector))
    with pytest.raises(ValueError, match="DetectionModel, not a segmentation model"):
        FastSAMRegions(detector, imgsz=64, device="cpu")([_two_colour_image()])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="could not load"):
        FastSAMRegions(garbage, imgsz=64, device="cpu")([_two_colour_image()])


def test_fastsam_random_weights_fall_back_and_restore_threads(random_seg_checkpoint):
    saved = torch.get_num_threads(), cv2.getNumThreads()
    # Counts ultralytics would change (it sets torch to cores - 1 in predict on a CPU).
    torch_threads, cv2_threads = (os.cpu_count() or 1) + 2, 3
    torch.set_num_threads(torch_threads)
    cv2.setNumThreads(cv2_threads)
    segmenter = FastSAMRegions(random_seg_checkpoint, imgsz=64, device="cpu")
    image = _two_colour_image(80, 48)
    try:
        (proposal,) = segmenter([image])
        threads_after = torch.get_num_threads(), cv2.getNumThreads()
    finally:
        torch.set_num_threads(saved[0])
        cv2.setNumThreads(saved[1])
    # An untrained model predicts no mask above conf 0.4: the default regions are used and counted.
    assert proposal.fallback and proposal.boxes == default_regions(80, 48)
    assert (segmenter.images, segmenter.fallbacks) == (1, 1)
    assert threads_after == (torch_threads, cv2_threads)
    params = segmenter.params()
    assert len(params["checkpoint_sha256"]) == 64 and params["conf"] == 0.4


def test_fastsam_masks_become_boxes_inside_the_image(random_seg_checkpoint):
    # With a near-zero confidence threshold the random model yields masks: the real mask path runs.
    segmenter = FastSAMRegions(
        random_seg_checkpoint, imgsz=64, conf=1e-4, min_area=0.0, max_area=1.0, max_regions=3, device="cpu"
    )
    images = [_two_colour_image(80, 48), _two_colour_image(40, 30)]
    proposals = segmenter(images)
    # the same prediction, to compare every box with the mask it came from
    results = segmenter._load().predict(images, imgsz=64, conf=1e-4, iou=segmenter.iou, device="cpu",
                                        retina_masks=False, verbose=False)
    for image, proposal, result in zip(images, proposals, results):
        assert not proposal.fallback
        assert 1 <= len(proposal.boxes) <= 3 and len(set(proposal.boxes)) == len(proposal.boxes)
        w, h = image.size
        conf = result.boxes.conf.float().tolist()
        clipped = [(max(0.0, a), max(0.0, b), min(float(w), c), min(float(h), d))
                   for a, b, c, d in result.boxes.xyxy.float().tolist()]
        sources = []
        for box in proposal.boxes:
            x1, y1, x2, y2 = box
            assert 0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h
            j = min(range(len(clipped)), key=lambda i: max(abs(u - v) for u, v in zip(clipped[i], box)))
            assert max(abs(u - v) for u, v in zip(clipped[j], box)) < 1e-3  # a detection's own box
            polygon = result.masks.xy[j]  # its mask, in image coordinates
            assert len(polygon) > 0
            # the mask lies inside the box it gave (masks are cropped to their boxes; 1.5 px for scaling)
            assert polygon[:, 0].min() >= x1 - 1.5 and polygon[:, 0].max() <= x2 + 1.5
            assert polygon[:, 1].min() >= y1 - 1.5 and polygon[:, 1].max() <= y2 + 1.5
            sources.append(j)
        assert [conf[j] for j in sources] == sorted((conf[j] for j in sources), reverse=True)  # most confident first
    # An area window no mask falls into sends every image to the fallback.
    none_pass = FastSAMRegions(
        random_seg_checkpoint, imgsz=64, conf=1e-4, min_area=0.4321, max_area=0.4321, device="cpu"
    )
    assert all(p.fallback for p in none_pass(images))


def test_fastsam_through_compute_regions(random_seg_checkpoint, tmp_path, caplog):
    segmenter = FastSAMRegions(random_seg_checkpoint, imgsz=64, device="cpu")
    matcher = RegionMatcher(segmenter, _mean_colour, _text_embed, model_id="m", k=3)
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        out = compute_regions(_image_dataset(2), matcher, cache_dir=tmp_path)
    assert out["region_fallback"] == [True, True]
    assert [len(b) for b in out["region_boxes"]] == [5, 5]
    assert [len(t) for t in out["chunk_topk"][0]] == [3, 3]
    assert "2 of 2 images had no mask" in caplog.text


# -- regions the dataset provides ------------------------------------------------------------------------
def test_chunks_map_to_their_sentences_when_a_filtered_sentence_vanishes():
    from finetune.preprocess.region_links import chunk_sentence_indices

    sentences = ["A red cat sits.", "Red.", "A blue dog runs.", "A dog sleeps."]
    # the lexicon filter took "Red." away entirely: counting chunks would give sentence 1 to "A dog runs"
    assert chunk_sentence_indices(["A cat sits", "A dog runs", "A dog sleeps"], sentences) == [0, 2, 3]
    assert chunk_sentence_indices(["A cat sits", "nothing like it"], sentences) == [0, -1]
    assert chunk_sentence_indices([], sentences) == []


def test_dataset_region_links_keep_the_linked_chunks_and_their_objects():
    from finetune.preprocess.region_links import DatasetRegionLinks

    batch = {
        "filtered_caption": ["A picture. A cat sits on the left. A dog and a cat. A dog runs."],
        "sentences": [["A picture.", "A red cat sits on the left.", "A dog and a cat.", "A blue dog runs."]],
        "objects": [[{"box": [0, 0, 10, 10], "sentence_index": 3}, {"box": [5, 5, 20, 30], "sentence_index": 1}]],
    }
    out = DatasetRegionLinks(k=3)(batch)
    assert out["chunks"] == [["A cat sits on the left", "A dog runs"]]  # the preamble and relation: no object
    assert out["chunk_topk"] == [[[1], [0]]]
    assert out["region_boxes"] == [[[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 20.0, 30.0]]]
    assert out["region_fallback"] == [False]
    bad = dict(batch, objects=[[{"box": [5, 5, 5, 9], "sentence_index": 1}]])
    with pytest.raises(ValueError, match=r"box must be \[x1, y1, x2, y2\]"):
        DatasetRegionLinks()(bad)


def test_ultralytics_proposers_pickle_without_their_model(tmp_path):
    """datasets.map workers get the settings, not the loaded model; the cache key is the checkpoint's content.
    ``copy.deepcopy`` goes through the same ``__getstate__`` as the pickling of worker processes."""
    pytest.importorskip("ultralytics")  # the `regions` extra
    import copy
    import hashlib

    from finetune.preprocess.flism import UltralyticsDetector

    checkpoint = tmp_path / "weights.pt"
    checkpoint.write_bytes(b"weights")
    for proposer in (FastSAMRegions(checkpoint), UltralyticsDetector(checkpoint)):
        proposer._model = {"loaded": True}
        back = copy.deepcopy(proposer)
        assert back._model is None and proposer._model == {"loaded": True}
        assert back.checkpoint == proposer.checkpoint
        assert back.params()["checkpoint_sha256"] == hashlib.sha256(b"weights").hexdigest()
