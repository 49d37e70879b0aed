"""``train.compile``: the towers' repeated transformer blocks compiled one by one with ``torch.compile``.

Compiling block by block, as torchtune does (``training.compile_model``), instead of the whole model: every
block of a tower has the same code, so one compiled graph serves all of them (torch >= 2.5 treats module
parameters as graph inputs) and compilation takes the time of one block; the model keeps its module tree and
state-dict names (``nn.Module.compile`` compiles in place), so checkpoints, adapters and ``save_pretrained``
are untouched; and the parts between blocks (embeddings, pooling, the last CLIP layer that
:mod:`finetune.models.backends.pooled_tower` runs for the pooled token only, the losses) stay eager, where their shapes
change from step to step. Caption tensors are padded to a few fixed lengths
(:func:`finetune.data.collate.compile_lengths`) so that the text blocks see few shapes; varying batch sizes
(length buckets, region crops) are marked dynamic by torch after their first recompilation.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["compile_blocks", "transformer_blocks"]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: the items of every ``nn.ModuleList`` / ``nn.Sequential`` of two or more
    modules of one class that have submodules of their own (CLIP's ``encoder.layers``, open_clip's
    ``resblocks``, timm's ``blocks``), innermost lists only."""
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1
             and len({type(b) for b in m}) == 1 and all(any(True for _ in b.children()) for b in m)]
    inner = [m for m in lists if not any(o is not m and any(o is x for x in m.modules()) for o in lists)]
    return [block for m in inner for block in m]


def compile_blocks(model: nn.Module, **options: Any) -> int:
    """Compile every block of :func:`transformer_blocks` in place (``block.compile(**options)``); returns how
    many."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(**options)
    return len(blocks)
