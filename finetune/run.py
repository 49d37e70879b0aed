"""Fine-tune a CLIP-family model from a recipe: ``xlipkit train`` without the installed script.

    python finetune/run.py RECIPE.yaml [key=value ...]          # one process, this one (= xlipkit train RECIPE)
    accelerate launch --num_processes 8 finetune/run.py recipes/structxlip_docci.yaml train.lr=1e-5
    python finetune/run.py --list
    python finetune/run.py --schema > recipe.schema.json

A thin launcher over :mod:`finetune.cli.train` (the same as ``xlipkit train``); the run itself is
:func:`finetune.training.run_recipe`. It holds no library names: import ``run_recipe`` from
:mod:`finetune.training` and ``main`` from :mod:`finetune.cli.train`.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # run as a script, this file's folder is sys.path[0]: it would shadow real packages (`evaluate`, ...)
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    from finetune.threads import passive_wait_by_default

    passive_wait_by_default()  # before torch loads its OpenMP runtime
    from finetune.cli.train import main

    status = main()
    if status:  # imported here: --help, --list and --schema need none of the training modules (3 s of imports)
        from finetune.training.ending import accelerate_traceback_follows

        if accelerate_traceback_follows():
            print("(accelerate launch answers a failed script with a CalledProcessError traceback of its own; it "
                  "adds nothing to the error above, and `accelerate launch --quiet` leaves it out)", file=sys.stderr,
                  flush=True)
    from finetune.process_exit import exit_process

    exit_process(status)  # without the interpreter's module teardown (2 CPU-s, 4 s after the run wrote everything)
