"""Counting host reads of device values (GRM tests): the operators behind ``.item()``, ``float()``,
``bool()``, ``nonzero``, boolean-mask indexing and ``unique``. On an accelerator each one waits for the
device, so none may run inside a training step (issue 23)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = frozenset({
    "aten::_local_scalar_dense",  # .item(), float(), int(), bool() of a tensor
    "aten::item",
    "aten::nonzero",  # nonzero, boolean-mask indexing
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
})


class CountHostReads(TorchDispatchMode):
    """``with CountHostReads() as counter: ...`` records in ``counter.reads`` every host-reading operator
    that runs in the block (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in HOST_READS:
            self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))
