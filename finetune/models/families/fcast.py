"""The F-CAST model family ``fcast`` (F-CAST section 3): CAST image encoder + hierarchical text encoder.

- Image: :class:`finetune.models.cast.CastEncoder` on superpixels that :meth:`FCastModel.preprocess_images`
  computes (``finetune.preprocess.superpixels``) next to the pixels, in the data workers, or takes precomputed
  (a stream's ``KEY.superpixels.png`` entries, written once by ``xlipkit superpixels``).
- Text (3.2, eqs. 1-3): stage 1, a causal CLIP-style transformer (8 layers, context 77), encodes each
  chunk of 1-3 sentences on its own (``t_sub``, pooled at the end token and projected to D); a light
  residual MLP adapter (CLIP-Adapter, Gao et al. 2024: ``a·MLP(t) + (1-a)·t``, bottleneck D/4, a = 0.2)
  refines them; stage 2 (4 layers, bidirectional, learned positions) over a [CLS] token and the N = 4
  chunk embeddings gives ``t_long`` from its [CLS] output.
- Heads of the losses (3.3): FLAIR's :class:`~losses.flair.TextConditionedAttentionPool` over ``v_fine``,
  the part-level scale and bias, the whole-level scale and bias (``logit_scale`` / ``logit_bias``, the
  ones inference uses).

Inference uses the whole level only (3.3, "Inference with F-CAST"): ``encode_image(...).embeds`` is
``v_coarse``, ``encode_text(...).embeds`` is ``t_long`` of the balanced chunks (appendix C), so the
standard evaluator and benchmarks score cosines of the two. :meth:`FCastModel.tokenize` packs a
caption's N balanced chunks as N rows of 77 tokens side by side: ``input_ids (B, N * 77)``; an empty
chunk (a caption of fewer than N sentences) has an all-zero attention mask and is masked in stage 2.

A folder holds ``fcast_config.json`` and ``model.safetensors`` (the tokenizer is CLIP's BPE, built
offline from open_clip's vocabulary).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from finetune.models.cast import CAST_CONFIGS, CastConfig, CastEncoder, CastOutput
from finetune.models.core.encoder import DualEncoder, ImageFeatures, TextFeatures, TokenizedText
from finetune.models.families import register_model_family
from finetune.models.registry import register_named_config
from losses.flair import TextConditionedAttentionPool

CONFIG_NAME = "fcast_config.json"
#: stage 1 runs rows without a planned length at a multiple of this (at most the context): few shapes
BUCKET_STEP = 32
WEIGHTS_NAME = "model.safetensors"
MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's normalisation
STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class FCastConfig:
    """An F-CAST model.

    Attributes:
        image: the CAST encoder (:class:`CastConfig` fields).
        text_width, text_heads: stage-1 width and heads (FLAIR's text tower: 512, 8).
        stage1_layers, stage2_layers: 8 and 4 (F-CAST 3.2).
        context: stage-1 context per chunk (77).
        vocab_size: CLIP BPE (49,408).
        n_chunks: N (4).
        adapter_reduction, adapter_ratio: CLIP-Adapter's bottleneck (D/4) and residual ratio (0.2).
        pool_heads: heads of the attention pool (FLAIR: 8).
        init_logit_scale: scale of both levels at init, 1/0.07 (F-CAST 4.1 "0.07", read as FLAIR's
            temperature: log scale log(1/0.07)).
        init_logit_bias: -10 for both levels.
        superpixels: ``finetune.preprocess.superpixels.SuperpixelSettings`` fields; ``n_segments``
            defaults to the image config's.
    """

    image: dict = field(default_factory=lambda: CAST_CONFIGS["cast-b"].to_dict())
    text_width: int = 512
    text_heads: int = 8
    stage1_layers: int = 8
    stage2_layers: int = 4
    context: int = 77
    vocab_size: int = 49408
    n_chunks: int = 4
    adapter_reduction: int = 4
    adapter_ratio: float = 0.2
    pool_heads: int = 8
    init_logit_scale: float = 1 / 0.07
    init_logit_bias: float = -10.0
    superpixels: dict = field(default_factory=dict)

    def cast(self) -> CastConfig:
        return CastConfig(**self.image)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _named(image: str, **text: Any) -> FCastConfig:
    return FCastConfig(image=CAST_CONFIGS[image].to_dict(), **text)


#: registry names of the family (random weights): the paper's CAST-B model, a CAST-S one, a tiny one.
FCAST_CONFIGS: dict[str, Any] = {
    "fcast-b": lambda: _named("cast-b"),
    "fcast-s": lambda: _named("cast-s", text_width=384, text_heads=6),
    # the toy's biases start at -4 (about -ln(B) for its batch of 64): -10 is made for runs of 10^5 steps, and
    # AdamW moves a bias by at most lr per step, so a few hundred CPU steps cannot bring it to -ln(B)
    "fcast-tiny": lambda: _named("cast-tiny", text_width=64, text_heads=4, stage1_layers=2, stage2_layers=1,
                                 pool_heads=4, init_logit_bias=-4.0),
}


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None) -> Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class ChunkEncoder(nn.Module):
    """Stage 1 (eq. 1): a causal transformer over one chunk's tokens ``(n, 77)`` -> ``t_sub (n, D)``, the
    end token's state after ``ln_final`` times ``text_projection`` (CLIP's text tower)."""

    def __init__(self, vocab: int, context: int, width: int, heads: int, layers: int, embed_dim: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.positional_embedding = nn.Parameter(torch.randn(context, width) * 0.01)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed_dim) * width ** -0.5)
        nn.init.normal_(self.token_embedding.weight, std=0.02)

    @staticmethod
    def longest(attention_mask: Tensor) -> int:
        """The longest real row (at least 1). It reads the mask: call it where the mask is on the CPU (the data
        loader's collate)."""
        return max(int(attention_mask.long().sum(dim=1).max()), 1) if attention_mask.shape[0] else 1

    def columns(self, attention_mask: Tensor) -> int:
        """Columns the rows are cut to when no plan gave them: the smallest multiple of :data:`BUCKET_STEP` that
        holds :meth:`longest`, at most the context (77: 32, 64 or 77, the default buckets of a training run, so
        that evaluation's passes take a few shapes). It reads the mask."""
        context = self.positional_embedding.shape[0]
        return min(-(-self.longest(attention_mask) // BUCKET_STEP) * BUCKET_STEP, context)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, longest: int | None = None) -> Tensor:
        """``(n, 77)`` ids -> ``(n, D)``; ``longest``: the columns to run at, at least the longest real row, chosen
        on the CPU (a training batch's text plan); None: :meth:`columns`, a read of the mask."""
        # causal: trailing padding never reaches the end token, so rows are cut to the planned columns
        if longest is None:
            longest = self.columns(attention_mask)
        input_ids, attention_mask = input_ids[:, :longest], attention_mask[:, :longest]
        n, length = input_ids.shape
        x = self.token_embedding(input_ids) + self.positional_embedding[:length]
        causal = torch.full((length, length), float("-inf"), device=x.device).triu(1)
        for blk in self.blocks:
            x = blk(x, attn_mask=causal)
        end = (attention_mask.long().sum(dim=1) - 1).clamp(min=0)
        return self.ln_final(x[torch.arange(n, device=x.device), end]) @ self.text_projection


class ResidualAdapter(nn.Module):
    """CLIP-Adapter (Gao et al. 2024): ``a · MLP(t) + (1 - a) · t`` with ``MLP = ReLU(W2 ReLU(W1 t))``,
    ``W1: D -> D/r``, ``W2: D/r -> D`` without biases."""

    def __init__(self, dim: int, reduction: int = 4, ratio: float = 0.2) -> None:
        super().__init__()
        self.ratio = ratio
        self.fc = nn.Sequential(nn.Linear(dim, dim // reduction, bias=False), nn.ReLU(inplace=True),
                                nn.Linear(dim // reduction, dim, bias=False), nn.ReLU(inplace=True))

    def forward(self, x: Tensor) -> Tensor:
        return self.ratio * self.fc(x) + (1 - self.ratio) * x


class CaptionEncoder(nn.Module):
    """Stage 2 (eq. 3): ``t_long = proj(LN(Transformer([CLS]; Adapter(t_sub) + positions))[CLS])``.

    ``t_sub (B, N, D)``; ``valid (B, N)`` bool masks empty chunks (never the [CLS] token)."""

    def __init__(self, dim: int, heads: int, layers: int, n_chunks: int, reduction: int, ratio: float) -> None:
        super().__init__()
        self.adapter = ResidualAdapter(dim, reduction, ratio)
        self.cls_token = nn.Parameter(torch.randn(dim) * 0.02)
        self.positional_embedding = nn.Parameter(torch.randn(n_chunks + 1, dim) * 0.01)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_final = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, t_sub: Tensor, valid: Tensor) -> Tensor:
        b, n, _ = t_sub.shape
        x = torch.cat([self.cls_token.expand(b, 1, -1), self.adapter(t_sub)], dim=1)
        x = x + self.positional_embedding[: n + 1]
        pad = torch.cat([valid.new_zeros(b, 1), ~valid.bool()], dim=1)
        for blk in self.blocks:
            x = blk(x, key_padding_mask=pad)
        return self.proj(self.ln_final(x[:, 0]))


class FCastModel(DualEncoder):
    """An F-CAST model as a :class:`DualEncoder` (see the module docstring).

    Args:
        config: the :class:`FCastConfig`.
        name_or_path: what it was loaded from.
    """

    backend = "fcast"
    family = "siglip"  # sigmoid losses with a bias; inference by cosine

    def __init__(self, config: FCastConfig, name_or_path: str = "") -> None:
        from finetune.models.offline_tokenizers import clip_tokenizer
        from finetune.preprocess.superpixels import settings_from

        cast = config.cast()
        stage2_heads = config.text_heads if cast.embed_dim % config.text_heads == 0 else 1
        module = nn.Module()
        module.visual = CastEncoder(cast)
        module.text = ChunkEncoder(config.vocab_size, config.context, config.text_width, config.text_heads,
                                   config.stage1_layers, cast.embed_dim)
        module.caption = CaptionEncoder(cast.embed_dim, stage2_heads,
                                        config.stage2_layers, config.n_chunks, config.adapter_reduction,
                                        config.adapter_ratio)
        module.part_pool = TextConditionedAttentionPool(cast.embed_dim, config.pool_heads)
        init_scale = math.log(config.init_logit_scale)
        module.logit_scale = nn.Parameter(torch.tensor(init_scale))
        module.logit_bias = nn.Parameter(torch.tensor(config.init_logit_bias))
        module.part_logit_scale = nn.Parameter(torch.tensor(init_scale))
        module.part_logit_bias = nn.Parameter(torch.tensor(config.init_logit_bias))
        super().__init__(module)
        self.config = config
        self.name_or_path = name_or_path
        self.tokenizer = clip_tokenizer(config.context)
        self.max_text_len = self.base_text_len = config.context
        self.image_size, self.patch_size = cast.image_size, 8
        self.n_chunks = config.n_chunks
        self.superpixels = settings_from({"n_segments": cast.n_segments, **(config.superpixels or {})})
        #: folder of the superpixel cache (set for map-style training data by the ``fcast`` term), or None
        self.superpixel_cache_dir: str | None = None

    # -- parameters -------------------------------------------------------------------------------
    @property
    def logit_scale(self) -> nn.Parameter:
        """Log of the whole-level scale (eq. 8), the one inference uses."""
        return self.model.logit_scale

    @property
    def logit_bias(self) -> nn.Parameter:
        """Whole-level bias (eq. 8)."""
        return self.model.logit_bias

    # -- text -------------------------------------------------------------------------------------
    def tokenize_chunks(self, texts: list[str]) -> TokenizedText:
        """Each text as one stage-1 row: ``(n, 77)`` ids, end token kept on truncation."""
        from finetune.models.core.tokens import hf_tokenize

        tok = hf_tokenize(self.tokenizer, list(texts), self.config.context)
        ids, mask = tok.input_ids, tok.attention_mask
        if ids.shape[1] < self.config.context:
            pad = self.config.context - ids.shape[1]
            ids = F.pad(ids, (0, pad), value=self.tokenizer.pad_token_id or 0)
            mask = F.pad(mask, (0, pad), value=0)
        return TokenizedText(ids, mask, tok.truncated)

    def tokenize(self, texts: list[str], *, max_length: int | None = None) -> TokenizedText:
        """Captions -> their N balanced chunks (appendix C) side by side: ``input_ids (B, N * 77)``,
        ``attention_mask`` all zero on an empty chunk; ``truncated`` where any chunk was cut."""
        from finetune.data.text import balanced_chunks, split_sentences

        if isinstance(texts, str):
            raise TypeError("tokenize expects a list of captions, not one string: wrap it as [caption]")
        n = self.n_chunks
        rows, empty = [], []
        for text in texts:
            chunks = balanced_chunks(split_sentences(text), n)
            if not any(chunks):
                chunks[0] = [text.strip()]
            rows += [" ".join(c) for c in chunks]
            empty += [not c for c in chunks]
        tok = self.tokenize_chunks(rows)
        mask = tok.attention_mask.masked_fill(torch.tensor(empty, dtype=torch.bool)[:, None], 0)
        b = len(texts)
        truncated = tok.truncated.reshape(b, n).any(dim=1) if b else tok.truncated
        self._count_truncation(truncated)
        return TokenizedText(tok.input_ids.reshape(b, -1), mask.reshape(b, -1), truncated)

    def encode_subcaptions(self, input_ids: Tensor, attention_mask: Tensor, *, longest: int | None = None) -> Tensor:
        """Stage 1 (eqs. 1-2): ``(n, 77)`` ids -> ``t_sub (n, D)``. ``longest``: the columns to run the rows at (at
        least their longest real row), chosen where the mask is on the CPU (a training batch's text plan), so that
        the step does not read it; None: ``ChunkEncoder.columns`` of the mask, here."""
        return self.model.text(input_ids, attention_mask, longest)

    def encode_long(self, t_sub: Tensor, valid: Tensor | None = None) -> Tensor:
        """Adapter + stage 2 (eq. 3): ``t_sub (B, N, D)`` -> ``t_long (B, D)``."""
        if valid is None:
            valid = torch.ones(t_sub.shape[:2], dtype=torch.bool, device=t_sub.device)
        return self.model.caption(t_sub, valid)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                    states: bool = False) -> TextFeatures:
        """``input_ids (B, N * 77)`` from :meth:`tokenize` -> ``embeds = t_long (B, D)``."""
        if states:
            self.require("states", "encode_text(states=True)")
        b, n, c = input_ids.shape[0], self.n_chunks, self.config.context
        if input_ids.shape[1] != n * c:
            raise ValueError(f"F-CAST encode_text expects input_ids (B, {n} x {c}) from FCastModel.tokenize (N "
                             f"balanced chunks), got {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.reshape(b * n, c)
        t_sub = self.encode_subcaptions(input_ids.reshape(b * n, c), mask).reshape(b, n, -1)
        valid = mask.reshape(b, n, c).bool().any(dim=-1)
        return TextFeatures(self.encode_long(t_sub, valid), None, attention_mask)

    # -- images -----------------------------------------------------------------------------------
    def _prepare_image(self, image: Any) -> np.ndarray:
        from finetune.preprocess.superpixels import encoder_view

        return encoder_view(image, self.image_size)

    def superpixels_of(self, array: np.ndarray) -> np.ndarray:
        """Superpixel labels ``(H, W)`` of a preprocessed RGB uint8 image (through the cache when set)."""
        from finetune.preprocess.superpixels import SuperpixelCache, compute_superpixels

        if self.superpixel_cache_dir:
            return SuperpixelCache(self.superpixel_cache_dir, self.superpixels).get(array)
        return compute_superpixels(array, self.superpixels)

    def superpixels_of_batch(self, arrays: list[np.ndarray]) -> np.ndarray:
        """:meth:`superpixels_of` of a batch, ``(B, H, W)``: SFCN in one forward of the network (the same labels as one
        image at a time), SLIC and SEEDS per image; through the cache when set."""
        from finetune.preprocess.superpixels import SuperpixelCache, compute_superpixels_batch

        if self.superpixel_cache_dir:
            return SuperpixelCache(self.superpixel_cache_dir, self.superpixels).get_batch(arrays)
        return compute_superpixels_batch(arrays, self.superpixels)

    def preprocess_images(self, images: list[Any], superpixels: list[np.ndarray | None] | None = None
                          ) -> dict[str, Tensor]:
        """PIL images -> ``pixel_values (B, 3, S, S)`` (shortest side resized to S bicubic, centre crop,
        CLIP normalisation) and ``superpixels (B, S, S)`` int64 labels of the same crop.

        Args:
            images: PIL images.
            superpixels: per image, labels ``(S, S)`` precomputed on that crop (a stream's ``KEY.superpixels.png``
                entries, written by ``xlipkit superpixels``) or None where they are to be computed here.
        Raises:
            ValueError: precomputed labels of another size than the crop.
        """
        arrays = [self._prepare_image(im) for im in images]
        pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0
        pixels = (pixels - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]
        given = list(superpixels) if superpixels is not None else [None] * len(arrays)
        if len(given) != len(arrays):
            raise ValueError(f"preprocess_images: {len(given)} superpixel maps for {len(arrays)} images")
        side = self.image_size
        for labels in given:
            if labels is not None and tuple(np.shape(labels)) != (side, side):
                raise ValueError(f"precomputed superpixels of shape {tuple(np.shape(labels))} for a {side} x {side} "
                                 f"image: they were made for another image size; run `xlipkit superpixels` again")
        missing = [i for i, labels in enumerate(given) if labels is None]
        if missing:
            for i, labels in zip(missing, self.superpixels_of_batch([arrays[i] for i in missing])):
                given[i] = labels
        labels = torch.from_numpy(np.stack([np.asarray(g, dtype=np.int64) for g in given]))
        return {"pixel_values": pixels, "superpixels": labels}

    def encode_image_hierarchy(self, pixel_values: Tensor, superpixels: Tensor | None, *,
                               n_segments: int | None = None, noise_tokens: int | None = None) -> CastOutput:
        """The CAST encoder's full output (``v_fine``, ``v_coarse``, assignments) for ``pixel_values
        (B, 3, S, S)`` and ``superpixels (B, S, S)``. ``n_segments``: the segment count of the superpixels, counted
        where they are on the CPU (:meth:`segment_count`), so that the step does not read it; None counts it here.
        ``noise_tokens``: the segment tokens the first pooling's dropout is drawn at (the run's planned capacity;
        :class:`~finetune.models.cast.GraphPool`)."""
        if superpixels is None:
            raise ValueError("the F-CAST image encoder needs superpixels: pass the `superpixels` that "
                             "FCastModel.preprocess_images returns next to pixel_values")
        return self.model.visual(pixel_values, superpixels, n_segments, noise_tokens=noise_tokens)

    def segment_count(self, pixel_values: Tensor, superpixels: Tensor) -> int:
        """The segment count of ``superpixels`` (``CastEncoder.segment_count``): call it on the CPU."""
        return self.model.visual.segment_count(pixel_values, superpixels)

    def encode_image(self, pixel_values: Tensor, *, states: bool = False, states_rows: int | None = None,
                     superpixels: Tensor | None = None, **kwargs: Any) -> ImageFeatures:
        """``embeds = v_coarse (B, D)`` (whole level, 3.3)."""
        if states:
            self.require("states", "encode_image(states=True)")
        out = self.encode_image_hierarchy(pixel_values, superpixels)
        return ImageFeatures(out.coarse, None, tuple(out.labels.shape[-2:]))

    # -- saving -----------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        return {**super().config_dict(), "fcast": self.config.to_dict()}

    def save_pretrained(self, path: str) -> None:
        """Write ``fcast_config.json`` and ``model.safetensors`` into ``path``."""
        from safetensors.torch import save_file

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n", encoding="utf-8")
        state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt", "family": "fcast"})


def build_fcast(name: str) -> FCastModel:
    """A registry model of the family with random weights (``fcast-b``, ``fcast-s``, ``fcast-tiny``)."""
    return FCastModel(FCAST_CONFIGS[name](), name_or_path=name)


def load_fcast(name_or_path: str, *, dtype: Any = None, trust_remote_code: bool = False,
               revision: str | None = None) -> FCastModel:
    """Load a registry name (random weights) or a folder written by :meth:`FCastModel.save_pretrained`.

    Raises:
        FileNotFoundError: neither a registry name nor a folder with ``fcast_config.json``.
        ValueError: a config with unknown keys, or weights that do not match it.
    """
    if name_or_path in FCAST_CONFIGS:
        model = build_fcast(name_or_path)
    else:
        folder = Path(name_or_path).expanduser()
        if not (folder / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{folder} is not an F-CAST model folder (no {CONFIG_NAME}); registry names: "
                                    f"{', '.join(FCAST_CONFIGS)}")
        raw = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
        unknown = set(raw) - set(FCastConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{folder / CONFIG_NAME}: unknown keys {sorted(unknown)}")
        model = FCastModel(FCastConfig(**raw), name_or_path=str(folder))
        from safetensors.torch import load_file

        state = load_file(str(folder / WEIGHTS_NAME))
        missing, unexpected = model.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder / WEIGHTS_NAME} does not match {CONFIG_NAME}: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    if dtype is not None:
        model = model.to(dtype)
    return model


def _save_fcast(model: DualEncoder, folder: str) -> None:
    model.save_pretrained(str(folder))


register_model_family("fcast", load_fcast, _save_fcast, detect=lambda p: (Path(p) / CONFIG_NAME).is_file(),
                      files=f"{CONFIG_NAME} (F-CAST)")
# the named configs build through the family's loader (load_model("random:fcast-b")), not build_model
register_named_config("fcast-b", "fcast", "clip", "F-CAST with the paper's CAST-B image encoder, random weights",
                      None, real=True)
register_named_config("fcast-s", "fcast", "clip", "F-CAST with a CAST-S image encoder, random weights", None,
                      real=True)
register_named_config("fcast-tiny", "fcast", "clip", "F-CAST toy size for CPU recipes and tests", None)
