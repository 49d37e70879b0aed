"""``model.options``: the options of a recipe's model family, validated by the class the family declares in its
registration (:data:`finetune.plugins.MODEL_FAMILIES`), and the keys that moved into it."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

import finetune.plugins as plugins

from finetune.config.errors import _Origins, _fields_of, _raise_errors, _suggest
from finetune.config.io import _plain
from finetune.config.values import _build_options, _json_schema_of

__all__ = ["family_loader_options", "family_options_class"]


#: ``model`` keys of the vision_text family before ``model.options`` held them: still read, with a warning
_MOVED_MODEL_KEYS = ("vision", "text", "projection_dim")


def family_options_class(family: str) -> type | None:
    """The options class that ``model.options`` is validated against for model family ``family`` (the
    ``options`` its registration in :data:`finetune.plugins.MODEL_FAMILIES` names), or ``None`` for a family
    that takes no options or is not registered."""
    entry = plugins.MODEL_FAMILIES.get(family) if family in plugins.MODEL_FAMILIES else None
    return getattr(entry, "options", None)


def _families_with_options() -> list[str]:
    """The registered model families that take ``model.options``, sorted."""
    return [name for name in plugins.MODEL_FAMILIES.names() if family_options_class(name) is not None]


def family_loader_options(model: Any) -> dict[str, Any]:
    """The keywords a recipe's ``model`` section gives its family's loader beyond the name: the options that
    are set (``{"vision": ..., "text": ..., "projection_dim": 512}`` for vision_text), ``{}`` for none."""
    options = getattr(model, "options", None)
    if options is None:
        return {}
    plain = _plain(options)
    return {k: v for k, v in plain.items() if v is not None}


class _ModelOptions:
    """Marks ``model.options``; its JSON schema offers each family's options class, and its keys (for error
    messages) are those of every family's options (the validation itself uses the recipe's family)."""

    describe = "a mapping of the model family's options"

    def recipe_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for family in _families_with_options():
            out.update(_fields_of(family_options_class(family)) or {})
        return out

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        arms = [_json_schema_of(family_options_class(f), handler) for f in _families_with_options()]
        return {"anyOf": [*arms, {"type": "null"}],
                "description": "options of model.family: " + "; ".join(
                    f"{f}: {', '.join(_fields_of(family_options_class(f)) or {})}" for f in _families_with_options())}


_OPTIONS_MARK = _ModelOptions()


def _validate_model_options(value: Any, info: ValidationInfo) -> Any:
    """``model.options`` built as the options class of the recipe's family (``model.family``, or the
    deprecated ``model.backend``); unknown keys get the closest valid one, as term options do."""
    if value is None:
        return None
    if "family" not in info.data or "backend" not in info.data:
        return value  # the family itself is wrong: that error is reported
    family = info.data["family"] if info.data["family"] != "auto" else info.data["backend"]
    cls = family_options_class(family) if family != "auto" else None
    if cls is None:
        if isinstance(value, Mapping) and not value:
            return None
        takes = ", ".join(f"{f} ({', '.join(_fields_of(family_options_class(f)) or {})})"
                          for f in _families_with_options())
        if family == "auto":
            raise PydanticCustomError("recipe_value", "belongs to a model family: set model.family (families with "
                                      "options: {takes})", {"takes": takes})
        raise PydanticCustomError("recipe_value", "is set, but model family {family} takes no options (families "
                                  "with options: {takes}); remove it", {"family": repr(family), "takes": takes})
    if isinstance(value, Mapping):
        fields = _fields_of(cls) or {}
        unknown = [InitErrorDetails(type=PydanticCustomError("recipe_key", "is not a recipe key: {hint}", {
            "hint": _suggest(str(key), fields, ("model", "options"), False)}), loc=(key,), input=sub)
            for key, sub in value.items() if key not in fields]
        _raise_errors(unknown, "model.options")
    return _build_options(cls, value)


def _moved_model_keys(tree: dict[str, Any], origins: _Origins) -> None:
    """``model.vision`` / ``model.text`` / ``model.projection_dim`` (before ``model.options``) moved into
    ``model.options`` with a ``FutureWarning`` naming the new key; ``null`` ones (what every run folder's
    recipe.yaml of that time holds) are dropped silently."""
    model = tree.get("model")
    if not isinstance(model, dict):
        return
    moved = {k: model.pop(k) for k in _MOVED_MODEL_KEYS if k in model}
    moved = {k: v for k, v in moved.items() if v is not None}
    if not moved:
        return
    options = model.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return  # model.options' own error follows
    for key in moved:
        if key in options:
            raise origins.error(("model", key), f"and `model.options.{key}` are both set; `model.{key}` is the old "
                                f"name of `model.options.{key}`: keep only that", key_error=True)
    model["options"] = {**options, **moved}
    for key in moved:
        where = origins.error(("model", key), f"is deprecated: write it as `model.options.{key}` (the options of "
                              "model.family: vision_text); the old key will be refused in the next release",
                              key_error=True)
        warnings.warn(str(where), FutureWarning, stacklevel=3)
