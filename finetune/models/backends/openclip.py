"""open_clip backend: ``CLIP`` and ``CustomTextCLIP`` models (CLIP and SigLIP architectures).

What the towers compute (open_clip 3.x ``model.py`` / ``transformer.py``):

- text: token embedding + positional table, the transformer (causal mask for CLIP, none for
  SigLIP: ``no_causal_mask``), ``ln_final``, pooling by ``text_pool_type`` (``argmax``: the EOT
  id, the largest; ``eos``; ``last`` for SigLIP; ``first``) and ``text_projection`` (a matrix, or
  a ``Linear`` with bias for SigLIP). The pooled state is taken before ``ln_final`` here, which is
  the same value (the norm is per token) and saves the norm of every other token.
- image, open_clip ``VisionTransformer``: CLS (``tok``) or mean (``avg``) pooling after ``ln_post``,
  then ``@ proj``. Image, timm towers (open_clip's SigLIP configs): the trunk's final ``norm``,
  its pooling (``map``: an attention-pooling head, like SigLIP's), ``fc_norm``, head, then the
  adapter head (``TimmModel.head``).

States are the last block's outputs before the final norm (``forward_intermediates`` of the
tower with ``indices=1``), prefix tokens split off. The text tower is run by this module rather
than by ``model.encode_text`` so that KPS's frozen rows can be applied to the positional table,
and so that captions shorter than the context need no padding for causal towers.
"""

from __future__ import annotations

import json
import os
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from finetune.models.backends.activations import use_fast_quick_gelu
from finetune.files import atomic_dir
from finetune.models.core.encoder import DualEncoder, ImageFeatures, TextFeatures, TokenizedText, first_state_rows
from finetune.models.longclip import freeze_rows, kps_ratio
from finetune.models.core.tokens import hf_tokenize, pad_batch, truncate_keep_end

#: the file names open_clip reads in ``local-dir:`` / ``hf-hub:`` folders (open_clip/constants.py)
CONFIG_NAME = "open_clip_config.json"
WEIGHTS_NAME = "open_clip_model.safetensors"
SIGLIP2_VOCAB_SIZE = 256000


def _causal_mask(n: int, device: torch.device | None = None) -> Tensor:
    # open_clip TextTransformer.build_causal_mask: additive, -inf above the diagonal
    return torch.full((n, n), float("-inf"), device=device).triu_(1)


class OpenCLIPDualEncoder(DualEncoder):
    """An open_clip model as a :class:`DualEncoder`.

    Args:
        model: an open_clip ``CLIP`` or ``CustomTextCLIP`` with an open_clip ``TextTransformer``
            text tower and an open_clip ``VisionTransformer`` or timm ViT image tower.
        tokenizer: open_clip's tokenizer for it (``SimpleTokenizer``, ``HFTokenizer`` or
            ``SigLipTokenizer``).
        model_cfg: the open_clip model config (what ``open_clip_config.json`` holds under
            ``model_cfg``), kept to save the model in open_clip's format.
        name_or_path: where it came from.
        base_text_len: the pretrained text length before KPS (default: the current one).
        kps: KPS settings already applied to ``model``'s table, if any.

    Raises:
        ValueError: for towers this backend does not cover (CoCa, HF text towers, attention-pooled
            open_clip ViTs, ResNets, convnets).
    """

    backend = "open_clip"
    supports_states = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        model_cfg: dict[str, Any],
        *,
        name_or_path: str,
        base_text_len: int | None = None,
        kps: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(model)
        from open_clip import get_model_preprocess_cfg
        from open_clip.transform import PreprocessCfg, image_transform_v2

        self.name_or_path = str(name_or_path)
        self.model_cfg = deepcopy(model_cfg)
        self.tokenizer = tokenizer
        self._check_towers()
        use_fast_quick_gelu(model)
        pp = get_model_preprocess_cfg(model)
        self.preprocess_cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in pp.items()}
        fields = {k: v for k, v in pp.items() if k in PreprocessCfg.__dataclass_fields__}
        self.image_processor = image_transform_v2(PreprocessCfg(**fields), is_train=False)
        t = self._text
        pool = t["pool_type"]
        vocab = int(t["token_embedding"].weight.shape[0])
        if getattr(model, "logit_bias", None) is not None or pool == "last":
            hf_name = str(self.model_cfg.get("text_cfg", {}).get("hf_tokenizer_name", "")).lower()
            self.family = "siglip2" if vocab == SIGLIP2_VOCAB_SIZE or "siglip2" in hf_name else "siglip"
        else:
            self.family = "clip"
        self.patch_size = self._patch_size()
        size = self.preprocess_cfg.get("size", 224)
        self.image_size = int(size if isinstance(size, int) else size[0])
        n = int(self.position_embedding().shape[0])
        self.max_text_len = n
        self.base_text_len = int(base_text_len or n)
        self.kps = dict(kps) if kps else None
        self._set_tokenizer_length(n)

    # -- structure --------------------------------------------------------------------------------
    def _check_towers(self) -> None:
        from open_clip.timm_model import TimmModel
        from open_clip.transformer import TextTransformer, VisionTransformer

        m = self.model
        text = getattr(m, "text", None)
        if text is not None and not isinstance(text, TextTransformer):
            raise ValueError(f"{self.name_or_path!r}: open_clip text tower {type(text).__name__} is not supported "
                             f"(only open_clip's TextTransformer)")
        if text is not None and text.cls_emb is not None:
            raise ValueError(f"{self.name_or_path!r}: CoCa-style text towers (cls_emb) are not supported")
        pool = text.pool_type if text is not None else m.text_pool_type
        if pool not in ("argmax", "eos", "last", "first"):
            raise ValueError(f"{self.name_or_path!r}: text pool type {pool!r} gives no single embedding")
        v = m.visual
        if isinstance(v, VisionTransformer):
            if v.attn_pool is not None:
                raise ValueError(f"{self.name_or_path!r}: attention-pooled open_clip ViTs (CoCa) are not supported")
        elif isinstance(v, TimmModel):
            if not all(hasattr(v.trunk, a) for a in ("forward_intermediates", "norm", "fc_norm", "head")):
                raise ValueError(f"{self.name_or_path!r}: the timm image tower {type(v.trunk).__name__} is not a "
                                 f"ViT; only ViT towers are supported")
        else:
            raise ValueError(f"{self.name_or_path!r}: image tower {type(v).__name__} is not supported (open_clip "
                             f"VisionTransformer or timm ViT)")

    @property
    def _text(self) -> dict[str, Any]:
        m = self.model
        t = getattr(m, "text", None)
        if t is not None:
            return {"owner": t, "token_embedding": t.token_embedding, "transformer": t.transformer,
                    "ln_final": t.ln_final, "projection": t.text_projection, "attn_mask": t.attn_mask,
                    "pool_type": t.pool_type, "eos_id": t.eos_id, "pad_mask": t.use_pad_mask}
        return {"owner": m, "token_embedding": m.token_embedding, "transformer": m.transformer,
                "ln_final": m.ln_final, "projection": m.text_projection, "attn_mask": m.attn_mask,
                "pool_type": m.text_pool_type, "eos_id": getattr(m, "text_eos_id", None), "pad_mask": False}

    def _is_timm(self) -> bool:
        return hasattr(self.model.visual, "trunk")

    def _patch_size(self) -> int:
        v = self.model.visual
        ps = v.trunk.patch_embed.patch_size if self._is_timm() else v.patch_size
        return int(ps[0] if isinstance(ps, (tuple, list)) else ps)

    def _set_tokenizer_length(self, n: int) -> None:
        tok = self.tokenizer
        if hasattr(tok, "context_length"):
            tok.context_length = n
        inner = getattr(tok, "tokenizer", None)
        if inner is not None and hasattr(inner, "model_max_length"):
            inner.model_max_length = n

    # -- text -------------------------------------------------------------------------------------
    def text_pool_positions(self, input_ids: Tensor) -> Tensor:
        """``(B,)`` index of the pooled token, open_clip's ``text_global_pool`` rule."""
        t = self._text
        b, length = input_ids.shape
        pool = t["pool_type"]
        if pool == "argmax":
            return input_ids.argmax(dim=-1)
        if pool == "eos":
            return (input_ids == t["eos_id"]).int().argmax(dim=-1)
        idx = length - 1 if pool == "last" else 0
        return torch.full((b,), idx, dtype=torch.long, device=input_ids.device)

    def encode_text(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, states: bool = False
    ) -> TextFeatures:
        """Encode ``(B, L)`` ids, ``L <= max_text_len``: ``embeds`` ``(B, D)``, with ``states``
        ``(B, L, W)`` before ``ln_final``. ``attention_mask`` is returned, not used: open_clip text
        towers run causal (CLIP) or on padded captions as trained (SigLIP)."""
        t = self._text
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        length = input_ids.shape[1]
        if length > self.max_text_len:
            raise ValueError(f"{length} tokens exceed the model's {self.max_text_len} text positions")
        cast = t["transformer"].get_cast_dtype()
        x = t["token_embedding"](input_ids).to(cast)
        pos = self.position_embedding()[:length]
        if self.kps and self.kps.get("freeze_kept") and self.kps.get("keep", 0) > 0:
            pos = freeze_rows(pos, torch.arange(length, device=pos.device), int(self.kps["keep"]))
        x = x + pos.to(cast)
        mask = t["attn_mask"][:length, :length] if t["attn_mask"] is not None else None
        if t["pad_mask"]:
            add = t["owner"]._build_additive_mask(input_ids, length, x.dtype)
            mask = add if mask is None else mask.unsqueeze(0) + add
        x = t["transformer"](x, attn_mask=mask)
        idx = self.text_pool_positions(input_ids)
        embeds = self.project_text_states(x[torch.arange(x.shape[0], device=x.device), idx])
        if not states:
            return TextFeatures(embeds, None, attention_mask)
        return TextFeatures(embeds, x, attention_mask, idx)

    def project_text_states(self, x: Tensor) -> Tensor:
        """``(..., W)`` -> ``(..., D)``: ``ln_final`` then ``text_projection``."""
        t = self._text
        x = t["ln_final"](x)
        proj = t["projection"]
        if proj is None:
            return x
        return proj(x) if isinstance(proj, nn.Linear) else x @ proj

    def tokenize(self, texts: list[str], *, max_length: int | None = None) -> TokenizedText:
        """Tokenise with open_clip's tokenizer, truncating with the end token kept. Causal towers
        pooling the EOT token get rows padded to the longest caption, others to ``max_length``."""
        from open_clip.tokenizer import HFTokenizer, SigLipTokenizer, SimpleTokenizer, basic_clean, canonicalize_text

        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings, not one string: wrap it as [text]")
        length = max_length or self.max_text_len
        if length > self.max_text_len:
            raise ValueError(f"max_length={length} exceeds the model's {self.max_text_len} text positions")
        t = self._text
        padding = "longest" if t["attn_mask"] is not None and t["pool_type"] in ("argmax", "eos") else "max_length"
        tok = self.tokenizer
        if isinstance(tok, SimpleTokenizer):
            rows, flags = [], []
            for text in texts:
                ids, cut = truncate_keep_end([tok.sot_token_id, *tok.encode(text), tok.eot_token_id], length, 1)
                rows.append(ids)
                flags.append(cut)
            width = length if padding == "max_length" else max((len(r) for r in rows), default=1)
            ids, mask = pad_batch(rows, width, 0)
            out = TokenizedText(ids, mask, torch.tensor(flags, dtype=torch.bool))
        elif isinstance(tok, HFTokenizer):
            if tok.tokenizer_mode:
                raise ValueError(f"open_clip tokenizer_mode {tok.tokenizer_mode!r} is not supported")
            out = hf_tokenize(tok.tokenizer, texts, length, padding=padding, clean=tok.clean_fn)
            if tok.strip_sep_token:
                out.input_ids[out.input_ids == tok.tokenizer.sep_token_id] = 0
        elif isinstance(tok, SigLipTokenizer):
            out = hf_tokenize(tok.tokenizer, texts, length, padding=padding,
                              clean=lambda s: canonicalize_text(basic_clean(s)))
        else:
            raise TypeError(f"unsupported open_clip tokenizer {type(tok).__name__}")
        self._count_truncation(out.truncated)
        return out

    def position_embedding(self) -> nn.Parameter:
        """The text positional table ``(max_text_len, W)``."""
        return self._text["owner"].positional_embedding

    def resize_text_positions(self, table: Tensor) -> None:
        """Install ``table`` ``(L', W)``; rebuild the causal mask; update context lengths in the
        model, its config and the tokenizer."""
        t = self._text
        owner = t["owner"]
        old = owner.positional_embedding
        n = int(table.shape[0])
        owner.positional_embedding = nn.Parameter(
            table.detach().to(device=old.device, dtype=old.dtype).clone(), requires_grad=old.requires_grad)
        if t["attn_mask"] is not None:
            owner.register_buffer("attn_mask", _causal_mask(n, old.device), persistent=False)
        for mod in (self.model, getattr(self.model, "text", None)):
            if mod is not None and hasattr(mod, "context_length"):
                mod.context_length = n
        if hasattr(owner, "num_pos"):
            owner.num_pos = n
        self.model_cfg.setdefault("text_cfg", {})["context_length"] = n
        self.max_text_len = n
        self._set_tokenizer_length(n)

    # -- images -----------------------------------------------------------------------------------
    def encode_image(
        self, pixel_values: Tensor, *, states: bool = False, states_rows: int | None = None, **kwargs: Any
    ) -> ImageFeatures:
        """Encode ``(B, 3, H, W)`` images: ``embeds`` ``(B, D)``; with ``states`` the last block's
        patch states ``(B, N, W)`` before the final norm, prefix tokens removed (``states_rows`` = n:
        the first n images' only)."""
        if kwargs:
            raise TypeError(f"open_clip image towers take no extra inputs, got {sorted(kwargs)}")
        grid = (pixel_values.shape[-2] // self.patch_size, pixel_values.shape[-1] // self.patch_size)
        pixel_values = pixel_values.to(next(self.model.visual.parameters()).dtype)
        if not states:
            return ImageFeatures(self.model.encode_image(pixel_values), None, grid)
        out = self.model.visual.forward_intermediates(
            pixel_values, indices=1, output_fmt="NLC", output_extra_tokens=True)
        patches = out["image_intermediates"][-1]
        prefix = out.get("image_intermediates_prefix")
        pooled_state = None
        if prefix is not None and prefix[-1].shape[1] > 0 and self._cls_pooled():
            pooled_state = prefix[-1][:, 0]
        return first_state_rows(ImageFeatures(out["image_features"], patches, grid, pooled_state=pooled_state),
                                states_rows)

    def _cls_pooled(self) -> bool:
        v = self.model.visual
        if self._is_timm():
            return v.trunk.attn_pool is None and v.trunk.global_pool == "token"
        return v.pool_type == "tok"

    def project_image_states(self, x: Tensor) -> Tensor:
        """``(..., W)`` -> ``(..., D)``: the tower's final norm and head applied per state. For CLS
        pooling the CLS state gives ``embeds``; an attention-pooling (``map``) head is run on each
        state as a length-1 sequence; with mean pooling ``embeds`` is the head of the mean, not a
        projection of any one state."""
        v = self.model.visual
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if not self._is_timm():
            h = v.ln_post(flat)
            h = h @ v.proj if v.proj is not None else h
            return h.reshape(*lead, -1)
        trunk = v.trunk
        h = trunk.norm(flat)
        if trunk.attn_pool is not None:
            h = trunk.attn_pool(h[:, None, :])
        h = trunk.head(trunk.head_drop(trunk.fc_norm(h)))
        return v.head(h).reshape(*lead, -1)

    def preprocess_images(self, images: list[Any]) -> dict[str, Tensor]:
        """PIL images -> ``{"pixel_values": (B, 3, H, W)}`` through open_clip's eval transform."""
        return {"pixel_values": torch.stack([self.image_processor(im.convert("RGB")) for im in images])}

    def image_transform_params(self) -> dict[str, Any]:
        """See :meth:`DualEncoder.image_transform_params`; read from open_clip's preprocess config."""
        pp = self.preprocess_cfg
        size = pp.get("size", 224)
        hw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        mode = {"shortest": "shortest_center_crop", "squash": "squash", "longest": "longest_pad"}[
            pp.get("resize_mode", "shortest")]
        resize: Any = hw[0] if mode == "shortest_center_crop" and hw[0] == hw[1] else hw
        return {
            "mode": mode,
            "size": resize,
            "crop": hw if mode != "squash" else None,
            "resample": "bilinear" if pp.get("interpolation") == "bilinear" else "bicubic",
            "mean": [float(v) for v in pp.get("mean")],
            "std": [float(v) for v in pp.get("std")],
            "patch_size": self.patch_size,
            "crop_offset": "round",  # torchvision's CenterCrop rounds the cut half (transformers floors it)
        }

    # -- the rest of the contract -----------------------------------------------------------------
    @property
    def logit_scale(self) -> nn.Parameter:
        """open_clip's ``logit_scale`` (log of the multiplier)."""
        return self.model.logit_scale

    @property
    def logit_bias(self) -> nn.Parameter | None:
        """open_clip's ``logit_bias`` (SigLIP configs, ``init_logit_bias``), else None."""
        return getattr(self.model, "logit_bias", None)

    def set_gradient_checkpointing(self, enable: bool = True) -> None:
        """open_clip's and timm's checkpointing, both non-reentrant."""
        self.model.set_grad_checkpointing(enable)

    def save_pretrained(self, path: str) -> None:
        """Write open_clip's folder format (``open_clip_config.json`` with ``model_cfg``,
        ``preprocess_cfg`` and ``xlipkit`` settings, ``open_clip_model.safetensors``, tokenizer
        files for HF tokenizers), atomically; ``open_clip.create_model("local-dir:PATH")`` reads it."""
        from safetensors.torch import save_file

        if self.adapter is not None and getattr(self.adapter, "type", "full") != "full":
            raise ValueError("this model carries a LoRA/DoRA adapter: save it with "
                             "finetune.models.finetuned.save_finetuned, or merge_adapter first")
        cfg = {
            "model_cfg": self.model_cfg,
            "preprocess_cfg": self.preprocess_cfg,
            "xlipkit": {"base_text_len": self.base_text_len, "kps": self.kps},
        }
        with atomic_dir(path) as tmp:
            state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
            save_file(state, str(tmp / WEIGHTS_NAME))
            inner = getattr(self.tokenizer, "tokenizer", None)
            if inner is not None:
                inner.save_pretrained(tmp)
            (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2), encoding="utf-8")


# -- construction ----------------------------------------------------------------------------------
def build_open_clip(
    model_cfg: dict[str, Any],
    tokenizer: Any,
    *,
    name_or_path: str,
    preprocess_cfg: dict[str, Any] | None = None,
) -> OpenCLIPDualEncoder:
    """Build an open_clip model with random weights from a config dict (open_clip's model-config
    JSON schema), the way ``open_clip.create_model`` picks ``CLIP`` or ``CustomTextCLIP``."""
    from open_clip import CLIP, CustomTextCLIP, set_model_preprocess_cfg
    from open_clip.transform import PreprocessCfg, merge_preprocess_dict

    cfg = deepcopy(model_cfg)
    custom = cfg.pop("custom_text", False) or "hf_model_name" in cfg.get("text_cfg", {})
    model = (CustomTextCLIP if custom else CLIP)(**cfg)
    pp = merge_preprocess_dict(PreprocessCfg(), {"size": model.visual.image_size, **(preprocess_cfg or {})})
    set_model_preprocess_cfg(model, pp)
    return OpenCLIPDualEncoder(model.eval(), tokenizer, model_cfg, name_or_path=name_or_path)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_NAME
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if "model_cfg" not in cfg:
        raise ValueError(f"{path} has no 'model_cfg' key: not an open_clip model folder")
    return cfg


#: the timm architecture of the ``tiny-openclip-siglip`` test config (:func:`register_tiny_timm_siglip`)
TIMM_TINY_SIGLIP = "xlipkit_tiny_vit_siglip"


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


def _register_test_towers(cfg: dict[str, Any]) -> None:
    if cfg.get("model_cfg", {}).get("vision_cfg", {}).get("timm_model_name") == TIMM_TINY_SIGLIP:
        register_tiny_timm_siglip()


def load_open_clip(
    name_or_path: str, *, dtype: torch.dtype | None = None, revision: str | None = None
) -> OpenCLIPDualEncoder:
    """Load an open_clip model: a local folder in open_clip's format, ``hf-hub:org/repo`` (or
    ``org/repo``), or a built-in architecture ``"ViT-B-16"`` / ``"ViT-B-16:pretrained_tag"``
    (random weights without a tag)."""
    import open_clip

    src = str(name_or_path)
    folder = Path(src[len("local-dir:"):] if src.startswith("local-dir:") else src)
    if folder.is_dir():
        cfg = _read_config(folder)
        _register_test_towers(cfg)
        model = open_clip.create_model(f"local-dir:{folder}")
        tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
        saved = cfg.get("xlipkit") or {}
        enc = OpenCLIPDualEncoder(model, tokenizer, cfg["model_cfg"], name_or_path=src,
                                  base_text_len=saved.get("base_text_len"), kps=saved.get("kps"))
    elif src.startswith("hf-hub:") or "/" in src:
        from huggingface_hub import hf_hub_download

        repo = src[len("hf-hub:"):] if src.startswith("hf-hub:") else src
        cfg_path = hf_hub_download(repo, CONFIG_NAME, revision=revision)
        cfg = json.loads(Path(cfg_path).read_text(encoding="utf-8"))
        _register_test_towers(cfg)
        model = open_clip.create_model(f"hf-hub:{repo}")
        tokenizer = open_clip.get_tokenizer(f"hf-hub:{repo}")
        saved = cfg.get("xlipkit") or {}
        enc = OpenCLIPDualEncoder(model, tokenizer, cfg["model_cfg"], name_or_path=src,
                                  base_text_len=saved.get("base_text_len"), kps=saved.get("kps"))
    else:
        arch, _, tag = src.partition(":")
        model_cfg = open_clip.get_model_config(arch)
        if model_cfg is None:
            raise ValueError(f"{arch!r} is not an open_clip architecture; open_clip.list_models() lists them")
        model = open_clip.create_model(arch, pretrained=tag or None)
        tokenizer = open_clip.get_tokenizer(arch)
        enc = OpenCLIPDualEncoder(model, tokenizer, model_cfg, name_or_path=src)
    if dtype is not None:
        enc.to(dtype)
    return enc.eval()


def load_longclip_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> OpenCLIPDualEncoder:
    """Load a Long-CLIP ``.pt`` checkpoint (e.g. ``longclip-B.pt``) as an open_clip ``CLIP``.

    Long-CLIP checkpoints are OpenAI-format state dicts with a 248-row ``positional_embedding``
    and, from its training code, a trainable copy ``positional_embedding_res`` used for rows >= 20
    (``model_longclip.py``: ``pe·mask1 + pe_res·mask2``). The two are merged into one table; the
    model gets ``kps = {"length": 248, "keep": 20, "ratio": 4, "freeze_kept": True}`` and
    ``base_text_len = 77``. Loaded with ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the file is not an OpenAI-format ViT CLIP state dict.
    """
    from open_clip import SimpleTokenizer
    from open_clip.transform import PreprocessCfg

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"Long-CLIP checkpoint {file} does not exist")
    sd = torch.load(file, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ValueError(f"{file} does not hold a state dict (got {type(sd).__name__})")
    sd = {(k[len("module."):] if k.startswith("module.") else k): v for k, v in sd.items()}
    required = ("visual.proj", "visual.conv1.weight", "text_projection", "positional_embedding",
                "token_embedding.weight")
    missing = [k for k in required if k not in sd]
    if missing:
        raise ValueError(f"{file} is not an OpenAI/Long-CLIP ViT checkpoint: missing {missing}")
    keep = 20
    if "positional_embedding_res" in sd:
        res = sd.pop("positional_embedding_res")
        rows = torch.arange(res.shape[0]).unsqueeze(1)
        mask1 = sd.pop("mask1", (rows < keep).to(res.dtype))
        sd.pop("mask2", None)
        sd["positional_embedding"] = sd["positional_embedding"] * mask1 + res * (1 - mask1)
    for key in ("input_resolution", "context_length", "vocab_size", "mask1", "mask2"):
        sd.pop(key, None)
    sd = {k: v.float() for k, v in sd.items()}

    n = sd["positional_embedding"].shape[0]
    width = sd["ln_final.weight"].shape[0]
    vision_width = sd["visual.conv1.weight"].shape[0]
    patch = sd["visual.conv1.weight"].shape[-1]
    grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    model_cfg = {
        "embed_dim": int(sd["text_projection"].shape[1]),
        "quick_gelu": True,  # OpenAI CLIP, and Long-CLIP fine-tuned from it, use QuickGELU
        "vision_cfg": {
            "image_size": int(patch * grid),
            "layers": len({k.split(".")[3] for k in sd if k.startswith("visual.transformer.resblocks.")}),
            "width": int(vision_width),
            "patch_size": int(patch),
        },
        "text_cfg": {
            "context_length": int(n),
            "vocab_size": int(sd["token_embedding.weight"].shape[0]),
            "width": int(width),
            "heads": int(width // 64),
            "layers": len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")}),
        },
    }
    base = 77
    kps = None
    if n > base:
        kps = {"length": int(n), "keep": keep, "ratio": kps_ratio(base, keep, int(n)), "freeze_kept": True}
    enc = build_open_clip(model_cfg, SimpleTokenizer(context_length=n), name_or_path=str(file),
                          preprocess_cfg={"size": model_cfg["vision_cfg"]["image_size"],
                                          "mean": PreprocessCfg().mean, "std": PreprocessCfg().std})
    try:
        enc.model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{file} does not match the CLIP architecture inferred from it: {e}") from e
    enc.base_text_len = base if n > base else n
    enc.kps = kps
    if dtype is not None:
        enc.to(dtype)
    return enc.eval()
