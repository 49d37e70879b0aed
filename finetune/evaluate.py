"""``python -m finetune.evaluate RUN_OR_MODEL [...]``: the evaluation command (:mod:`finetune.cli.evaluate`, also
``xlipkit eval``), kept as the entry point DESIGN section 1 documents.

The library moved to :mod:`finetune.evaluation` (issue 32). Imported, this module forwards its old names
(``recall_at_k``, ``evaluate_sets``, ``format_table``, ...) for one release, with a ``FutureWarning`` naming the new
path; import them from ``finetune.evaluation`` instead.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any

#: the old names -> the module that holds each now
MOVED = {
    **dict.fromkeys(("DEFAULT_KS", "RetrievalEmbeddings", "RetrievalOptions", "encode_for_retrieval", "evaluate_sets",
                     "fold_recall", "format_table", "recall_at_k", "recall_sum", "set_label"), "finetune.evaluation"),
    "main": "finetune.cli.evaluate",
}


def __getattr__(name: str) -> Any:
    if name in MOVED:
        return getattr(importlib.import_module(MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (the library is finetune.evaluation)")


if __name__ == "__main__":
    here = os.path.dirname(os.path.realpath(__file__))
    if sys.path and os.path.realpath(sys.path[0] or ".") == here:  # run as a script: finetune/ shadows packages
        del sys.path[0]
    from finetune.cli.evaluate import main

    sys.exit(main())
else:
    warnings.warn("finetune.evaluate is deprecated as a library and its names will be removed in the next release: "
                  "import recall_at_k, evaluate_sets, format_table, ... from finetune.evaluation (the command "
                  "`python -m finetune.evaluate` stays)", FutureWarning, stacklevel=2)
