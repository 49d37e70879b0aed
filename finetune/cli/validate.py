"""``xlipkit validate RECIPE [key=value ...]``: check a recipe and list everything it needs, before anything slow
starts.

    xlipkit validate recipes/structxlip_docci.yaml
    xlipkit validate my.yaml model.name_or_path=runs/base/final

The recipe is read and typed (:func:`finetune.config.load_recipe`), every model, checkpoint file, dataset, extra
and run it builds on is listed with its state (:func:`finetune.training.needs.recipe_needs`): ``ready``, ``download`` (fetched on first use, or now by
``xlipkit download``) or ``missing`` (with what to do); its objective is built and a streamed ``data.train`` checked
against it, as a run does before anything slow (:func:`finetune.training.needs.recipe_problems`). Exit status 0 when nothing is missing, 2 otherwise (all
missing things in one message), as ``xlipkit train`` would refuse the recipe.
"""

from __future__ import annotations

import argparse
import sys

from finetune.cli.arguments import ArgumentParser
from finetune.config import RecipeError, load_recipe

__all__ = ["main"]

_HEADINGS = {"ready": "found", "download": "to download (`xlipkit download` fetches them now)",
             "missing": "missing"}


def _parser(prog: str) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Check a recipe and list the models, checkpoints, datasets and runs "
                                              "it needs, with what is missing and what would be downloaded.")
    p.add_argument("recipe", help="path to a recipe YAML")
    p.add_argument("overrides", nargs="*", help="recipe overrides as key.sub=value")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; returns 0 when the recipe passes the run's early checks and nothing it needs is missing,
    else 2."""
    args = _parser(prog or "python -m finetune.cli.validate").parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    from finetune.training.needs import recipe_needs, recipe_problems

    needs = recipe_needs(recipe, recipe_ref=args.recipe)
    print(f"{args.recipe}: a valid recipe; it needs {len(needs)} thing{'s' * (len(needs) != 1)} from outside "
          "the toolkit")
    for state, heading in _HEADINGS.items():
        group = [n for n in needs if n.state == state]
        if group:
            print(f"\n{heading}:")
            for need in group:
                print(f"  {need.key}: {need.what}\n      {need.how}")
    problems = recipe_problems(recipe, args.recipe)  # the missing ones and the run's own early checks
    if problems is not None:
        print(f"\nrecipe error: {problems}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
