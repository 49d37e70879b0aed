"""Fixtures of the model-layer tests: tiny models of every backend, saved once per session with
``save_pretrained`` and loaded through ``load_model`` like hub checkpoints (DESIGN 9).

Other packages' tests can do the same with the public helpers
``finetune.models.registry.save_tiny(name, folder)`` and ``finetune.load_model(folder)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image

from finetune.models.core.encoder import DualEncoder
from finetune.models.registry import TINY_NAMES


@pytest.fixture(params=TINY_NAMES)
def tiny(request: pytest.FixtureRequest, load_tiny: Callable[..., DualEncoder]) -> DualEncoder:
    """Each tiny model (HF CLIP, SigLIP, SigLIP2 NaFlex, open_clip CLIP, open_clip SigLIP), loaded
    from its saved folder."""
    return load_tiny(request.param)


@pytest.fixture
def images() -> list[Image.Image]:
    """Three small RGB images of different sizes and contents."""
    rng = np.random.RandomState(0)
    sizes = [(40, 30), (32, 32), (50, 64)]
    return [Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


@pytest.fixture
def captions() -> list[str]:
    """Three captions, the first longer than 77 CLIP tokens."""
    long = " ".join(f"A red circle number {i} is at the top left of the scene." for i in range(12))
    return [long, "two blue squares on the right", "a small green star"]
