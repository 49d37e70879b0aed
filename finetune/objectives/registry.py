"""The term registry (DESIGN 4, Seams): bases (``clip``, ``siglip``, ``longclip``) and added terms
(``structxlip``, ...) register the same way, each with an options dataclass that the recipe schema
validates ``objective.terms.<name>`` against.

The entries live in the ground floor, :data:`finetune.plugins.TERMS` (builder, options class, citation) and
:data:`finetune.plugins.TERM_OPTIONS` (the options class, which ``finetune.config`` reads without importing this
package). Term modules are found without a list to edit: the first lookup imports every module of the
``finetune.objectives`` package (:func:`discover_terms`), and a recipe's ``objective.import: [my_pkg.my_term]``
imports a user's own modules (:func:`import_term_modules`), which register with :func:`register_term` when
imported::

    from dataclasses import dataclass
    from finetune.objectives import Term, register_term
    from finetune.plugins import Citation

    @dataclass
    class MyOptions:
        margin: float = 0.2

    @register_term("my_term", MyOptions, citation=Citation("Me et al., My Term (2026)", "https://arxiv.org/abs/..."))
    def build_my_term(options: MyOptions):
        return MyTerm(options.margin), 1.0   # the term and its weight (or {value name: weight})
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

import finetune.plugins as plugins
from finetune.plugins import Citation, TermEntry

from .base import RESERVED_NAMES, Term

TermBuilder = Callable[[Any], "tuple[Term, dict[str, float] | float]"]

_PACKAGE = __name__.rsplit(".", 1)[0]


class _Builders(Mapping[str, TermBuilder]):
    """Registered term name -> its builder: a read-only view of :data:`finetune.plugins.TERMS`."""

    def __getitem__(self, name: str) -> TermBuilder:
        return plugins.TERMS.get(name).builder

    def __contains__(self, name: object) -> bool:
        return name in plugins.TERMS

    def __iter__(self) -> Iterator[str]:
        return iter(plugins.TERMS.names())

    def __len__(self) -> int:
        return len(plugins.TERMS)


#: registered term name -> ``builder(options) -> (term, weights)`` (a view of ``finetune.plugins.TERMS``)
TERM_BUILDERS: Mapping[str, TermBuilder] = _Builders()
#: registered term name -> its options dataclass (``finetune.plugins.TERM_OPTIONS``, which the recipe schema reads)
TERM_OPTIONS = plugins.TERM_OPTIONS


def register_term(name: str, config_cls: type, *,
                  citation: Citation | Mapping[str, Any] | str | None = None) -> Callable[[TermBuilder], TermBuilder]:
    """Register ``builder(options) -> (term, weights)`` under ``name``, usable as ``objective.base: name``
    (built with the options' defaults) and as ``objective.terms.<name>`` (built with the recipe's options,
    validated against the dataclass ``config_cls``).

    ``weights`` is one float for every value the term's ``loss`` returns, or ``{value name: weight}``
    (missing names weigh 1). Names are what a recipe writes and the prefix of the logged loss names
    (``name/value``); ``loss``, ``lr``, ``logit_scale``, ``step`` and ``none`` are taken, and ``/`` is not
    allowed.

    Args:
        citation: the term's paper (a :class:`finetune.plugins.Citation`, a mapping of its fields, or its
            text): the model card of a run that used the term lists it under "Methods" and is tagged with
            ``citation.tag`` (default: the term's name).
    """
    if not isinstance(name, str) or not name or "/" in name or name in RESERVED_NAMES:
        raise ValueError(f"register_term: {name!r} cannot name a term: use a non-empty name without '/', "
                         f"other than {', '.join(sorted(RESERVED_NAMES))}")
    if not dataclasses.is_dataclass(config_cls) or not isinstance(config_cls, type):
        raise TypeError(f"register_term({name!r}, ...): the options must be a dataclass type, got {config_cls!r}")
    if isinstance(citation, str):
        citation = Citation(citation)
    elif isinstance(citation, Mapping):
        try:
            citation = Citation(**citation)
        except TypeError as exc:
            raise TypeError(f"register_term({name!r}, ...): a citation has the fields text, url and tag "
                            f"({exc})") from None
    if citation is not None and not isinstance(citation, Citation):
        raise TypeError(f"register_term({name!r}, ...): citation must be a finetune.plugins.Citation, a mapping of "
                        f"its fields or its text, got {citation!r}")

    def deco(builder: TermBuilder) -> TermBuilder:
        known = plugins.TERMS.peek(name)
        if known is not None and _qualname(known.builder) != _qualname(builder):
            raise ValueError(f"objective term {name!r} is already registered by {_qualname(known.builder)}; "
                             f"pick another name for {_qualname(builder)}")
        plugins.TERM_OPTIONS.add(name, config_cls)
        plugins.TERMS.add(name, TermEntry(builder, config_cls, citation), replace=True)
        return builder

    return deco


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def discover_terms() -> list[str]:
    """Import every module of the ``finetune.objectives`` package (the discovery rule of
    :mod:`finetune.plugins`), so that a term module dropped into the folder registers without being listed
    anywhere. Modules whose name starts with ``_`` are skipped. Returns the imported module names, relative
    to the package (``"contrastive"``, ``"structxlip.term"``)."""
    imported = plugins.discover_modules([_PACKAGE])
    return [name[len(_PACKAGE) + 1:] for name in imported if name != _PACKAGE]


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
    if name not in plugins.TERMS:
        known = ", ".join(plugins.TERMS.names()) or "none"
        raise ValueError(f"{key}: {name!r} is not a registered objective term; registered terms: {known} "
                         f"(a term of your own: add its module to objective.import)")
    entry = plugins.TERMS.get(name)
    if options is None:
        options = entry.options()
    term, weights = entry.builder(options)
    if not isinstance(term, Term):
        raise TypeError(f"{key}: the builder of {name!r} returned {type(term).__name__}, not a Term")
    term.name = name
    return term, weights


def base_options(name: str, label_smoothing: float | None = None) -> Any:
    """The options of the base term ``name``: its defaults, with ``objective.label_smoothing`` when set."""
    if name not in plugins.TERMS:
        known = ", ".join(plugins.TERMS.names()) or "none"
        raise ValueError(f"objective.base: {name!r} is not a registered objective term; choose `none` or one of "
                         f"{known}")
    options = plugins.TERMS.get(name).options()
    if label_smoothing is None:
        return options
    if "label_smoothing" not in {f.name for f in dataclasses.fields(options)}:
        raise ValueError(f"objective.label_smoothing: the base term {name!r} has no label smoothing; remove "
                         f"objective.label_smoothing or pick a base that has it (clip, longclip)")
    return dataclasses.replace(options, label_smoothing=label_smoothing)
