"""The ``flair`` model family: FLAIR's attention-pooled CLIP (FLAIR, section 3; public code ``model.py``).

The model is open_clip's ``CLIP`` (ViT image tower, causal text tower pooling the EOT token) plus FLAIR's
text-conditioned attention pool (:class:`losses.flair.TextConditionedAttentionPool`):

- image: the ViT's ``ln_post`` is applied to every token and ONE projection (``image_post.proj`` in the
  authors' checkpoints, open_clip's ``visual.proj`` here) maps both the class token (the global embedding,
  ``encode_image(...).embeds``) and the patch tokens (the local tokens the pool attends over,
  :meth:`FlairDualEncoder.local_tokens`);
- text: open_clip's text tower, EOT (argmax) pooling, ``ln_final`` and ``text_post.proj`` (open_clip's
  ``text_projection``);
- the pool, ``visual_proj`` in the authors' checkpoints (submodules ``attn``, ``ln_q``, ``ln_k``, ``ln_v``);
- ``logit_scale`` initialised to ``log(1 / 0.07)`` (CLIP's, as the authors' code) and ``logit_bias`` to
  -10 (a config's ``init_logit_bias`` overrides it: ``small-flair``, the CPU recipe's model, starts at -4);
  the objective term clamps the scale to ``[0, ln 100]`` after every step.

Folders of this family hold ``flair_config.json`` (the open_clip model config, the pool's heads, the
preprocessing) and ``flair_model.safetensors`` whose tensors carry the AUTHORS' parameter names
(:data:`AUTHOR_NAMES`), so a converted authors' checkpoint and a saved model are one format. The authors'
released ``.pt`` / ``.safetensors`` checkpoints load from a file or ``org/repo/file.pt`` on the hub
(:func:`load_flair_checkpoint`), their architecture read from the tensor shapes.
"""

from __future__ import annotations

import json
import math
import re
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from losses.flair import TextConditionedAttentionPool

from finetune.files import atomic_dir
from finetune.models.families import register_model_family
from finetune.models.registry import build_model, named_config, register_named_config
from finetune.models.backends.openclip import OpenCLIPDualEncoder

CONFIG_NAME = "flair_config.json"
WEIGHTS_NAME = "flair_model.safetensors"
FAMILY = "flair"
#: the attribute of the open_clip model that holds the pool (the authors' name)
POOL_NAME = "visual_proj"
#: log(1 / 0.07): FLAIR's initial log logit scale (public code ``model.py``; CLIP's init)
INIT_LOGIT_SCALE = math.log(1 / 0.07)
INIT_LOGIT_BIAS = -10.0
#: the clamp of the log logit scale after every optimiser step (public ``train.py``)
LOGIT_SCALE_RANGE = (0.0, math.log(100.0))
#: our parameter name -> the authors' (everything else is the same in both)
AUTHOR_NAMES = {"visual.proj": "image_post.proj", "text_projection": "text_post.proj"}
_OUR_NAMES = {v: k for k, v in AUTHOR_NAMES.items()}
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
HEAD_WIDTH = 64  # open_clip's head width, used to read the heads of an authors' checkpoint from its shapes
POOL_HEADS = 8   # FLAIR's pool heads (section 3.2, ViT-B/16)


def to_author_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename our state dict (open_clip ``CLIP`` names plus ``visual_proj.*``) to the authors' names."""
    return {AUTHOR_NAMES.get(k, k): v for k, v in state.items()}


def from_author_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an authors' state dict to ours; drops a DDP ``module.`` prefix."""
    out = {}
    for k, v in state.items():
        k = k[len("module."):] if k.startswith("module.") else k
        out[_OUR_NAMES.get(k, k)] = v
    return out


class FlairDualEncoder(OpenCLIPDualEncoder):
    """FLAIR's model as a :class:`~finetune.models.core.encoder.DualEncoder` (see the module docstring).

    ``encode_image`` gives the global embedding (class token through ``ln_post`` and the projection) and,
    with ``states=True``, the patch states before ``ln_post``; :meth:`local_tokens` projects them into the
    ``(B, N, D)`` local tokens, and :attr:`pool` conditions them on texts.

    Args:
        model: an open_clip ``CLIP`` (ViT image tower with class-token pooling, causal text tower).
        tokenizer: open_clip's ``SimpleTokenizer``.
        model_cfg: the open_clip model config of ``model``.
        pool_heads: heads of the attention pool (8 in FLAIR).
        name_or_path: where it came from.
    """

    backend = FAMILY

    def __init__(self, model: nn.Module, tokenizer: Any, model_cfg: dict[str, Any], *, pool_heads: int = POOL_HEADS,
                 name_or_path: str) -> None:
        from open_clip.transformer import VisionTransformer

        if not isinstance(getattr(model, "visual", None), VisionTransformer) or model.visual.pool_type != "tok":
            raise ValueError(f"{name_or_path!r}: FLAIR needs an open_clip ViT image tower with class-token pooling")
        if getattr(model.visual, "final_ln_after_pool", False) or model.visual.proj is None:
            raise ValueError(f"{name_or_path!r}: FLAIR's image tower applies ln_post to every token and has one "
                             f"projection (final_ln_after_pool false, a proj)")
        dim = int(model.visual.proj.shape[1])
        if POOL_NAME not in model._modules:
            model.add_module(POOL_NAME, TextConditionedAttentionPool(dim, pool_heads))
        if getattr(model, "logit_bias", None) is None:
            model.logit_bias = nn.Parameter(torch.tensor(INIT_LOGIT_BIAS))
        super().__init__(model, tokenizer, model_cfg, name_or_path=name_or_path)
        self.family = "clip"  # a causal CLIP text tower; the sigmoid loss is the objective's business
        self.pool_heads = int(pool_heads)

    @property
    def pool(self) -> TextConditionedAttentionPool:
        """The text-conditioned attention pool (``visual_proj`` in the authors' checkpoints)."""
        return getattr(self.model, POOL_NAME)

    @property
    def embed_dim(self) -> int:
        """D, the joint embedding width."""
        return int(self.model.visual.proj.shape[1])

    def local_tokens(self, states: Tensor) -> Tensor:
        """``(B, N, W)`` patch states (``encode_image(..., states=True).states``) -> ``(B, N, D)`` local
        tokens: ``ln_post`` and the shared projection, as the class token (FLAIR 3.2)."""
        return self.project_image_states(states)

    def encode_local(self, pixel_values: Tensor) -> tuple[Tensor, Tensor]:
        """``(B, 3, H, W)`` images -> ``(global (B, D), local (B, N, D))``, raw (not normalised)."""
        feats = self.encode_image(pixel_values, states=True)
        return feats.embeds, self.local_tokens(feats.states)

    def conditioned(self, texts: Tensor, local: Tensor) -> Tensor:
        """Text-conditioned image embeddings ``v_tc`` (FLAIR eq. 2): ``texts`` ``(B, Q, D)`` queries per
        image against ``local`` ``(B, N, D)`` -> ``(B, Q, D)``."""
        return self.pool(texts, local)

    def adapter_preset(self, *, include_mlp: bool = True) -> str | None:
        """None: the open_clip preset (the towers' attention and MLPs); the pool trains fully when asked
        (``adapter.extra_targets``)."""
        return None

    def config_dict(self) -> dict[str, Any]:
        """:meth:`DualEncoder.config_dict` plus the pool's heads."""
        return {**super().config_dict(), "pool_heads": self.pool_heads}

    def author_state_dict(self) -> dict[str, Tensor]:
        """The weights under the authors' parameter names (``image_post.proj``, ``text_post.proj``,
        ``visual_proj.*``, top-level ``token_embedding``, ...), detached, contiguous, on the CPU."""
        return {k: v.detach().contiguous().cpu() for k, v in to_author_names(self.model.state_dict()).items()}

    def save_pretrained(self, path: str) -> None:
        """Write ``flair_config.json`` and ``flair_model.safetensors`` (authors' names, pool included),
        atomically; :func:`load_flair` reads it back."""
        from safetensors.torch import save_file

        if self.adapter is not None and getattr(self.adapter, "type", "full") != "full":
            raise ValueError("this model carries a LoRA/DoRA adapter: save it with "
                             "finetune.models.finetuned.save_finetuned, or merge_adapter first")
        cfg = {"model_cfg": self.model_cfg, "preprocess_cfg": self.preprocess_cfg, "pool_heads": self.pool_heads,
               "parameter_names": "authors", "xlipkit": {"base_text_len": self.base_text_len, "kps": self.kps}}
        with atomic_dir(path) as tmp:
            save_file(self.author_state_dict(), str(tmp / WEIGHTS_NAME))
            (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2), encoding="utf-8")


# -- construction ---------------------------------------------------------------------------------------
def build_flair(model_cfg: dict[str, Any], *, pool_heads: int = POOL_HEADS, name_or_path: str = "flair",
                preprocess_cfg: dict[str, Any] | None = None, context_length: int | None = None) -> FlairDualEncoder:
    """A FLAIR model with random weights from an open_clip model config (``embed_dim``, ``vision_cfg``,
    ``text_cfg``), logit scale ``log(1/0.07)``, bias ``model_cfg["init_logit_bias"]`` (default -10, the paper's),
    the pool with ``pool_heads`` heads."""
    from open_clip import CLIP, SimpleTokenizer, set_model_preprocess_cfg
    from open_clip.transform import PreprocessCfg, merge_preprocess_dict

    cfg = deepcopy(model_cfg)
    bias = float(cfg.pop("init_logit_bias", INIT_LOGIT_BIAS))
    cfg.pop("init_logit_scale", None)
    model = CLIP(**cfg, init_logit_scale=INIT_LOGIT_SCALE, init_logit_bias=bias)
    pp = merge_preprocess_dict(PreprocessCfg(), {"size": model.visual.image_size, **(preprocess_cfg or {})})
    set_model_preprocess_cfg(model, pp)
    n = context_length or int(cfg.get("text_cfg", {}).get("context_length", 77))
    return FlairDualEncoder(model.eval(), SimpleTokenizer(context_length=n),
                            {**cfg, "init_logit_bias": bias}, pool_heads=pool_heads,
                            name_or_path=name_or_path)


def _load_weights(enc: FlairDualEncoder, state: dict[str, Tensor], source: str) -> None:
    ours = from_author_names(state)
    ours = {k: v.float() if v.is_floating_point() else v for k, v in ours.items()}
    try:
        enc.model.load_state_dict(ours, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{source}: the weights do not fit the FLAIR architecture {enc.model_cfg}: {e}") from e


def load_flair(name_or_path: str, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False,
               revision: str | None = None) -> FlairDualEncoder:
    """The ``flair`` family's loader: a registry name (``flair-vit-b-16``, ``tiny-flair``, ``small-flair``:
    random weights), a folder written by :meth:`FlairDualEncoder.save_pretrained`, an authors' checkpoint
    file (``.pt`` / ``.bin`` / ``.safetensors``), a hub repo holding a saved folder (``org/repo``) or an
    authors' checkpoint on the hub (``org/repo/file.pt``, e.g. ``xiaorui638/flair/flair-cc3m-recap.pt``).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: a folder without ``flair_config.json``, or weights that do not fit.
    """
    src = str(name_or_path)
    entry = named_config(src)
    if entry is not None and entry.backend == FAMILY:
        enc = build_model(entry.name)
    else:
        path = Path(src).expanduser()
        if path.is_dir():
            enc = _load_folder(path)
        elif path.is_file() or src.endswith(_CHECKPOINT_SUFFIXES) and src.startswith(("/", ".", "~")):
            enc = load_flair_checkpoint(path)
        elif src.startswith(("/", "./", "../", "~")):
            raise FileNotFoundError(f"FLAIR model path {path} does not exist")
        else:
            enc = _load_hub(src[len("hf-hub:"):] if src.startswith("hf-hub:") else src, revision)
    if dtype is not None:
        enc.to(dtype)
    return enc.eval()


def _load_folder(folder: Path) -> FlairDualEncoder:
    from safetensors.torch import load_file

    cfg_path = folder / CONFIG_NAME
    if not cfg_path.is_file():
        raise ValueError(f"{folder} is not a FLAIR model folder: no {CONFIG_NAME} (found: "
                         f"{sorted(p.name for p in folder.iterdir())[:10]})")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        model_cfg = cfg["model_cfg"]
    except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{cfg_path} is not a valid FLAIR config ({e!r}): it needs a 'model_cfg'") from e
    saved = cfg.get("xlipkit") or {}
    n = int(model_cfg.get("text_cfg", {}).get("context_length", 77))
    enc = build_flair(model_cfg, pool_heads=int(cfg.get("pool_heads", POOL_HEADS)), name_or_path=str(folder),
                      preprocess_cfg=cfg.get("preprocess_cfg"), context_length=n)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise ValueError(f"{folder}: {CONFIG_NAME} is there but {WEIGHTS_NAME} is missing")
    _load_weights(enc, load_file(str(weights)), str(weights))
    enc.base_text_len = int(saved.get("base_text_len") or n)
    enc.kps = saved.get("kps")
    return enc


def _load_hub(repo: str, revision: str | None) -> FlairDualEncoder:
    from huggingface_hub import hf_hub_download

    parts = repo.split("/")
    if len(parts) > 2:  # org/repo/path/to/checkpoint.pt: an authors' checkpoint file
        file = hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]), revision=revision)
        enc = load_flair_checkpoint(file)
    else:
        cfg = Path(hf_hub_download(repo, CONFIG_NAME, revision=revision))
        hf_hub_download(repo, WEIGHTS_NAME, revision=revision)
        enc = _load_folder(cfg.parent)
    enc.name_or_path = repo
    return enc


def _read_checkpoint(file: Path) -> dict[str, Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    sd = torch.load(file, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]  # open_clip's training checkpoint: {"epoch", "name", "state_dict", "optimizer"}
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise ValueError(f"{file} does not hold a state dict of tensors")
    return sd


def _layers(state: dict[str, Tensor], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return len({m.group(1) for k in state if (m := pattern.match(k))})


def flair_config_from_state(state: dict[str, Tensor]) -> dict[str, Any]:
    """The open_clip model config of an authors' FLAIR state dict, read from its shapes (heads: width / 64,
    open_clip's head width; MLP ratio from ``c_fc``).

    Raises:
        ValueError: naming the missing parameters when it is not a FLAIR ViT checkpoint.
    """
    required = ("image_post.proj", "text_post.proj", "visual.conv1.weight", "visual.positional_embedding",
                "token_embedding.weight", "positional_embedding", "ln_final.weight", "visual_proj.attn.in_proj_weight")
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"not a FLAIR ViT checkpoint with the authors' parameter names: missing {missing}")
    vision_width = int(state["visual.conv1.weight"].shape[0])
    patch = int(state["visual.conv1.weight"].shape[-1])
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    width = int(state["ln_final.weight"].shape[0])
    v_mlp = state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0] / vision_width
    t_mlp = state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0] / width
    return {
        "embed_dim": int(state["image_post.proj"].shape[1]),
        "vision_cfg": {"image_size": patch * grid, "layers": _layers(state, "visual.transformer.resblocks."),
                       "width": vision_width, "head_width": HEAD_WIDTH, "patch_size": patch, "mlp_ratio": v_mlp},
        "text_cfg": {"context_length": int(state["positional_embedding"].shape[0]),
                     "vocab_size": int(state["token_embedding.weight"].shape[0]), "width": width,
                     "heads": max(1, width // HEAD_WIDTH), "layers": _layers(state, "transformer.resblocks."),
                     "mlp_ratio": t_mlp},
    }


def load_flair_checkpoint(path: str | Path, *, pool_heads: int = POOL_HEADS,
                          dtype: torch.dtype | None = None) -> FlairDualEncoder:
    """Load an authors' FLAIR checkpoint (``flair-cc3m-recap.pt``, ...; their parameter names, an optional
    ``state_dict`` wrapper and ``module.`` prefix), with ``torch.load(weights_only=True)`` or safetensors.

    The architecture is read from the shapes (:func:`flair_config_from_state`); the pool's heads cannot be,
    and are FLAIR's 8 unless ``pool_heads`` says otherwise. Preprocessing is open_clip's default (224 px
    or the checkpoint's size, bicubic, OpenAI mean and std), as the authors'.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a FLAIR checkpoint, or weights that do not fit.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"FLAIR checkpoint {file} does not exist")
    state = _read_checkpoint(file)
    state = {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}
    try:
        model_cfg = flair_config_from_state(state)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    enc = build_flair(model_cfg, pool_heads=pool_heads, name_or_path=str(file))
    _load_weights(enc, state, str(file))
    if dtype is not None:
        enc.to(dtype)
    return enc.eval()


# -- registry configs -----------------------------------------------------------------------------------
def flair_vit_b16_config() -> dict[str, Any]:
    """FLAIR ViT-B/16 (public ``ViT-B-16-FLAIR.json``: open_clip's ViT-B-16)."""
    return {"embed_dim": 512,
            "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 16},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12}}


def tiny_flair_config() -> dict[str, Any]:
    """Test size: 2 layers, width 64 (one 64-wide head, so an authors'-format copy's shapes give it back),
    32-pixel images, patch 8."""
    return {"embed_dim": 64,
            "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 2}}


#: the CPU recipe's initial logit bias: about -ln(32), the batch (a choice; the paper gives only -10). From
#: -10, AdamW moves the bias by about lr per step, so a few hundred steps at lr 1e-3 cannot calibrate it and
#: the towers collapse to the chance-level constant; ``flair-vit-b-16`` keeps the paper's -10.
SMALL_INIT_LOGIT_BIAS = -4.0


def small_flair_config() -> dict[str, Any]:
    """The CPU recipe's size (``flair_tiny_synthetic.yaml``): 2 layers, width 64 (one 64-wide head) in both
    towers, 64-pixel images, patch 8 (64 patches); logit bias initialised to :data:`SMALL_INIT_LOGIT_BIAS`."""
    return {"embed_dim": 64, "init_logit_bias": SMALL_INIT_LOGIT_BIAS,
            "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "patch_size": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 2}}


def _detect(folder: Path) -> bool:
    return (Path(folder) / CONFIG_NAME).is_file()


def _save(model: Any, folder: str) -> None:
    model.save_pretrained(str(folder))


register_model_family(FAMILY, load_flair, _save, detect=_detect, files=f"{CONFIG_NAME} (FLAIR)")


# -- named configs (random weights; finetune.models.registry) -----------------------------------------
def _named(config: Any, name: str) -> Any:
    return lambda: build_flair(config(), pool_heads=8, name_or_path=name)


register_named_config("tiny-flair", FAMILY, "clip", "FLAIR (open_clip ViT + attention pool), 2 layers, width 64, 32 px",
                      _named(tiny_flair_config, "tiny-flair"))
register_named_config("small-flair", FAMILY, "clip", "FLAIR for the CPU recipe: 2 layers, width 64, 64 px, patch 8",
                      _named(small_flair_config, "small-flair"))
register_named_config("flair-vit-b-16", FAMILY, "clip", "FLAIR ViT-B/16 (paper), random weights",
                      _named(flair_vit_b16_config, "flair-vit-b-16"), real=True,
                      pretrained="xiaorui638/flair/flair-cc3m-recap.pt (model.family: flair)")

__all__ = ["AUTHOR_NAMES", "FlairDualEncoder", "INIT_LOGIT_BIAS", "INIT_LOGIT_SCALE", "LOGIT_SCALE_RANGE",
           "build_flair", "flair_config_from_state", "from_author_names", "load_flair", "load_flair_checkpoint",
           "to_author_names"]
