"""``finetune.preprocess.flism`` is a package (issue 25 item 4) whose ``__init__`` keeps every name the single
module exported: users, recipes and ``finetune.objectives.fastgoal`` import them from the package."""

from __future__ import annotations

import importlib

import finetune.preprocess.flism as flism

#: ``finetune.preprocess.flism.__all__`` before the split, and the module each name now lives in
BEFORE_THE_SPLIT = {
    "DatasetBoxes": "detectors", "SamMasks": "detectors", "UltralyticsDetector": "detectors",
    "YolosDetector": "detectors", "build_proposer": "detectors", "candidate_boxes": "detectors",
    "clip_to_input": "detectors", "mask_box": "detectors",
    "FLISMMatcher": "matcher", "compute_flism": "matcher", "flism_features": "matcher", "match_sentences": "matcher",
    "select_pairs": "matcher",
    "flism_stats": "stats", "render_flism_preview": "preview",
    "pairs_by_image": "pairs", "write_pairs": "pairs",
}


def test_every_name_of_the_module_is_exported_by_the_package_from_its_stage_module():
    """...but its command line, which moved up to finetune.cli.pairs (issue 32: the preprocessing floor loads no
    model)."""
    assert set(BEFORE_THE_SPLIT) <= set(flism.__all__) and "main" not in flism.__all__
    for name, module in BEFORE_THE_SPLIT.items():
        stage = importlib.import_module(f"finetune.preprocess.flism.{module}")
        assert getattr(flism, name) is getattr(stage, name), name
        assert getattr(stage, name).__module__ == stage.__name__, name  # defined there, not re-exported
