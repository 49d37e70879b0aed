"""Test-wide settings: no test touches a hub or the network."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
