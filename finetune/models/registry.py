"""Named model configs that build with random weights, offline (DESIGN 2 and 4).

``load_model("random:NAME")`` builds one: the ``random:`` prefix says in the name itself that the
weights are random, wherever a name goes (``load_model``, a recipe's ``model.name_or_path``, the CLIs,
``xlipkit.json``). Without the prefix, the real-size architectures (``clip-vit-base-patch16`` ...) are
refused, because their names are those of pretrained hub checkpoints without the organisation
(``openai/clip-vit-base-patch16``): whoever drops the ``openai/`` means the pretrained model, and would
fine-tune noise. The small test and demo configs (``tiny-*``, ``small-*``) still build from the bare
name, with a warning.

Test configs (a few layers, small widths, 32-pixel images):

- ``tiny-clip``: transformers ``CLIPModel`` with the real CLIP tokenizer (built offline).
- ``tiny-siglip``: transformers ``SiglipModel`` with a small offline WordPiece tokenizer.
- ``tiny-siglip2``: transformers ``Siglip2Model`` (NaFlex, at most 16 patches of 8 pixels).
- ``tiny-openclip``: open_clip ``CLIP`` with open_clip's ``SimpleTokenizer``.
- ``tiny-openclip-siglip``: open_clip ``CustomTextCLIP`` in the SigLIP layout (timm ViT image tower
  with a MAP head, bidirectional text tower pooling the last token, logit bias).

``small-clip`` is the quickstart model of DESIGN 7 (CLIP, 4 layers, width 128 in both towers,
64-pixel images, patch 8, real CLIP tokenizer). Real architectures with random weights:
``clip-vit-base-patch16`` (alias ``ViT-B/16``), ``clip-vit-large-patch14`` (``ViT-L/14``) and
``siglip2-base-patch16-224`` (the fixed-resolution SigLIP2 B/16 layout; its Gemma tokenizer is not
shipped with any package, so it carries the small WordPiece tokenizer: ids fit its 256k vocabulary).

Each config is registered by its family's module in :mod:`finetune.models.families` (beside the
family's builder, with :func:`register_named_config`) into :data:`finetune.plugins.NAMED_CONFIGS`; this
module holds the lookup (:func:`build_model`, :func:`resolve_name`, :func:`random_config`) and imports
no family: the registry's discovery rule imports them on the first lookup. Other engineers' tests use
:func:`build_model` and :func:`save_tiny`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.models.core.encoder import DualEncoder
from finetune.plugins import NAMED_CONFIGS

#: the prefix that builds a registry config with random weights: ``random:clip-vit-base-patch16``
RANDOM_PREFIX = "random:"

#: the test configs, one per backend and family
TINY_NAMES: tuple[str, ...] = ("tiny-clip", "tiny-siglip", "tiny-siglip2", "tiny-openclip", "tiny-openclip-siglip")


@dataclass(frozen=True)
class RegistryEntry:
    """One named config: its model family (``backend``), its kind (``family``: clip / siglip / siglip2),
    a one-line description and the builder.

    ``build``: builds the model with random weights, or None for a config that its family's own loader
    builds from the name (``fcast-b``: ``load_model("random:fcast-b")`` calls the ``fcast`` loader).
    ``real``: a real-size architecture (its bare name is refused by ``load_model``: write
    ``random:NAME``); ``pretrained``: what a user typing the bare name probably meant (the pretrained
    checkpoint of the same architecture), named in that refusal. ``aliases``: other spellings
    (lower case, ``vit-b/16``)."""

    name: str
    backend: str
    family: str
    description: str
    build: Callable[[], DualEncoder] | None
    real: bool = False
    pretrained: str | None = None
    aliases: tuple[str, ...] = ()


def register_named_config(
    name: str,
    backend: str,
    family: str,
    description: str,
    build: Callable[[], DualEncoder] | None,
    *,
    real: bool = False,
    pretrained: str | None = None,
    aliases: tuple[str, ...] = (),
) -> RegistryEntry:
    """Register a named random-weights config of the model family ``backend`` (the fields of
    :class:`RegistryEntry`) in :data:`finetune.plugins.NAMED_CONFIGS`; a family's module calls it
    beside its builder.

    Raises:
        ValueError: ``name`` is already registered for another config.
    """
    entry = RegistryEntry(name, backend, family, description, build, real, pretrained,
                          tuple(a.lower() for a in aliases))
    return NAMED_CONFIGS.add(name, entry)


def _all() -> dict[str, RegistryEntry]:
    return dict(NAMED_CONFIGS.items())


def _alias_table() -> dict[str, str]:
    return {alias: e.name for _, e in NAMED_CONFIGS.items() for alias in e.aliases}


def named_config(name: str) -> RegistryEntry | None:
    """The registered config ``name`` (``random:`` stripped, case-insensitive, aliases resolved), or None."""
    key = resolve_name(name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name)
    return _all()[key] if key is not None else None


@dataclass(frozen=True)
class RandomConfig:
    """What a registry name (without ``random:``) builds: its canonical ``name``, the model ``family``
    that builds it, whether it is a real-size architecture, and the pretrained model a user typing
    it probably meant."""

    name: str
    family: str
    real: bool
    pretrained: str | None = None


def random_config(name: str, family: str = "auto") -> RandomConfig | None:
    """The random-weights config ``name`` names (``random:`` stripped; aliases resolved) for the model
    ``family`` (``"auto"``: any), or None: the registered configs whose family (``backend``) fits;
    configs built by their family's loader (``fcast-b``) match their exact name."""
    name = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    entries = _all()
    key = resolve_name(name)
    if key is not None and family in ("auto", entries[key].backend):
        entry = entries[key]
        return RandomConfig(key, entry.backend, entry.real, entry.pretrained)
    entry = entries.get(name.strip())
    if entry is not None and entry.build is None and family in ("auto", entry.backend):
        return RandomConfig(entry.name, entry.backend, entry.real, entry.pretrained)
    return None


def registry_names() -> list[str]:
    """Every name :func:`build_model` accepts (aliases included)."""
    return sorted(n for n, e in _all().items() if e.build is not None) + sorted(_alias_table())


def resolve_name(name: str) -> str | None:
    """The registry name for ``name`` (case-insensitive, aliases resolved) of a config that
    :func:`build_model` builds, or None."""
    key = name.strip().lower()
    entries = _all()
    key = _alias_table().get(key, key)
    return key if key in entries and entries[key].build is not None else None


def build_model(name: str, *, seed: int = 0) -> DualEncoder:
    """Build a registry model with random weights drawn from ``seed`` (the global RNG is left
    untouched). ``name`` may carry the ``random:`` prefix; the model's ``name_or_path`` is
    ``random:<name>``, so that what it records loads back through ``load_model``.

    Raises:
        ValueError: for a name that is not in the registry (the message lists the names).
    """
    key = resolve_name(name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name)
    if key is None:
        raise ValueError(f"{name!r} is not a registry model; registry names: {', '.join(registry_names())}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _all()[key].build()
    model.name_or_path = RANDOM_PREFIX + key  # what it records (xlipkit.json's base_model) says how it was built
    return model


def save_tiny(name: str, folder: str | os.PathLike, *, seed: int = 0) -> Path:
    """Build registry model ``name`` and save it with ``save_pretrained`` into ``folder`` (the
    backend's native format, as a hub checkpoint would be); return the folder path, which
    ``finetune.load_model`` loads like a hub id."""
    model = build_model(name, seed=seed)
    model.save_pretrained(str(folder))
    return Path(folder)
