"""Objectives: a recipe's ``objective`` section -> an optional base term plus weighted added terms (DESIGN 3,
DESIGN 4 Seams).

Bases and added terms share one registry (:func:`register_term`, over :data:`finetune.plugins.TERMS`; the term's
options dataclass goes to :data:`finetune.plugins.TERM_OPTIONS`, which the recipe schema reads, so
``objective.terms.<name>`` is validated like every other recipe key). ``objective.base`` names any registered
term or ``none``; the first lookup imports every module of this package so that its terms register
(:func:`discover_terms`), and a recipe's ``objective.import`` imports a user's own.
"""

from __future__ import annotations

from typing import Any

from .base import (
    Features,
    ImageRequest,
    Objective,
    Term,
    TermCollisionError,
    TextRequest,
    loss_name,
)
from .contrastive import BASE_TERMS, ClipOptions, ClipTerm, LongClipOptions, LongClipTerm, SiglipOptions, SiglipTerm
from .planning import merge_features
from .registry import (
    TERM_BUILDERS,
    TERM_OPTIONS,
    Citation,
    TermBuilder,
    base_options,
    build_term,
    discover_terms,
    import_term_modules,
    register_term,
)


def build_base_term(base: str, label_smoothing: float | None = None) -> Term:
    """The base term named by ``objective.base`` (any registered term), built with its default options.

    ``label_smoothing=None`` keeps the term's own default (0 for clip, 0.1 for longclip as in Long-CLIP's
    training code); a number overrides it (an error for a base without the option, e.g. siglip).
    """
    term, _ = build_term(base, base_options(base, label_smoothing), key="objective.base")
    return term


def build_objective(cfg: Any) -> Objective:
    """Build the :class:`Objective` of a recipe's ``objective`` section.

    Reads ``imports`` (imported first, so that a config object built in code finds a user's terms too),
    ``base`` (a registered term, built with its default options and ``label_smoothing``, or ``none``) and
    ``terms`` (name -> options). With ``base: none`` the objective is the weighted sum of the terms.

    Raises:
        ValueError: an unknown term, a term given twice, colliding batch fields or feature keys, or nothing
            to optimise (``base: none`` and no terms).
    """
    import_term_modules(getattr(cfg, "imports", None) or [])
    base_name = getattr(cfg, "base", "clip") or "none"
    terms = dict(getattr(cfg, "terms", None) or {})
    if base_name == "none" and not terms:
        raise ValueError("objective: nothing to optimise: objective.base is `none` and objective.terms is empty; "
                         "set objective.base (e.g. clip) or add a term under objective.terms")
    if base_name in terms:
        raise ValueError(f"objective.terms.{base_name}: {base_name!r} is already objective.base; drop one of them "
                         f"(set objective.base: none to use the term with these options as the only base)")
    base, base_weights = None, 1.0
    if base_name != "none":
        base, base_weights = build_term(
            base_name, base_options(base_name, getattr(cfg, "label_smoothing", None)), key="objective.base")
    built = [build_term(name, options) for name, options in terms.items()]
    return Objective(base, built, base_weights=base_weights)


__all__ = [
    "BASE_TERMS", "Citation", "ClipOptions", "ClipTerm", "Features", "ImageRequest", "LongClipOptions",
    "LongClipTerm", "Objective", "SiglipOptions", "SiglipTerm", "TERM_BUILDERS", "TERM_OPTIONS", "Term", "TermBuilder",
    "TermCollisionError", "TextRequest", "build_base_term", "build_objective", "build_term", "discover_terms",
    "import_term_modules", "loss_name", "merge_features", "register_term",
]
