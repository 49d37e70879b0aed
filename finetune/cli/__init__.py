"""The ``xlipkit`` command: one entry point for the toolkit's command lines.

    xlipkit train RECIPE [key.sub=value ...]    # = finetune/run.py
    xlipkit eval RUN_OR_MODEL [...]             # = python -m finetune.evaluate
    xlipkit push RUN --repo-id USER/NAME        # = python -m finetune.hub push
    xlipkit export RUN OUT_DIR                  # = python -m finetune.hub export
    xlipkit preview RECIPE [...]                # = python -m finetune.preview
    xlipkit pairs IMAGES_AND_CAPTIONS OUT       # = python -m finetune.preprocess.flism
    xlipkit recipes                             # = finetune/run.py --list
    xlipkit schema                              # = finetune/run.py --schema

One module per command, each with ``main(argv, *, prog=None) -> int``: ``train`` (also ``recipes``, ``schema``),
``evaluate`` (``eval``), ``hub`` (``push``, ``export``), ``preview`` and ``pairs``; :mod:`finetune.cli.main`
dispatches to them, so options, output and exit status are those of the module's own command line. The entry
points users type (``finetune/run.py``, ``python -m finetune.evaluate``, ...) are thin modules over these. Several processes:
``accelerate launch [--num_processes N] -m finetune.cli train RECIPE`` (see :mod:`finetune.cli.main`).
"""
