"""The hub: push a run to the Hugging Face hub with a generated model card, stage what would be uploaded, and export
a run as a plain transformers / open_clip folder (DESIGN 1). Loading back is :func:`finetune.load_finetuned`.

- :mod:`~finetune.hub.upload`: :func:`read_run`, :func:`stage_upload`, :func:`push`, :func:`export`;
- :mod:`~finetune.hub.model_card`: the ``README.md`` model card (metadata, results, how to load).

The command line is :mod:`finetune.cli.hub`::

    xlipkit push runs/structxlip_docci --repo-id me/clip-structxlip-docci   # = python -m finetune.hub push ...
    xlipkit export runs/structxlip_docci exported/clip-structxlip-docci      # = python -m finetune.hub export ...
"""

from __future__ import annotations

from finetune.hub.upload import (FORMATS, HubPushError, RunFolder, export, push, read_run, resolve_token,
                               stage_upload)

__all__ = ["FORMATS", "HubPushError", "RunFolder", "export", "push", "read_run", "resolve_token", "stage_upload"]
