"""Modules a model needs at inference, saved and restored with it (DESIGN 4, "Seams").

A head trained by an objective term that the model also needs at inference (GRM's adapters,
FLAIR's text-conditioned attention pool) goes into ``model.inference_modules`` (an
``nn.ModuleDict`` on every :class:`~finetune.models.core.encoder.DualEncoder`)::

    register_inference_module(MyHead)                 # once, where MyHead is defined
    model.inference_modules["pool"] = MyHead(width=512, heads=8)

``save_finetuned`` (full and adapter runs), hub pushes and exports then write
``xlipkit_inference.json`` (per module: the registered class name and its init kwargs as JSON)
and ``xlipkit_inference.safetensors`` (its state dict, keys ``<module name>.<tensor name>``)
beside the model; ``load_model`` / ``load_finetuned`` rebuild them. Only registered classes are
rebuilt, by the name they were registered under: no class path from a file is ever imported (the
registry is :data:`finetune.plugins.INFERENCE_MODULES`; its discovery imports the toolkit's own term
modules, which register their heads such as GRM's, when a saved class is not registered yet).

A registered class gives its init kwargs either with an ``inference_config()`` method returning
a JSON-serialisable dict, or, without one, from the arguments its ``__init__`` was called with
(recorded once the class is registered).
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import finetune.plugins as plugins

CONFIG_NAME = "xlipkit_inference.json"
WEIGHTS_NAME = "xlipkit_inference.safetensors"
FORMAT_VERSION = 1
_RECORD = "_xlipkit_init_kwargs"



def register_inference_module(cls: type[nn.Module] | None = None, *, name: str | None = None) -> Any:
    """Allow ``cls`` to be rebuilt when a model holding it in ``inference_modules`` is loaded.

    Usable as ``register_inference_module(Cls)``, ``@register_inference_module`` or
    ``@register_inference_module(name="flair.pool")``. Registering the same class again is a no-op.

    Args:
        cls: an ``nn.Module`` subclass whose ``__init__`` takes JSON-serialisable keyword arguments.
        name: the name written into ``xlipkit_inference.json`` (default ``cls.__qualname__``).

    Returns:
        ``cls`` (or a decorator when ``cls`` is not given).

    Raises:
        TypeError: ``cls`` is not an ``nn.Module`` subclass.
        ValueError: ``name`` is taken by another class.
    """
    if cls is None:
        return functools.partial(register_inference_module, name=name)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_inference_module needs an nn.Module subclass, got {cls!r}")
    key = name or cls.__qualname__
    known = plugins.INFERENCE_MODULES.peek(key)
    if known is not None and known is not cls:
        raise ValueError(f"inference module name {key!r} is already taken by {known.__module__}."
                         f"{known.__qualname__}; register {cls.__qualname__} with name=...")
    if not callable(getattr(cls, "inference_config", None)) and not getattr(
            vars(cls).get("__init__", cls.__init__), "_xlipkit_records", False):
        cls.__init__ = _recording_init(cls.__init__)
    plugins.INFERENCE_MODULES.add(key, cls, replace=True)
    return cls


def _recording_init(init: Any) -> Any:
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        record = dict(bound.arguments)
        record.pop(next(iter(signature.parameters)))  # self
        for p in signature.parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                record.update(record.pop(p.name, {}))
            elif p.kind is inspect.Parameter.VAR_POSITIONAL:
                record.pop(p.name, None)
        object.__setattr__(self, _RECORD, record)

    wrapped._xlipkit_records = True  # type: ignore[attr-defined]
    return wrapped


def inference_module_names() -> list[str]:
    """Names of the registered inference-module classes (the toolkit's own discovered first)."""
    return plugins.INFERENCE_MODULES.names()


def _registered_name(module: nn.Module) -> str:
    for key, cls in plugins.INFERENCE_MODULES.snapshot().items():  # the module's class registered before it was made
        if type(module) is cls:
            return key
    raise ValueError(f"inference module of class {type(module).__module__}.{type(module).__qualname__} is not "
                     f"registered, so it could not be rebuilt when the model is loaded: call "
                     f"finetune.models.register_inference_module({type(module).__qualname__}) where it is defined")


def module_config(module: nn.Module) -> dict[str, Any]:
    """The JSON init kwargs that rebuild ``module`` (see the module docstring).

    Raises:
        ValueError: the class is not registered, its kwargs were not recorded (an instance made
            before the class was registered) or are not JSON-serialisable.
    """
    key = _registered_name(module)
    method = getattr(module, "inference_config", None)
    config = method() if callable(method) else getattr(module, _RECORD, None)
    if config is None:
        raise ValueError(f"the {key} inference module was created before register_inference_module({key}) ran, so "
                         f"its init arguments were not recorded: register the class where it is defined, or give "
                         f"it an inference_config() method")
    try:
        json.dumps(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the init arguments of the {key} inference module are not JSON-serialisable ({e}); give "
                         f"the class an inference_config() method returning plain values") from e
    return dict(config)


def save_inference_modules(model: nn.Module, folder: str | Path) -> list[str]:
    """Write ``model.inference_modules`` into ``folder`` (``xlipkit_inference.json`` +
    ``xlipkit_inference.safetensors``); nothing when there are none.

    Returns:
        the names of the modules written.

    Raises:
        ValueError: a module that could not be rebuilt (see :func:`module_config`).
    """
    from safetensors.torch import save_file

    modules = getattr(model, "inference_modules", None)
    if not modules:
        return []
    entries, tensors = {}, {}
    for name, module in modules.items():
        entries[name] = {"class": _registered_name(module), "config": module_config(module),
                         "defined_in": type(module).__module__}  # a hint for the error message, never imported
        for key, value in module.state_dict().items():
            tensors[f"{name}.{key}"] = value.detach().contiguous().cpu()
    folder = Path(folder)
    save_file(tensors, str(folder / WEIGHTS_NAME))
    (folder / CONFIG_NAME).write_text(json.dumps({"format": "xlipkit-inference", "version": FORMAT_VERSION,
                                                  "modules": entries}, indent=2), encoding="utf-8")
    return list(entries)


def load_inference_modules(model: nn.Module, folder: str | Path) -> list[str]:
    """Rebuild the modules saved by :func:`save_inference_modules` into ``model.inference_modules``
    (on the model's device and dtype, in eval mode); nothing when ``folder`` has none.

    Returns:
        the names of the modules restored.

    Raises:
        ValueError: a broken ``xlipkit_inference.json``, a class that is not registered (the message
            names the module it was defined in, to import), or weights that do not fit.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    path = folder / CONFIG_NAME
    if not path.is_file():
        return []
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        entries = spec["modules"]
        assert isinstance(entries, dict)
    except (json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
        raise ValueError(f"{path} is not a valid description of inference modules ({e!r})") from e
    weights_file = folder / WEIGHTS_NAME
    if entries and not weights_file.is_file():
        raise ValueError(f"{path} lists inference modules {sorted(entries)} but {weights_file} is missing")
    tensors = load_file(str(weights_file)) if entries else {}
    try:
        ref = next(model.parameters())
        device, dtype = ref.device, ref.dtype
    except StopIteration:
        device, dtype = torch.device("cpu"), None
    classes = plugins.INFERENCE_MODULES.snapshot()
    if any(not isinstance(e, dict) or e.get("class") not in classes for e in entries.values()):
        classes = dict(plugins.INFERENCE_MODULES.items())  # discovers: the toolkit's terms register their heads
    for name, entry in entries.items():
        cls_name = entry.get("class") if isinstance(entry, dict) else None
        if cls_name not in classes:
            hint = entry.get("defined_in") if isinstance(entry, dict) else None
            raise ValueError(f"{path}: inference module {name!r} is of class {cls_name!r}, which is not registered "
                             f"(registered: {inference_module_names() or 'none'}); import the module that registers "
                             f"it{f' ({hint})' if hint else ''} before loading")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{path}: config of inference module {name!r} must be a mapping, got {config!r}")
        try:
            module = classes[cls_name](**config)
        except TypeError as e:
            raise ValueError(f"{path}: inference module {name!r} ({cls_name}) cannot be built from {config}: {e}") from e
        prefix = f"{name}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{weights_file}: the weights of inference module {name!r} do not fit {cls_name}"
                             f"({config}): {e}") from e
        module.to(device=device)
        if dtype is not None and dtype.is_floating_point:
            module.to(dtype=dtype)
        model.inference_modules[name] = module.eval()
    return list(entries)
