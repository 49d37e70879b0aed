"""Fine-tune a CLIP-family model from a recipe: the launcher the README documents.

    accelerate launch --config_file configs/accelerate/one_process.yaml -q finetune/run.py RECIPE.yaml [key=value ...]
    accelerate launch --num_processes 8 finetune/run.py recipes/structxlip_docci.yaml train.lr=1e-5
    python finetune/run.py --list
    python finetune/run.py --schema > recipe.schema.json

A thin launcher over :mod:`finetune.cli.train` (the same as ``xlipkit train``); the run itself is
:func:`finetune.training.run_recipe`. Imported, this module forwards its old library names (``run``, ``main``,
``RECIPES_DIR``) for one release, with a ``FutureWarning`` naming the new path.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any

#: the old library names -> ``(module, name)`` that holds each now
MOVED = {"run": ("finetune.training.recipe", "run_recipe"), "main": ("finetune.cli.train", "main"),
         "RECIPES_DIR": ("finetune.cli.train", "RECIPES_DIR")}


def __getattr__(name: str) -> Any:
    if name in MOVED:
        module, new = MOVED[name]
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (the run is finetune.training.run_recipe)")


if __name__ == "__main__":
    # run as a script, this file's folder is sys.path[0]: it would shadow real packages (`evaluate`, ...)
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    from finetune.threads import passive_wait_by_default

    passive_wait_by_default()  # before torch loads its OpenMP runtime
    from finetune.cli.train import main
    from finetune.training.ending import accelerate_traceback_follows

    status = main()
    if status and accelerate_traceback_follows():
        print("(accelerate launch answers a failed script with a CalledProcessError traceback of its own; it adds "
              "nothing to the error above, and `accelerate launch --quiet` leaves it out)", file=sys.stderr, flush=True)
    sys.exit(status)
else:
    warnings.warn("importing finetune.run is deprecated and its names will be removed in the next release: run a "
                  "recipe with finetune.training.run_recipe, the command line is finetune.cli.train.main (the "
                  "launcher `finetune/run.py RECIPE` stays)", FutureWarning, stacklevel=2)
