"""A torch function mode that records reads of tensor values back to the host (``.item()``, ``.cpu()``,
``bool()``, boolean-mask indexing, ...): on an accelerator each is a device sync, which a training step must
not do (BRIEF: no host reads inside the training step). Used by the TSL and FAST-GOAL tests."""

from __future__ import annotations

import torch

#: functions whose result needs the tensor's values on the host
HOST_READS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                        "argwhere", "unique", "masked_select"})


class HostReads(torch.overrides.TorchFunctionMode):
    """``with HostReads() as mode: ...`` then ``mode.reads``: the host reads made inside, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
        if name in HOST_READS:
            self.reads.append(name)
        elif isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            self.reads.append(f"{name}[bool mask]")
        return func(*args, **(kwargs or {}))
