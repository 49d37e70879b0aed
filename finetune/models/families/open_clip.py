"""The ``open_clip`` model family: open_clip models (:mod:`finetune.models.backends.openclip`;
architecture names such as ``ViT-B-16:openai``, ``hf-hub:org/repo``, open_clip folders), and its
named test configs with random weights ``tiny-openclip`` and ``tiny-openclip-siglip`` (see
:mod:`finetune.models.registry`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from finetune.models.core.encoder import DualEncoder
from finetune.models.families import register_model_family
from finetune.models.registry import register_named_config


def _load_open_clip(name_or_path: str, *, dtype: Any = None, trust_remote_code: bool = False,
                    revision: str | None = None) -> DualEncoder:
    from finetune.models.backends.openclip import load_open_clip

    return load_open_clip(str(name_or_path), dtype=dtype, revision=revision)


def _save_native(model: DualEncoder, folder: str) -> None:
    model.save_pretrained(str(folder))


register_model_family("open_clip", _load_open_clip, _save_native,
                      detect=lambda p: (Path(p) / "open_clip_config.json").is_file(),
                      files="open_clip_config.json (open_clip)")


# -- named configs ----------------------------------------------------------------------------------
def _tiny_openclip() -> DualEncoder:
    from open_clip import SimpleTokenizer

    from finetune.models.backends.openclip import build_open_clip

    cfg = {"embed_dim": 32,
           "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
    return build_open_clip(cfg, SimpleTokenizer(context_length=77), name_or_path="tiny-openclip")


def _tiny_openclip_siglip() -> DualEncoder:
    from open_clip.tokenizer import HFTokenizer

    from finetune.models.backends.openclip import TIMM_TINY_SIGLIP, build_open_clip, register_tiny_timm_siglip
    from finetune.models.offline_tokenizers import word_tokenizer, word_vocab_size

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


register_named_config("tiny-openclip", "open_clip", "clip", "open_clip CLIP, 2 layers, width 32, 32 px", _tiny_openclip)
register_named_config("tiny-openclip-siglip", "open_clip", "siglip",
                      "open_clip SigLIP layout (timm MAP-head ViT), 2 layers, width 32, 32 px", _tiny_openclip_siglip)
