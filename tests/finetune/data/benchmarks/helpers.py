"""Helpers of the benchmark tests: load a benchmark from a fixture folder through the registry."""

from __future__ import annotations

from pathlib import Path

from finetune.data.sources import load_source


def load(name: str, path: Path | None, *, on_error: str = "skip", **spec):
    """``load_source`` of benchmark ``name`` read from ``path``."""
    spec = {"name": name, "path": str(path) if path else None, **spec}
    return load_source(spec, on_error=on_error)


def ids(loaded) -> list[str]:
    return list(loaded.dataset["id"])


def undecoded():
    """An image feature that keeps the file path (no decoding)."""
    import datasets

    return datasets.Image(decode=False)
