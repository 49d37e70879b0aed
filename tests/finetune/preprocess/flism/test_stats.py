"""FLISM's statistics for the run report."""

from __future__ import annotations

import pytest

from finetune.preprocess.flism.detectors import DatasetBoxes
from finetune.preprocess.flism.matcher import FLISMMatcher, compute_flism
from finetune.preprocess.flism.stats import flism_stats
from tests.finetune.preprocess.flism.stubs import Colours, scenes

pytestmark = pytest.mark.usefixtures("quiet_datasets")


def test_stats_of_a_matched_dataset(tmp_path):
    enc = Colours()
    data = compute_flism(scenes(), FLISMMatcher(DatasetBoxes(links=False), enc.images, enc.texts, model_id="stub"),
                         cache_dir=tmp_path)
    stats = flism_stats(data)
    assert stats["images"] == 2 and stats["candidates_per_image"] == 7
    assert stats["found_share"] == pytest.approx(2 / 7) and stats["default_share"] == pytest.approx(5 / 7)
    assert sum(stats["similarity_histogram"]["counts"]) == 2 and stats["images_without_pairs"] == 0
    kept = [data[i]["flism_candidate_kinds"][data[i]["flism_pair_candidate"][0]] for i in range(2)]
    assert stats["kept_found_share"] == kept.count("found") / 2
