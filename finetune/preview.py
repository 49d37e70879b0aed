"""``python -m finetune.preview RECIPE [...]``: what StructXLIP trains on, drawn (:mod:`finetune.cli.preview`, also
``xlipkit preview``), kept as the entry point the recipes and guides name.

The command moved to :mod:`finetune.cli.preview` and the drawing to :mod:`finetune.objectives.structxlip.preview`
(issue 32). Imported, this module forwards its old names for one release, with a ``FutureWarning`` naming the new
path.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

#: the old names -> the module that holds each now
MOVED = {"main": "finetune.cli.preview", "preview_recipe": "finetune.cli.preview",
         "render_preview": "finetune.objectives.structxlip.preview", "save_png_atomic": "finetune.files"}


def __getattr__(name: str) -> Any:
    if name in MOVED:
        return getattr(importlib.import_module(MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (the command is finetune.cli.preview)")


if __name__ == "__main__":
    from finetune.cli.preview import main

    sys.exit(main())
else:
    warnings.warn("finetune.preview is deprecated as a library and its names will be removed in the next release: "
                  "import preview_recipe / main from finetune.cli.preview, render_preview from "
                  "finetune.objectives.structxlip.preview (the command `python -m finetune.preview` stays)",
                  FutureWarning, stacklevel=2)
