"""Model families (DESIGN 2 and 4, "Seams"): who loads, saves and recognises a kind of model.

A model family is a name plus three functions:

- ``loader(name_or_path, *, dtype=None, trust_remote_code=False, revision=None) -> DualEncoder``
  loads a folder (or a name / hub id the family understands);
- ``saver(model, folder)`` writes the model into an existing, empty ``folder`` in the family's own
  format (what ``loader`` reads back);
- ``detect(folder) -> bool`` says whether a folder is in the family's format (optional; a family
  without one is found through ``xlipkit.json`` or by naming it).

Each module of this package is one family: its builder, its :func:`register_model_family` call and
its named configs (:func:`finetune.models.registry.register_named_config`) side by side: ``hf``
(transformers ``CLIPModel`` / ``SiglipModel`` / ``Siglip2Model``), ``open_clip``, ``vision_text``
(GRM's ViT / Swin + BERT), ``flair`` and ``fcast``. They land in
:data:`finetune.plugins.MODEL_FAMILIES` and are found by its discovery rule (the first lookup imports
every module of this package), so this ``__init__`` imports none of them. A user's family registers
the same way from its own module. :func:`finetune.load_model` with ``family="auto"`` finds a
folder's family from the family recorded in its ``xlipkit.json`` first, then from the registered
``detect`` functions (the most recently registered first, so a specific family wins over a generic
one; the generic ``hf`` and ``open_clip`` formats are tried last). A model records the name of the
family that loaded it in ``DualEncoder.backend``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.models.core.encoder import DualEncoder
from finetune.plugins import MODEL_FAMILIES

__all__ = ["ModelFamily", "detect_family", "get_model_family", "model_family_names", "recipe_family",
           "register_model_family", "resolve_family_setting", "unregister_model_family"]

INFO_NAME = "xlipkit.json"

Loader = Callable[..., DualEncoder]
Saver = Callable[[DualEncoder, str], None]
Detector = Callable[[Path], bool]


@dataclass(frozen=True)
class ModelFamily:
    """A registered model family (see the module docstring).

    Attributes:
        name: the family's name, recorded in ``DualEncoder.backend`` and ``xlipkit.json``.
        loader: ``loader(name_or_path, *, dtype, trust_remote_code, revision) -> DualEncoder``.
        saver: ``saver(model, folder)``: writes ``model`` into the existing folder ``folder``.
        detect: ``detect(folder) -> bool``, or None.
        files: what a folder of this family holds, for error messages (``"config.json
            (transformers)"``).
        options: the dataclass a recipe's ``model.options`` is validated against for this family, or None
            for a family that takes no options.
    """

    name: str
    loader: Loader
    saver: Saver
    detect: Detector | None = None
    files: str = ""
    options: type | None = None


#: the families tried last by ``detect_family``: their formats (a transformers ``config.json``) are
#: also found in other families' folders (``vision_text`` saves a ``config.json`` too)
_GENERIC = ("hf", "open_clip")


def register_model_family(
    name: str,
    loader: Loader,
    saver: Saver,
    *,
    detect: Detector | None = None,
    files: str = "",
    options: type | None = None,
) -> ModelFamily:
    """Register a model family so that :func:`finetune.load_model` can load, and
    ``save_finetuned`` save, its models (an entry of :data:`finetune.plugins.MODEL_FAMILIES`; the
    built-in families are discovered first, so that a name they hold is refused here).

    Args:
        name: a new family name (``"flair"``); models loaded by ``loader`` get
            ``model.backend = name``.
        loader: ``loader(name_or_path, *, dtype=None, trust_remote_code=False, revision=None)``
            returning a :class:`DualEncoder`; it must accept those keywords.
        saver: ``saver(model, folder)`` writing ``model`` into the existing folder ``folder`` so
            that ``loader(folder)`` rebuilds it.
        detect: ``detect(folder) -> bool``: whether ``folder`` holds a model of this family, for
            ``family="auto"``.
        files: a short description of the family's folder (``"toy_config.json"``), used in errors.
        options: the dataclass of the family's ``model.options`` (its loader gets the fields that are set as
            keywords), or None.

    Returns:
        the :class:`ModelFamily`.

    Raises:
        ValueError: ``name`` is empty, ``"auto"`` or already registered.
        TypeError: ``loader``, ``saver`` or ``detect`` is not callable.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"model family name {name!r} must be a non-empty string other than 'auto'")
    if name in MODEL_FAMILIES:  # the built-in families are discovered first, so a clash is found here
        raise ValueError(f"model family {name!r} is already registered (registered: {_names_text()}); "
                         f"choose another name")
    for what, fn in (("loader", loader), ("saver", saver), ("detect", detect)):
        if fn is not None and not callable(fn):
            raise TypeError(f"register_model_family({name!r}): {what} must be callable, got {type(fn).__name__}")
    family = ModelFamily(name, loader, saver, detect, files or f"a {name} model folder", options)
    MODEL_FAMILIES.add(name, family)
    return family


def unregister_model_family(name: str) -> None:
    """Remove a registered family (tests, plugins that reload); ``KeyError`` naming the registered
    ones when it is not registered."""
    if name not in MODEL_FAMILIES:
        raise KeyError(f"model family {name!r} is not registered (registered: {_names_text()})")
    MODEL_FAMILIES.remove(name)


def model_family_names() -> list[str]:
    """Names of the registered model families: the generic ``hf`` and ``open_clip`` first, then the
    others in registration order (the built-in ones, discovered in module order, before a user's)."""
    return [family.name for family in _ordered()]


def _ordered() -> list[ModelFamily]:
    families = [family for _, family in MODEL_FAMILIES.items()]
    return sorted(families, key=lambda f: f.name not in _GENERIC)  # stable


def _names_text() -> str:
    return ", ".join(repr(n) for n in model_family_names()) or "none"


def get_model_family(name: str, *, key: str = "family") -> ModelFamily:
    """The registered family ``name``.

    Args:
        name: a registered family name.
        key: how the caller calls the setting, for the message (``"family"``, ``"backend"``,
            ``"recipe.model.family"``).

    Raises:
        ValueError: ``name`` is not registered; the message lists the registered families.
    """
    if name not in MODEL_FAMILIES:
        raise ValueError(f"{key} {name!r} is not a registered model family; registered: {_names_text()} "
                         f"(or 'auto'). A family registered by a plugin needs its module imported first "
                         f"(finetune.models.register_model_family)")
    return MODEL_FAMILIES.get(name)


def recorded_family(folder: str | Path) -> str | None:
    """The family recorded in ``folder/xlipkit.json`` (``model_family``, or ``backend`` in folders
    written before families existed), or None when there is no readable record."""
    path = Path(folder) / INFO_NAME
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return None
    if not isinstance(info, dict):
        return None
    name = info.get("model_family") or info.get("backend")
    return name if isinstance(name, str) and name else None


def detect_family(folder: str | Path) -> str | None:
    """The name of the family that ``folder`` belongs to, or None.

    ``xlipkit.json``'s recorded family first (when it is registered), then the registered
    ``detect`` functions, the most recently registered first.

    Raises:
        ValueError: ``xlipkit.json`` records a family that is not registered (the message says to
            import the module that registers it).
    """
    folder = Path(folder)
    recorded = recorded_family(folder)
    if recorded is not None:
        if recorded not in MODEL_FAMILIES:
            raise ValueError(f"{folder / INFO_NAME} records model family {recorded!r}, which is not registered "
                             f"(registered: {_names_text()}): import the module that registers it "
                             f"(register_model_family) before loading")
        return recorded
    for family in reversed(_ordered()):  # the most recently registered first, the generic formats last
        if family.detect is not None and family.detect(folder):
            return family.name
    return None


def resolve_family_setting(
    family: str | None = "auto", backend: str | None = "auto", *, keys: tuple[str, str] = ("family", "backend")
) -> tuple[str, str]:
    """The family a caller asked for, from ``family`` and its deprecated alias ``backend``.

    ``backend`` counts only while ``family`` is ``"auto"``; both non-auto and different is an error.

    Args:
        family, backend: the two settings (``"auto"`` or a family name).
        keys: what the caller calls them, for messages (``("model.family", "model.backend")`` for a
            recipe).

    Returns:
        ``(name, key)``: the family name (``"auto"`` or a registered one) and which setting named
        it, for messages.

    Raises:
        ValueError: an unregistered name (the message lists the registered ones), or ``family`` and
            ``backend`` naming different families.
    """
    family = family or "auto"
    backend = backend or "auto"
    if family != "auto" and backend not in ("auto", family):
        raise ValueError(f"{keys[0]}={family!r} and its deprecated alias {keys[1]}={backend!r} disagree: set "
                         f"{keys[0]} only")
    name, key = (family, keys[0]) if family != "auto" else (backend, keys[1])
    if name != "auto":
        get_model_family(name, key=key)
    return name, key


def recipe_family(model_cfg: Any) -> str:
    """The model family a recipe's ``model`` section names: ``model.family``, or the deprecated
    ``model.backend`` while ``family`` is ``auto`` (a warning says so).

    Raises:
        ValueError: naming the recipe key, for an unregistered family or two that disagree.
    """
    import warnings

    family = getattr(model_cfg, "family", "auto")
    backend = getattr(model_cfg, "backend", "auto")
    if backend not in (None, "auto"):
        warnings.warn(f"recipe key model.backend is deprecated: use model.family: {backend}", DeprecationWarning,
                      stacklevel=2)
    return resolve_family_setting(family, backend, keys=("recipe key model.family", "recipe key model.backend"))[0]


def model_family_options(model_cfg: Any) -> dict[str, Any]:
    """The loader keywords a recipe's ``model`` section gives its family beyond the name: ``vision``,
    ``text`` and ``projection_dim`` (family ``vision_text``), those that are set."""
    keys = ("vision", "text", "projection_dim")
    return {k: getattr(model_cfg, k) for k in keys if getattr(model_cfg, k, None) is not None}
