"""How far Recall@1 moves between seeds, for a recipe and the runs it is compared with (``eval.compare_with``).

Run ``python bench/seed_spread.py recipes/quickstart.yaml --seeds 0 1 2``: the recipe and each recipe of its
``eval.compare_with`` are run once per seed, as shipped except for ``train.seed`` (data order, augmentation and
the initialisation of new parameters), ``output.dir`` (``runs/seed_spread/<recipe>-seed<N>``) and
``eval.compare_with`` (emptied: the comparison runs are runs of this sweep; ``eval.seed_spread``, which this
measures, is nulled too, so that setting it does not make the runs stale). Each run is a ``finetune/run.py``
process of its own, one at a time; a run folder that already holds a finished run of the same resolved recipe
(and the same ``model.init_from`` start) is reused, as ``model.init_from`` reuses one.

It prints, per evaluation set and direction, each run's R@1 per seed, the difference between the recipe and
each comparison on the same seed, the means, and the seed spread: the largest R@1 range over the seeds of any
of these recipes in either direction, the number ``eval.seed_spread`` takes. The verdict is
``finetune.evaluation.report.verdict`` applied to the means over seeds, with that spread. Everything goes to
``bench/results/seed_spread_<recipe>.json`` with the commit, torch version, thread count and machine load, so
that a number quoted in a docs page names the run that measured it.

The numbers depend on the CPU, the torch build and the thread count (``OMP_NUM_THREADS``; the report says
which): compare spreads measured on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DIRECTIONS = (("t2i", "text→image"), ("i2t", "image→text"))
#: how finetune.evaluation.report.verdict says where a single run's spread comes from
RECIPE_SPREAD = "taken from the recipe (`eval.seed_spread`, measured over seeds beforehand, not by this run)"


def seeded_recipe(ref: str, seed: int, runs: Path) -> tuple[Path, dict[str, Any]]:
    """Write the recipe ``ref`` with ``train.seed = seed``, ``output.dir = runs/<stem>-seed<seed>`` and no
    ``eval.compare_with`` to ``runs/<stem>-seed<seed>.yaml``; returns that path and the resolved recipe."""
    import yaml

    from finetune.config import load_recipe, recipe_to_dict

    name = f"{Path(ref).stem}-seed{seed}"
    out_dir = runs / name
    recipe = load_recipe(ref, [f"train.seed={seed}", f"output.dir={out_dir}", "eval.compare_with=[]",
                               "eval.seed_spread=null"])
    data = recipe_to_dict(recipe)
    for meta in ("source", "description"):
        data.pop(meta, None)
    path = runs / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# {ref} with train.seed={seed} (bench/seed_spread.py)\n" + yaml.safe_dump(data, sort_keys=False)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return path, data


#: written into a run folder this sweep trained: the commit and machine load it was trained with
TRAINED_WITH = "seed_spread_trained_with.json"


def run_seeded(path: Path) -> tuple[dict[str, Any], str]:
    """The finished run of the seeded recipe at ``path``: reused when current, else trained now by a
    ``finetune/run.py`` process. Returns its ``metrics.json`` (with ``trained_with``: the commit, thread
    setting and load average it was trained with, when this sweep trained it) and ``reused`` / ``trained``."""
    from finetune.training.upstream import ensure

    def launch(recipe: Any, chain: tuple[str, ...] = ()) -> int:
        cmd = [sys.executable, str(ROOT / "finetune" / "run.py"), str(path)]
        if getattr(recipe.output, "overwrite", False):
            cmd.append("output.overwrite=true")
        print("$", " ".join(cmd), flush=True)
        load, commit = os.getloadavg()[0], _commit()
        status = subprocess.call(cmd, cwd=Path.cwd())
        if status == 0:
            record = {"commit": commit, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                      "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)]}
            (Path(recipe.output.dir) / TRAINED_WITH).write_text(json.dumps(record) + "\n", encoding="utf-8")
        return status

    done = ensure(str(path), "bench/seed_spread.py", launch)
    metrics = done.metrics()
    try:
        metrics["trained_with"] = json.loads((done.run_dir / TRAINED_WITH).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        metrics["trained_with"] = None
    return metrics, done.status


def recall_table(runs: dict[str, dict[int, dict[str, Any]]], at: str = "R@1") -> dict[str, Any]:
    """``{set: {direction: {recipe: {seed: value}}}}`` of ``at`` from each run's ``metrics["after"]``.

    Args:
        runs: ``{recipe: {seed: metrics}}``.
        at: the recall to read (``R@1``).
    """
    table: dict[str, Any] = {}
    for ref, by_seed in runs.items():
        for seed, metrics in by_seed.items():
            for name, result in (metrics.get("after") or {}).items():
                for direction, _ in DIRECTIONS:
                    value = (result.get(direction) or {}).get(at)
                    if value is not None:
                        table.setdefault(name, {}).setdefault(direction, {}).setdefault(ref, {})[seed] = float(value)
    return table


def seed_spread(table: dict[str, Any]) -> float:
    """The largest range (max - min over seeds) of any recipe, set and direction of ``table``
    (:func:`recall_table`): what ``eval.seed_spread`` holds."""
    ranges = [max(v.values()) - min(v.values()) for d in table.values() for r in d.values() for v in r.values()
              if len(v) > 1]
    if not ranges:
        raise ValueError("a seed spread needs at least two seeds of one recipe")
    return max(ranges)


def mean_after(table: dict[str, Any], ref: str) -> dict[str, Any]:
    """``ref``'s mean R@1 over seeds, shaped like ``metrics["after"]`` (for ``finetune.evaluation.report.verdict``)."""
    out: dict[str, Any] = {}
    for name, by_direction in table.items():
        for direction, by_ref in by_direction.items():
            if ref in by_ref:
                out.setdefault(name, {})[direction] = {"R@1": statistics.fmean(by_ref[ref].values())}
    return out


def paired_gaps(table: dict[str, Any], ref: str, other: str) -> dict[str, Any]:
    """``{set: {direction: {seed: ref - other}}}`` over the seeds both were run with."""
    out: dict[str, Any] = {}
    for name, by_direction in table.items():
        for direction, by_ref in by_direction.items():
            a, b = by_ref.get(ref, {}), by_ref.get(other, {})
            gaps = {s: round(a[s] - b[s], 2) for s in sorted(set(a) & set(b))}
            if gaps:
                out.setdefault(name, {})[direction] = gaps
    return out


def markdown(table: dict[str, Any], main: str, others: list[str], seeds: list[int]) -> str:
    """R@1 per seed of ``main`` and each of ``others``, their difference, and the means, per set and direction."""
    lines = []
    for name, by_direction in table.items():
        for other in others:
            head = f"| seed | `{Path(main).stem}` | `{Path(other).stem}` | difference |"
            lines += [f"{name}, R@1 text→image / image→text:", "", head, "|---|---|---|---|"]
            rows = [*seeds, "mean"]
            for seed in rows:
                cells = []
                for ref in (main, other):
                    parts = []
                    for direction, _ in DIRECTIONS:
                        values = by_direction.get(direction, {}).get(ref, {})
                        value = statistics.fmean(values.values()) if seed == "mean" and values else values.get(seed)
                        parts.append("–" if value is None else f"{value:.1f}")
                    cells.append(" / ".join(parts))
                diffs = []
                for direction, _ in DIRECTIONS:
                    gaps = paired_gaps({name: by_direction}, main, other).get(name, {}).get(direction, {})
                    value = statistics.fmean(gaps.values()) if seed == "mean" and gaps else gaps.get(seed)
                    diffs.append("–" if value is None else f"{value:+.1f}")
                lines.append(f"| {seed} | {cells[0]} | {cells[1]} | {' / '.join(diffs)} |")
            lines.append("")
    return "\n".join(lines)


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!bench/results"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line; returns what it writes to ``bench/results/seed_spread_<recipe>.json``."""
    import torch

    from finetune.config import load_recipe
    from finetune.evaluation.report import verdict

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="a recipe YAML whose eval.compare_with names recipes")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", default="runs/seed_spread", help="where the seeded recipes and runs go")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/seed_spread_<recipe>.json)")
    args = p.parse_args(argv)
    if len(args.seeds) < 2:
        p.error("give at least two seeds")
    recipe = load_recipe(args.recipe)
    others = list(recipe.eval.compare_with or [])
    for ref in others:
        if Path(ref).is_dir():
            p.error(f"eval.compare_with names the run folder {ref}: a folder cannot be re-run with another seed")
    refs = [args.recipe, *others]
    load = [os.getloadavg()[0]]
    started = time.time()
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    record: list[dict[str, Any]] = []
    for seed in args.seeds:
        for ref in refs:
            path, _ = seeded_recipe(ref, seed, Path(args.runs))
            metrics, status = run_seeded(path)
            runs.setdefault(ref, {})[seed] = metrics
            record.append({"recipe": ref, "seed": seed, "run": str(path.with_suffix("")), "status": status,
                           "wall_time_s": metrics.get("wall_time_s"), "trained_with": metrics.get("trained_with"),
                           "after": metrics.get("after")})
            load.append(os.getloadavg()[0])
    table = recall_table(runs)
    spread = seed_spread(table)
    objective = {ref: next(iter(runs[ref].values())).get("objective", "?") for ref in refs}
    said = verdict((args.recipe, {"after": mean_after(table, args.recipe), "objective": objective[args.recipe]}),
                   [(o, {"after": mean_after(table, o), "objective": objective[o]}) for o in others], spread)
    if said:  # the verdict of a single run reads the spread from its recipe; here this sweep measured it
        said = said.replace(RECIPE_SPREAD, f"measured over seeds {', '.join(map(str, args.seeds))} by this sweep")
    text = markdown(table, args.recipe, others, args.seeds)
    print(text)
    print(f"seed spread (largest R@1 range over seeds {args.seeds}): {spread:.1f} points")
    if said:
        print(f"Verdict on the means over seeds: {said}")
    result = {
        "recipe": args.recipe,
        "compare_with": others,
        "seeds": args.seeds,
        "seed_spread": round(spread, 2),
        "r1": table,
        "r1_gaps": {o: paired_gaps(table, args.recipe, o) for o in others},
        "verdict_on_means": said,
        "runs": record,
        "commit": _commit(),  # of this sweep; each run's own is its trained_with (null: not trained by a sweep)
        "command": "python bench/seed_spread.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine(),
                    "load_average_1min": {"min": min(load), "max": max(load)}},
        "wall_s": round(time.time() - started, 1),
    }
    out = Path(args.out) if args.out else RESULTS / f"seed_spread_{Path(args.recipe).stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
