"""Deprecated: the scorers are the package :mod:`finetune.evaluation.scorers` (issue 32).

This module forwards the names of the old ``finetune.scorers`` package (``Scorer``, ``register_scorer``,
``get_scorer``, ...) for one release, with a ``FutureWarning`` naming the new path; import them from
``finetune.evaluation.scorers`` instead. Its submodules (``finetune.scorers.grm``, ...) are
``finetune.evaluation.scorers.grm``, ...
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

NEW = "finetune.evaluation.scorers"

warnings.warn("finetune.scorers is deprecated and will be removed in the next release: import Scorer, "
              "register_scorer, get_scorer, ... from finetune.evaluation.scorers", FutureWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    module = importlib.import_module(NEW)
    if name in module.__all__:
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (the scorers are {NEW})")
