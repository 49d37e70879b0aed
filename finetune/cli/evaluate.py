"""``xlipkit eval`` / ``python -m finetune.evaluate``: Recall@K (or zero-shot accuracy) of a run folder or of any
model, from the command line. The metric and the protocols are the library :mod:`finetune.evaluation`.

    python -m finetune.evaluate runs/quickstart
    python -m finetune.evaluate openai/clip-vit-base-patch16 --sets docci,urban1k --max-text-len 248
    xlipkit eval runs/quickstart
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.cli.arguments import add_trust_option

if TYPE_CHECKING:
    from finetune.evaluation import RetrievalOptions
    from finetune.evaluation.scorers import Scorer

__all__ = ["main"]


def _parser(prog: str = "python -m finetune.evaluate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Text-to-image and image-to-text Recall@K of a fine-tuned run or of any model. MODEL_OR_RUN is a "
            "run folder (holding recipe.yaml and final/; its recipe's eval sets are the default) or anything "
            "finetune.load_model accepts (a registry name, a hub id, a local folder). Prints a table; for a run "
            "folder, writes RUN/metrics_eval.json (or --out)."
        ),
        epilog=(
            "examples:\n"
            "  python -m finetune.evaluate runs/quickstart\n"
            "  python -m finetune.evaluate runs/structxlip_docci --sets docci,urban1k --protocol docci=goal\n"
            "  python -m finetune.evaluate openai/clip-vit-base-patch16 --sets urban1k --max-text-len 248 "
            "--out clip_urban1k.json\n"
            "  python -m finetune.evaluate runs/flair_docci --scorer flair --rerank-top-k 128\n"
            "  python -m finetune.evaluate runs/flair_cc3m_recap --zeroshot imagenet/val --templates seven"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_or_run", metavar="MODEL_OR_RUN", help="run folder, registry name, hub id or model folder")
    p.add_argument("--sets", help="comma-separated sets, each `name` or `name:protocol` (e.g. docci,urban1k), or a "
                                  "YAML list as in a recipe's eval.sets, e.g. '[{name: synthetic, split: test}]'")
    p.add_argument("--protocol", action="append", default=[], metavar="SET=PROTOCOL",
                   help="evaluation protocol of one set (repeatable), e.g. --protocol docci=goal")
    p.add_argument("--batch-size", type=int, help="rows per forward pass (default: the recipe's, else 64)")
    p.add_argument("--ks", help="comma-separated K values (default: the recipe's, else 1,5,10,25,50)")
    p.add_argument("--max-text-len", type=int,
                   help="for a model (not a run): stretch text positions to this length with Long-CLIP KPS")
    p.add_argument("--on-error", choices=("skip", "raise"), help="bad examples: skip and count, or stop")
    p.add_argument("--cache-dir", help="where data sources cache their files")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (default 0)")
    p.add_argument("--scorer", help="a registered scorer (finetune.evaluation.scorers), e.g. cosine (default: the "
                                    "recipe's eval.scorer, else cosine)")
    p.add_argument("--rerank-top-k", metavar="K",
                   help="re-score only each query's global-cosine top-K with the scorer (FLAIR's inference); "
                        "'none' scores all (default: the recipe's eval.rerank_top_k, else none)")
    p.add_argument("--block-size", type=int,
                   help="texts x images per score block, bounds memory (default: the recipe's, else 1024)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first, so that the scorer it registers can be named (repeatable)")
    p.add_argument("--zeroshot", metavar="FOLDER",
                   help="zero-shot classification of an image folder with one sub-folder per class (class name = "
                        "folder name, _ as space): top-1 / top-5 accuracy with prompt templates")
    p.add_argument("--templates", default="seven",
                   help="zero-shot prompt templates: seven (CLIP's 7 ImageNet templates, FLAIR's; default), openai "
                        "(CLIP's 80), simple, or a text file with one template per line holding {}")
    p.add_argument("--out", help="write the metrics JSON here (default for a run: RUN/metrics_eval.json)")
    add_trust_option(p, "the run folder's recipe.yaml")
    return p


class _UsageError(Exception):
    pass


def _parse_sets(text: str, protocols: list[str]) -> list[Any]:
    """``docci,urban1k:default`` or a YAML flow list of entries as in a recipe's ``eval.sets``
    (``[{name: synthetic, split: test, size: 256}]``), as typed ``SourceSpec`` objects, checked as a recipe's
    ``eval.sets`` are (registered names, keys, no streams) before the model loads."""
    import yaml

    from finetune.config import RecipeError, parse_sources

    if text.lstrip().startswith(("[", "{")):
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise _UsageError(f"--sets {text!r} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    else:
        value = [t.strip() for t in text.split(",")]
        if not all(value):
            raise _UsageError(f"--sets {text!r} has an empty entry; write names separated by commas, e.g. "
                              "docci,urban1k")
    try:
        return _apply_protocols(parse_sources(value, "--sets"), protocols)
    except RecipeError as exc:
        raise _UsageError(str(exc)) from None


def _apply_protocols(sets: list[Any], protocols: list[str]) -> list[Any]:
    """``sets`` (typed ``SourceSpec`` entries) with ``--protocol SET=PROTOCOL`` applied."""
    sets = list(sets)
    for item in protocols:
        name, sep, protocol = item.partition("=")
        if not sep or not name.strip() or not protocol.strip():
            raise _UsageError(f"--protocol {item!r} is not SET=PROTOCOL (e.g. --protocol docci=goal)")
        if not any(s.name == name.strip() for s in sets):
            raise _UsageError(f"--protocol {item!r}: no set named {name.strip()!r} among "
                              f"{', '.join(str(s.name) for s in sets)}")
        sets = [dataclasses.replace(s, protocol=protocol.strip()) if s.name == name.strip() else s for s in sets]
    return sets


def _parse_ks(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        raise _UsageError(f"--ks {text!r}: write positive integers separated by commas, e.g. 1,5,10") from None
    if not ks or min(ks) < 1:
        raise _UsageError(f"--ks {text!r}: every K must be >= 1")
    return ks


def _parse_rerank(text: str) -> int | None:
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise _UsageError(f"--rerank-top-k {text!r}: give a positive integer K, or 'none' to score every item")
    return k


def _resolve_scorer(name: str, imports: list[str]) -> Scorer:
    import importlib

    from finetune.evaluation.scorers import get_scorer

    for module in imports:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise _UsageError(f"--import {module}: cannot import it ({exc}); install it or put its folder on "
                              f"PYTHONPATH") from None
    try:
        return get_scorer(name)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / "recipe.yaml").is_file()


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; returns the exit status (2 on bad arguments, a bad recipe or an
    unloadable model)."""
    parser = _parser(prog) if prog else _parser()
    args = parser.parse_args(argv)  # before any import of the evaluation's libraries: `--help` needs none
    try:
        return _main(args)
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    from finetune.config import RecipeError, load_recipe

    target = Path(args.model_or_run)
    recipe = None
    if _is_run_dir(target):
        if not (target / "final").is_dir():
            raise _UsageError(f"run folder {target} has no final/ model folder: did the run finish? "
                              f"(re-run it, or pass a model folder)")
        if args.max_text_len is not None:
            raise _UsageError("--max-text-len applies to models, not run folders (a run keeps its own length)")
        try:  # a run folder may come from anyone: its objective.import runs code only when the user says so
            recipe = load_recipe(target / "recipe.yaml", trust_imports=args.trust_recipe_code)
        except RecipeError as exc:  # an objective.import refused names --trust-recipe-code
            raise _UsageError(f"cannot read the run's recipe: {exc}") from None
    if args.batch_size is not None and args.batch_size < 1:
        raise _UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.sets:
        sets = _parse_sets(args.sets, args.protocol)
    elif args.zeroshot:
        sets = []
    elif recipe is not None:
        sets = _apply_protocols(list(recipe.eval.sets), args.protocol)
    else:
        raise _UsageError(f"{args.model_or_run} is not a run folder: give the sets to evaluate, e.g. "
                          "--sets docci,urban1k")
    if args.zeroshot:
        from finetune.evaluation.zeroshot import folder_classes, load_templates

        try:
            folder_classes(args.zeroshot)
            load_templates(args.templates)
        except ValueError as exc:
            raise _UsageError(str(exc)) from None
    if not sets and not args.zeroshot:
        raise _UsageError("no evaluation sets: the run's recipe has an empty eval.sets; give --sets")
    options = _options(args, recipe)
    if args.out:
        from finetune.runs.errors import RunFolderError
        from finetune.runs.folder import check_eval_output

        try:  # before the model loads: never overwrite the model's own files
            check_eval_output(args.out, [target / "final"] if recipe is not None else [target])
        except RunFolderError as exc:
            raise _UsageError(str(exc)) from None
    out = Path(args.out) if args.out else (target / "metrics_eval.json" if recipe is not None else None)
    lock = _claim_output(out, target if recipe is not None else None)
    try:
        return _evaluate_and_write(args, target, recipe, out, sets, options)
    finally:
        if lock is not None:
            lock.release()


def _options(args: argparse.Namespace, recipe: Any) -> RetrievalOptions:
    """How to evaluate: each option given on the command line, else the run's recipe's, else the default."""
    from finetune.evaluation import DEFAULT_KS, RetrievalOptions

    if args.block_size is not None and args.block_size < 1:
        raise _UsageError(f"--block-size must be >= 1, got {args.block_size}")
    ev, data = (recipe.eval, recipe.data) if recipe is not None else (None, None)
    return RetrievalOptions(
        ks=_parse_ks(args.ks) if args.ks else list(ev.ks if ev else DEFAULT_KS),
        batch_size=args.batch_size or (ev.batch_size if ev else 64),
        on_error=args.on_error or (data.on_error if data else "skip"),
        cache_dir=args.cache_dir or (data.cache_dir if data else None),
        scorer=_resolve_scorer(args.scorer or (ev.scorer if ev else "cosine"), args.imports),
        rerank_top_k=(_parse_rerank(args.rerank_top_k) if args.rerank_top_k is not None
                      else ev.rerank_top_k if ev else None),
        block_size=args.block_size or (ev.block_size if ev else 1024),
        num_workers=args.num_workers)


#: what an evaluation writes at most (metrics JSON), with room to spare
_EVAL_OUTPUT_BYTES = 2**20


def _claim_output(out: Path | None, run_dir: Path | None) -> Any:
    """Before the model loads: the folder ``out`` goes to must be writable with room for the results, and a
    run folder written into is locked (:class:`finetune.runs.lock.RunLock`) so that no training replaces
    it meanwhile. Returns the lock (None when none was taken).

    Raises:
        _UsageError: not writable, no room, or a run writes into that run folder now.
    """
    from finetune.runs.errors import RunFolderError
    from finetune.runs.lock import RunLock, lock_on_main_process
    from finetune.runs.space import check_free_space, check_writable

    if out is None:
        return None
    folder = next(p for p in [out.parent.absolute(), *out.parent.absolute().parents] if p.exists())
    what = f"the folder of {str(out)!r}" if folder == out.parent.absolute() else f"{str(folder)!r} (for {str(out)!r})"
    inside = run_dir is not None and out.absolute().is_relative_to(run_dir.absolute())
    if inside:
        what = f"run folder {str(run_dir)!r}"
    checks = [lambda: check_writable(folder, what),
              lambda: check_free_space(folder, _EVAL_OUTPUT_BYTES, what=what, detail="the evaluation results",
                                       advice="free some space, or write the results elsewhere (--out)")]
    try:
        if inside:
            lock = RunLock(run_dir, what=what, command="python -m finetune.evaluate")
            return lock_on_main_process(lock, *checks)
        return lock_on_main_process(None, *checks)
    except RunFolderError as exc:
        raise _UsageError(f"{exc} (nothing was evaluated)") from None


def _check_finite_weights(model: Any, name: str) -> None:
    """Refuse a model whose weights hold NaN or inf (one pass over its parameters, and its buffers for NaN: an
    attention mask holds -inf by design; before any image is encoded): every embedding it makes would be NaN, and
    Recall@K meaningless.

    Raises:
        _UsageError: naming the model, the first bad tensor and how many there are.
    """
    import torch

    bad = [n for n, t in model.named_parameters() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    bad += [n for n, t in model.named_buffers() if t.is_floating_point() and bool(torch.isnan(t).any())]  # masks: -inf
    if bad:
        more = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
        raise _UsageError(f"cannot evaluate {name}: its weights hold NaN or inf ({bad[0]}{more}): the model is broken "
                          "(a run that diverged, a damaged save). Evaluate another checkpoint, or train again "
                          "(train.on_nonfinite: raise stops a run at its first non-finite step)")


def _evaluate_and_write(args: argparse.Namespace, target: Path, recipe: Any, out: Path | None, sets: list,
                        options: RetrievalOptions) -> int:
    """Load the model, evaluate it (and classify zero-shot), print the table and write ``out``."""
    from accelerate import Accelerator

    from finetune.evaluation import evaluate_sets, format_table

    from finetune.models import load_finetuned, load_model

    accelerator = Accelerator()
    try:
        if recipe is not None:
            model = load_finetuned(str(target / "final"))
        else:
            from finetune.training.assets import model_need

            need = model_need(args.model_or_run, key="MODEL_OR_RUN")
            if need is not None and need.state == "missing":  # in seconds, not after the hub's retries
                raise _UsageError(f"cannot load {args.model_or_run}: {need.how}")
            model = load_model(args.model_or_run, max_text_len=args.max_text_len)
    except (OSError, ValueError, KeyError) as exc:
        raise _UsageError(f"cannot load {args.model_or_run}: {exc}") from None
    _check_finite_weights(model, args.model_or_run)
    model.to(accelerator.device)

    from finetune.data.images import DataError

    zeroshot = None
    if args.zeroshot:
        from finetune.evaluation.zeroshot import zeroshot_classify

        # the paper classifies by the global embeddings: cosine unless --scorer names another
        zeroshot_scorer = _resolve_scorer(args.scorer, args.imports) if args.scorer else "cosine"
        zeroshot = zeroshot_classify(model, args.zeroshot, templates=args.templates, scorer=zeroshot_scorer,
                                     batch_size=options.batch_size, accelerator=accelerator)
    try:
        results = evaluate_sets(model, sets, options, accelerator=accelerator) if sets else {}
    except DataError as exc:  # unknown set or protocol, missing files, bad examples
        raise _UsageError(str(exc)) from None
    if accelerator.is_main_process:
        if results:
            print(format_table(None, results), flush=True)
        if zeroshot is not None:
            print(f"zero-shot {zeroshot['folder']}: {zeroshot['n_images']} images, {zeroshot['n_classes']} classes, "
                  f"top-1 {zeroshot['top1']:.2f} %, top-5 {zeroshot['top5']:.2f} % ({zeroshot['scorer']})", flush=True)
        if out is not None:
            from finetune.files import write_json_atomic

            write_json_atomic(out, {"model": args.model_or_run, "run": recipe is not None,
                                    "max_text_len": model.max_text_len, "ks": list(options.ks), "sets": results,
                                    **({"zeroshot": zeroshot} if zeroshot is not None else {})})
            print(f"wrote {out}", flush=True)
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
