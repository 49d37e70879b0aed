"""The benchmarks package registers every benchmark with its protocols and keeps the names of the single module."""

from __future__ import annotations

import pytest

from finetune.data import benchmarks
from finetune.data.protocols import available_protocols
from finetune.data.sources import available_sources

pytestmark = pytest.mark.filterwarnings("ignore:.*the papers evaluate on:UserWarning")


def test_every_benchmark_is_registered_with_its_protocols():
    sources = available_sources()
    for name in ("docci", "docci_fg", "dci", "urban1k", "sharegpt4v", "flickr30k", "coco"):
        assert name in sources
    assert available_protocols("docci") == ["test", "goal"]
    assert available_protocols("dci") == ["all", "goal"]
    assert available_protocols("sharegpt4v") == ["1k", "10k"]
    assert available_protocols("flickr30k") == ["test", "full"]
    assert available_protocols("coco") == ["val2017", "karpathy", "karpathy_1k"]
    assert benchmarks.available_protocols is available_protocols


#: ``finetune.data.benchmarks.__all__`` before the package split
BEFORE_THE_SPLIT = ["available_protocols", "protocol_record", "OFFICIAL_FILES", "build_docci", "build_docci_fg",
                    "build_dci", "build_urban1k", "build_sharegpt4v", "build_flickr30k", "build_coco"]


def test_the_package_keeps_the_modules_names_and_each_builder_lives_in_its_benchmarks_module():
    assert set(BEFORE_THE_SPLIT) <= set(benchmarks.__all__)
    assert all(hasattr(benchmarks, name) for name in benchmarks.__all__)
    for name in ("docci", "dci", "urban1k", "sharegpt4v", "flickr30k", "coco"):
        builder = getattr(benchmarks, f"build_{name}")
        assert builder.__module__ == f"finetune.data.benchmarks.{name}", name
    assert benchmarks.build_docci_fg.__module__ == "finetune.data.benchmarks.docci"  # DOCCI's files, its sentences
