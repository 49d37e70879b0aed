"""The argument parser of the command lines: ``argparse``'s, with usage errors that never echo a secret; and the one
option with which the user lets a recipe run the code it names (:func:`add_trust_option`).

``argparse`` answers an argument it does not know with ``error: unrecognized arguments: ...``, repeating it: a
``--token hf_...`` or an override after a bad option (``--bogus hub.token=...``) would reach the terminal, and under
SLURM or Kubernetes a log file. :class:`ArgumentParser` masks them by key (:func:`finetune.config.secrets.
mask_secrets`) before the message is printed.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["TRUST_OPTION", "ArgumentParser", "add_trust_option"]

#: the option that lets a recipe run its code: :data:`finetune.config.TRUST_FLAG`, which every refusal of a recipe's
#: code names (spelled out here so that ``--help`` imports no recipe code)
TRUST_OPTION = "--trust-recipe-code"


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors (and its sub-commands', which share its class) mask secrets."""

    def error(self, message: str) -> NoReturn:
        from finetune.config.secrets import mask_secrets  # only on an error: `--help` imports no recipe code

        super().error(mask_secrets(message))


def add_trust_option(parser: argparse.ArgumentParser, what: str = "the recipe") -> None:
    """``--trust-recipe-code`` (``--trust-recipe-imports``, its earlier name, still works): the user allows ``what``
    to run the code it names, its ``objective.import`` modules and ``pipe:`` shard commands; off by default. Only the
    commands that run a recipe take it (``train``, ``preview``, ``eval``); ``validate`` and ``download`` never run a
    recipe's code. Parsed as ``args.trust_recipe_code``."""
    parser.add_argument(TRUST_OPTION, "--trust-recipe-imports", dest="trust_recipe_code", action="store_true",
                        help=f"let {what} run the code it names (its objective.import modules, pipe: shard commands); "
                             "only for a recipe you trust, off by default")
