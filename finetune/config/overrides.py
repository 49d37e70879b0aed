"""Command-line overrides of a recipe: ``key.sub=value`` (``train.lr=1e-5``, ``eval.sets=[docci,urban1k]``,
``eval.sets.0.size=128``), each value read as YAML and set into the recipe before validation, so that it is
checked like a file value and its errors name the override."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from finetune.config.errors import KeyPath, RecipeError, _dotted
from finetune.config.secrets import mask_override
from finetune.config.io import MAX_OVERRIDES, MAX_RECIPE_BYTES, YAMLLimitError, safe_load_yaml
from finetune.config.sources import parse_source_shorthand

def _parse_override(text: str) -> tuple[KeyPath, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"command-line override `{mask_override(text)}` is not `key.sub=value` "
                          f"(e.g. `train.lr=1e-5`, `eval.sets=[docci,urban1k]`)")
    parts = key.split(".")
    if any(not p for p in parts):
        raise RecipeError(f"command-line override `{mask_override(text)}`: `{key}` has an empty part; write dotted "
                          "keys like `train.lr`",
                          key=key)
    try:
        value = safe_load_yaml(raw) if raw.strip() else None
    except YAMLLimitError as exc:
        raise RecipeError(f"command-line override `{mask_override(text)}`: {exc.problem}",
                          key=key) from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"command-line override `{mask_override(text)}`: the value is not valid YAML ({problem}); "
                          f"quote it, e.g. {key}='...'", key=key) from None
    return tuple(int(p) if p.isdigit() else p for p in parts), value


def check_override_sizes(overrides: Sequence[str]) -> None:
    """At most :data:`~finetune.config.io.MAX_OVERRIDES` overrides holding at most
    :data:`~finetune.config.io.MAX_RECIPE_BYTES` bytes together, checked before any is parsed.

    Raises:
        RecipeError: naming the count, or the size and the key of the longest override (its value not shown).
    """
    if len(overrides) > MAX_OVERRIDES:
        raise RecipeError(f"{len(overrides):,} command-line overrides, more than the {MAX_OVERRIDES:,} a run may take; "
                          "write the values into the recipe instead")
    sizes = [len(str(o).encode("utf-8", "surrogatepass")) for o in overrides]
    if sum(sizes) > MAX_RECIPE_BYTES:
        longest = str(overrides[max(range(len(sizes)), key=sizes.__getitem__)])
        key = longest.partition("=")[0].strip()[:80]
        raise RecipeError(f"the command-line overrides hold {sum(sizes):,} bytes, more than the {MAX_RECIPE_BYTES:,} a "
                          f"recipe may hold (the longest sets `{key}`, {max(sizes):,} bytes); write long values into "
                          "files the recipe names", key=key or None)


def _is_source_path(path: KeyPath) -> bool:
    keys = tuple(str(p) for p in path)
    return keys == ("data", "train") or (len(keys) == 3 and keys[:2] == ("eval", "sets"))


def _set_path(tree: dict[str, Any], path: KeyPath, value: Any, text: str) -> None:
    """Set ``tree[path] = value``, creating mappings on the way; integer parts index lists and a
    dataset shorthand string (``docci:goal``) on the way becomes its mapping."""
    node: Any = tree
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list) and isinstance(part, int):
            if part >= len(node):
                raise RecipeError(f"command-line override `{mask_override(text)}`: `{_dotted(path[:i])}` has "
                                  f"{len(node)} "
                                  f"entries, there is no index {part}", key=_dotted(path))
            key: Any = part
        elif isinstance(node, dict):
            key = str(part)
        else:
            raise RecipeError(f"command-line override `{mask_override(text)}`: `{_dotted(path[:i])}` is {node!r}, "
                              "not a mapping; "
                              f"set it whole instead (e.g. `{_dotted(path[:i])}={{...}}`)", key=_dotted(path))
        if last:
            node[key] = value
            return
        if isinstance(node, dict) and node.get(key) is None:
            node[key] = {}
        if isinstance(node[key], str) and _is_source_path(path[:i + 1]):
            node[key] = parse_source_shorthand(node[key])
        node = node[key]
