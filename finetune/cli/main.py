"""``xlipkit COMMAND [ARGS ...]``: dispatch to the command lines of the toolkit's modules.

Each command is a thin name for an existing command line: the arguments after the command go unchanged to
that module's ``main(argv)``, which parses them, prints its own ``--help`` (under the name ``xlipkit
COMMAND``) and returns the exit status that ``python -m MODULE`` would give. Nothing is imported before a
command is chosen, so ``xlipkit --help`` is instant and a command loads only its own module.

Several processes (DDP, FSDP, DeepSpeed, several nodes) go through Accelerate's launcher, which starts one
Python process per device; give it the package as a module (``-m``), as ``python -m finetune.cli``::

    accelerate launch -m finetune.cli train recipes/structxlip_docci.yaml
    accelerate launch --num_processes 8 -m finetune.cli train recipes/structxlip_docci.yaml train.lr=1e-5
    torchrun --nproc_per_node 8 -m finetune.cli train recipes/structxlip_docci.yaml

``accelerate launch finetune/run.py RECIPE`` keeps working and is the same program.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from dataclasses import dataclass
from typing import Sequence

__all__ = ["COMMANDS", "Command", "console", "main"]


@dataclass(frozen=True)
class Command:
    """One ``xlipkit`` command.

    Attributes:
        name: the command, ``xlipkit NAME``.
        summary: one line for ``xlipkit --help``.
        module: the module whose ``main(argv, *, prog=None) -> int`` runs it.
        same_as: the equivalent command line without ``xlipkit``.
        subcommand: the module's own sub-command this command stands for (``finetune.hub push``).
        fixed: the only arguments the module gets; set for commands that take none (``recipes``).
    """

    name: str
    summary: str
    module: str
    same_as: str
    subcommand: str | None = None
    fixed: tuple[str, ...] | None = None

    def run(self, argv: Sequence[str]) -> int:
        """Hand ``argv`` to the module's ``main``; returns its exit status (``--help`` and usage errors exit
        through ``SystemExit``, as argparse does for ``python -m MODULE``)."""
        module = importlib.import_module(self.module)
        if self.fixed is not None:
            argparse.ArgumentParser(prog=f"xlipkit {self.name}",
                                    description=f"{self.summary[0].upper()}{self.summary[1:]} (the same as "
                                                f"`{self.same_as}`).").parse_args(list(argv))
            return module.main(list(self.fixed))
        if self.subcommand is not None:
            return module.main([self.subcommand, *argv], prog="xlipkit")
        return module.main(list(argv), prog=f"xlipkit {self.name}")


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("train", "fine-tune or pretrain a model from a recipe, evaluate it before and after",
            "finetune.cli.train", "finetune/run.py RECIPE [key.sub=value ...]"),
    Command("eval", "Recall@K (or zero-shot accuracy) of a run folder or of any model",
            "finetune.cli.evaluate", "python -m finetune.evaluate"),
    Command("push", "push a run to the Hugging Face hub with a generated model card",
            "finetune.cli.hub", "python -m finetune.hub push", subcommand="push"),
    Command("export", "write a run as a plain transformers / open_clip folder (adapter merged)",
            "finetune.cli.hub", "python -m finetune.hub export", subcommand="export"),
    Command("preview", "draw what StructXLIP trains on for a recipe's first examples",
            "finetune.cli.preview", "python -m finetune.preview"),
    Command("pairs", "write FLISM's global-local pairs of a dataset as jsonl (FAST-GOAL III-A)",
            "finetune.cli.pairs", "python -m finetune.preprocess.flism"),
    Command("superpixels", "write F-CAST's superpixels once into a copy of a recipe's webdataset shards",
            "finetune.cli.superpixels", "python -m finetune.cli.superpixels"),
    Command("validate", "check a recipe and list the models, checkpoints and datasets it needs, before a run",
            "finetune.cli.validate", "python -m finetune.cli.validate"),
    Command("download", "fetch the models, checkpoints and datasets a recipe needs (--dry-run: list them)",
            "finetune.cli.download", "python -m finetune.cli.download"),
    Command("copy", "copy a shipped recipe to edit: xlipkit copy structxlip_docci my.yaml",
            "finetune.cli.copy", "python -m finetune.cli.copy"),
    Command("recipes", "list the recipes shipped in recipes/",
            "finetune.cli.train", "finetune/run.py --list", fixed=("--list",)),
    Command("schema", "print the recipe JSON schema, for editors and the docs",
            "finetune.cli.train", "finetune/run.py --schema", fixed=("--schema",)),
)}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xlipkit")
    except PackageNotFoundError:
        return "unknown (not installed; run `pip install -e .`)"


def _parser() -> argparse.ArgumentParser:
    width = max(len(n) for n in COMMANDS)
    commands = "\n".join(f"  {c.name:{width}s}  {c.summary}" for c in COMMANDS.values())
    parser = argparse.ArgumentParser(
        prog="xlipkit",
        usage="xlipkit [-h] [--version] COMMAND [ARGS ...]",
        description="Adapt CLIP-family vision-language models to long, detail-rich captions. "
                    "`xlipkit COMMAND --help` shows a command's options.",
        epilog=(
            f"commands:\n{commands}\n\n"
            "examples:\n"
            "  xlipkit train recipes/quickstart.yaml\n"
            "  xlipkit train recipes/structxlip_docci.yaml train.lr=1e-5 adapter.type=lora\n"
            "  accelerate launch --num_processes 8 -m finetune.cli train recipes/structxlip_docci.yaml\n"
            "  xlipkit eval runs/quickstart\n"
            "  xlipkit push runs/quickstart --repo-id me/quickstart --stage-only /tmp/upload\n"
            "  xlipkit recipes"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the installed version and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``xlipkit COMMAND [ARGS ...]``; returns the command's exit status (2 for an unknown command).

    Args:
        argv: the arguments after ``xlipkit`` (default ``sys.argv[1:]``).
    """
    from finetune.threads import passive_wait_by_default

    passive_wait_by_default()  # before a command imports torch, which loads the OpenMP runtime
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] in ("-h", "--help"):
        parser.print_help(sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        print(f"xlipkit {_version()}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        close = difflib.get_close_matches(args[0], COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        parser.print_usage(sys.stderr)
        print(f"xlipkit: error: unknown command {args[0]!r}{hint} (choose from {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    return command.run(args[1:])


def console() -> None:
    """The ``xlipkit`` console script: :func:`main` on ``sys.argv[1:]``, then the process ends with its status
    without the interpreter's module teardown (:func:`finetune.process_exit.exit_process`)."""
    from finetune.process_exit import exit_process

    try:
        status = main()
    except SystemExit as stop:  # --help and usage errors, as argparse ends them
        status = stop.code
    exit_process(status)
