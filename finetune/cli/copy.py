"""``xlipkit copy NAME [DEST]``: copy a shipped recipe to edit, as ``tune cp`` does.

    xlipkit copy structxlip_docci my.yaml
    xlipkit copy quickstart.yaml configs/      # -> configs/quickstart.yaml

``NAME`` is a recipe of ``recipes/`` (``xlipkit recipes`` lists them), with or without ``.yaml``; ``DEST`` a file
or an existing folder (default ``./NAME.yaml``). An existing file (or symbolic link) is kept unless ``--force``,
which replaces it (a link itself, never what it points to). ``NAME`` is never a path: only the recipes of
``recipes/`` are copied. The copy is the file as shipped, comments and all; relative paths in it
(``model.init_from``, ``output.dir``, datasets) are read from the folder a run starts in, as the shipped recipe's are.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import sys
import tempfile
from pathlib import Path

from finetune.cli.arguments import ArgumentParser
from finetune.files import give_user_permissions

__all__ = ["copy_recipe", "main"]


def copy_recipe(name: str, dest: str | Path | None = None, *, force: bool = False) -> Path:
    """Copy the shipped recipe ``name`` to ``dest``; returns the written file.

    ``name`` is a recipe's name, never a path: only the files of ``recipes/`` are copied. The copy is written
    beside ``dest`` and renamed into place, so that ``dest`` is a whole file or untouched; a ``dest`` that is a
    symbolic link is never written through (with ``force``, the link itself is replaced by the file).

    Raises:
        FileNotFoundError: no shipped recipe of that name (the message suggests the closest), or a name that is a
            path.
        FileExistsError: ``dest`` exists (a dangling symbolic link included) and ``force`` is not set.
        PermissionError / OSError: ``dest`` cannot be written (its folder is read-only, a file stands in its path).
    """
    from finetune.cli.train import RECIPES_DIR

    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    shipped = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    if stem not in shipped:
        if "/" in name or "\\" in name or stem.startswith("."):
            raise FileNotFoundError(f"{name!r} is a path, not the name of a shipped recipe: xlipkit copy copies only "
                                    f"the recipes of {RECIPES_DIR} (`xlipkit recipes` lists them); copy your own "
                                    "files with cp")
        close = difflib.get_close_matches(stem, shipped, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise FileNotFoundError(f"no shipped recipe {name!r} in {RECIPES_DIR}{hint} (`xlipkit recipes` lists them)")
    source = RECIPES_DIR / f"{stem}.yaml"
    target = Path(dest).expanduser() if dest is not None else Path(f"{stem}.yaml")
    if target.is_dir():  # a folder, or a link to one: the copy goes inside
        target = target / source.name
    if target.is_symlink() and not force:
        where = os.readlink(target)
        state = "exists" if target.exists() else "does not exist"
        raise FileExistsError(f"{target} is a symbolic link to {where}, which {state}: give another DEST, or --force "
                              "to replace the link (never what it points to) with the recipe")
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists: give another DEST, or --force to overwrite it")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file stands where a folder of the path should be
        raise NotADirectoryError(errno.ENOTDIR, f"a file stands in the path {target.parent}") from None
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(source.read_bytes())
        give_user_permissions(tmp)
        os.replace(tmp, target)  # a link at target is replaced, not followed
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _parser(prog: str) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Copy a shipped recipe to edit (`xlipkit recipes` lists them).")
    p.add_argument("name", help="a shipped recipe, e.g. structxlip_docci")
    p.add_argument("dest", nargs="?", help="file or folder to copy to (default ./NAME.yaml)")
    p.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; returns 0, or 2 for an unknown recipe, an existing DEST or a DEST that cannot be written."""
    args = _parser(prog or "python -m finetune.cli.copy").parse_args(argv)
    try:
        target = copy_recipe(args.name, args.dest, force=args.force)
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a read-only folder, a file where a folder should be
        print(f"error: cannot write {args.dest or 'the copy'}: {exc.strerror or exc}; give a DEST you can write",
              file=sys.stderr)
        return 2
    print(f"wrote {target}; edit it (output.dir is still the shipped recipe's), then:\n"
          f"  xlipkit validate {target}\n  xlipkit train {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
