"""``xlipkit copy NAME [DEST]``: copy a shipped recipe to edit, as ``tune cp`` does.

    xlipkit copy structxlip_docci my.yaml
    xlipkit copy quickstart.yaml configs/      # -> configs/quickstart.yaml

``NAME`` is a recipe of ``recipes/`` (``xlipkit recipes`` lists them), with or without ``.yaml``; ``DEST`` a file
or an existing folder (default ``./NAME.yaml``). An existing file is kept unless ``--force``. The copy is the
file as shipped, comments and all; relative paths in it (``model.init_from``, ``output.dir``, datasets) are read
from the folder a run starts in, as the shipped recipe's are.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
from pathlib import Path

from finetune.cli.arguments import ArgumentParser

__all__ = ["copy_recipe", "main"]


def copy_recipe(name: str, dest: str | Path | None = None, *, force: bool = False) -> Path:
    """Copy the shipped recipe ``name`` to ``dest``; returns the written file.

    Raises:
        FileNotFoundError: no shipped recipe of that name (the message suggests the closest).
        FileExistsError: ``dest`` exists and ``force`` is not set.
    """
    from finetune.cli.train import RECIPES_DIR

    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    source = RECIPES_DIR / f"{stem}.yaml"
    if not source.is_file():
        shipped = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        close = difflib.get_close_matches(stem, shipped, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise FileNotFoundError(f"no shipped recipe {name!r} in {RECIPES_DIR}{hint} (`xlipkit recipes` lists them)")
    target = Path(dest).expanduser() if dest is not None else Path(f"{stem}.yaml")
    if target.is_dir():
        target = target / source.name
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists: give another DEST, or --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def _parser(prog: str) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Copy a shipped recipe to edit (`xlipkit recipes` lists them).")
    p.add_argument("name", help="a shipped recipe, e.g. structxlip_docci")
    p.add_argument("dest", nargs="?", help="file or folder to copy to (default ./NAME.yaml)")
    p.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; returns 0, or 2 for an unknown recipe or an existing DEST."""
    args = _parser(prog or "python -m finetune.cli.copy").parse_args(argv)
    try:
        target = copy_recipe(args.name, args.dest, force=args.force)
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {target}; edit it (output.dir is still the shipped recipe's), then:\n"
          f"  xlipkit validate {target}\n  xlipkit train {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
