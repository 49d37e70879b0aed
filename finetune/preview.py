"""``python -m finetune.preview RECIPE [...]``: what StructXLIP trains on, drawn (:mod:`finetune.cli.preview`, also
``xlipkit preview``), kept as the entry point the recipes and guides name.

The command is :mod:`finetune.cli.preview` and the drawing :mod:`finetune.objectives.structxlip.preview`; this module
holds no library names.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from finetune.cli.preview import main

    sys.exit(main())
