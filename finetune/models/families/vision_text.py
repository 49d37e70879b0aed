"""Model family ``vision_text``: transformers ``VisionTextDualEncoderModel`` behind :class:`DualEncoder`.

GRM's backbone (GRM, "Dual-encoder Feature Extraction" and Appendix "Implementation Details"): an
ImageNet-pretrained ViT-B/16 or Swin-B image tower and a BERT-base text tower, each with a linear
projection (no bias) to the joint dimension d = 512. A recipe builds one from its two towers::

    model:
      family: vision_text
      options: {vision: google/vit-base-patch16-224-in21k, text: bert-base-uncased, projection_dim: 512}

(the projections and the logit scale are new, randomly initialised, as
``VisionTextDualEncoderModel.from_vision_text_pretrained`` makes them), and a saved folder (the
``save_pretrained`` output: ``config.json`` with ``model_type: vision-text-dual-encoder``, the
tokenizer and the image processor) loads back with ``model: {name_or_path: <folder>}``.

What the towers return (transformers ``modeling_vision_text_dual_encoder.py``, ``modeling_vit.py``,
``modeling_swin.py``, ``modeling_bert.py``):

- ``embeds`` are the model's own: the tower's ``pooler_output`` through ``visual_projection`` /
  ``text_projection`` (ViT and BERT pool the [CLS] state with a dense layer and tanh, Swin averages
  its layer-normed tokens), so no single token's projection reproduces them: ``pooled_state`` is
  ``None``, as for SigLIP's attention-pooled towers.
- image ``states`` ``(B, N, W)``: the last encoder layer's patch states before the tower's final
  ``layernorm``, [CLS] removed (ViT: 14 x 14 = 196 for ViT-B/16 at 224 px; Swin: the last stage's
  7 x 7 = 49 windows at 224 px); ``project_image_states`` is ``layernorm`` then ``visual_projection``
  (LAPS's ``Linear(768, 512)`` over the ViT's output tokens).
- text ``states`` ``(B, L, W)``: BERT's last hidden states (BERT has no final norm after its last
  layer's own), [CLS] and [SEP] included, as LAPS keeps them; ``project_text_states`` is
  ``text_projection``.

Tiny test configs (random weights, real config classes): registry names ``tiny-vision-text-vit`` and
``tiny-vision-text-swin``, and :func:`save_tiny_towers` writes a tiny ViT, Swin and BERT (with a real
``BertTokenizerFast``) with ``save_pretrained``, to be loaded back like hub ids.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from finetune.files import atomic_dir
from finetune.models.core.encoder import DualEncoder, ImageFeatures, TextFeatures, TokenizedText
from finetune.models.core.encoder import first_state_rows as _first_rows
from finetune.models.families import register_model_family
from finetune.models.registry import build_model, named_config, register_named_config
from finetune.models.core.spans import spans_by_offsets, spans_by_pieces
from finetune.models.weight_files import quiet_shard_bar
from finetune.models.core.tokens import hf_tokenize

__all__ = ["VisionTextDualEncoder", "VisionTextOptions", "load_vision_text", "from_towers", "save_tiny_towers",
           "MODEL_TYPE", "VISION_TYPES"]

#: ``config.model_type`` of a ``VisionTextDualEncoderModel`` folder
MODEL_TYPE = "vision-text-dual-encoder"
#: image towers this family knows how to read states from
VISION_TYPES = ("vit", "swin")
#: ImageNet normalisation (LAPS's transforms; the default image processor of towers saved without one)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# module names of transformers 5 (q_proj ... / mlp.fc1) and 4 (attention.self.query ... / intermediate.dense)
_ATTN = r"\.attention\.(?:(?:attention|self)\.(?:query|key|value)|output\.dense|q_proj|k_proj|v_proj|o_proj)"
_MLP = r"(?:\.intermediate\.dense|\.output\.dense|\.mlp\.fc1|\.mlp\.fc2)"


class VisionTextDualEncoder(DualEncoder):
    """A transformers ``VisionTextDualEncoderModel`` (ViT or Swin + BERT) as a :class:`DualEncoder`.

    Args:
        model: the ``VisionTextDualEncoderModel``.
        tokenizer: the text tower's tokenizer (a fast BERT tokenizer for ``sentence_spans`` by offsets).
        image_processor: the image tower's image processor.
        name_or_path: where it came from.
    """

    backend = "vision_text"
    family = "clip"
    supports_states = True

    def __init__(self, model: nn.Module, tokenizer: Any, image_processor: Any, *, name_or_path: str) -> None:
        super().__init__(model)
        cfg = model.config
        vtype = cfg.vision_config.model_type
        if vtype not in VISION_TYPES:
            raise ValueError(f"{name_or_path!r}: vision tower of model_type {vtype!r} is not supported by the "
                             f"vision_text family; supported: {', '.join(VISION_TYPES)}")
        self.vision_type = vtype
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.name_or_path = str(name_or_path)
        v = cfg.vision_config
        size = v.image_size if isinstance(v.image_size, int) else v.image_size[0]
        patch = v.patch_size if isinstance(v.patch_size, int) else v.patch_size[0]
        self.image_size = int(size)
        # Swin halves the grid at every stage after the first: its last-stage tokens cover 2**(S-1) patches
        self.patch_size = int(patch) * (2 ** (len(v.depths) - 1) if vtype == "swin" else 1)
        n = int(cfg.text_config.max_position_embeddings)
        limit = getattr(tokenizer, "model_max_length", n)
        n = min(n, int(limit)) if isinstance(limit, int) and limit > 0 else n
        saved = getattr(cfg, "xlipkit", None) or {}
        self.base_text_len = int(saved.get("base_text_len", n))
        self.max_text_len = n
        self.tokenizer.model_max_length = n

    # -- text -------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str], *, max_length: int | None = None) -> TokenizedText:
        """Tokenise with BERT's tokenizer ([CLS] ... [SEP]), [SEP] kept on truncation, padded to the
        longest caption (the attention mask hides padding)."""
        length = max_length or self.max_text_len
        if length > self.max_text_len:
            raise ValueError(f"max_length={length} exceeds the model's {self.max_text_len} text positions")
        tok = hf_tokenize(self.tokenizer, texts, length, padding="longest")
        self._count_truncation(tok.truncated)
        return tok

    def sentence_spans(self, captions: list[str]) -> list[list[tuple[int, int] | None]]:
        """Each sentence's token range in ``tokenize(captions)`` (see :meth:`DualEncoder.sentence_spans`),
        from the fast tokenizer's ``offset_mapping`` ([CLS] at 0, so a caption's first word is at 1)."""
        if isinstance(captions, str):
            raise TypeError("captions must be a list of strings, not one string: wrap it as [caption]")
        if getattr(self.tokenizer, "is_fast", False):
            return spans_by_offsets(self, self.tokenizer, list(captions))
        return spans_by_pieces(self, list(captions))

    def encode_text(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, states: bool = False
    ) -> TextFeatures:
        """Encode ``(B, L)`` ids: ``embeds`` ``(B, D)`` (BERT's pooler through ``text_projection``); with
        ``states`` also BERT's last hidden states ``(B, L, W)`` and the pooled position (0, [CLS])."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        out = self.model.text_model(input_ids=input_ids, attention_mask=attention_mask)
        embeds = self.model.text_projection(out.pooler_output)
        if not states:
            return TextFeatures(embeds, None, attention_mask)
        pool = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        return TextFeatures(embeds, out.last_hidden_state, attention_mask, pool)

    def project_text_states(self, x: Tensor) -> Tensor:
        """``(..., W)`` -> ``(..., D)``: ``text_projection`` (BERT has no final norm of its own)."""
        return self.model.text_projection(x)

    # -- images -----------------------------------------------------------------------------------
    def encode_image(
        self, pixel_values: Tensor, *, states: bool = False, states_rows: int | None = None, **kwargs: Any
    ) -> ImageFeatures:
        """Encode images ``(B, 3, H, W)``: ``embeds`` ``(B, D)`` (the tower's pooler through
        ``visual_projection``); with ``states`` the last layer's patch states ``(B, N, W)`` before the
        final ``layernorm``, [CLS] removed."""
        vm = self.model.vision_model
        if not states:
            out = vm(pixel_values=pixel_values, **kwargs)
            grid = (pixel_values.shape[-2] // self.patch_size, pixel_values.shape[-1] // self.patch_size)
            return ImageFeatures(self.model.visual_projection(out.pooler_output), None, grid)
        out = vm(pixel_values=pixel_values, output_hidden_states=True, **kwargs)
        last = out.hidden_states[-1]
        tokens = last[:, 1:] if self.vision_type == "vit" else last
        n = tokens.shape[1]
        rows = pixel_values.shape[-2] // self.patch_size
        cols = n // rows if rows and n % rows == 0 else math.isqrt(n)
        feats = ImageFeatures(self.model.visual_projection(out.pooler_output), tokens, (n // cols, cols))
        return _first_rows(feats, states_rows)

    def project_image_states(self, x: Tensor) -> Tensor:
        """``(..., W)`` -> ``(..., D)``: the tower's final ``layernorm`` then ``visual_projection``."""
        return self.model.visual_projection(self.model.vision_model.layernorm(x))

    def preprocess_images(self, images: list[Any]) -> dict[str, Tensor]:
        """PIL images -> ``{"pixel_values": (B, 3, H, W)}`` through the tower's image processor."""
        rgb = [im if im.mode == "RGB" else im.convert("RGB") for im in images]
        return {"pixel_values": self.image_processor(images=rgb, return_tensors="pt")["pixel_values"]}

    def image_transform_params(self) -> dict[str, Any]:
        """See :meth:`DualEncoder.image_transform_params`: ViT's processor squashes to ``size``."""
        from finetune.models.backends.hf import _resample_name, _size_get

        p = self.image_processor
        size = getattr(p, "size", None)
        params: dict[str, Any] = {"resample": _resample_name(getattr(p, "resample", "bilinear")),
                                  "mean": [float(v) for v in p.image_mean], "std": [float(v) for v in p.image_std],
                                  "patch_size": self.patch_size}
        shortest = _size_get(size, "shortest_edge")
        if shortest:
            crop = None
            if getattr(p, "do_center_crop", False):
                cs = getattr(p, "crop_size", None)
                crop = (int(_size_get(cs, "height")), int(_size_get(cs, "width")))
            return {**params, "mode": "shortest_center_crop" if crop else "shortest", "size": int(shortest),
                    "crop": crop}
        return {**params, "mode": "squash", "size": (int(_size_get(size, "height")), int(_size_get(size, "width"))),
                "crop": None}

    # -- the rest of the contract -----------------------------------------------------------------
    @property
    def logit_scale(self) -> nn.Parameter:
        """The model's ``logit_scale`` (log of the multiplier; init log(1/0.07))."""
        return self.model.logit_scale

    def set_gradient_checkpointing(self, enable: bool = True) -> None:
        """Non-reentrant activation checkpointing of both towers (or off)."""
        for tower in (self.model.vision_model, self.model.text_model):
            if enable:
                tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                tower.gradient_checkpointing_disable()

    def adapter_preset(self, *, include_mlp: bool = True) -> str:
        """LoRA / DoRA targets: the attention linears (query, key, value, output) of every ViT / Swin /
        BERT layer, and with ``include_mlp`` their two MLP linears."""
        layer = r"(?:vision_model|text_model)\.(?:encoder\.)?layers?\.\d+(?:\.blocks\.\d+)?"
        parts = [_ATTN] + ([_MLP] if include_mlp else [])
        return layer + "(?:" + "|".join(parts) + ")"

    def config_dict(self) -> dict[str, Any]:
        """:meth:`DualEncoder.config_dict` plus the towers' model types and the projection dim."""
        cfg = self.model.config
        return {**super().config_dict(), "vision_type": self.vision_type,
                "text_type": cfg.text_config.model_type, "projection_dim": int(cfg.projection_dim)}

    def save_pretrained(self, path: str) -> None:
        """Write a transformers folder (``config.json``, ``model.safetensors``, tokenizer and image
        processor), atomically."""
        if self.adapter is not None and getattr(self.adapter, "type", "full") != "full":
            raise ValueError("this model carries a LoRA/DoRA adapter: save it with "
                             "finetune.models.finetuned.save_finetuned, or merge_adapter first")
        self.model.config.xlipkit = {"base_text_len": self.base_text_len, "kps": None}
        with atomic_dir(path) as tmp, quiet_shard_bar():
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            self.image_processor.save_pretrained(tmp)


# -- loading --------------------------------------------------------------------------------------
def _image_processor(source: str, vision_config: Any, revision: str | None) -> Any:
    """The tower's own image processor, or (a folder without one) a ViT processor that squashes to the
    tower's size with ImageNet statistics and bicubic resampling (LAPS's test transform)."""
    from transformers import AutoImageProcessor

    local = Path(source).is_dir()
    if not local or (Path(source) / "preprocessor_config.json").is_file():
        return AutoImageProcessor.from_pretrained(source, revision=revision)
    return _default_processor(vision_config)


def _default_processor(vision_config: Any) -> Any:
    from transformers import ViTImageProcessor

    size = vision_config.image_size if isinstance(vision_config.image_size, int) else vision_config.image_size[0]
    return ViTImageProcessor(size={"height": size, "width": size}, image_mean=list(IMAGENET_MEAN),
                             image_std=list(IMAGENET_STD), resample=3)


def from_towers(
    vision: str,
    text: str,
    *,
    projection_dim: int = 512,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> VisionTextDualEncoder:
    """Build GRM's dual encoder from a pretrained image tower and a pretrained text tower (hub ids or
    ``save_pretrained`` folders); the two projections to ``projection_dim`` and the logit scale are new
    (``VisionTextDualEncoderModel.from_vision_text_pretrained``).

    Args:
        vision: a ViT or Swin checkpoint (``google/vit-base-patch16-224-in21k``,
            ``microsoft/swin-base-patch4-window7-224``).
        text: a BERT checkpoint with its tokenizer (``bert-base-uncased``).
        projection_dim: the joint dimension d (GRM: 512).

    Raises:
        ValueError: an image tower other than ViT / Swin, or a non-positive ``projection_dim``.
    """
    from transformers import AutoConfig, AutoTokenizer, VisionTextDualEncoderModel

    if not isinstance(projection_dim, int) or projection_dim < 1:
        raise ValueError(f"model.options.projection_dim must be a positive integer, got {projection_dim!r}")
    vcfg = AutoConfig.from_pretrained(vision, revision=revision, trust_remote_code=trust_remote_code)
    if vcfg.model_type not in VISION_TYPES:
        raise ValueError(f"model.options.vision {vision!r} is a {vcfg.model_type!r} model; the vision_text family "
                         f"takes a ViT or Swin image tower ({', '.join(VISION_TYPES)})")
    kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    vkw = {f"vision_{k}": v for k, v in kwargs.items()}
    tkw = {f"text_{k}": v for k, v in kwargs.items()}
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized projections" warning is the point here
    try:
        model = VisionTextDualEncoderModel.from_vision_text_pretrained(vision, text, projection_dim=projection_dim,
                                                                       **vkw, **tkw)
    finally:
        hf_logging.set_verbosity(level)
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = AutoTokenizer.from_pretrained(text, revision=revision, trust_remote_code=trust_remote_code)
    processor = _image_processor(vision, model.config.vision_config, revision)
    return VisionTextDualEncoder(model.eval(), tokenizer, processor, name_or_path=f"{vision} + {text}")


def load_vision_text(
    name_or_path: str,
    *,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    vision: str | None = None,
    text: str | None = None,
    projection_dim: int | None = None,
) -> VisionTextDualEncoder:
    """The ``vision_text`` family's loader: a saved ``VisionTextDualEncoderModel`` (folder or hub id), a
    registry name (``tiny-vision-text-vit``), or, with ``vision`` and ``text``, a new model built from
    the two towers (:func:`from_towers`; ``name_or_path`` is then not read).

    Raises:
        ValueError: only one of ``vision`` / ``text``, ``projection_dim`` without them, or a checkpoint
            that is not a ``VisionTextDualEncoderModel``.
    """
    if (vision is None) != (text is None):
        raise ValueError("the vision_text family builds a model from two towers: give both model.options.vision "
                         "and model.options.text (or neither, and model.name_or_path a saved vision_text model)")
    if vision is not None:
        return from_towers(vision, text, projection_dim=512 if projection_dim is None else projection_dim,
                           dtype=dtype, revision=revision, trust_remote_code=trust_remote_code)
    if projection_dim is not None:
        raise ValueError("model.options.projection_dim applies when model.options.vision and model.options.text "
                         "build a new model; a saved vision_text model keeps its own projections: drop "
                         "model.options.projection_dim")
    entry = named_config(str(name_or_path))
    if entry is not None and entry.backend == "vision_text":
        model = build_model(entry.name)
        return model.to(dtype) if dtype is not None else model
    from transformers import AutoConfig, AutoTokenizer, VisionTextDualEncoderModel

    config = AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    if config.model_type != MODEL_TYPE:
        raise ValueError(f"{name_or_path!r} is a transformers {config.model_type!r} model, not a "
                         f"VisionTextDualEncoderModel ({MODEL_TYPE!r}); to build one from two towers set "
                         f"model.options.vision and model.options.text")
    kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = VisionTextDualEncoderModel.from_pretrained(name_or_path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    processor = _image_processor(str(name_or_path), model.config.vision_config, revision)
    return VisionTextDualEncoder(model.eval(), tokenizer, processor, name_or_path=str(name_or_path))


def _positive(value: int | None) -> str | None:
    return None if value is None or value >= 1 else f"must be a positive integer (GRM: 512), got {value}"


@dataclasses.dataclass
class VisionTextOptions:
    """``model.options`` of the ``vision_text`` family (GRM's backbone): the two towers of a new dual encoder.
    With ``vision`` and ``text`` set, ``model.name_or_path`` is not read; without them it names a saved
    ``VisionTextDualEncoderModel`` (a folder, a hub id or ``tiny-vision-text-vit``).

    Attributes:
        vision: the image tower: a ViT or Swin hub id or folder (GRM: ViT-B/16 ImageNet-21k, or Swin-B).
        text: the text tower: a BERT hub id or folder, with its tokenizer (GRM: BERT-base).
        projection_dim: the joint dimension d of the new projections (GRM: 512); null: 512.
    """

    vision: str | None = None
    text: str | None = None
    projection_dim: int | None = dataclasses.field(default=None, metadata={"check": _positive})

    def __post_init__(self) -> None:
        for key in ("vision", "text"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                raise ValueError(f"has an empty {key}: give a hub id or a folder, or remove it")
        if (self.vision is None) != (self.text is None):
            given, missing = ("vision", "text") if self.vision is not None else ("text", "vision")
            raise ValueError(f"builds a model from two towers: {given} is set but {missing} is not; set "
                             f"model.options.{missing} too")
        if self.projection_dim is not None and self.vision is None:
            raise ValueError("has projection_dim, which sizes the projections of a model built from the towers "
                             "(model.options.vision and text); a saved model keeps its own: drop it or set both towers")


def _detect(folder: Path) -> bool:
    import json

    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, AttributeError):
        return False


def _save(model: DualEncoder, folder: str) -> None:
    model.save_pretrained(str(folder))


register_model_family("vision_text", load_vision_text, _save, detect=_detect, options=VisionTextOptions,
                      files=f"config.json with model_type {MODEL_TYPE!r} (transformers VisionTextDualEncoderModel)")


# -- tiny test configs ----------------------------------------------------------------------------
_TINY_VIT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "image_size": 32, "patch_size": 8}
_TINY_SWIN = {"image_size": 32, "patch_size": 2, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2],
              "window_size": 4}
_TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 128}


def tiny_bert_tokenizer(model_max_length: int = 128) -> Any:
    """A real ``BertTokenizerFast`` (lower-casing WordPiece, [CLS] ... [SEP]) over the small offline word list
    of :mod:`finetune.models.offline_tokenizers`, for the tiny BERT towers."""
    import string

    from transformers import BertTokenizerFast

    from finetune.models.offline_tokenizers import _WORDS

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens += ["##" + c for c in string.ascii_lowercase + string.digits]
    tokens += [w for w in dict.fromkeys(_WORDS) if w not in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return BertTokenizerFast(vocab=vocab, do_lower_case=True, model_max_length=model_max_length)


def _tiny_towers(vision_type: str) -> tuple[nn.Module, nn.Module, Any]:
    from transformers import BertConfig, BertModel, SwinConfig, SwinModel, ViTConfig, ViTModel

    tokenizer = tiny_bert_tokenizer()
    text = BertModel(BertConfig(vocab_size=len(tokenizer), **_TINY_BERT))
    vision = SwinModel(SwinConfig(**_TINY_SWIN)) if vision_type == "swin" else ViTModel(ViTConfig(**_TINY_VIT))
    return vision, text, tokenizer


def build_tiny(vision_type: str, *, projection_dim: int = 16) -> VisionTextDualEncoder:
    """A tiny ``VisionTextDualEncoderModel`` with random weights: a 2-layer width-32 ViT (32 px, patch 8) or a
    2-stage Swin (32 px, patch 2, window 4), a 2-layer width-32 BERT, projections to ``projection_dim``."""
    from transformers import VisionTextDualEncoderConfig, VisionTextDualEncoderModel

    vision, text, tokenizer = _tiny_towers(vision_type)
    config = VisionTextDualEncoderConfig.from_vision_text_configs(vision.config, text.config,
                                                                   projection_dim=projection_dim)
    model = VisionTextDualEncoderModel(config=config, vision_model=vision, text_model=text)
    processor = _default_processor(model.config.vision_config)
    return VisionTextDualEncoder(model.eval(), tokenizer, processor, name_or_path=f"tiny-vision-text-{vision_type}")


def save_tiny_towers(folder: str | Path, *, seed: int = 0) -> dict[str, Path]:
    """Save a tiny ViT, a tiny Swin and a tiny BERT (with its tokenizer) with ``save_pretrained`` under
    ``folder`` (``vit/``, ``swin/``, ``bert/``), as hub checkpoints would be, so that tests load them through
    ``model.options.vision`` / ``model.options.text`` like hub ids. Returns ``{"vit": path, "swin": path, "bert": path}``."""
    folder = Path(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vit, bert, tokenizer = _tiny_towers("vit")
        swin, _, _ = _tiny_towers("swin")
    paths = {"vit": folder / "vit", "swin": folder / "swin", "bert": folder / "bert"}
    vit.save_pretrained(paths["vit"], safe_serialization=True)
    swin.save_pretrained(paths["swin"], safe_serialization=True)
    bert.save_pretrained(paths["bert"], safe_serialization=True)
    tokenizer.save_pretrained(paths["bert"])
    return paths


def build_vit_b16_bert_base(*, projection_dim: int = 512) -> VisionTextDualEncoder:
    """GRM's architecture at its real size with random weights, offline: a ViT-B/16 at 224 px (transformers'
    ``ViTConfig`` defaults) and a 12-layer BERT-base with 512 positions, projections to 512; the tokenizer is the
    offline WordPiece of :func:`tiny_bert_tokenizer` (a smaller vocabulary than bert-base-uncased's, so a smaller
    token embedding), for benchmarks that need its compute and its 512 text positions, not its weights."""
    from transformers import (BertConfig, BertModel, ViTConfig, ViTModel, VisionTextDualEncoderConfig,
                              VisionTextDualEncoderModel)

    tokenizer = tiny_bert_tokenizer(512)
    vision, text = ViTModel(ViTConfig()), BertModel(BertConfig(vocab_size=len(tokenizer)))
    config = VisionTextDualEncoderConfig.from_vision_text_configs(vision.config, text.config,
                                                                   projection_dim=projection_dim)
    model = VisionTextDualEncoderModel(config=config, vision_model=vision, text_model=text)
    return VisionTextDualEncoder(model.eval(), tokenizer, _default_processor(model.config.vision_config),
                                 name_or_path="vision-text-vit-b16-bert-base")


register_named_config("vision-text-vit-b16-bert-base", "vision_text", "clip",
                      "transformers VisionTextDualEncoder: ViT-B/16 (224 px) + BERT-base (12 layers, 512 positions), "
                      "projections to 512 (GRM's backbone at size; offline WordPiece vocabulary)",
                      build_vit_b16_bert_base, real=True)
register_named_config("tiny-vision-text-vit", "vision_text", "clip",
                      "transformers VisionTextDualEncoder: ViT (2 layers, width 32, 32 px, patch 8) + BERT (2 layers, "
                      "width 32), projections to 16", lambda: build_tiny("vit"))
register_named_config("tiny-vision-text-swin", "vision_text", "clip",
                      "transformers VisionTextDualEncoder: Swin (2 stages, 32 px, patch 2) + BERT (2 layers, width "
                      "32), projections to 16", lambda: build_tiny("swin"))
