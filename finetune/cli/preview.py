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

The recipe goes through the check ``xlipkit train`` makes before anything slow
(:func:`finetune.training.preflight.preflight`, less ``output.dir``: a preview writes no run folder) and the preview
uses the objective it built; the recipe's own code runs only with ``--trust-recipe-code``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
from pathlib import Path
from typing import Any

from finetune.cli.arguments import ArgumentParser, add_trust_option
from finetune.config import RecipeError, load_recipe, refuse_recipe

__all__ = ["main", "preview_recipe"]

log = logging.getLogger("xlipkit")


def render_preview(items: list[dict], out: str | Path, **kwargs: Any) -> Path:
    """:func:`finetune.objectives.structxlip.preview.render_preview`, imported when a preview is drawn (the
    drawing libraries load after the arguments are parsed)."""
    from finetune.objectives.structxlip.preview import render_preview as draw

    return draw(items, out, **kwargs)


def _preview_model(m: Any, trust: bool = False) -> Any:
    """The model the preprocessing runs under: the one training would start from. With ``model.init_from``, its
    run's ``final/`` when that run is trained and current; before then the architecture of ``model.name_or_path``
    with random weights, said as INFO (only the similarity-based choice of each chunk's top-K regions depends on
    the weights)."""
    from finetune.models.families import recipe_family
    from finetune.models.finetuned import load_model
    from finetune.models.registry import RANDOM_PREFIX, random_config
    from finetune.training.model import load_start_model
    from finetune.training.upstream import find_current

    name, kps = m.name_or_path, dict(vars(m.kps)) if m.kps is not None else None
    if m.init_from:
        init = find_current(m.init_from, "model.init_from", trust=trust)
        if init is not None:
            return load_start_model(m, init).eval()
        log.info("model.init_from: %s is not trained yet (training this recipe trains it first); the preview "
                 "uses %s with random weights", m.init_from, name)
        if not name.startswith(RANDOM_PREFIX) and random_config(name, recipe_family(m)) is not None:
            name = RANDOM_PREFIX + name  # said above: no warning that a pretrained model was meant
    return load_model(name, family=recipe_family(m), max_text_len=m.max_text_len, dtype=m.dtype,
                      trust_remote_code=m.trust_remote_code, kps=kps)


def _structxlip_term(recipe: Any, objective: Any = None) -> Any:
    from finetune.objectives import TERM_BUILDERS, build_objective
    from finetune.objectives.structxlip import StructXLIPTerm, build_structxlip

    if "structxlip" not in TERM_BUILDERS:
        raise RuntimeError("the structxlip objective term is not registered")
    objective = objective if objective is not None else build_objective(recipe.objective)
    for term in objective.all_terms:
        if isinstance(term, StructXLIPTerm):
            return term
    log.info("the recipe's objective has no structxlip term: previewing with its default options")
    return build_structxlip(None)[0]


def preview_recipe(recipe: Any, *, n: int = 8, out: str | Path = "structxlip_preview.png",
                   objective: Any = None) -> Path:
    """Preprocess the first ``n`` training examples of ``recipe`` as a StructXLIP run would and draw them.

    Args:
        recipe: a :class:`finetune.config.Recipe` (``finetune.config.load_recipe``).
        n: examples (rows).
        out: the PNG to write.
        objective: the recipe's objective when the caller built it (the preflight did); built here otherwise.

    Returns:
        the PNG path.
    """
    # the model, data and drawing libraries load once a recipe is read (`--help` needs none of them)
    from finetune.data.sources import load_source
    from finetune.data.streams import ExampleStream, open_stream

    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    term = _structxlip_term(recipe, objective)
    model = _preview_model(recipe.model, recipe.trust_code)
    spec = recipe.data.train  # a typed SourceSpec since load_recipe
    if spec.is_stream:  # the first n examples of the stream, with the per-example work
        term.check_stream()
        from finetune.training.inputs import read_policy

        stream = ExampleStream(open_stream(spec, policy=read_policy(recipe)), spec, on_error=recipe.data.on_error,
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
    p = ArgumentParser(
        prog=prog,
        description="Draw what StructXLIP trains on for the first N examples of a recipe's training set: "
                    "images, edge maps with regions, original and filtered captions, chunks and their regions.",
    )
    p.add_argument("recipe", help="path to a recipe YAML")
    p.add_argument("overrides", nargs="*", help="recipe overrides as key.sub=value (before or after the options)")
    add_trust_option(p)
    p.add_argument("--n", type=int, default=8, help="number of examples (default 8)")
    p.add_argument("--out", default="structxlip_preview.png", help="PNG to write (default structxlip_preview.png)")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = _parser(prog) if prog else _parser()
    args = parser.parse_intermixed_args(argv)  # `RECIPE --n 8 key=value`: overrides after options too
    if not logging.getLogger("xlipkit").handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        recipe = load_recipe(args.recipe, args.overrides, trust_imports=args.trust_recipe_code)
    except RecipeError as exc:
        return refuse_recipe(str(exc))
    from finetune.training.preflight import preflight
    from finetune.training.upstream import PrerequisiteError

    checked = preflight(recipe, args.recipe, output=False)  # a preview writes no run folder
    if not checked.ok:  # all at once, before the model loads
        return refuse_recipe(checked.message())
    try:
        path = preview_recipe(recipe, n=args.n, out=args.out, objective=checked.objective)
    except PrerequisiteError as exc:  # a model.init_from that names nothing usable
        return refuse_recipe(str(exc))
    print(f"wrote {path}")
    return 0
