"""``xlipkit preview`` (``python -m finetune.preview``): preview what StructXLIP trains on, before spending GPU
hours.

    xlipkit preview recipes/structxlip_docci.yaml --n 8 --out preview.png
    xlipkit preview recipes/quickstart.yaml data.train.size=16 --n 4

For the first ``n`` training examples of a recipe the preview runs the StructXLIP preprocessing exactly as
training will (``StructXLIPTerm.preprocess``: lexicon filter, edge maps, regions and each chunk's top-K
regions under the recipe's model as loaded, cached like a run's) and draws one row per example: the colour
image; its edge map I' with the region boxes (the ones encoded for the local loss in colour, labelled
``r<index>``, the others dashed); the original caption, the appearance terms the lexicon filter removed,
the structure-centric caption T', and each chunk with its positive regions. A recipe without a
``structxlip`` term is previewed with the term's default options. The run report embeds the same picture
(``StructXLIPTerm.report_sections``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import sys
from pathlib import Path
from typing import Any

from finetune.config import RecipeError, load_recipe
from finetune.objectives.structxlip.preview import render_preview

__all__ = ["main", "preview_recipe"]

log = logging.getLogger("xlipkit")


def _structxlip_term(recipe: Any) -> Any:
    from finetune.objectives import TERM_BUILDERS, build_objective
    from finetune.objectives.structxlip import StructXLIPTerm, build_structxlip

    if "structxlip" not in TERM_BUILDERS:
        raise RuntimeError("the structxlip objective term is not registered")
    for term in build_objective(recipe.objective).all_terms:
        if isinstance(term, StructXLIPTerm):
            return term
    log.info("the recipe's objective has no structxlip term: previewing with its default options")
    return build_structxlip(None)[0]


def preview_recipe(recipe: Any, *, n: int = 8, out: str | Path = "structxlip_preview.png") -> Path:
    """Preprocess the first ``n`` training examples of ``recipe`` as a StructXLIP run would and draw them.

    Args:
        recipe: a :class:`finetune.config.Recipe` (``finetune.config.load_recipe``).
        n: examples (rows).
        out: the PNG to write.

    Returns:
        the PNG path.
    """
    # the model, data and drawing libraries load once a recipe is read (`--help` needs none of them)
    from finetune.data.sources import load_source
    from finetune.data.streams import ExampleStream, open_stream
    from finetune.models.families import recipe_family
    from finetune.models.finetuned import load_model

    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    term = _structxlip_term(recipe)
    m = recipe.model
    model = load_model(m.name_or_path, family=recipe_family(m), max_text_len=m.max_text_len, dtype=m.dtype,
                       trust_remote_code=m.trust_remote_code, kps=dict(vars(m.kps)) if m.kps is not None else None)
    spec = recipe.data.train  # a typed SourceSpec since load_recipe
    if spec.is_stream:  # the first n examples of the stream, with the per-example work
        term.check_stream()
        stream = ExampleStream(open_stream(spec), spec, on_error=recipe.data.on_error,
                               transform=lambda example: term.stream_map(example, model))
        dataset, name = list(itertools.islice(stream, n)), stream.spec.name
    else:
        spec = dataclasses.replace(spec, limit=min(n, spec.limit) if spec.limit else n)
        source = load_source(spec, on_error=recipe.data.on_error, cache_dir=recipe.data.cache_dir)
        dataset = term.preprocess(source.dataset, model, cache_dir=recipe.data.cache_dir, log=log)
        name = source.name
    items = [term.preview_fields(dataset[i]) for i in range(min(n, len(dataset)))]
    title = (f"StructXLIP training inputs: {Path(recipe.source).name if recipe.source else 'recipe'}, "
             f"{name} (first {len(items)}), compat {term.compat}, regions encoded as "
             f"{term.options.regions.encode}")
    return render_preview(items, out, title=title)


def _parser(prog: str = "python -m finetune.preview") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Draw what StructXLIP trains on for the first N examples of a recipe's training set: "
                    "images, edge maps with regions, original and filtered captions, chunks and their regions.",
    )
    p.add_argument("recipe", help="path to a recipe YAML")
    p.add_argument("overrides", nargs="*", help="recipe overrides as key.sub=value")
    p.add_argument("--n", type=int, default=8, help="number of examples (default 8)")
    p.add_argument("--out", default="structxlip_preview.png", help="PNG to write (default structxlip_preview.png)")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = _parser(prog) if prog else _parser()
    args = parser.parse_args(argv)
    if not logging.getLogger("xlipkit").handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    from finetune.training.needs import missing_message, recipe_needs

    missing = missing_message(recipe_needs(recipe, recipe_ref=args.recipe), args.recipe)
    if missing is not None:  # all at once, before the model loads
        print(f"recipe error: {missing}", file=sys.stderr)
        return 2
    path = preview_recipe(recipe, n=args.n, out=args.out)
    print(f"wrote {path}")
    return 0
