"""bench/shapes.py's CPU proxies hold: a clip-248 full fine-tune step launches at most 1.2x the kernels of a SigLIP2
step at the same depth (12 + 12 layers, bf16 autocast on the CPU), in one text pass and without new attention shapes
after warm-up, and casts each parameter once per step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import shapes  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_datasets")


@pytest.fixture
def fresh_accelerate():
    """run_case makes a bf16 Accelerator: the next test starts from a clean accelerate state."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.slow
def test_clip_248_launches_within_1_2x_of_siglip2_at_the_same_depth(tmp_path, fresh_accelerate):
    clip = shapes.run_case("clip-248", steps=2, warmup=1, batch=4, workdir=tmp_path / "clip")
    siglip = shapes.run_case("siglip2", steps=2, warmup=1, batch=4, workdir=tmp_path / "siglip")
    ratio = clip["ops_per_step"] / siglip["ops_per_step"]
    assert ratio <= 1.2, (clip["ops_per_step"], siglip["ops_per_step"], clip["per_step"][-1]["top_ops"])
    for r in (clip, siglip):
        assert r["text_passes_per_step"] == 1 and r["image_passes_per_step"] == 1
        assert r["new_sdpa_shapes_after_warmup"] == 0
        # autocast casts each weight at most once per step (its cache holds within the step's one autocast region)
        assert 0 < r["parameter_casts_per_step"] <= r["parameters"]
