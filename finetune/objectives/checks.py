"""Checks of term option values, shared by the term modules' options dataclasses.

Each check takes a field's value and returns None when it is valid (``None`` is always valid: it means
"the default") or the end of an error message (``"must be > 0, got -1"``) that the recipe schema prefixes
with the recipe key. Used as ``field(default=..., metadata={"check": positive})``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["at_least_one", "non_negative", "positive", "unit"]


def positive(value: Any) -> str | None:
    """None when ``value`` is None or > 0, else the error message."""
    return None if value is None or value > 0 else f"must be > 0, got {value!r}"


def non_negative(value: Any) -> str | None:
    """None when ``value`` is None or >= 0, else the error message."""
    return None if value is None or value >= 0 else f"must be >= 0, got {value!r}"


def at_least_one(value: Any) -> str | None:
    """None when ``value`` is None or >= 1, else the error message."""
    return None if value is None or value >= 1 else f"must be >= 1, got {value!r}"


def unit(value: Any) -> str | None:
    """None when ``value`` is None or in [0, 1], else the error message."""
    return None if value is None or 0 <= value <= 1 else f"must be in [0, 1], got {value!r}"
