"""Fixtures of the run-folder tests: the tiny model their runs train, and a log handler of each test's own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def tiny_model(tiny_dir: Callable[[str], Path]) -> Path:
    """The folder tiny-clip was saved to (once per session), named by the runs' ``model.name_or_path``."""
    return tiny_dir("tiny-clip")


@pytest.fixture
def own_log_handlers():
    """The run's log handler writes to the stderr of the test that made it: give each test its own."""
    import logging

    logger = logging.getLogger("xlipkit")
    saved = logger.handlers[:]
    logger.handlers.clear()
    yield
    logger.handlers[:] = saved
