"""Loading and saving models: ``finetune.load_model`` (one entry point for registry names, local folders,
checkpoints and hub ids) and the fine-tuned folders of :func:`save_finetuned` / :func:`load_finetuned`
(DESIGN 2, ``finetuned.py``).

A saved adapter folder holds peft's ``adapter_config.json`` + ``adapter_model.safetensors``,
``xlipkit_extra.safetensors`` (the extra trained tensors) and ``xlipkit.json`` (base model,
backend, family, KPS settings, adapter settings, a fingerprint of the base architecture, the
recipe), so that :func:`load_finetuned` rebuilds base + KPS + adapter exactly. ``load_model`` of
such a folder calls :func:`load_finetuned`, which loads the base with ``load_model``: the two live
in this one module, above :mod:`finetune.models.adapters`."""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from finetune.config import AdapterConfig
from finetune.models.adapters import (
    EXTRA_NAME,
    _attach_peft,
    _quiet_peft,
    base_signature,
    extra_parameter_names,
    merge_adapter,
    peft_model_of,
)
from finetune.files import atomic_dir
from finetune.models.core.encoder import DualEncoder
from finetune.models.weight_files import check_weight_files, naming_damaged_weights

INFO_NAME = "xlipkit.json"
FORMAT_VERSION = 1

_BUILTIN = ("auto", "hf", "open_clip")  # the families the name resolution below knows without a folder
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
_KPS_KEYS = {"keep", "ratio", "freeze_kept"}
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin")


def _torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _looks_local(name: str) -> bool:
    # hub ids are "org/name"; anything else with a path shape is meant as a local path
    return (name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name) or name.endswith(_CHECKPOINT_SUFFIXES))


log = logging.getLogger("xlipkit")


class ModelNotFoundError(ValueError):
    """No model family could load the model name: the message lists what was tried and the registry names."""


class TextLengthError(ValueError):
    """A ``max_text_len`` the model cannot take: below its original text length, or below positions already
    stretched (the message says which values work)."""


class RandomWeightsNameError(ModelNotFoundError):
    """A bare registry name of a real-size architecture (``clip-vit-base-patch16``): it would build random
    weights where the user most likely meant the pretrained checkpoint; the message names both spellings."""


def _unknown(name: str, family: str, tried: list[str]) -> ModelNotFoundError:
    from finetune.models.families import model_family_names
    from finetune.models.registry import registry_names

    lines = [f"could not load model {name!r} (family={family!r}). Looked for:"]
    lines += [f"  - {t}" for t in tried]
    lines.append(f"Registry names (random weights): {', '.join(registry_names())}; write them as 'random:NAME' "
                 "(e.g. 'random:tiny-clip')")
    lines.append("Families: 'hf' (transformers CLIPModel, SiglipModel, Siglip2Model: hub id or save_pretrained "
                 "folder) and 'open_clip' (architecture names such as 'ViT-B-16' or 'ViT-B-16:openai', "
                 "'hf-hub:org/repo', open_clip folders); a Long-CLIP .pt checkpoint loads through open_clip. "
                 f"Registered model families: {', '.join(repr(n) for n in model_family_names())}.")
    return ModelNotFoundError("\n".join(lines))


def _adapter_folder(folder: Path) -> bool:
    """Whether ``folder`` is an adapter folder written by ``save_finetuned`` (``xlipkit.json`` with
    kind ``adapter``; folders without a readable kind: no native model files beside it)."""
    import json

    info_file = folder / "xlipkit.json"
    if not info_file.is_file():
        return False
    try:
        kind = json.loads(info_file.read_text(encoding="utf-8")).get("kind")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        kind = None
    if kind in ("adapter", "full"):
        return kind == "adapter"
    return not (folder / "config.json").is_file() and not (folder / "open_clip_config.json").is_file()


def _load_folder(folder: Path, family: str, dtype: torch.dtype | None, trust_remote_code: bool) -> DualEncoder:
    from finetune.models.families import detect_family, get_model_family, model_family_names
    from finetune.models.inference_modules import load_inference_modules

    check_weight_files(folder)  # a damaged file is named before a loader trips over it
    if _adapter_folder(folder):
        return load_finetuned(str(folder))
    if family == "auto":
        name = detect_family(folder)
        if name is None:
            wanted = " or ".join(get_model_family(n).files for n in model_family_names())
            raise FileNotFoundError(f"{folder} is not a model folder of any registered model family: no {wanted} "
                                    f"in it (found: {sorted(p.name for p in folder.iterdir())[:10]})")
    else:
        name = family
        found = get_model_family(name)
        if found.detect is not None and not found.detect(folder):
            raise FileNotFoundError(f"{folder} is not a model folder for family={name!r}: no {found.files} in it "
                                    f"(found: {sorted(p.name for p in folder.iterdir())[:10]})")
    model = get_model_family(name).loader(str(folder), dtype=dtype, trust_remote_code=trust_remote_code,
                                          revision=None)
    model.backend = name
    load_inference_modules(model, folder)
    return model


def _build_random(config: Any, dtype: torch.dtype | None, trust_remote_code: bool) -> DualEncoder:
    """Build the random-weights config ``config`` (:class:`finetune.models.registry.RandomConfig`)."""
    from finetune.models.families import get_model_family
    from finetune.models.registry import RANDOM_PREFIX, build_model, named_config

    if named_config(config.name) is not None:  # a config build_model builds
        model = build_model(config.name)
    else:  # a config its family's own loader builds (fcast-b)
        model = get_model_family(config.family).loader(config.name, dtype=None, trust_remote_code=trust_remote_code,
                                                       revision=None)
        model.backend = config.family
        model.name_or_path = RANDOM_PREFIX + config.name
    return model.to(dtype) if dtype is not None else model


def _random_weights(name: str, family: str, dtype: torch.dtype | None, trust_remote_code: bool) -> DualEncoder | None:
    """Registry names: ``random:NAME`` builds NAME's config with random weights; a bare real-size
    architecture name is refused (:class:`RandomWeightsNameError`); a bare small test / demo name builds
    with a warning. None when ``name`` is no registry name for ``family``."""
    from finetune.models.registry import RANDOM_PREFIX, random_config

    explicit = name.startswith(RANDOM_PREFIX)
    bare = name[len(RANDOM_PREFIX):].strip() if explicit else name
    config = random_config(bare, family)
    if explicit:
        if config is not None:
            return _build_random(config, dtype, trust_remote_code)
        return _random_open_clip(bare, family, dtype)
    if config is None:
        return None
    spelled = RANDOM_PREFIX + config.name
    if config.real:
        meant = f"For the pretrained model write {config.pretrained!r}. " if config.pretrained else ""
        raise RandomWeightsNameError(
            f"{name!r} is not a pretrained model: it names xlipkit's registry config of the {config.name} "
            f"architecture, which builds with RANDOM weights. {meant}For random weights (pretraining from "
            f"scratch, benchmarks) write {spelled!r}.")
    log.warning("model %r: the registry config %s with RANDOM weights (no pretrained checkpoint); write %r to say "
                "so", name, config.name, spelled)
    return _build_random(config, dtype, trust_remote_code)


def _random_open_clip(arch: str, family: str, dtype: torch.dtype | None) -> DualEncoder:
    """``random:ViT-B-16``: open_clip's architecture with random weights, said explicitly."""
    import open_clip

    from finetune.models.registry import RANDOM_PREFIX, registry_names

    if family in ("auto", "open_clip") and ":" not in arch and arch.replace("/", "-") in open_clip.list_models():
        from finetune.models.backends.openclip import load_open_clip

        model = load_open_clip(arch.replace("/", "-"), dtype=dtype)
        model.name_or_path = RANDOM_PREFIX + arch.replace("/", "-")
        return model
    raise ModelNotFoundError(
        f"{RANDOM_PREFIX + arch!r}: '{RANDOM_PREFIX}' builds a registry config (or an open_clip architecture) with "
        f"random weights, and {arch!r} is none{'' if family == 'auto' else f' for family {family!r}'}. Registry "
        f"names: {', '.join(registry_names())}; open_clip architectures: open_clip.list_models()")


def _load(name: str, family: str, dtype: torch.dtype | None, trust_remote_code: bool,
          revision: str | None, family_options: dict[str, Any] | None = None) -> DualEncoder:
    from finetune.models.families import get_model_family
    from finetune.models.registry import named_config

    if family_options:
        if family in _BUILTIN:
            raise ValueError(f"model options {sorted(family_options)} need a model family that takes them "
                             f"(vision_text: vision, text, projection_dim); family is {family!r}")
        model = get_model_family(family).loader(name, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 revision=revision, **family_options)
        model.backend = family
        return model

    if name.startswith("local-dir:"):  # open_clip's schema for local folders
        folder = Path(name[len("local-dir:"):]).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"open_clip folder {folder} does not exist")
        return _load_folder(folder, "open_clip", dtype, trust_remote_code)
    model = _random_weights(name, family, dtype, trust_remote_code)
    if model is not None:
        return model
    if family not in _BUILTIN:  # a registered family of its own: a folder, or whatever its loader takes
        path = Path(name).expanduser()
        if path.is_dir():
            return _load_folder(path, family, dtype, trust_remote_code)
        model = get_model_family(family).loader(name, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 revision=revision)
        model.backend = family
        return model
    tried = []
    entry = named_config(name) if not name.startswith("random:") else None
    tried.append("a registry name" + (f" (found {entry.name!r}, but it is a {entry.backend} model)" if entry else ""))

    path = Path(name).expanduser()
    if path.is_dir():
        return _load_folder(path, family, dtype, trust_remote_code)
    if path.is_file():
        if path.suffix in _CHECKPOINT_SUFFIXES and family in ("auto", "open_clip"):
            from finetune.models.backends.openclip import load_longclip_checkpoint

            return load_longclip_checkpoint(path, dtype=dtype)
        raise ValueError(f"{path} is a file; give a model folder, or a Long-CLIP/OpenAI checkpoint "
                         f"({', '.join(_CHECKPOINT_SUFFIXES)}) with family 'auto' or 'open_clip'")
    tried.append(f"a local folder or checkpoint file at {path} (does not exist)")
    if _looks_local(name):
        raise FileNotFoundError(f"model path {path} does not exist")

    import open_clip

    arch = name.partition(":")[0].replace("/", "-")
    if family in ("auto", "open_clip") and arch in open_clip.list_models():
        from finetune.models.backends.openclip import load_open_clip

        return load_open_clip(name.replace("/", "-"), dtype=dtype)
    tried.append("an open_clip architecture name (open_clip.list_models())")

    is_hub = name.startswith("hf-hub:") or (name.count("/") == 1 and not name.startswith("/"))
    if not is_hub:
        raise _unknown(name, family, tried)
    errors = []
    if name.startswith("hf-hub:") or family == "open_clip":
        from finetune.models.backends.openclip import load_open_clip

        return load_open_clip(name, dtype=dtype, revision=revision)
    from finetune.models.backends.hf import load_hf

    try:
        return load_hf(name, dtype=dtype, trust_remote_code=trust_remote_code, revision=revision)
    except OSError as e:
        errors.append(f"transformers: {e}")
    if family == "auto":
        from finetune.models.backends.openclip import load_open_clip

        try:
            return load_open_clip(name, dtype=dtype, revision=revision)
        except OSError as e:
            errors.append(f"open_clip: {e}")
    tried.append(f"a hub repository {name!r} ({'; '.join(str(e).splitlines()[0] for e in errors)})")
    raise _unknown(name, family, tried)


def apply_text_length(model: DualEncoder, max_text_len: int, kps: dict[str, Any] | None = None) -> DualEncoder:
    """Give ``model`` ``max_text_len`` text positions: KPS (``finetune.models.longclip.apply_kps``)
    when it is longer than the model's table, nothing when equal.

    Raises:
        TextLengthError: below the model's original text length, below a table that was already stretched.
        ValueError: unknown ``kps`` keys.
    """
    from finetune.models.longclip import DEFAULT_KEEP, apply_kps

    if max_text_len < model.base_text_len:
        raise TextLengthError(f"max_text_len={max_text_len} is below the original text length {model.base_text_len} "
                              f"of {model.name_or_path!r}; use a value >= {model.base_text_len} (longer captions "
                              "are truncated with the end token kept)")
    if max_text_len == model.max_text_len:
        return model
    if max_text_len < model.max_text_len:
        raise TextLengthError(f"{model.name_or_path!r} already has {model.max_text_len} text positions (KPS "
                              f"{model.kps}); max_text_len={max_text_len} cannot shrink them: use "
                              f"{model.max_text_len} or load the unstretched base model")
    settings: dict[str, Any] = {"keep": DEFAULT_KEEP, "ratio": None, "freeze_kept": True}
    unknown = set(kps or {}) - _KPS_KEYS
    if unknown:
        raise ValueError(f"unknown KPS settings {sorted(unknown)}; known: {sorted(_KPS_KEYS)}")
    settings.update(kps or {})
    return apply_kps(model, length=max_text_len, **settings)


def load_model(
    name_or_path: str,
    *,
    family: str = "auto",
    max_text_len: int | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    kps: dict[str, Any] | None = None,
    revision: str | None = None,
    backend: str = "auto",
    family_options: dict[str, Any] | None = None,
) -> DualEncoder:
    """Load a :class:`DualEncoder` (DESIGN 4).

    ``name_or_path`` is tried as, in order: a registry name with random weights, written
    ``random:NAME`` (``random:tiny-clip``, ``random:small-clip``, ``random:clip-vit-base-patch16``,
    ``random:fcast-b``, ...; also ``random:ViT-B-16`` for an open_clip architecture); bare, a real-size
    architecture's name (``clip-vit-base-patch16``) is refused, naming the pretrained hub id it
    resembles (``openai/clip-vit-base-patch16``), and a small test / demo config (``tiny-clip``,
    ``small-clip``) builds with a warning; a local folder of a registered model
    family (:func:`finetune.models.register_model_family`; with ``family="auto"`` the family
    recorded in the folder's ``xlipkit.json``, else the first family whose ``detect`` recognises
    it: transformers ``config.json`` with model_type clip / siglip / siglip2, open_clip
    ``open_clip_config.json``, ...; an xlipkit adapter folder goes to ``load_finetuned``); a
    Long-CLIP / OpenAI ``.pt`` checkpoint; an open_clip architecture (``"ViT-B-16"``: random
    weights, which open_clip's own warning says; ``"ViT-B-16:openai"``: a pretrained tag); a hub
    id (transformers, or open_clip for ``hf-hub:org/repo`` / ``family="open_clip"`` / repos with only ``open_clip_config.json``).
    A family other than ``hf`` / ``open_clip`` named explicitly gets ``name_or_path`` as it is.
    Modules the model needs at inference (``xlipkit_inference.json``) are restored with it.

    Args:
        name_or_path: see above.
        family: ``"auto"`` or a registered model family (``"hf"``, ``"open_clip"``, ...).
        max_text_len: text positions wanted; above the model's length applies Long-CLIP KPS with
            the ``kps`` settings (the model needs the ``kps`` capability); ``None`` keeps the
            model's own.
        dtype: ``torch.dtype`` or ``"float32"`` / ``"bfloat16"`` / ``"float16"``.
        trust_remote_code: passed to transformers (off by default).
        kps: KPS settings ``{"keep": 20, "ratio": None, "freeze_kept": True}`` (any subset).
        revision: hub revision.
        backend: deprecated alias of ``family``, used while ``family`` is ``"auto"``.
        family_options: more keywords for the family's loader (``vision_text``: ``vision``, ``text``,
            ``projection_dim``, which build a new model from two towers).

    Returns:
        the model; ``model.backend`` is the name of the family that loaded it.

    Raises:
        ValueError: unknown name (:class:`ModelNotFoundError`: the message lists what was looked
            for, the registry names and the families), a bare real-size registry name
            (:class:`RandomWeightsNameError`), an unregistered ``family`` (the message lists the registered ones),
            unsupported architecture, bad ``dtype`` / ``kps``, or a ``max_text_len`` below the
            model's original length.
        FileNotFoundError: a local path that does not exist or is not a model folder.
        DamagedWeightsError: an ``OSError`` naming a weight file that cannot be read (empty, truncated, not
            safetensors), with what to do (:mod:`finetune.models.weight_files`).
    """
    from finetune.models.families import resolve_family_setting

    if backend not in (None, "auto"):
        warnings.warn("load_model(backend=...) is deprecated: use family=...", DeprecationWarning, stacklevel=2)
    name, _ = resolve_family_setting(family, backend)
    with naming_damaged_weights(str(name_or_path), revision):
        model = _load(str(name_or_path), name, _torch_dtype(dtype), trust_remote_code, revision, family_options)
    if max_text_len is not None:
        apply_text_length(model, int(max_text_len), kps)
    return model


# -- fine-tuned folders: save_finetuned / load_finetuned (xlipkit.json) -------------------------------
def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")


def save_finetuned(model: DualEncoder, folder: str | Path, *, recipe: dict[str, Any] | None = None) -> Path:
    """Save a fine-tuned model into ``folder`` (atomically) so that :func:`load_finetuned`
    rebuilds it.

    ``full`` (or merged) models: the model family's own folder (its registered saver; ``hf`` and
    ``open_clip``: ``save_pretrained``) plus ``xlipkit.json``. ``lora`` / ``dora``: peft's
    ``adapter_config.json`` + ``adapter_model.safetensors``, ``xlipkit_extra.safetensors`` (the
    ``train_extra`` tensors: stretched positions, logit scale/bias) and ``xlipkit.json``. Both
    kinds also hold ``model.inference_modules`` when there are any (``xlipkit_inference.json`` +
    ``xlipkit_inference.safetensors``, :mod:`finetune.models.inference_modules`).

    Returns:
        the folder path.

    Raises:
        ValueError: the model's family (``model.backend``) is not registered, or an inference
            module that could not be rebuilt (its class is not registered).
    """
    from safetensors.torch import save_file

    from finetune.models.families import get_model_family
    from finetune.models.inference_modules import save_inference_modules

    cfg = model.adapter
    kind = "adapter" if cfg is not None and cfg.type != "full" else "full"
    info: dict[str, Any] = {
        "format": "xlipkit",
        "version": FORMAT_VERSION,
        "kind": kind,
        "base_model": model.name_or_path,
        "model_family": model.backend,
        "backend": model.backend,  # read by folders' consumers from before model families
        "family": model.family,
        "base_text_len": model.base_text_len,
        "max_text_len": model.max_text_len,
        "kps": model.kps,
        "adapter": asdict(cfg) if cfg is not None else None,
        "signature": base_signature(model),
        "recipe": recipe,
    }
    family = get_model_family(model.backend, key="model.backend (the model family that loaded it)")
    with atomic_dir(folder) as tmp:
        if kind == "full":
            family.saver(model, str(tmp))
        else:
            peft_model_of(model).save_pretrained(str(tmp))
            names = extra_parameter_names(model, cfg.train_extra)
            params = dict(model.model.named_parameters())
            save_file({n: params[n].detach().contiguous().cpu() for n in names}, str(tmp / EXTRA_NAME))
            info["extra_tensors"] = names
        info["inference_modules"] = save_inference_modules(model, tmp)
        _write_json(tmp / INFO_NAME, info)
    return Path(folder)


def read_info(folder: str | Path) -> dict[str, Any]:
    """Read and check a folder's ``xlipkit.json``.

    Raises:
        FileNotFoundError: no ``xlipkit.json`` in the folder.
        ValueError: not valid JSON or not an xlipkit description.
    """
    path = Path(folder) / INFO_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {folder} is not a folder written by save_finetuned "
                                f"(for a plain model folder use finetune.load_model)")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    missing = [k for k in ("kind", "base_model", "backend") if k not in info]
    if info.get("format") != "xlipkit" or missing:
        raise ValueError(f"{path} is not an xlipkit description (format={info.get('format')!r}, missing {missing})")
    if info["kind"] not in ("full", "adapter"):
        raise ValueError(f"{path}: kind {info['kind']!r} must be 'full' or 'adapter'")
    return info


def _check_base(info: dict[str, Any], model: DualEncoder, folder: Path) -> None:
    saved = info.get("signature") or {}
    found = base_signature(model)
    diff = [f"{k}: adapter {saved[k]!r} vs base {found.get(k)!r}" for k in saved if saved[k] != found.get(k)]
    if diff:
        raise ValueError(f"the adapter in {folder} was trained on base model {info['base_model']!r}, but the base "
                         f"model {model.name_or_path!r} does not match it ({'; '.join(diff)}); load it with the "
                         f"base it was trained on (load_finetuned(path, base=...))")


def load_finetuned(
    path: str | Path,
    *,
    revision: str | None = None,
    merge: bool = False,
    base: str | DualEncoder | None = None,
) -> DualEncoder:
    """Rebuild a model saved by :func:`save_finetuned`: base + KPS + adapter (+ extra tensors, +
    the inference modules saved with it).

    Args:
        path: a folder, or a hub id (downloaded with ``huggingface_hub.snapshot_download``).
        revision: hub revision.
        merge: fold a LoRA/DoRA adapter into the base weights (:func:`merge_adapter`).
        base: the base model to put the adapter on (a name/path for ``load_model`` or a loaded
            DualEncoder); default: the ``base_model`` recorded in ``xlipkit.json``.

    Returns:
        the model in eval mode, giving the outputs of the model that was saved.

    Raises:
        FileNotFoundError: no ``xlipkit.json``.
        ValueError: a base model whose architecture does not match the adapter's.
        DamagedWeightsError: an ``OSError`` naming a weight file of the folder (or of its base model) that cannot
            be read, with what to do.
    """
    folder = Path(path)
    if not folder.is_dir():
        if folder.exists() or str(path).startswith(("/", ".", "~")):
            raise FileNotFoundError(f"{path} is not a folder written by save_finetuned")
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(path), revision=revision))
    check_weight_files(folder)
    with naming_damaged_weights(str(folder)):
        return _load_finetuned_folder(folder, merge, base)


def _load_finetuned_folder(folder: Path, merge: bool, base: str | DualEncoder | None) -> DualEncoder:
    """:func:`load_finetuned` of a local folder."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from finetune.models.inference_modules import load_inference_modules
    from finetune.models.longclip import apply_kps

    info = read_info(folder)
    family = info.get("model_family") or info["backend"]
    if info["kind"] == "full":  # load_model restores the inference modules beside the model
        return load_model(str(folder), family=family).eval()

    if isinstance(base, DualEncoder):
        model = base
    else:
        # "auto": a base of another backend loads, and the signature check below names the mismatch
        model = load_model(str(base or info["base_model"]))
    if info.get("kps"):
        apply_kps(model, **info["kps"])
    _check_base(info, model, folder)
    cfg = AdapterConfig(**info["adapter"])
    try:
        with _quiet_peft():
            peft_model = PeftModel.from_pretrained(model.model, str(folder), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"the adapter in {folder} does not fit base model {model.name_or_path!r}: {e}") from e
    _attach_peft(model, peft_model)
    model.adapter = cfg
    extra_file = folder / EXTRA_NAME
    if extra_file.is_file():
        params = dict(model.model.named_parameters())
        for name, tensor in load_file(str(extra_file)).items():
            if name not in params or params[name].shape != tensor.shape:
                have = tuple(params[name].shape) if name in params else "missing"
                raise ValueError(f"{extra_file}: tensor {name} {tuple(tensor.shape)} does not fit the base model "
                                 f"({have})")
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].dtype))
    load_inference_modules(model, folder)
    if merge:
        merge_adapter(model)
    return model.eval()
