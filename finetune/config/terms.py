"""The options of objective terms in a recipe (``objective.terms``), validated against the class each term registered
(:func:`register_term_config`; the registry is :data:`finetune.plugins.TERM_OPTIONS`), and ``objective.import``:
the user's modules imported before the rest of a recipe is validated, so that what they register is checked like a
built-in."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

import finetune.plugins as plugins
from finetune.config.errors import _Origins, _prefixed, _raise_errors, _type_name
from finetune.config.values import _build_options, _is_options_class, _json_schema_of

__all__ = ["TRUST_FLAG", "TRUST_RULE", "register_term_config", "registered_term_configs"]


class _TermOptions:
    """Marks ``objective.terms``; its JSON schema lists the registered terms and their options, and its keys
    (for error messages) are the registered term names, each with its options class."""

    def recipe_fields(self) -> dict[str, Any]:
        return plugins.TERM_OPTIONS.snapshot()

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        props = {name: {"anyOf": [_json_schema_of(cls, handler), {"type": "null"}]}
                 for name, cls in sorted(registered_term_configs().items())}
        return {"type": "object", "properties": props, "additionalProperties": False,
                "description": "registered objective term -> its options (null: the defaults)"}


_TERMS_MARK = _TermOptions()


# The options classes live in the ground floor, finetune.plugins.TERM_OPTIONS (read at call time, so a test may
# swap it); this module never imports finetune.objectives: the registry's first lookup discovers the terms.


def register_term_config(name: str, cls: type) -> None:
    """Register the options class of an objective term (a dataclass, stdlib or pydantic, or a
    pydantic model), so that ``objective.terms.<name>`` in a recipe is validated against and built
    as ``cls``. Unknown keys are rejected with the closest valid one; a dataclass field's
    ``metadata={"check": fn}`` (``fn(value) -> message or None``) is a range check.

    Registering the same class twice is a no-op; a different class under a taken name is an error.
    (:func:`finetune.objectives.register_term` registers a term's options here itself.)
    """
    if not _is_options_class(cls):
        raise TypeError(f"register_term_config({name!r}, ...): expected a dataclass or a pydantic model "
                        f"type, got {cls!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_term_config: the term name must be a non-empty string, got {name!r}")
    known = plugins.TERM_OPTIONS.peek(name)
    if known is not None and known is not cls:
        raise ValueError(
            f"objective term {name!r} is already registered with {known.__module__}.{known.__qualname__}; "
            f"pick another name for {cls.__module__}.{cls.__qualname__}"
        )
    plugins.TERM_OPTIONS.add(name, cls)


def registered_term_configs() -> dict[str, type]:
    """The registered term names and their options classes (the built-in terms discovered first)."""
    _import_objectives()
    return plugins.TERM_OPTIONS.snapshot()


def _import_objectives() -> None:
    """Discover the registered terms (the first lookup of ``finetune.plugins.TERM_OPTIONS`` imports the
    term modules); without their dependencies (torch), only the terms registered so far are known."""
    try:
        plugins.TERM_OPTIONS.discover()
    except ImportError:
        pass



def _term_options(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PydanticCustomError("recipe_value", "expected a mapping of term name -> options, got {got} ({kind})",
                                  {"got": repr(value), "kind": _type_name(value)})
    registry = registered_term_configs()
    out, errors = {}, []
    for name, options in value.items():
        if name not in registry:
            known = ", ".join(f"`{n}`" for n in sorted(registry)) or "none (finetune.objectives registered no terms)"
            close = difflib.get_close_matches(str(name), list(registry), n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            message = f"is not a registered objective term: {hint}registered terms: {known}"
            errors.append(InitErrorDetails(type=PydanticCustomError("recipe_key", message.replace("{", "{{")),
                                           loc=(name,), input=options))
            continue
        try:
            out[name] = _build_options(registry[name], options)
        except ValidationError as exc:
            errors.extend(_prefixed(exc, (name,)))
    _raise_errors(errors, "objective.terms")
    return out



#: the packages of xlipkit itself: importing them runs no code from a recipe's folder
_OWN_PACKAGES = ("finetune", "losses")
#: the command-line flag with which the user allows a recipe's code to run (``xlipkit train``, ``preview``, ``eval``)
TRUST_FLAG = "--trust-recipe-code"
#: the trust rule, as every refusal of a recipe's code says it
TRUST_RULE = (f"code a recipe names runs only when you allow it on the command line: pass {TRUST_FLAG} to `xlipkit "
              "train`, `preview` or `eval` if you trust the recipe (`xlipkit validate` and `download` never run it)")


def _import_user_modules(tree: dict[str, Any], origins: _Origins, trust: bool = False) -> None:
    """``objective.import: [my_pkg.my_term]``: import the modules (they register terms, scorers or
    model families) before the rest is validated. Untrusted (``trust=False``, unless the user said otherwise:
    :data:`TRUST_FLAG`), only modules already imported or of xlipkit itself are; any other is a
    :class:`RecipeError` that names it and the flag."""
    objective = tree.get("objective")
    if not isinstance(objective, dict) or "import" not in objective:
        return
    modules = objective["import"]
    if modules is None:
        objective["import"] = modules = []
    if isinstance(modules, str):
        objective["import"] = modules = [modules]
    if not isinstance(modules, list) or not all(isinstance(m, str) and m.strip() for m in modules):
        raise origins.error(("objective", "import"), f"expected a list of module names (e.g. `[my_pkg.my_term]`), "
                                                     f"got {modules!r}")
    for i, name in enumerate(modules):
        if not trust and name.strip() not in sys.modules and name.strip().split(".")[0] not in _OWN_PACKAGES:
            raise origins.error(("objective", "import", i),
                                f"would import the module {name.strip()!r}, which runs its code; {TRUST_RULE}")
        try:
            importlib.import_module(name.strip())
        except ImportError as exc:
            raise origins.error(("objective", "import", i),
                                f"cannot import module {name!r} ({exc}); install it or put its folder on "
                                f"PYTHONPATH") from None
