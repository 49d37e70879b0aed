"""Test-wide settings: no test touches a hub or the network."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402 - after the offline settings above


@pytest.fixture
def quiet_datasets():
    """No ``datasets`` progress bars during a test (``pytestmark = pytest.mark.usefixtures("quiet_datasets")``)."""
    import datasets

    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()
