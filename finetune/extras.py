"""Optional dependencies (``pip install -e ".[NAME]"`` in the clone) and the error a recipe gets when it needs a
missing one.

xlipkit is Apache-2.0; a dependency under a licence that would bind its users (ultralytics: AGPL-3.0) is an
extra, installed only by those whose recipes use it. The code that uses an extra imports it where it runs, so
that ``import finetune`` and every recipe that does not need it work without it; what needs it calls
:func:`require_extra` when the recipe is checked (the objective is built before any prerequisite trains or any
data loads), so that a missing extra stops the run at once with the command that installs it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

__all__ = ["EXTRAS", "Extra", "MissingExtraError", "has_extra", "install_command", "require_extra"]


@dataclass(frozen=True)
class Extra:
    """One optional dependency group of ``pyproject.toml``.

    Attributes:
        name: the extra's name (``pip install -e ".[name]"``).
        modules: the top-level modules it provides, all importable when it is installed.
        licence: the licence of what it installs.
        brings: what in xlipkit uses it.
    """

    name: str
    modules: tuple[str, ...]
    licence: str
    brings: str


#: the extras whose absence a recipe can run into (``dev`` installs all of them, for the tests)
EXTRAS: dict[str, Extra] = {
    "regions": Extra(
        name="regions",
        modules=("ultralytics",),
        licence="AGPL-3.0",
        brings="FastSAM regions for StructXLIP (objective.terms.structxlip.regions.checkpoint) and ultralytics YOLO "
               "detectors for FAST-GOAL's FLISM (objective.terms.fastgoal.regions.detector: a .pt file, "
               "python -m finetune.preprocess.flism --detector FILE.pt)",
    ),
}


def install_command(name: str) -> str:
    """The command that installs the extra ``name``: ``pip install -e ".[name]"``, run in the clone (xlipkit is
    installed from a clone of its repository, not from PyPI)."""
    return f'pip install -e ".[{name}]"'


class MissingExtraError(ValueError):
    """A recipe (or command) needs an extra that is not installed. A ``ValueError``, so that a run reports it as
    a recipe error (exit status 2) before anything slow starts."""


def has_extra(name: str) -> bool:
    """Whether every module of the extra ``name`` can be imported (found without importing it)."""
    for module in EXTRAS[name].modules:
        try:
            if importlib.util.find_spec(module) is None:
                return False
        except (ImportError, ValueError):  # a finder that refuses it, or a broken half-imported module
            return False
    return True


def require_extra(name: str, needed_by: str) -> None:
    """Raise :class:`MissingExtraError` when the extra ``name`` is not installed.

    Args:
        name: a key of :data:`EXTRAS` (``"regions"``).
        needed_by: what needs it, starting with the recipe key or option (``"objective.terms.structxlip.regions.
            checkpoint (FastSAM regions)"``); the message starts with it.

    Raises:
        MissingExtraError: naming the extra, its licence, the ``pip install`` command, and the way around it.
    """
    if has_extra(name):
        return
    extra = EXTRAS[name]
    missing = ", ".join(extra.modules)
    raise MissingExtraError(
        f"{needed_by} needs {missing}, which is not installed: {install_command(extra.name)} in the clone (the "
        f"`{extra.name}` extra, {extra.licence}), or change that setting. The `{extra.name}` extra brings "
        f"{extra.brings}."
    )
