"""``xlipkit download RECIPE [key=value ...]``: fetch what a recipe needs and can be downloaded, as ``tune
download`` does, so that the run itself can go offline (``HF_HUB_OFFLINE=1``).

    xlipkit download recipes/structxlip_docci.yaml
    xlipkit download recipes/structxlip_docci.yaml --dry-run model.name_or_path=openai/clip-vit-large-patch14

Hub models go through ``huggingface_hub.snapshot_download`` (its cache, its token), the benchmarks' official files
through :mod:`finetune.data.download` (the same cache and checks as a run's first use), ultralytics checkpoints
through ultralytics' ``attempt_download_asset``. What no command can fetch (DCI behind the SA-1B licence, a local
dataset, a run folder) is listed with what to do, and so is what sits on a host that does not answer (the same
probe, and the same answer, as ``xlipkit validate``'s). With ``--dry-run``, or offline (``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE``: then no host is asked), it only says what it would fetch. A recipe's own code never runs
here (``objective.import`` modules are not imported).

Exit status: 0 when everything the recipe needs is there afterwards (or, with ``--dry-run``, always after the
plan), 1 when a download failed or offline flags forbade them, 2 for a bad recipe or for needs that cannot be
downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys

from finetune.cli.arguments import ArgumentParser
from finetune.config import RecipeError, load_recipe, refuse_recipe

__all__ = ["main"]


def _parser(prog: str) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Download the models, checkpoints and datasets a recipe needs "
                                              "(hub models with huggingface_hub.snapshot_download).")
    p.add_argument("recipe", help="path to a recipe YAML")
    p.add_argument("overrides", nargs="*", help="recipe overrides as key.sub=value (before or after the options)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be downloaded")
    return p


def _offline_flags() -> list[str]:
    return [f for f in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
            if os.environ.get(f, "").strip().lower() in ("1", "true", "yes", "on")]


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; returns the exit status (module docstring)."""
    # `RECIPE --dry-run key=value`: overrides after the options too
    args = _parser(prog or "python -m finetune.cli.download").parse_intermixed_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides, trust_imports=False)  # never runs the recipe's code
    except RecipeError as exc:
        return refuse_recipe(str(exc))
    from finetune.training.assets import fetch_need, fetchable
    from finetune.training.preflight import command_ref, recipe_needs

    offline = _offline_flags()  # then no host is asked: the plan, as where the network can be reached
    needs = recipe_needs(recipe, recipe_ref=args.recipe, plan_only=bool(offline))
    todo = [n for n in needs if fetchable(n)]
    cannot = [n for n in needs if n.state == "missing" and not fetchable(n)]
    for need in needs:
        if need.state == "ready":
            print(f"already there  {need.key}: {need.what}")
    if args.dry_run or offline:
        for need in todo:
            print(f"would fetch    {need.key}: {need.what} ({need.how})")
    failed = 0
    if offline and todo and not args.dry_run:
        print(f"error: {' and '.join(offline)} {'is' if len(offline) == 1 else 'are'} set: nothing was downloaded; "
              f"run `xlipkit download {command_ref(recipe, args.recipe)}` where the network can be reached (without "
              "those variables), then train offline with the same caches", file=sys.stderr)
        failed = 1
    elif not args.dry_run:
        for need in todo:
            print(f"fetching       {need.key}: {need.what}", flush=True)
            try:
                print(f"  -> {fetch_need(need)}")
            except Exception as exc:  # reported per item; the others still download
                print(f"error: {need.key}: {need.what}: {type(exc).__name__}: {exc}", file=sys.stderr)
                failed += 1
    for need in cannot:
        print(f"cannot fetch   {need.key}: {need.what}: {need.how}", file=sys.stderr)
    if failed:
        return 1
    return 2 if cannot and not args.dry_run else 0


if __name__ == "__main__":
    raise SystemExit(main())
