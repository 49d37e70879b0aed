"""``xlipkit validate RECIPE [key=value ...]``: check a recipe and list everything it needs, before anything slow
starts.

    xlipkit validate recipes/structxlip_docci.yaml
    xlipkit validate my.yaml model.name_or_path=runs/base/final

The recipe is read and typed (:func:`finetune.config.load_recipe`) and goes through the check ``xlipkit train``
makes before anything slow (:func:`finetune.training.preflight.preflight`): every model, checkpoint file, dataset,
stream shard, extra and run it builds on is listed with its state (``ready``, ``download``: fetched on first use, or
now by ``xlipkit download``; ``missing``, with what to do), its objective is built and a streamed ``data.train``
checked against it, and its ``output.dir`` is checked. Exit status 0 exactly when ``xlipkit train`` would pass these
checks, 2 otherwise (every reason in one message, each missing thing listed once).

A recipe's own code never runs here: a module of ``objective.import`` that is not part of xlipkit is not imported
(the recipe is refused, naming the ``--trust-recipe-code`` that ``xlipkit train`` would need), and a ``pipe:``
command is named, not run.
"""

from __future__ import annotations

import argparse
import sys

from finetune.cli.arguments import ArgumentParser
from finetune.config import RecipeError, load_recipe, refuse_recipe

__all__ = ["main"]

_HEADINGS = {"ready": "found", "download": "to download (`xlipkit download` fetches them now)",
             "missing": "missing"}


def _parser(prog: str) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Check a recipe as `xlipkit train` does before anything slow, and list "
                                              "the models, checkpoints, datasets and runs it needs, with what is "
                                              "missing and what would be downloaded. Runs none of the recipe's code.")
    p.add_argument("recipe", help="path to a recipe YAML")
    p.add_argument("overrides", nargs="*", help="recipe overrides as key.sub=value")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; returns 0 when ``xlipkit train`` would pass its checks before the run, else 2."""
    args = _parser(prog or "python -m finetune.cli.validate").parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides, trust_imports=False)  # never runs the recipe's code
    except RecipeError as exc:
        return refuse_recipe(str(exc))
    from finetune.training.preflight import preflight

    checked = preflight(recipe, args.recipe)
    needs = checked.needs
    print(f"{args.recipe}: a valid recipe; it needs {len(needs)} thing{'s' * (len(needs) != 1)} from outside "
          "the toolkit")
    for state, heading in _HEADINGS.items():
        group = [n for n in needs if n.state == state]
        if group:
            print(f"\n{heading}:")
            for need in group:
                print(f"  {need.key}: {need.what}\n      {need.how}")
    sys.stdout.flush()
    if not checked.ok:  # the missing things are listed above: counted here, not repeated
        print(file=sys.stderr)
        return refuse_recipe(checked.message(listed=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
