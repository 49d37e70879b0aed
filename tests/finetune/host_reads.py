"""Counting the host reads of tensors that a training step makes, on the CPU.

On an accelerator each of these waits for the device: ``.item()`` / ``float()`` / ``int()`` / ``bool()`` of a
tensor (``aten._local_scalar_dense``), ``.tolist()``, ``.cpu()``, ``.numpy()``, and the ops whose output size
depends on the values (``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``, ``bincount``, ``equal``). On the CPU nothing waits, so a test
cannot time them; :class:`HostReads` counts them instead (a ``TorchDispatchMode`` for the ops, wrappers for the
``Tensor`` methods that read memory without dispatching), with the stack of each so that a failure names the
line.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: ops that read values to the host (or size their output by the values, which reads them)
SYNCING_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero.out,
    aten.argwhere.default,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.equal.default,
    aten.is_nonzero.default,
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_METHODS = ("tolist", "item", "cpu", "numpy")


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@dataclass
class HostRead:
    """One read: what (``aten.nonzero``, ``Tensor.tolist``) and where (the innermost frames of xlipkit code)."""

    what: str
    where: str


@dataclass
class HostReads(TorchDispatchMode):
    """Counts host reads while active (``with HostReads() as reads: ...``; ``reads.events``)."""

    events: list[HostRead] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        self._saved: dict[str, object] = {}

    def _record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2]
                  if "/finetune/" in f.filename or "/losses/" in f.filename or "/accelerate/" in f.filename]
        where = " <- ".join(f"{f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                            for f in reversed(frames[-4:]))
        self.events.append(HostRead(what, where or "(outside the toolkit)"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING_OPS:
            self._record(f"aten.{func.__name__}")
        elif func in _INDEXING and _bool_index(args):
            self._record(f"boolean-mask indexing (aten.{func.__name__})")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._record("aten.repeat_interleave without output_size")
        return func(*args, **kwargs)

    def __enter__(self):
        for name in _METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(tensor, *a, _original=original, _name=name, **k):
                self._record(f"Tensor.{_name}")
                return _original(tensor, *a, **k)

            setattr(torch.Tensor, name, wrapper)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)

    def report(self) -> str:
        return "\n".join(f"{e.what}: {e.where}" for e in self.events)
