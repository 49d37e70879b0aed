"""The argument checks every loss of ``losses`` runs: one rule, described in ``docs/guides/losses.md``
("Arguments and empty batches").

* What the host knows (types, shapes, dtypes, Python numbers, constructor arguments) is checked at once:
  a ``ValueError`` that names the argument and the accepted range.
* What only the tensor's values tell (owner indices in range, a tensor ``logit_scale`` finite and > 0, per-pair
  weights finite and >= 0) is checked by :func:`device_check`, a device-side assertion
  (``torch._assert_async``): on the CPU it raises the same ``ValueError`` at once; on an accelerator it adds a
  kernel to the stream and reads nothing back, so a training step stays free of host reads (the process stops
  with a device-side assert at the next synchronisation when it fails).
* Embeddings are not checked for finiteness: a NaN there is a divergence of the model, which reaches the loss
  value and the training loop's non-finite check (``train.on_nonfinite``), and checking every embedding would
  cost a reduction per tensor per step.
* An empty batch (B = 0, or no valid row) gives 0 with the graph intact (:func:`zero_with_graph`), so backward
  runs and, across processes, every rank reaches the same collectives.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = [
    "check_embeds",
    "check_index_range",
    "check_mask",
    "check_number",
    "check_scalar",
    "device_check",
    "zero_with_graph",
]

#: ``torch._assert_async`` refuses messages of 255 characters or more on CUDA
_MAX_DEVICE_MESSAGE = 250


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def device_check(ok: Tensor, message: str) -> None:
    """Assert the one-element bool tensor ``ok`` without reading it back to the host.

    ``torch._assert_async``: on the CPU a failed check raises ``ValueError(message)`` at once; on an accelerator
    the check is a kernel on the current stream (no synchronisation), and a failure stops the process with a
    device-side assert at the next synchronisation (PyTorch prints ``message`` from the kernel on stderr; run with
    ``CUDA_LAUNCH_BLOCKING=1``, or on the CPU, to get the traceback at the check).

    Args:
        ok: a one-element bool tensor, True when the values are acceptable.
        message: what is wrong and how to fix it, naming the argument (cut to 250 characters on an accelerator).
    """
    try:
        torch._assert_async(ok, message[:_MAX_DEVICE_MESSAGE])
    except RuntimeError as error:  # the CPU kernel raises at once; nothing is raised here on an accelerator
        if ok.device.type != "cpu":
            raise
        raise ValueError(message) from error


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    above: bool = False,
    where: str = "",
) -> float:
    """A finite real number (``int`` / ``float``, not ``bool``) within ``[low, high]`` (``(low, high]`` with
    ``above``); returns it as a float.

    Raises:
        ValueError: naming ``name``, when ``value`` is not a number, is NaN or infinite, or is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{_prefix(where)}{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{_prefix(where)}{name} must be finite, got {value!r}")
    if low is not None and (number <= low if above else number < low):
        bound = f"> {low:g}" if above else f">= {low:g}"
        raise ValueError(f"{_prefix(where)}{name} must be {bound}, got {value!r}")
    if high is not None and number > high:
        raise ValueError(f"{_prefix(where)}{name} must be <= {high:g}, got {value!r}")
    return number


def check_scalar(name: str, value: Tensor | float, *, low: float | None = None, above: bool = False,
                 where: str = "") -> None:
    """A scalar loss parameter (``logit_scale``, ``logit_bias``, a temperature): a finite Python number (``>= low``,
    or ``> low`` with ``above``), or a real tensor of shape ``()`` or ``(1,)`` whose value is checked likewise on
    the device (:func:`device_check`: no host read).

    Raises:
        ValueError: naming ``name``: a wrong type or shape, or (at once for a number, on the CPU for a tensor) a
            NaN, infinite or out-of-range value.
    """
    if not isinstance(value, Tensor):
        check_number(name, value, low=low, above=above, where=where)
        return
    if value.dtype == torch.bool or value.is_complex() or tuple(value.shape) not in ((), (1,)):
        raise ValueError(f"{_prefix(where)}{name} must be a number or a real scalar tensor (shape () or (1,)), got "
                         f"a {value.dtype} tensor of shape {tuple(value.shape)}")
    ok = torch.isfinite(value).all() if value.is_floating_point() else None  # integers are always finite
    if low is not None:
        in_range = ((value > low) if above else (value >= low)).all()
        ok = in_range if ok is None else ok & in_range
    if ok is None:
        return
    bound = "" if low is None else f" and {'>' if above else '>='} {low:g}"
    device_check(ok, f"{_prefix(where)}{name} must be finite{bound}")


def check_embeds(name: str, x: object, *, dims: int = 2, shape: str = "(B, D)", where: str = "") -> None:
    """A floating tensor with ``dims`` dimensions (``shape`` names them in the message)."""
    if not isinstance(x, Tensor) or x.dim() != dims or not x.is_floating_point():
        got = (x.dtype, tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{_prefix(where)}{name} must be a {shape} floating-point tensor, got {got}")


def check_mask(name: str, mask: object, shape: tuple[int, ...], *, where: str = "") -> None:
    """A bool tensor of exactly ``shape``."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(shape):
        got = (mask.dtype, tuple(mask.shape)) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{_prefix(where)}{name} must be a bool tensor of shape {tuple(shape)}, got {got}")


def check_index_range(name: str, index: Tensor, high: int | None, *, where: str = "") -> None:
    """Integer indices in ``[0, high)`` (``[0, inf)`` when ``high`` is None), checked on the device
    (:func:`device_check`: no host read)."""
    if index.numel() == 0:
        return
    ok = (index >= 0).all()
    if high is not None:
        ok = ok & (index < high).all()
    span = f"in [0, {high})" if high is not None else ">= 0"
    device_check(ok, f"{_prefix(where)}{name} must hold sample indices {span}; an index outside would leave "
                     "its rows without a sample")


def zero_with_graph(*inputs: Tensor | float | Iterable[Tensor]) -> Tensor:
    """A scalar 0 that depends on every tensor of ``inputs`` (tensors, or iterables of them such as a module's
    parameters; numbers are ignored): what a loss returns for an empty batch. Backward runs and gives zero
    gradients, so an optimiser step and, across processes, DDP's gradient reduction see every parameter."""
    tensors: list[Tensor] = []
    for item in inputs:
        if isinstance(item, Tensor):
            tensors.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            tensors.extend(t for t in item if isinstance(t, Tensor))
    floating = [t for t in tensors if t.is_floating_point()]
    if not floating:
        device = tensors[0].device if tensors else None
        return torch.zeros((), device=device)
    return sum(t.sum() for t in floating) * 0.0
