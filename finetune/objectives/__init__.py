"""Objectives: a recipe's ``objective`` section -> one base term plus weighted added terms (DESIGN 3).

Added terms register themselves with :func:`register_term`, which also registers their options dataclass
with the recipe schema, so ``objective.terms.<name>`` is validated like every other recipe key.
"""

from __future__ import annotations

from typing import Any, Callable

from .base import Features, ImageRequest, Objective, Term, TextRequest, merge_features
from .contrastive import BASE_TERMS, ClipTerm, LongClipTerm, SiglipTerm

TermBuilder = Callable[[Any], tuple[Term, "dict[str, float] | float"]]
TERM_BUILDERS: dict[str, TermBuilder] = {}


def register_term(name: str, config_cls: type) -> Callable[[TermBuilder], TermBuilder]:
    """Register ``builder(options) -> (term, weights)`` for ``objective.terms.<name>``, with the options
    dataclass ``config_cls`` that the recipe schema validates against."""

    def deco(builder: TermBuilder) -> TermBuilder:
        TERM_BUILDERS[name] = builder
        from finetune.config import register_term_config

        register_term_config(name, config_cls)
        return builder

    return deco


def build_base_term(base: str, label_smoothing: float | None = None) -> Term:
    """The base term named by ``objective.base``.

    ``label_smoothing=None`` keeps the term's own default (0 for clip, 0.1 for longclip as in Long-CLIP's
    training code).
    """
    if base not in BASE_TERMS:
        raise ValueError(f"objective.base: unknown base loss {base!r}; choose one of {sorted(BASE_TERMS)}")
    if base == "siglip":
        return SiglipTerm()
    if label_smoothing is None:
        return BASE_TERMS[base]()
    return BASE_TERMS[base](label_smoothing=label_smoothing)


def build_objective(cfg: Any) -> Objective:
    """Build the :class:`Objective` of a recipe's ``objective`` section (``base``, ``label_smoothing``,
    ``terms``)."""
    base = build_base_term(cfg.base, getattr(cfg, "label_smoothing", None))
    terms = []
    for name, options in (cfg.terms or {}).items():
        if name not in TERM_BUILDERS:
            raise ValueError(
                f"objective.terms.{name}: unknown term; registered terms: {sorted(TERM_BUILDERS) or 'none'}"
            )
        terms.append(TERM_BUILDERS[name](options))
    return Objective(base, terms)


def _register_builtin_terms() -> None:
    """Import the modules of the added terms so that they register (kept lazy-safe)."""
    import importlib

    for mod in ("structxlip",):
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as exc:  # a term module that is not part of this checkout yet
            if exc.name != f"{__name__}.{mod}":
                raise


_register_builtin_terms()

__all__ = [
    "BASE_TERMS", "ClipTerm", "Features", "ImageRequest", "LongClipTerm", "Objective", "SiglipTerm", "Term",
    "TextRequest", "TERM_BUILDERS", "build_objective", "merge_features", "register_term",
]
