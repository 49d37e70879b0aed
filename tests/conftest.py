"""Test-wide settings: no test touches a hub or the network."""

import os
from collections.abc import Callable
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the entry points' default (finetune/threads.py), here before any test imports torch: torch's OpenMP threads sleep
# instead of spinning while the test's subprocesses and other users' jobs share the cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402 - after the offline settings above

if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    # pytest-xdist workers share the cores: each worker's own torch ops on its share (subprocesses keep theirs)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def quiet_datasets():
    """No ``datasets`` progress bars during a test (``pytestmark = pytest.mark.usefixtures("quiet_datasets")``)."""
    import datasets

    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_dir(name)``: the folder tiny registry model ``name`` was saved to (once per session), read by any test
    that loads a saved model the way a user's local folder or hub id is loaded."""
    from finetune.models.registry import save_tiny

    root = tmp_path_factory.mktemp("tiny-models")
    saved: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in saved:
            saved[name] = save_tiny(name, root / name)
        return saved[name]

    return get


@pytest.fixture
def load_tiny(tiny_dir: Callable[[str], Path]) -> Callable[..., object]:
    """``load_tiny(name, **load_model_kwargs)``: a fresh model loaded from the saved folder (:func:`tiny_dir`)."""
    from finetune import load_model

    def load(name: str, **kwargs: object) -> object:
        return load_model(str(tiny_dir(name)), **kwargs)

    return load


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Every test starts and ends with a clean accelerate state: a recipe run in-process with
    ``mixed_precision: bf16`` must not leave its autocast to the next test's ``Accelerator``."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
