"""transformers backend: ``CLIPModel``, ``SiglipModel`` and ``Siglip2Model`` behind :class:`DualEncoder`.

What the towers return (transformers 5 source, ``modeling_clip.py`` / ``modeling_siglip.py`` /
``modeling_siglip2.py``):

- CLIP text: the EOS token's state after ``final_layer_norm``, through ``text_projection``
  (first EOS, or the arg-max id for legacy configs with ``eos_token_id == 2``); causal attention.
- CLIP image: the CLS token after ``post_layernorm``, through ``visual_projection``.
- SigLIP / SigLIP2 text: the LAST position after ``final_layer_norm``, through ``head``; no causal
  mask, trained on captions padded to the full length with no attention mask, so the text tower
  runs without one here too and captions are always padded to ``max_text_len``.
- SigLIP / SigLIP2 image: the MAP attention-pooling head over all post-layernormed patch states.
  The head's "projection" of one state is the head run on a length-1 sequence of that state
  (post_layernorm, then head): a token attending only to itself. The image embedding is the head
  over *all* tokens, which no single token's projection reproduces.

Fixed-resolution SigLIP2 checkpoints (``google/siglip2-base-patch16-224``) are ``SiglipModel``s
with a Gemma tokenizer (family ``"siglip2"``); NaFlex checkpoints are ``Siglip2Model``s whose image
inputs are patch sequences with ``pixel_attention_mask`` and ``spatial_shapes``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from finetune.models.backends.activations import use_fast_quick_gelu
from finetune.files import atomic_dir
from finetune.models.core.encoder import DualEncoder, ImageFeatures, TextFeatures, TokenizedText
from finetune.models.core.encoder import first_state_rows as _first_rows
from finetune.models.longclip import sync_frozen_rows_hook
from finetune.models.backends.pooled_tower import (
    clip_text_forward,
    clip_vision_forward,
    fast_path_kwargs_ok,
    fast_path_ok,
    hooked,
)
from finetune.models.core.spans import spans_by_offsets, spans_by_pieces
from finetune.models.weight_files import quiet_shard_bar
from finetune.models.core.tokens import hf_tokenize

#: transformers ``model_type`` -> family
HF_MODEL_TYPES = {"clip": "clip", "siglip": "siglip", "siglip2": "siglip2"}
#: SigLIP2's Gemma vocabulary size, which tells a fixed-resolution SigLIP2 from a SigLIP checkpoint
GEMMA_VOCAB_SIZE = 256000


def _pooled(out: Any) -> Tensor:
    # transformers 5 returns a ModelOutput from get_*_features, 4.x a tensor
    return out if isinstance(out, Tensor) else out.pooler_output


def _resample_name(value: Any) -> str:
    from PIL import Image

    try:
        return Image.Resampling(int(value)).name.lower()
    except (TypeError, ValueError):
        return str(getattr(value, "value", value)).lower()


def _size_get(size: Any, key: str) -> Any:
    if size is None:
        return None
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def patchify(pixel_values: Tensor, patch_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Turn images ``(B, C, H, W)`` into NaFlex inputs, the way ``Siglip2ImageProcessor`` orders
    patches (row-major, each patch ``(p, p, C)`` flattened).

    Returns:
        ``pixel_values`` ``(B, N, p·p·C)``, ``pixel_attention_mask`` ``(B, N)`` of ones and
        ``spatial_shapes`` ``(B, 2)`` with ``N = (H/p)·(W/p)``.
    """
    b, c, h, w = pixel_values.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch_size}; "
                         f"use model.preprocess_images to resize it")
    gh, gw = h // patch_size, w // patch_size
    x = pixel_values.reshape(b, c, gh, patch_size, gw, patch_size).permute(0, 2, 4, 3, 5, 1)
    x = x.reshape(b, gh * gw, patch_size * patch_size * c)
    mask = torch.ones(b, gh * gw, dtype=torch.long, device=pixel_values.device)
    shapes = torch.tensor([[gh, gw]] * b, dtype=torch.long, device=pixel_values.device)
    return x, mask, shapes


def _causal_padding_mask(attention_mask: Tensor, tower: nn.Module) -> Tensor:
    """The ``(B, 1, L, L)`` mask of a causal text tower over padded rows (key ``j`` visible to query ``i`` when
    ``j <= i`` and ``j`` is a real token): what transformers' ``create_causal_mask`` builds from the ``(B, L)``
    mask, made here on the device because transformers first checks on the host whether the mask has padding
    at all (a read of the device). Boolean for SDPA, additive for eager attention."""
    b, length = attention_mask.shape
    positions = torch.arange(length, device=attention_mask.device)
    allowed = (positions[None, :] <= positions[:, None])[None, None] & attention_mask.bool()[:, None, None, :]
    if getattr(tower.config, "_attn_implementation", "sdpa") == "sdpa":
        return allowed
    dtype = tower.embeddings.token_embedding.weight.dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


class HFDualEncoder(DualEncoder):
    """A transformers ``CLIPModel`` / ``SiglipModel`` / ``Siglip2Model`` as a :class:`DualEncoder`.

    Args:
        model: the transformers model.
        tokenizer: its transformers tokenizer.
        image_processor: its transformers image processor.
        name_or_path: where it came from (hub id, folder or registry name).
        family: ``"clip"``, ``"siglip"`` or ``"siglip2"``; detected when None.

    KPS settings and the original text length are kept in ``model.config.xlipkit``
    (``{"base_text_len": int, "kps": dict | None}``), which ``save_pretrained`` writes into
    ``config.json`` and plain transformers ignores.
    """

    backend = "hf"
    supports_states = True

    def __init__(
        self, model: nn.Module, tokenizer: Any, image_processor: Any, *, name_or_path: str, family: str | None = None
    ) -> None:
        super().__init__(model)
        cfg = model.config
        if cfg.model_type not in HF_MODEL_TYPES:
            raise ValueError(f"unsupported transformers model_type {cfg.model_type!r} for {name_or_path!r}; "
                             f"supported: {sorted(HF_MODEL_TYPES)}")
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.name_or_path = str(name_or_path)
        self.naflex = cfg.model_type == "siglip2"
        self.family = family or self._detect_family()
        vcfg = cfg.vision_config
        if self.family != "clip" and not getattr(vcfg, "vision_use_head", True):
            raise ValueError(f"{name_or_path!r} has no image pooling head (vision_use_head=False): it has no image "
                             f"embedding to train")
        self.patch_size = int(vcfg.patch_size)
        self.image_size = (
            self.patch_size * math.isqrt(int(vcfg.num_patches)) if self.naflex else int(vcfg.image_size)
        )
        n = int(self.position_embedding().shape[0])
        saved = getattr(cfg, "xlipkit", None) or {}
        self.base_text_len = int(saved.get("base_text_len", n))
        self.kps = dict(saved["kps"]) if saved.get("kps") else None
        self.max_text_len = n
        self.tokenizer.model_max_length = n
        sync_frozen_rows_hook(self._text_embeddings().position_embedding, self.kps)
        use_fast_quick_gelu(model)

    def _detect_family(self) -> str:
        mt = self.model.config.model_type
        if mt == "siglip":
            tok_name = type(self.tokenizer).__name__.lower()
            gemma_vocab = self.model.config.text_config.vocab_size == GEMMA_VOCAB_SIZE
            if gemma_vocab or "gemma" in tok_name or "siglip2" in tok_name:
                return "siglip2"
        return HF_MODEL_TYPES[mt]

    def _text_embeddings(self) -> nn.Module:
        return self.model.text_model.embeddings

    # -- text -------------------------------------------------------------------------------------
    def text_pool_positions(self, input_ids: Tensor) -> Tensor:
        """``(B,)`` index of the token each caption's embedding is pooled from (EOS for CLIP, the
        last position for SigLIP), the same rule as the transformers forward."""
        b, length = input_ids.shape
        if self.family != "clip":
            return torch.full((b,), length - 1, dtype=torch.long, device=input_ids.device)
        eos = self.model.text_model.eos_token_id
        if eos == 2:  # legacy configs (before transformers PR #24773): the EOS id is the largest id
            return input_ids.to(torch.int).argmax(dim=-1)
        return (input_ids.to(torch.int) == eos).int().argmax(dim=-1)

    def encode_text(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, states: bool = False
    ) -> TextFeatures:
        """Encode ``(B, L)`` ids: ``embeds`` ``(B, D)``; with ``states`` also ``(B, L, W)`` states
        before ``final_layer_norm`` and the pooled positions."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        tower_mask = attention_mask if self.family == "clip" else None
        if not states:
            tm = self.model.text_model
            if self.family == "clip" and fast_path_ok(tm):  # last layer for the pooled token only
                pooled = clip_text_forward(tm, input_ids, tower_mask, self.text_pool_positions(input_ids))
                return TextFeatures(self.model.text_projection(pooled), None, attention_mask)
        if tower_mask is not None:  # CLIP: causal and padding mask made here, so transformers does not check it
            tower_mask = _causal_padding_mask(tower_mask, self.model.text_model)
        if not states:
            out = self.model.get_text_features(input_ids=input_ids, attention_mask=tower_mask)
            return TextFeatures(_pooled(out), None, attention_mask)
        out = self.model.text_model(input_ids=input_ids, attention_mask=tower_mask, output_hidden_states=True)
        pooled = out.pooler_output
        embeds = self.model.text_projection(pooled) if self.family == "clip" else pooled
        return TextFeatures(embeds, out.hidden_states[-1], attention_mask, self.text_pool_positions(input_ids))

    def encode_text_groups(self, groups: list[tuple[Tensor, Tensor]], *, right_padded: bool = False) -> list[Tensor]:
        """:meth:`DualEncoder.encode_text_groups`; CLIP on the pooled-token path looks the tokens of all
        groups up in one call, so that backward builds one dense ``(vocab, W)`` embedding gradient, not one
        per group (each is a 100 MB zero-fill for CLIP's 49,408 x 512 table). ``right_padded`` rows run without
        the padding mask (under the causal mask no real token attends to the padding after it), so that neither
        this module nor transformers' mask builder checks the mask on the device."""
        tm = self.model.text_model
        if self.family != "clip" or not fast_path_ok(tm):
            return super().encode_text_groups(groups)
        if hooked(tm.embeddings):
            return [self.model.text_projection(clip_text_forward(
                tm, ids, None if right_padded else mask, self.text_pool_positions(ids), right_padded=right_padded))
                for ids, mask in groups]
        tokens = tm.embeddings.token_embedding(torch.cat([ids.reshape(-1) for ids, _ in groups]))
        out = []
        for (ids, mask), part in zip(groups, tokens.split([ids.numel() for ids, _ in groups])):
            pooled = clip_text_forward(tm, ids, None if right_padded else mask, self.text_pool_positions(ids),
                                       token_embeds=part.view(*ids.shape, -1), right_padded=right_padded)
            out.append(self.model.text_projection(pooled))
        return out

    def project_text_states(self, x: Tensor) -> Tensor:
        """``(..., W)`` -> ``(..., D)``: ``final_layer_norm`` then ``text_projection`` (CLIP) or
        ``head`` (SigLIP)."""
        tm = self.model.text_model
        x = tm.final_layer_norm(x)
        return self.model.text_projection(x) if self.family == "clip" else tm.head(x)

    def tokenize(self, texts: list[str], *, max_length: int | None = None) -> TokenizedText:
        """Tokenise with the model's tokenizer; CLIP pads to the longest caption (the causal mask
        makes padding irrelevant), SigLIP to ``max_length`` (it pools the last position)."""
        length = max_length or self.max_text_len
        if length > self.max_text_len:
            raise ValueError(f"max_length={length} exceeds the model's {self.max_text_len} text positions")
        padding = "longest" if self.family == "clip" else "max_length"
        tok = hf_tokenize(self.tokenizer, texts, length, padding=padding)
        self._count_truncation(tok.truncated)
        return tok

    def sentence_spans(self, captions: list[str]) -> list[list[tuple[int, int] | None]]:
        """Each sentence's token range in ``tokenize(captions)`` (see
        :meth:`DualEncoder.sentence_spans`), from the fast tokenizer's ``offset_mapping``; a slow
        tokenizer falls back to tokenising sentence by sentence."""
        if isinstance(captions, str):
            raise TypeError("captions must be a list of strings, not one string: wrap it as [caption]")
        if getattr(self.tokenizer, "is_fast", False):
            return spans_by_offsets(self, self.tokenizer, list(captions))
        return spans_by_pieces(self, list(captions))

    def position_embedding(self) -> nn.Parameter:
        """The text positional table ``(max_text_len, W)``."""
        return self._text_embeddings().position_embedding.weight

    def resize_text_positions(self, table: Tensor) -> None:
        """Install ``table`` ``(L', W)`` as the text positions, with position ids, config
        ``max_position_embeddings``, tokenizer ``model_max_length`` and the frozen-rows hook."""
        emb = self._text_embeddings()
        old = emb.position_embedding.weight
        n = int(table.shape[0])
        new = nn.Embedding(n, table.shape[1], device=old.device, dtype=old.dtype)
        with torch.no_grad():
            new.weight.copy_(table.to(device=old.device, dtype=old.dtype))
        new.weight.requires_grad_(old.requires_grad)
        emb.position_embedding = new
        emb.register_buffer("position_ids", torch.arange(n, device=old.device).expand((1, -1)), persistent=False)
        self.model.config.text_config.max_position_embeddings = n
        self.model.text_model.config.max_position_embeddings = n
        self.max_text_len = n
        self.tokenizer.model_max_length = n
        sync_frozen_rows_hook(new, self.kps)

    # -- images -----------------------------------------------------------------------------------
    def encode_image(
        self, pixel_values: Tensor, *, states: bool = False, states_rows: int | None = None, **kwargs: Any
    ) -> ImageFeatures:
        """Encode images: ``(B, 3, H, W)``, or for NaFlex patch sequences ``(B, N, 3·p·p)`` with the
        ``pixel_attention_mask`` ``(B, N)`` and ``spatial_shapes`` ``(B, 2)`` keywords (4-D images
        are patchified as they are). ``states_rows`` = n returns the states of the first n images only.

        CLIP towers run their last layer for the class token only where no states are needed
        (:mod:`finetune.models.backends.pooled_tower`); the embeddings are the transformers forward's."""
        if self.naflex:
            return _first_rows(self._encode_naflex(pixel_values, states=states, **kwargs), states_rows)
        grid = (pixel_values.shape[-2] // self.patch_size, pixel_values.shape[-1] // self.patch_size)
        vm = self.model.vision_model
        if self.family == "clip" and fast_path_ok(vm) and fast_path_kwargs_ok(kwargs):
            n = (pixel_values.shape[0] if states_rows is None else states_rows) if states else 0
            pooled, cls, last = clip_vision_forward(vm, pixel_values, states_rows=n, **kwargs)
            embeds = self.model.visual_projection(pooled)
            if not states:
                return ImageFeatures(embeds, None, grid)
            return ImageFeatures(embeds, last[:, 1:], grid, pooled_state=cls)
        if not states:
            embeds = _pooled(self.model.get_image_features(pixel_values=pixel_values, **kwargs))
            return ImageFeatures(embeds, None, grid)
        if self.family == "clip":
            out = vm(pixel_values=pixel_values, **kwargs)
            last = out.last_hidden_state  # CLIP applies post_layernorm to the CLS token only
            embeds = self.model.visual_projection(out.pooler_output)
            return _first_rows(ImageFeatures(embeds, last[:, 1:], grid, pooled_state=last[:, 0]), states_rows)
        out = vm(pixel_values=pixel_values, output_hidden_states=True, **kwargs)
        return _first_rows(ImageFeatures(out.pooler_output, out.hidden_states[-1], grid), states_rows)

    def _encode_naflex(self, pixel_values: Tensor, *, states: bool, pixel_attention_mask: Tensor | None = None,
                       spatial_shapes: Tensor | None = None, **kwargs: Any) -> ImageFeatures:
        if pixel_values.ndim == 4:
            pixel_values, pixel_attention_mask, spatial_shapes = patchify(pixel_values, self.patch_size)
        elif pixel_attention_mask is None or spatial_shapes is None:
            raise ValueError("NaFlex patch inputs need pixel_attention_mask and spatial_shapes: pass the whole dict "
                             "from model.preprocess_images(images)")
        shapes = spatial_shapes.tolist()
        grid = tuple(shapes[0]) if all(s == shapes[0] for s in shapes) else (0, 0)
        inputs = dict(pixel_values=pixel_values, pixel_attention_mask=pixel_attention_mask,
                      spatial_shapes=spatial_shapes, **kwargs)
        if not states:
            embeds = _pooled(self.model.get_image_features(**inputs))
            return ImageFeatures(embeds, None, grid, patch_mask=pixel_attention_mask, spatial_shapes=spatial_shapes)
        out = self.model.vision_model(**inputs, output_hidden_states=True)
        return ImageFeatures(out.pooler_output, out.hidden_states[-1], grid,
                             patch_mask=pixel_attention_mask, spatial_shapes=spatial_shapes)

    def project_image_states(self, x: Tensor) -> Tensor:
        """``(..., W)`` -> ``(..., D)``. CLIP: ``post_layernorm`` then ``visual_projection`` (the
        CLS state gives ``embeds``). SigLIP: ``post_layernorm`` then the MAP head on each state as
        a length-1 sequence (the module docstring says why no token reproduces ``embeds``)."""
        vm = self.model.vision_model
        if self.family == "clip":
            return self.model.visual_projection(vm.post_layernorm(x))
        flat = vm.post_layernorm(x.reshape(-1, 1, x.shape[-1]))
        return vm.head(flat).reshape(*x.shape[:-1], -1)

    def preprocess_images(self, images: list[Any]) -> dict[str, Tensor]:
        """PIL images -> the keyword inputs of :meth:`encode_image`, through the model's own
        transformers image processor (images are converted to RGB first)."""
        rgb = [im if im.mode == "RGB" else im.convert("RGB") for im in images]
        out = self.image_processor(images=rgb, return_tensors="pt")
        return {k: out[k] for k in ("pixel_values", "pixel_attention_mask", "spatial_shapes") if k in out}

    def image_transform_params(self) -> dict[str, Any]:
        """See :meth:`DualEncoder.image_transform_params`; read from the image processor."""
        p = self.image_processor
        params: dict[str, Any] = {
            "resample": _resample_name(getattr(p, "resample", "bicubic")),
            "mean": [float(v) for v in p.image_mean],
            "std": [float(v) for v in p.image_std],
            "patch_size": self.patch_size,
        }
        if self.naflex:
            return {**params, "mode": "naflex", "size": None, "crop": None,
                    "max_num_patches": int(getattr(p, "max_num_patches", 0))}
        size = getattr(p, "size", None)
        shortest = _size_get(size, "shortest_edge")
        crop = None
        if getattr(p, "do_center_crop", False):
            cs = getattr(p, "crop_size", None)
            crop = (int(_size_get(cs, "height")), int(_size_get(cs, "width")))
        if shortest:
            mode, resize = ("shortest_center_crop" if crop else "shortest"), int(shortest)
        else:
            mode, resize = "squash", (int(_size_get(size, "height")), int(_size_get(size, "width")))
        return {**params, "mode": mode, "size": resize, "crop": crop}

    # -- the rest of the contract -----------------------------------------------------------------
    @property
    def logit_scale(self) -> nn.Parameter:
        """The model's ``logit_scale`` (log of the multiplier)."""
        return self.model.logit_scale

    @property
    def logit_bias(self) -> nn.Parameter | None:
        """SigLIP's ``logit_bias``; None for CLIP."""
        return getattr(self.model, "logit_bias", None) if self.family != "clip" else None

    def set_gradient_checkpointing(self, enable: bool = True) -> None:
        """Non-reentrant activation checkpointing of every encoder layer (or off)."""
        m = self.model
        if not enable:
            fn = getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable
            fn()
            return
        kwargs = {"use_reentrant": False}
        if hasattr(m, "activation_checkpointing_enable"):
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def save_pretrained(self, path: str) -> None:
        """Write a transformers folder (``config.json`` with ``xlipkit`` settings,
        ``model.safetensors``, tokenizer and image-processor files), atomically."""
        if self.adapter is not None and getattr(self.adapter, "type", "full") != "full":
            raise ValueError("this model carries a LoRA/DoRA adapter: save it with "
                             "finetune.models.finetuned.save_finetuned, or merge_adapter first")
        self.model.config.xlipkit = {"base_text_len": self.base_text_len, "kps": self.kps}
        with atomic_dir(path) as tmp, quiet_shard_bar():
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            self.image_processor.save_pretrained(tmp)


def _model_class(model_type: str) -> type:
    from transformers import CLIPModel, Siglip2Model, SiglipModel

    return {"clip": CLIPModel, "siglip": SiglipModel, "siglip2": Siglip2Model}[model_type]


def _default_image_processor(config: Any) -> Any:
    from transformers import CLIPImageProcessor, Siglip2ImageProcessor, SiglipImageProcessor

    v = config.vision_config
    if config.model_type == "clip":
        return CLIPImageProcessor(size={"shortest_edge": v.image_size},
                                  crop_size={"height": v.image_size, "width": v.image_size})
    if config.model_type == "siglip":
        return SiglipImageProcessor(size={"height": v.image_size, "width": v.image_size})
    return Siglip2ImageProcessor(patch_size=v.patch_size, max_num_patches=v.num_patches)


#: the class names transformers writes for a plain ``tokenizers`` tokenizer (v5 and v4)
_GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def _load_tokenizer(source: str, *, revision: str | None, trust_remote_code: bool) -> Any:
    """The folder's tokenizer. A generic ``tokenizers`` tokenizer is loaded as such: AutoTokenizer
    would otherwise rebuild it with the model type's own class (SigLIP2's Gemma BPE pipeline) and
    change its ids."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = Path(source) / "tokenizer_config.json"
    if cfg_file.is_file():
        tok_class = json.loads(cfg_file.read_text(encoding="utf-8")).get("tokenizer_class")
        if tok_class in _GENERIC_TOKENIZERS:
            return PreTrainedTokenizerFast.from_pretrained(source)
    return AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)


def load_hf(
    source: str,
    *,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    name_or_path: str | None = None,
) -> HFDualEncoder:
    """Load a transformers CLIP / SigLIP / SigLIP2 checkpoint (hub id or ``save_pretrained`` folder).

    The tokenizer and image processor come from the same place. A CLIP folder without tokenizer
    files gets the real CLIP tokenizer built offline from open_clip's vocabulary; a folder without
    an image processor gets the default one for its config.

    Raises:
        ValueError: for a ``model_type`` other than clip / siglip / siglip2, or a SigLIP folder
            without tokenizer files.
    """
    from transformers import AutoConfig, AutoImageProcessor

    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
    if config.model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{source!r} is a transformers {config.model_type!r} model; supported model types: "
                         f"{sorted(HF_MODEL_TYPES)}")
    kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = _model_class(config.model_type).from_pretrained(source, **kwargs)
    local = Path(source).is_dir()
    has_tok = not local or any((Path(source) / f).is_file() for f in (
        "tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model", "tokenizer.model"))
    if has_tok:
        tokenizer = _load_tokenizer(source, revision=revision, trust_remote_code=trust_remote_code)
    elif config.model_type == "clip":
        from finetune.models.offline_tokenizers import clip_tokenizer

        tokenizer = clip_tokenizer(config.text_config.max_position_embeddings)
    else:
        raise ValueError(f"{source} has no tokenizer files (tokenizer.json / tokenizer_config.json / spiece.model): "
                         f"save the model with its tokenizer")
    has_proc = not local or (Path(source) / "preprocessor_config.json").is_file()
    processor = (AutoImageProcessor.from_pretrained(source, revision=revision) if has_proc
                 else _default_image_processor(config))
    return HFDualEncoder(model.eval(), tokenizer, processor, name_or_path=name_or_path or source)
