"""The ``hf`` model family: transformers ``CLIPModel`` / ``SiglipModel`` / ``Siglip2Model``
(:mod:`finetune.models.backends.hf`), and its named configs with random weights (the test configs
``tiny-clip``, ``tiny-siglip``, ``tiny-siglip2``, the quickstart's ``small-clip``, and the real
architectures ``clip-vit-base-patch16``, ``clip-vit-large-patch14``, ``siglip2-base-patch16-224``;
see :mod:`finetune.models.registry`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.models.core.encoder import DualEncoder
from finetune.models.families import register_model_family
from finetune.models.registry import register_named_config


def _load_hf(name_or_path: str, *, dtype: Any = None, trust_remote_code: bool = False,
             revision: str | None = None) -> DualEncoder:
    from finetune.models.backends.hf import load_hf

    return load_hf(str(name_or_path), dtype=dtype, trust_remote_code=trust_remote_code, revision=revision)


def _save_native(model: DualEncoder, folder: str) -> None:
    model.save_pretrained(str(folder))


register_model_family("hf", _load_hf, _save_native, detect=lambda p: (Path(p) / "config.json").is_file(),
                      files="config.json (transformers)")


# -- named configs ----------------------------------------------------------------------------------
def _hf_clip(text: dict[str, Any], vision: dict[str, Any], projection_dim: int, name: str) -> DualEncoder:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from finetune.models.backends.hf import HFDualEncoder
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

    from finetune.models.backends.hf import HFDualEncoder
    from finetune.models.offline_tokenizers import word_tokenizer

    config = SiglipConfig(text_config=text, vision_config=vision)
    size = vision["image_size"]
    processor = SiglipImageProcessor(size={"height": size, "width": size})
    return HFDualEncoder(SiglipModel(config).eval(), word_tokenizer(64), processor, name_or_path=name, family=family)


def _tiny_siglip2() -> DualEncoder:
    from transformers import Siglip2Config, Siglip2ImageProcessor, Siglip2Model

    from finetune.models.backends.hf import HFDualEncoder
    from finetune.models.offline_tokenizers import word_tokenizer

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_patches": 16, "patch_size": 8}
    config = Siglip2Config(text_config=_word_text(32, 64, 2, 2), vision_config=vision)
    processor = Siglip2ImageProcessor(patch_size=8, max_num_patches=16)
    return HFDualEncoder(Siglip2Model(config).eval(), word_tokenizer(64), processor, name_or_path="tiny-siglip2")


_TINY_V = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "image_size": 32, "patch_size": 8}
_TINY_T = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
_SMALL_V = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
            "image_size": 64, "patch_size": 8}
_SMALL_T = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4}
_B16_V = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "image_size": 224, "patch_size": 16}
_B_T = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 8}
_L14_V = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
          "image_size": 224, "patch_size": 14}
_L_T = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
_SIG_V = {**_B16_V, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}

register_named_config("tiny-clip", "hf", "clip", "transformers CLIP, 2 layers, width 32, 32 px, real CLIP tokenizer",
                      lambda: _hf_clip(_TINY_T, _TINY_V, 32, "tiny-clip"))
register_named_config("tiny-siglip", "hf", "siglip", "transformers SigLIP, 2 layers, width 32, 32 px",
                      lambda: _hf_siglip(_word_text(32, 64, 2, 2), _TINY_V, "tiny-siglip"))
register_named_config("tiny-siglip2", "hf", "siglip2", "transformers SigLIP2 NaFlex, 2 layers, width 32, 16 patches",
                      _tiny_siglip2)
register_named_config("small-clip", "hf", "clip", "the quickstart CLIP: 4 layers, width 128, 64 px, patch 8",
                      lambda: _hf_clip(_SMALL_T, _SMALL_V, 128, "small-clip"))
register_named_config("clip-vit-base-patch16", "hf", "clip", "CLIP ViT-B/16 architecture, random weights",
                      lambda: _hf_clip(_B_T, _B16_V, 512, "clip-vit-base-patch16"),
                      real=True, pretrained="openai/clip-vit-base-patch16", aliases=("vit-b/16",))
register_named_config("clip-vit-large-patch14", "hf", "clip", "CLIP ViT-L/14 architecture, random weights",
                      lambda: _hf_clip(_L_T, _L14_V, 768, "clip-vit-large-patch14"),
                      real=True, pretrained="openai/clip-vit-large-patch14", aliases=("vit-l/14",))
register_named_config("siglip2-base-patch16-224", "hf", "siglip2",
                      "SigLIP2 B/16 fixed-resolution architecture, random weights",
                      lambda: _hf_siglip(_word_text(768, 3072, 12, 12, vocab=256000, layer_norm_eps=1e-6,
                                                    hidden_act="gelu_pytorch_tanh"),
                                         _SIG_V, "siglip2-base-patch16-224", family="siglip2"),
                      real=True, pretrained="google/siglip2-base-patch16-224", aliases=("siglip2-b/16",))
