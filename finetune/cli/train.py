"""``xlipkit train`` (``finetune/run.py``): fine-tune or pretrain a CLIP-family model from a recipe, evaluate it
before and after (:func:`finetune.training.run_recipe`); ``--list`` the shipped recipes, ``--schema`` the recipe
JSON schema.

    xlipkit train recipes/quickstart.yaml                       # one process, this one (= python finetune/run.py)
    accelerate launch --num_processes 8 finetune/run.py recipes/structxlip_docci.yaml train.lr=1e-5
    python finetune/run.py --list
    python finetune/run.py --schema > recipe.schema.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from finetune.cli.arguments import ArgumentParser, add_trust_option
from finetune.config import RecipeError, list_recipes, load_recipe, recipe_json_schema, refuse_recipe

__all__ = ["RECIPES_DIR", "main"]

#: the recipes shipped with the toolkit (``--list``)
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def _parser(prog: str = "finetune/run.py") -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description=(
            "Fine-tune a CLIP / SigLIP / SigLIP2 model on long captions from a YAML recipe: load the model, "
            "stretch its text positions (Long-CLIP KPS), add a LoRA/DoRA adapter or train fully, run the "
            "recipe's objective (clip, siglip, longclip + StructXLIP ...), and report Recall@K before and "
            "after, in this process. `accelerate launch` starts it once per device: several GPUs or nodes "
            "(DDP/FSDP/DeepSpeed)."
        ),
        epilog=(
            "examples:\n"
            "  python finetune/run.py recipes/quickstart.yaml   # = xlipkit train: one process, this one\n"
            "  accelerate launch finetune/run.py recipes/structxlip_docci.yaml train.lr=1e-5 adapter.type=lora\n"
            "  ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 finetune/run.py recipes/quickstart.yaml "
            "train.max_steps=20   # two CPU processes\n"
            "  python finetune/run.py --list\n"
            "  python finetune/run.py --schema > recipe.schema.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", nargs="?", help="path to a recipe YAML (see --list)")
    p.add_argument("overrides", nargs="*",
                   help="recipe overrides as key.sub=value (typed, validated; before or after the options)")
    add_trust_option(p)
    p.add_argument("--list", action="store_true", help="list the recipes shipped in recipes/ and exit")
    p.add_argument("--schema", action="store_true",
                   help="print the recipe JSON schema (for editors: `# yaml-language-server: $schema=FILE`) and exit")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line (``finetune/run.py``, ``xlipkit train``); returns the exit status: 0, 2 on a recipe
    error (printed as ``recipe error: ...``), else the run's. ``prog`` names the command in usage and help.

    The recipe goes through :func:`finetune.training.preflight.preflight`, the check ``xlipkit validate`` makes,
    and the run trains the objective it built; the recipe's own code runs only with ``--trust-recipe-code``."""
    parser = _parser(prog) if prog else _parser()
    args = parser.parse_intermixed_args(argv)  # `RECIPE --opt key=value`: overrides after options too
    if args.schema:
        print(json.dumps(recipe_json_schema(), indent=2))
        return 0
    if args.list:
        for name, desc in list_recipes(RECIPES_DIR):
            print(f"{name:34s} {desc}")
        return 0
    if not args.recipe:
        parser.print_usage(sys.stderr)
        print("error: give a recipe path (see --list)", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args.recipe, args.overrides, trust_imports=args.trust_recipe_code)
    except RecipeError as exc:
        return refuse_recipe(str(exc))
    # imported once a recipe is loaded: `--help`, `--list` and a bad recipe need none of the training libraries
    from finetune.training.preflight import preflight
    from finetune.training.recipe import run_recipe

    checked = preflight(recipe, args.recipe)
    if not checked.ok:  # everything that stops it at once, before anything slow starts
        return refuse_recipe(checked.message())
    try:
        return run_recipe(recipe, checked=checked)
    except RecipeError as exc:  # found as the run starts (a DeepSpeed release that cannot train these models, ...)
        return refuse_recipe(str(exc))
