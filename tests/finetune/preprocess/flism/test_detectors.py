"""FLISM's candidates (FAST-GOAL III-A step 2): the default regions, YOLOS, ultralytics YOLO and SAM (GOAL's
LISM) through their checkpoint paths."""

from __future__ import annotations

import cv2
import pytest
import torch

from finetune.preprocess.flism.detectors import (
    SamMasks,
    UltralyticsDetector,
    YolosDetector,
    build_proposer,
    candidate_boxes,
    mask_box,
)

from finetune.preprocess.regions import preserve_thread_settings
from tests.finetune.preprocess.flism.stubs import image
from tests.finetune.preprocess.tiny_detectors import save_tiny_sam, save_tiny_yolo, save_tiny_yolos

pytestmark = pytest.mark.usefixtures("quiet_datasets")


@pytest.fixture(scope="module")
def detectors(tmp_path_factory):
    root = tmp_path_factory.mktemp("detectors")
    return {"yolos": save_tiny_yolos(root / "yolos"), "yolo": save_tiny_yolo(root / "yolo.pt"),
            "sam": save_tiny_sam(root / "sam")}


def test_candidates_are_found_boxes_then_quadrants_and_the_centre_box():
    boxes, kinds = candidate_boxes(80, 60, [(1, 2, 30, 40)])
    assert boxes == [(1.0, 2.0, 30.0, 40.0), (0.0, 0.0, 40.0, 30.0), (40.0, 0.0, 80.0, 30.0),
                     (0.0, 30.0, 40.0, 60.0), (40.0, 30.0, 80.0, 60.0), (20.0, 15.0, 60.0, 45.0)]
    assert kinds == ["found"] + ["default"] * 5
    # Table VII's "YOLO only": the detections alone; nothing at all: the whole image
    assert candidate_boxes(80, 60, [(1, 2, 30, 40)], default=False) == ([(1.0, 2.0, 30.0, 40.0)], ["found"])
    assert candidate_boxes(80, 60, [], default=False) == ([(0.0, 0.0, 80.0, 60.0)], ["whole_image"])


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

    images = [image(), image(50, 90)]
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
        found = detector([image(), image(50, 90)])
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
        pytest.importorskip("ultralytics")  # the `regions` extra
        from ultralytics import YOLO

        YOLO("yolov8n-seg.yaml").save(str(segmenter))
    with pytest.raises(ValueError, match=r"regions.detector: .*holds a SegmentationModel, not a detection model"):
        UltralyticsDetector(segmenter, imgsz=64)([image()])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="regions.detector: could not load"):
        UltralyticsDetector(garbage, imgsz=64)([image()])


def test_sam_lism_candidates_through_the_mask_generation_pipeline(detectors):
    sam = SamMasks(str(detectors["sam"]), points_per_side=4, points_per_batch=16, min_area=0.0, max_area=1.0,
                   pred_iou_thresh=0.0, stability_score_thresh=0.0)
    (boxes,) = sam([image()])
    assert boxes and all(0 <= x1 < x2 <= 80 and 0 <= y1 < y2 <= 60 for x1, y1, x2, y2 in boxes)
    strict = SamMasks(str(detectors["sam"]), points_per_side=4, points_per_batch=16, min_area=0.0, max_area=0.0,
                      pred_iou_thresh=0.0, stability_score_thresh=0.0)
    assert strict([image()]) == [[]]  # no mask covers at most 0 % of the image
