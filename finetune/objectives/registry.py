"""The term registry (DESIGN 4, Seams): bases (``clip``, ``siglip``, ``longclip``) and added terms
(``structxlip``, ...) register the same way, each with an options dataclass that the recipe schema
validates ``objective.terms.<name>`` against.

Term modules are found without a list to edit: :func:`discover_terms` imports every module of the
``finetune.objectives`` package, and a recipe's ``objective.import: [my_pkg.my_term]`` imports a user's own
modules (:func:`import_term_modules`), which register with :func:`register_term` when imported::

    from dataclasses import dataclass
    from finetune.objectives import Term, register_term

    @dataclass
    class MyOptions:
        margin: float = 0.2

    @register_term("my_term", MyOptions)
    def build_my_term(options: MyOptions):
        return MyTerm(options.margin), 1.0   # the term and its weight (or {value name: weight})
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterable
from typing import Any, Callable

from .base import RESERVED_NAMES, Term

TermBuilder = Callable[[Any], "tuple[Term, dict[str, float] | float]"]
#: registered term name -> ``builder(options) -> (term, weights)``
TERM_BUILDERS: dict[str, TermBuilder] = {}
#: registered term name -> its options dataclass
TERM_OPTIONS: dict[str, type] = {}

_PACKAGE = __name__.rsplit(".", 1)[0]


def register_term(name: str, config_cls: type) -> Callable[[TermBuilder], TermBuilder]:
    """Register ``builder(options) -> (term, weights)`` under ``name``, usable as ``objective.base: name``
    (built with the options' defaults) and as ``objective.terms.<name>`` (built with the recipe's options,
    validated against the dataclass ``config_cls``).

    ``weights`` is one float for every value the term's ``loss`` returns, or ``{value name: weight}``
    (missing names weigh 1). Names are what a recipe writes and the prefix of the logged loss names
    (``name/value``); ``loss``, ``lr``, ``logit_scale``, ``step`` and ``none`` are taken, and ``/`` is not
    allowed.
    """
    if not isinstance(name, str) or not name or "/" in name or name in RESERVED_NAMES:
        raise ValueError(f"register_term: {name!r} cannot name a term: use a non-empty name without '/', "
                         f"other than {', '.join(sorted(RESERVED_NAMES))}")
    if not dataclasses.is_dataclass(config_cls) or not isinstance(config_cls, type):
        raise TypeError(f"register_term({name!r}, ...): the options must be a dataclass type, got {config_cls!r}")

    def deco(builder: TermBuilder) -> TermBuilder:
        known = TERM_BUILDERS.get(name)
        if known is not None and _qualname(known) != _qualname(builder):
            raise ValueError(f"objective term {name!r} is already registered by {_qualname(known)}; "
                             f"pick another name for {_qualname(builder)}")
        from finetune.config import register_term_config

        register_term_config(name, config_cls)
        TERM_BUILDERS[name] = builder
        TERM_OPTIONS[name] = config_cls
        return builder

    return deco


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def discover_terms() -> list[str]:
    """Import every module of the ``finetune.objectives`` package (``pkgutil``), so that a term module
    dropped into the folder registers without being listed anywhere. Modules whose name starts with ``_``
    are skipped. Returns the imported module names."""
    package = importlib.import_module(_PACKAGE)
    names = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        importlib.import_module(f"{_PACKAGE}.{info.name}")
        names.append(info.name)
    return names


def import_term_modules(modules: Iterable[str]) -> None:
    """Import a recipe's ``objective.import`` modules (they register terms, scorers or model families).

    Raises:
        ImportError: naming the recipe key and the module when one cannot be imported.
    """
    for i, name in enumerate(modules or ()):
        try:
            importlib.import_module(str(name).strip())
        except ImportError as exc:
            raise ImportError(f"objective.import[{i}]: cannot import module {name!r} ({exc}); install it or put "
                              f"its folder on PYTHONPATH") from exc


def build_term(name: str, options: Any = None, *, key: str | None = None) -> tuple[Term, dict[str, float] | float]:
    """Build the registered term ``name`` from ``options`` (an instance of its options dataclass, or
    ``None`` for the defaults). The term's ``name`` is set to the registered name, which prefixes its
    logged losses.

    Args:
        key: the recipe key the term came from, for the error message (default ``objective.terms.<name>``).
    """
    key = key or f"objective.terms.{name}"
    if name not in TERM_BUILDERS:
        known = ", ".join(sorted(TERM_BUILDERS)) or "none"
        raise ValueError(f"{key}: {name!r} is not a registered objective term; registered terms: {known} "
                         f"(a term of your own: add its module to objective.import)")
    if options is None:
        options = TERM_OPTIONS[name]()
    term, weights = TERM_BUILDERS[name](options)
    if not isinstance(term, Term):
        raise TypeError(f"{key}: the builder of {name!r} returned {type(term).__name__}, not a Term")
    term.name = name
    return term, weights


def base_options(name: str, label_smoothing: float | None = None) -> Any:
    """The options of the base term ``name``: its defaults, with ``objective.label_smoothing`` when set."""
    if name not in TERM_OPTIONS:
        known = ", ".join(sorted(TERM_BUILDERS)) or "none"
        raise ValueError(f"objective.base: {name!r} is not a registered objective term; choose `none` or one of "
                         f"{known}")
    options = TERM_OPTIONS[name]()
    if label_smoothing is None:
        return options
    if "label_smoothing" not in {f.name for f in dataclasses.fields(options)}:
        raise ValueError(f"objective.label_smoothing: the base term {name!r} has no label smoothing; remove "
                         f"objective.label_smoothing or pick a base that has it (clip, longclip)")
    return dataclasses.replace(options, label_smoothing=label_smoothing)
