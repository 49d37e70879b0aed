"""The argument parser of the command lines: ``argparse``'s, with usage errors that never echo a secret.

``argparse`` answers an argument it does not know with ``error: unrecognized arguments: ...``, repeating it: a
``--token hf_...`` or an override after a bad option (``--bogus hub.token=...``) would reach the terminal, and under
SLURM or Kubernetes a log file. :class:`ArgumentParser` masks them by key (:func:`finetune.config.secrets.
mask_secrets`) before the message is printed.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors (and its sub-commands', which share its class) mask secrets."""

    def error(self, message: str) -> NoReturn:
        from finetune.config.secrets import mask_secrets  # only on an error: `--help` imports no recipe code

        super().error(mask_secrets(message))
