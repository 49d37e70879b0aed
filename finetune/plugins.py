"""The ground floor: every registry of the toolkit, with one discovery rule (DESIGN 2, 4 "Seams").

Objective terms and their option classes, scorers, model families and their named configs,
inference modules and data sources all register the same way: a module calls ``REGISTRY.add(name,
entry)`` (or a ``register_*`` helper built on it) when it is imported. Nothing is listed by hand:

*One discovery rule.* The first lookup in a registry imports every module of the packages the registry
names (``pkgutil``; a module whose name starts with ``_`` is skipped, a module name instead of a package
is imported as it is). A user's own modules register the same way once imported (a recipe's
``objective.import``, or an ``import`` in their script).

An entry may carry its paper: a term registers a :class:`Citation` with its :class:`TermEntry`
(``register_term(name, Options, citation=...)``), and the model card of a run cites the terms it used.

This module imports nothing from the toolkit at import time, so any layer may import it: it is the
bottom of the import graph, and no import circle can pass through it.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["Citation", "Registry", "TermEntry", "TERMS", "TERM_OPTIONS", "SCORERS", "MODEL_FAMILIES", "NAMED_CONFIGS",
           "INFERENCE_MODULES", "DATA_SOURCES", "citation_of", "discover_modules", "registries"]


def discover_modules(packages: Iterable[str]) -> list[str]:
    """Import every module of ``packages`` (recursively; names starting with ``_`` are skipped) and return
    the imported module names. A name that is a module, not a package, is imported as it is."""
    imported = []
    for name in packages:
        package = importlib.import_module(name)
        imported.append(name)
        path = getattr(package, "__path__", None)
        if path is None:
            continue
        for info in pkgutil.walk_packages(path, prefix=f"{name}."):
            if any(part.startswith("_") for part in info.name.split(".")):
                continue
            importlib.import_module(info.name)
            imported.append(info.name)
    return imported


class Registry(Generic[T]):
    """Names to entries of one kind (``what``: "objective term", "scorer", ...).

    Args:
        what: the kind, for messages (``"scorer"``).
        packages: the toolkit's packages (or modules) whose modules register entries; imported on the
            first lookup (:func:`discover_modules`).
        recipe_key: the recipe key that names an entry, for messages (``"eval.scorer"``).
    """

    def __init__(self, what: str, packages: Iterable[str] = (), *, recipe_key: str = "") -> None:
        self.what = what
        self.packages = tuple(packages)
        self.recipe_key = recipe_key
        self._entries: dict[str, T] = {}
        self._discovered = False
        self._lock = threading.RLock()

    # -- registration -----------------------------------------------------------------------------
    def add(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Register ``entry`` under ``name``.

        Raises:
            ValueError: ``name`` is empty or not a string, or already holds another entry (``replace=True``
                overrides). Registering the same entry twice (a module imported again) is allowed.
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.what} needs a non-empty name, got {name!r}")
        with self._lock:
            known = self._entries.get(name)
            if known is not None and not replace and not _same(known, entry):
                raise ValueError(f"{self.what} {name!r} is already registered ({_describe(known)}); pick another "
                                 f"name for {_describe(entry)} or pass replace=True")
            self._entries[name] = entry
        return entry

    def remove(self, name: str) -> T | None:
        """Unregister ``name`` (tests, or a plugin that replaces a built-in); returns the old entry."""
        with self._lock:
            return self._entries.pop(name, None)

    def peek(self, name: str) -> T | None:
        """The entry under ``name`` as registered so far, or ``None``; discovers nothing (for a ``register_*``
        helper that checks a taken name while the registering modules are being imported)."""
        return self._entries.get(name)

    def snapshot(self) -> dict[str, T]:
        """A copy of what is registered so far (discovers nothing); :meth:`restore` puts it back (tests: call
        :meth:`discover` first, since a module imported once does not register again)."""
        with self._lock:
            return dict(self._entries)

    def restore(self, entries: dict[str, T]) -> None:
        """Replace the registered entries by ``entries`` (a :meth:`snapshot`)."""
        with self._lock:
            self._entries = dict(entries)

    # -- lookup -----------------------------------------------------------------------------------
    def discover(self) -> None:
        """Import the registering modules once (the discovery rule; later calls do nothing)."""
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            try:
                discover_modules(self.packages)
            except BaseException:
                self._discovered = False
                raise

    def get(self, name: str) -> T:
        """The entry registered under ``name``.

        Raises:
            KeyError: unknown ``name``; the message lists the registered names and the closest one.
        """
        self.discover()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise KeyError(self.unknown(name)) from None

    def unknown(self, name: Any) -> str:
        """The message for an unknown ``name``: what is registered, the closest name, how to add one."""
        import difflib

        names = self.names()
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        where = f"{self.recipe_key}: " if self.recipe_key else ""
        return (f"{where}unknown {self.what} {name!r}{hint}; registered: {', '.join(names) or 'none'} "
                f"(a module of your own registers more once imported)")

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        self.discover()
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` pairs in registration order."""
        self.discover()
        return list(self._entries.items())

    def __contains__(self, name: object) -> bool:
        self.discover()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self.discover()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {len(self._entries)} registered, packages={list(self.packages)})"


def _same(a: Any, b: Any) -> bool:
    """Whether two entries are the same registration (also across a module re-import: same qualified name)."""
    if a is b or a == b:
        return True
    return _describe(a) == _describe(b) and _describe(a) != repr(a)


def _describe(entry: Any) -> str:
    target = getattr(entry, "target", entry)  # a record holding the registered callable
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(entry)


@dataclasses.dataclass(frozen=True)
class Citation:
    """The paper behind a registered entry, which model cards list (``## Methods``) and tag.

    Attributes:
        text: authors, title and venue (``"Zhang et al., Long-CLIP: ... (ECCV 2024)"``).
        url: a link to the paper, or ``None``.
        tag: the hub tag of the method (default: the registered name).
    """

    text: str
    url: str | None = None
    tag: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"a citation needs the paper's text (authors, title, venue), got {self.text!r}")

    def markdown(self) -> str:
        """``text, url`` (or the text alone)."""
        return self.text + (f", {self.url}" if self.url else "")


@dataclasses.dataclass(frozen=True)
class TermEntry:
    """What :func:`finetune.objectives.register_term` registers in :data:`TERMS`.

    Attributes:
        builder: ``builder(options) -> (term, weights)``.
        options: the options dataclass of ``objective.terms.<name>`` (also in :data:`TERM_OPTIONS`).
        citation: the term's paper (model cards cite it for every run that used the term), or ``None``.
    """

    builder: Callable[[Any], Any]
    options: type
    citation: Citation | None = None

    @property
    def target(self) -> Callable[[Any], Any]:
        """The registered callable (names the entry in messages; the same builder re-imported is the same entry)."""
        return self.builder


#: objective terms: name -> :class:`TermEntry` (builder, options class, citation;
#: :func:`finetune.objectives.register_term`)
TERMS: Registry[TermEntry] = Registry("objective term", ("finetune.objectives",), recipe_key="objective")
#: objective terms: name -> the options dataclass that ``objective.terms.<name>`` is validated against
TERM_OPTIONS: Registry[type] = Registry("objective term", ("finetune.objectives",), recipe_key="objective.terms")
#: scorers for evaluation: name -> a :class:`finetune.evaluation.scorers.Scorer` class or factory
SCORERS: Registry[Any] = Registry("scorer", ("finetune.evaluation.scorers",), recipe_key="eval.scorer")
#: model families: name -> :class:`finetune.models.families.ModelFamily`
MODEL_FAMILIES: Registry[Any] = Registry("model family", ("finetune.models.families",), recipe_key="model.family")
#: named model configs (``random:NAME``, FLAIR / F-CAST / GRM sizes): name -> their registration record
NAMED_CONFIGS: Registry[Any] = Registry("model config", ("finetune.models.families",),
                                        recipe_key="model.name_or_path")
#: modules saved beside a model for inference (GRM's head, TSL's heads): name -> ``nn.Module`` class
INFERENCE_MODULES: Registry[Any] = Registry("inference module", ("finetune.objectives",))
#: data sources: name -> their builder record (:func:`finetune.data.sources.register_source`)
DATA_SOURCES: Registry[Any] = Registry("data source", ("finetune.data",), recipe_key="data.train.name")


def registries() -> dict[str, Registry[Any]]:
    """Every registry of the toolkit by its attribute name (for ``xlipkit recipes`` and the docs)."""
    return {name: value for name, value in globals().items() if isinstance(value, Registry)}


def citation_of(registry: Registry[Any], name: str) -> Citation | None:
    """The :class:`Citation` registered with ``name`` in ``registry`` (an entry's ``citation``), or ``None``
    for an unknown name or an entry without one."""
    if name not in registry:
        return None
    citation = getattr(registry.get(name), "citation", None)
    return citation if isinstance(citation, Citation) else None
