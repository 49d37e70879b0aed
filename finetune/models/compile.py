"""``train.compile``: the towers' repeated transformer blocks compiled one by one with ``torch.compile``, once.

Compiling block by block, as torchtune does (``training.compile_model``), instead of the whole model: every
block of a tower has the same code, so one compiled graph serves all of them (torch >= 2.5 treats module
parameters as graph inputs) and compilation takes the time of one block; the model keeps its module tree and
state-dict names (``nn.Module.compile`` compiles in place), so checkpoints, adapters and ``save_pretrained``
are untouched; and the parts between blocks (embeddings, pooling, the last CLIP layer that
:mod:`finetune.models.backends.pooled_tower` runs for the pooled token only, the losses) stay eager.

The blocks are compiled with static shapes (``dynamic=False``): the run's passes take a few planned shapes
(:mod:`finetune.objectives.shapes`: one image pass, one text pass per kind at one of its planned bucket lengths),
which the trainer's warm-up runs before the first step, so each block is compiled once per shape there and never
again (:func:`compiled_graphs` counts; ``tests/finetune/objectives/test_shapes.py`` checks; the step setup raises
dynamo's recompile limit to the planned shapes). Static shapes are also what CUDA graphs need:
``train.compile: reduce-overhead`` records each block's kernels as CUDA graphs (torch's cudagraph trees, one per
shape), which cuts the launches of a block to one replay; it pays only on a GPU and only where the shapes repeat,
which the planned lengths give.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["COMPILE_MODES", "compile_blocks", "compile_options", "compiled_graphs", "transformer_blocks"]

#: ``train.compile`` values besides true / false: torch.compile's modes
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_options(setting: bool | str) -> dict[str, Any] | None:
    """The ``torch.compile`` keywords of ``train.compile`` (None: off): ``true`` is the ``default`` mode; every mode
    compiles with static shapes.

    Raises:
        ValueError: an unknown mode, naming ``train.compile`` and the choices.
    """
    if setting is False or setting is None:
        return None
    mode = "default" if setting is True else str(setting)
    if mode not in COMPILE_MODES:
        raise ValueError(f"train.compile: {setting!r} is not true, false or one of {', '.join(COMPILE_MODES)}")
    return {"mode": mode, "dynamic": False}


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


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (``torch._dynamo.utils.counters``): a recompilation adds
    one, so an unchanged count over a stretch of steps means nothing was recompiled there."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
