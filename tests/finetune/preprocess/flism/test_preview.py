"""FLISM's preview picture."""

from __future__ import annotations

import pytest
from PIL import Image

from finetune.preprocess.flism.detectors import DatasetBoxes
from finetune.preprocess.flism.matcher import FLISMMatcher, compute_flism
from finetune.preprocess.flism.preview import render_flism_preview
from tests.finetune.preprocess.flism.stubs import Colours, scenes

pytestmark = pytest.mark.usefixtures("quiet_datasets")


def test_preview_of_a_matched_dataset(tmp_path):
    enc = Colours()
    data = compute_flism(scenes(), FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub"),
                         cache_dir=tmp_path)
    path = render_flism_preview([data[0], data[1]], tmp_path / "plots" / "flism.png")
    assert path.is_file() and Image.open(path).size[0] > 200
