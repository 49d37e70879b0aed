"""Named model configs that build with random weights, offline (DESIGN 4, "registry.py").

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

Other engineers' tests use :func:`build_model` and :func:`save_tiny`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.models.encoder import DualEncoder

TIMM_TINY_SIGLIP = "xlipkit_tiny_vit_siglip"


#: the prefix that builds a registry config with random weights: ``random:clip-vit-base-patch16``
RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class RegistryEntry:
    """One buildable config: its backend, family, a one-line description and the builder.

    ``real``: a real-size architecture (its bare name is refused by ``load_model``: write
    ``random:NAME``); ``pretrained``: what a user typing the bare name probably meant (the pretrained
    checkpoint of the same architecture), named in that refusal."""

    name: str
    backend: str
    family: str
    description: str
    build: Callable[[], DualEncoder]
    real: bool = False
    pretrained: str | None = None


# -- transformers configs ---------------------------------------------------------------------------
def _hf_clip(text: dict[str, Any], vision: dict[str, Any], projection_dim: int, name: str) -> DualEncoder:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from finetune.models.hf import HFDualEncoder
    from finetune.models.offline_tokenizers import clip_tokenizer

    text = {"vocab_size": 49408, "max_position_embeddings": 77, "bos_token_id": 49406, "eos_token_id": 49407,
            "pad_token_id": 49407, "hidden_act": "quick_gelu", **text}
    vision = {"hidden_act": "quick_gelu", **vision}
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)
    size = vision["image_size"]
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return HFDualEncoder(CLIPModel(config).eval(), clip_tokenizer(77), processor, name_or_path=name)


def _word_text(hidden: int, inter: int, layers: int, heads: int, vocab: int | None = None, **extra: Any) -> dict:
    from finetune.models.offline_tokenizers import word_vocab_size

    return {"vocab_size": vocab or word_vocab_size(), "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "max_position_embeddings": 64,
            "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1, "projection_size": hidden, **extra}


def _hf_siglip(text: dict[str, Any], vision: dict[str, Any], name: str, family: str | None = None) -> DualEncoder:
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    from finetune.models.hf import HFDualEncoder
    from finetune.models.offline_tokenizers import word_tokenizer

    config = SiglipConfig(text_config=text, vision_config=vision)
    size = vision["image_size"]
    processor = SiglipImageProcessor(size={"height": size, "width": size})
    return HFDualEncoder(SiglipModel(config).eval(), word_tokenizer(64), processor, name_or_path=name, family=family)


def _tiny_siglip2() -> DualEncoder:
    from transformers import Siglip2Config, Siglip2ImageProcessor, Siglip2Model

    from finetune.models.hf import HFDualEncoder
    from finetune.models.offline_tokenizers import word_tokenizer

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_patches": 16, "patch_size": 8}
    config = Siglip2Config(text_config=_word_text(32, 64, 2, 2), vision_config=vision)
    processor = Siglip2ImageProcessor(patch_size=8, max_num_patches=16)
    return HFDualEncoder(Siglip2Model(config).eval(), word_tokenizer(64), processor, name_or_path="tiny-siglip2")


# -- open_clip configs --------------------------------------------------------------------------------
def register_tiny_timm_siglip() -> None:
    """Register ``xlipkit_tiny_vit_siglip`` in timm: a 2-block, width-32 ViT on 32-pixel images
    with patch 8, no class token and SigLIP's MAP pooling head (``vit_base_patch16_siglip_224`` in
    miniature), so that open_clip SigLIP configs can be built small. Idempotent."""
    import timm
    from timm.models import register_model
    from timm.models.vision_transformer import VisionTransformer

    if timm.is_model(TIMM_TINY_SIGLIP):
        return

    def xlipkit_tiny_vit_siglip(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        if pretrained:
            raise ValueError(f"{TIMM_TINY_SIGLIP} is a test architecture without pretrained weights")
        for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
            kwargs.pop(key, None)
        args = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
                "class_token": False, "global_pool": "map", **kwargs}
        return VisionTransformer(**args)

    xlipkit_tiny_vit_siglip.__module__ = "timm.models.vision_transformer"
    register_model(xlipkit_tiny_vit_siglip)


def _tiny_openclip() -> DualEncoder:
    from open_clip import SimpleTokenizer

    from finetune.models.openclip import build_open_clip

    cfg = {"embed_dim": 32,
           "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
    return build_open_clip(cfg, SimpleTokenizer(context_length=77), name_or_path="tiny-openclip")


def _tiny_openclip_siglip() -> DualEncoder:
    from open_clip.tokenizer import HFTokenizer

    from finetune.models.offline_tokenizers import word_tokenizer, word_vocab_size
    from finetune.models.openclip import build_open_clip

    register_tiny_timm_siglip()
    cfg = {"embed_dim": 32, "init_logit_bias": -10, "custom_text": True,
           "vision_cfg": {"image_size": 32, "timm_model_name": TIMM_TINY_SIGLIP, "timm_model_pretrained": False,
                          "timm_pool": "map", "timm_proj": "none"},
           "text_cfg": {"context_length": 64, "vocab_size": word_vocab_size(), "hf_tokenizer_name": "xlipkit/tiny-word",
                        "tokenizer_kwargs": {"clean": "canonicalize"}, "width": 32, "heads": 2, "layers": 2,
                        "no_causal_mask": True, "proj_bias": True, "pool_type": "last", "norm_kwargs": {"eps": 1e-6}}}
    with tempfile.TemporaryDirectory() as tmp:
        word_tokenizer(64).save_pretrained(tmp)
        tokenizer = HFTokenizer(tmp, context_length=64, clean="canonicalize")
    pp = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "resize_mode": "squash", "interpolation": "bicubic"}
    return build_open_clip(cfg, tokenizer, name_or_path="tiny-openclip-siglip", preprocess_cfg=pp)


def _flair(config: str, name: str, pool_heads: int = 8) -> DualEncoder:
    from finetune.models import flair

    return flair.build_flair(getattr(flair, config)(), pool_heads=pool_heads, name_or_path=name)


def _tiny_vision_text(vision_type: str) -> DualEncoder:
    from finetune.models.vision_text import build_tiny

    return build_tiny(vision_type)


# -- the table ----------------------------------------------------------------------------------------
def _entries() -> list[RegistryEntry]:
    tiny_v = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    tiny_t = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    small_v = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
               "image_size": 64, "patch_size": 8}
    small_t = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4}
    b16_v = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
             "image_size": 224, "patch_size": 16}
    b_t = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 8}
    l14_v = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
             "image_size": 224, "patch_size": 14}
    l_t = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
    sig_v = {**b16_v, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
    return [
        RegistryEntry("tiny-clip", "hf", "clip", "transformers CLIP, 2 layers, width 32, 32 px, real CLIP tokenizer",
                      lambda: _hf_clip(tiny_t, tiny_v, 32, "tiny-clip")),
        RegistryEntry("tiny-siglip", "hf", "siglip", "transformers SigLIP, 2 layers, width 32, 32 px",
                      lambda: _hf_siglip(_word_text(32, 64, 2, 2), tiny_v, "tiny-siglip")),
        RegistryEntry("tiny-siglip2", "hf", "siglip2", "transformers SigLIP2 NaFlex, 2 layers, width 32, 16 patches",
                      _tiny_siglip2),
        RegistryEntry("tiny-openclip", "open_clip", "clip", "open_clip CLIP, 2 layers, width 32, 32 px",
                      _tiny_openclip),
        RegistryEntry("tiny-openclip-siglip", "open_clip", "siglip",
                      "open_clip SigLIP layout (timm MAP-head ViT), 2 layers, width 32, 32 px", _tiny_openclip_siglip),
        RegistryEntry("small-clip", "hf", "clip", "the quickstart CLIP: 4 layers, width 128, 64 px, patch 8",
                      lambda: _hf_clip(small_t, small_v, 128, "small-clip")),
        RegistryEntry("clip-vit-base-patch16", "hf", "clip", "CLIP ViT-B/16 architecture, random weights",
                      lambda: _hf_clip(b_t, b16_v, 512, "clip-vit-base-patch16"),
                      real=True, pretrained="openai/clip-vit-base-patch16"),
        RegistryEntry("clip-vit-large-patch14", "hf", "clip", "CLIP ViT-L/14 architecture, random weights",
                      lambda: _hf_clip(l_t, l14_v, 768, "clip-vit-large-patch14"),
                      real=True, pretrained="openai/clip-vit-large-patch14"),
        RegistryEntry("siglip2-base-patch16-224", "hf", "siglip2",
                      "SigLIP2 B/16 fixed-resolution architecture, random weights",
                      lambda: _hf_siglip(_word_text(768, 3072, 12, 12, vocab=256000, layer_norm_eps=1e-6,
                                                    hidden_act="gelu_pytorch_tanh"),
                                         sig_v, "siglip2-base-patch16-224", family="siglip2"),
                      real=True, pretrained="google/siglip2-base-patch16-224"),
        RegistryEntry("tiny-flair", "flair", "clip", "FLAIR (open_clip ViT + attention pool), 2 layers, width 64, 32 px",
                      lambda: _flair("tiny_flair_config", "tiny-flair")),
        RegistryEntry("small-flair", "flair", "clip", "FLAIR for the CPU recipe: 2 layers, width 64, 64 px, patch 8",
                      lambda: _flair("small_flair_config", "small-flair")),
        RegistryEntry("flair-vit-b-16", "flair", "clip", "FLAIR ViT-B/16 (paper), random weights",
                      lambda: _flair("flair_vit_b16_config", "flair-vit-b-16"),
                      real=True, pretrained="xiaorui638/flair/flair-cc3m-recap.pt (model.family: flair)"),
        RegistryEntry("tiny-vision-text-vit", "vision_text", "clip",
                      "transformers VisionTextDualEncoder: ViT (2 layers, width 32, 32 px, patch 8) + BERT (2 layers, "
                      "width 32), projections to 16", lambda: _tiny_vision_text("vit")),
        RegistryEntry("tiny-vision-text-swin", "vision_text", "clip",
                      "transformers VisionTextDualEncoder: Swin (2 stages, 32 px, patch 2) + BERT (2 layers, width "
                      "32), projections to 16", lambda: _tiny_vision_text("swin")),
    ]


REGISTRY: dict[str, RegistryEntry] = {e.name: e for e in _entries()}
ALIASES: dict[str, str] = {
    "vit-b/16": "clip-vit-base-patch16",
    "vit-l/14": "clip-vit-large-patch14",
    "siglip2-b/16": "siglip2-base-patch16-224",
}
#: the test configs, one per backend and family
TINY_NAMES: tuple[str, ...] = ("tiny-clip", "tiny-siglip", "tiny-siglip2", "tiny-openclip", "tiny-openclip-siglip")


#: random-weights configs that a model family's own loader builds (not in :data:`REGISTRY`):
#: ``{family: {name: real}}`` (``finetune.models.fcast.FCAST_CONFIGS``, checked by the tests)
FAMILY_CONFIGS: dict[str, dict[str, bool]] = {"fcast": {"fcast-b": True, "fcast-s": True, "fcast-tiny": False}}


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
    ``family`` (``"auto"``: any), or None: :data:`REGISTRY` entries whose backend fits, and the
    :data:`FAMILY_CONFIGS` of ``family``."""
    name = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    key = resolve_name(name)
    if key is not None and family in ("auto", REGISTRY[key].backend):
        entry = REGISTRY[key]
        return RandomConfig(key, entry.backend, entry.real, entry.pretrained)
    bare = name.strip()
    for fam, names in FAMILY_CONFIGS.items():
        if family in ("auto", fam) and bare in names:
            return RandomConfig(bare, fam, names[bare])
    return None


def registry_names() -> list[str]:
    """Every name :func:`build_model` accepts (aliases included)."""
    return sorted(REGISTRY) + sorted(ALIASES)


def resolve_name(name: str) -> str | None:
    """The registry name for ``name`` (case-insensitive, aliases resolved), or None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in REGISTRY else None


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
        model = REGISTRY[key].build()
    model.name_or_path = RANDOM_PREFIX + key  # what it records (xlipkit.json's base_model) says how it was built
    return model


def save_tiny(name: str, folder: str | os.PathLike, *, seed: int = 0) -> Path:
    """Build registry model ``name`` and save it with ``save_pretrained`` into ``folder`` (the
    backend's native format, as a hub checkpoint would be); return the folder path, which
    ``finetune.load_model`` loads like a hub id."""
    model = build_model(name, seed=seed)
    model.save_pretrained(str(folder))
    return Path(folder)

