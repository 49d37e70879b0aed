"""``python -m finetune.evaluate RUN_OR_MODEL [...]``: the evaluation command (:mod:`finetune.cli.evaluate`, also
``xlipkit eval``), kept as the entry point DESIGN section 1 documents.

The library is :mod:`finetune.evaluation` (``recall_at_k``, ``evaluate_sets``, ``format_table``, ...); this module
holds no library names.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    here = os.path.dirname(os.path.realpath(__file__))
    if sys.path and os.path.realpath(sys.path[0] or ".") == here:  # run as a script: finetune/ shadows packages
        del sys.path[0]
    from finetune.cli.evaluate import main
    from finetune.process_exit import exit_process

    exit_process(main())
