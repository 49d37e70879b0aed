"""Fixtures of the losses tests: one two-process gloo run shared by every distributed test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Spawned ranks import the rank-side code by module name: keep this folder importable.
sys.path.insert(0, str(Path(__file__).parent))

import two_rank_cases  # noqa: E402


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every case of ``two_rank_cases`` run on two CPU processes (gloo); one dict per rank."""
    return two_rank_cases.run_two_ranks(str(tmp_path_factory.mktemp("two_ranks")))
