"""Tiny random-weight detectors built from real configs and saved like the real checkpoints, so that tests load
them through the same code a hub id or a downloaded file takes (no network): YOLOS (transformers), an
ultralytics YOLO ``.pt`` and SAM (transformers, for GOAL's LISM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

#: the labels of the tiny YOLOS (COCO-style: id 0 is "N/A")
YOLOS_LABELS = {0: "N/A", 1: "person", 2: "cat", 3: "dog"}


def save_tiny_yolos(folder: str | Path, seed: int = 0) -> Path:
    """A 2-layer YOLOS (width 32, patch 8, 64 px, 10 detection tokens) and its image processor, saved with
    ``save_pretrained``."""
    from transformers import YolosConfig, YolosForObjectDetection, YolosImageProcessor

    torch.manual_seed(seed)
    cfg = YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      image_size=[64, 64], patch_size=8, num_detection_tokens=10, id2label=YOLOS_LABELS,
                      label2id={v: k for k, v in YOLOS_LABELS.items()})
    folder = Path(folder)
    YolosForObjectDetection(cfg).save_pretrained(folder)
    YolosImageProcessor(size={"shortest_edge": 64, "longest_edge": 96}).save_pretrained(folder)
    return folder


def save_tiny_yolo(path: str | Path, seed: int = 0) -> Path:
    """An ultralytics YOLOv8n detector from its model yaml (random weights), saved as a ``.pt`` checkpoint."""
    pytest.importorskip("ultralytics")  # the `regions` extra
    from ultralytics import YOLO

    from finetune.preprocess.regions import preserve_thread_settings

    torch.manual_seed(seed)
    with preserve_thread_settings():
        YOLO("yolov8n.yaml").save(str(path))
    return Path(path)


def save_tiny_sam(folder: str | Path, seed: int = 0) -> Path:
    """A 2-layer SAM (width 32, 64 px input, 16 px masks) and its processor, saved with ``save_pretrained``."""
    from transformers import (SamConfig, SamImageProcessor, SamMaskDecoderConfig, SamModel, SamProcessor,
                              SamPromptEncoderConfig, SamVisionConfig)

    torch.manual_seed(seed)
    vision = SamVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64, image_size=64,
                             patch_size=8, output_channels=32, global_attn_indexes=[1], window_size=4,
                             num_pos_feats=16)
    prompt = SamPromptEncoderConfig(hidden_size=32, image_size=64, patch_size=8, mask_input_channels=4)
    decoder = SamMaskDecoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64,
                                   iou_head_hidden_dim=32)
    cfg = SamConfig(vision_config=vision.to_dict(), prompt_encoder_config=prompt.to_dict(),
                    mask_decoder_config=decoder.to_dict())
    folder = Path(folder)
    SamModel(cfg).save_pretrained(folder)
    SamProcessor(SamImageProcessor(size={"longest_edge": 64}, pad_size={"height": 64, "width": 64},
                                   mask_size={"longest_edge": 16}, mask_pad_size={"height": 16, "width": 16})
                 ).save_pretrained(folder)
    return folder
