"""The README's quickstart numbers, as this machine gets them: the quickstart and its clip-only comparison with seeds
0-2, from an empty run folder, printed as the README's table and the seed table of docs/guides/benchmarks.md.

Run ``python bench/quickstart_numbers.py`` from the clone (about 3 minutes per fine-tune on 2 quiet cores, so
10-20 minutes for seeds 0-2). It empties ``runs/quickstart_numbers`` (this script's own folder; ``--reuse`` keeps
its finished runs), writes there a copy of ``recipes/quickstart_pretrain.yaml`` whose run goes there too (so the
start is trained afresh, not reused from ``runs/quickstart_pretrain``), and for each seed the quickstart and
``quickstart_finetune_clip.yaml`` with ``train.seed`` set, ``model.init_from`` naming that fresh start and no
``eval.compare_with`` (``bench/seed_spread.py``'s seeded recipes). Each run is a ``finetune/run.py`` process, one at a
time; the start is trained by the first.

It prints:

- the README's Recall@K table: the start, and each fine-tune read up to 248 tokens and cut at 77, as the mean over
  the seeds with the range (min-max) beside it;
- the per-seed R@1 table of StructXLIP against clip-only, with the paired differences and the means
  (``bench/seed_spread.py``'s), the seed spread (the largest R@1 range over the seeds of either recipe, what
  ``eval.seed_spread`` holds) and on how many seeds StructXLIP is ahead in each direction;
- StructXLIP's structure loss L_{I',T'} at the end of each run (the last logged interval mean) against its chance
  level ln B;
- the machine: commit, torch build, CPU, thread settings, load.

Everything goes to ``bench/results/quickstart_numbers.json``. The numbers depend on the CPU, the torch build and the
thread count (a run is deterministic on one machine): compare them with the README's only as far as the README's
range across machines says.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import seed_spread  # noqa: E402  (bench/seed_spread.py: seeded runs, R@1 tables, the spread)

ROOT = Path(__file__).resolve().parents[1]
START = "recipes/quickstart_pretrain.yaml"
QUICKSTART = "recipes/quickstart.yaml"
CLIP_ONLY = "recipes/quickstart_finetune_clip.yaml"
STRUCTURE = "structxlip/structure"
DIRECTIONS = ("t2i", "i2t")


def write_recipe(ref: str, path: Path, overrides: list[str]) -> Path:
    """Write ``ref`` with ``overrides`` applied, as a resolved recipe, to ``path``."""
    import yaml

    from finetune.config import load_recipe, recipe_to_dict

    data = recipe_to_dict(load_recipe(ROOT / ref, overrides))
    for meta in ("source", "description"):
        data.pop(meta, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {ref} with {' '.join(overrides)} (bench/quickstart_numbers.py)\n"
                    + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def fmt_range(values: list[float]) -> str:
    """``mean`` for one value, ``mean (min-max)`` for several, one decimal."""
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def _recall(metrics: dict[str, Any], part: str, direction: str, at: str) -> float | None:
    results = metrics.get(part) or {}
    if not results:
        return None
    value = ((next(iter(results.values())) or {}).get(direction) or {}).get(at)
    return None if value is None else float(value)


def recall_rows(runs: dict[str, dict[int, dict[str, Any]]], start_steps: Any = "?") -> list[str]:
    """The README's Recall@K table: start, each fine-tune at 248 tokens and cut at 77; each cell the mean over the
    seeds with their range.

    Args:
        runs: ``{recipe: {seed: metrics.json}}`` of :data:`QUICKSTART` and :data:`CLIP_ONLY`.
        start_steps: the start's training steps, for its row.
    """
    rows = ["| run | objective | steps | text tokens | t→i R@1 | t→i R@5 | i→t R@1 | i→t R@5 |",
            "|---|---|---|---|---|---|---|---|"]

    def cells(all_metrics: list[dict[str, Any]], part: str) -> list[str]:
        out = []
        for direction in DIRECTIONS:
            for at in ("R@1", "R@5"):
                values = [v for m in all_metrics if (v := _recall(m, part, direction, at)) is not None]
                out.append(fmt_range(sorted(set(values)) if part == "before" else values) if values else "–")
        return out

    rows.append(f"| start (`{Path(START).name}`) | clip | {start_steps} | 248 | "
                + " | ".join(cells(list(runs[QUICKSTART].values()), "before")) + " |")
    for ref, objective in ((QUICKSTART, "clip + StructXLIP"), (CLIP_ONLY, "clip")):
        metrics = list(runs[ref].values())
        steps = metrics[0].get("steps", "?")
        rows.append(f"| `{Path(ref).name}` | {objective} | {steps} | 248 | " + " | ".join(cells(metrics, "after")) + " |")
        rows.append(f"| `{Path(ref).name}` | {objective} | {steps} | cut at 77 | "
                    + " | ".join(cells(metrics, "after_at_base_length")) + " |")
    return rows


def ahead_count(table: dict[str, Any], ref: str, other: str) -> dict[str, str]:
    """On how many seeds ``ref`` is ahead of, level with and behind ``other`` in R@1, per direction."""
    out = {}
    for _, by_direction in seed_spread.paired_gaps(table, ref, other).items():
        for direction, gaps in by_direction.items():
            values = list(gaps.values())
            out[direction] = (f"ahead on {sum(g > 0 for g in values)}, level on {sum(g == 0 for g in values)}, "
                              f"behind on {sum(g < 0 for g in values)} of {len(values)} seeds")
    return out


def structure_loss(metrics: dict[str, Any], batch_size: int) -> dict[str, float] | None:
    """StructXLIP's L_{I',T'} at the end of a run (the last logged value, an interval mean) and chance, ln B."""
    history = [h for h in metrics.get("history") or [] if STRUCTURE in h]
    if not history:
        return None
    return {"step": history[-1]["step"], "last": round(float(history[-1][STRUCTURE]), 3),
            "chance_ln_batch": round(math.log(batch_size), 3)}


def _machine(load: list[float]) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
            "load_average_1min": {"min": round(min(load), 2), "max": round(max(load), 2)}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line; returns what it writes to ``bench/results/quickstart_numbers.json``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", default="runs/quickstart_numbers",
                   help="this script's run folder, emptied first (default runs/quickstart_numbers)")
    p.add_argument("--reuse", action="store_true", help="keep the finished runs in --runs instead of emptying it")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every recipe (a smaller check: train.max_steps=2); the README's numbers "
                        "are those without")
    p.add_argument("--out", default=str(seed_spread.RESULTS / "quickstart_numbers.json"))
    args = p.parse_args(argv)
    runs_dir = Path(args.runs).resolve()
    if runs_dir.exists() and not args.reuse:
        shutil.rmtree(runs_dir)
    load, started = [os.getloadavg()[0]], time.time()
    start = write_recipe(START, runs_dir / "quickstart_pretrain.yaml",
                         [*args.overrides, f"output.dir={runs_dir / 'quickstart_pretrain'}"])
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    record = []
    for seed in args.seeds:
        for ref in (QUICKSTART, CLIP_ONLY):
            name = f"{Path(ref).stem}-seed{seed}"
            path = write_recipe(ref, runs_dir / f"{name}.yaml",
                                [*args.overrides, f"train.seed={seed}", f"output.dir={runs_dir / name}",
                                 f"model.init_from={start}", "eval.compare_with=[]", "eval.seed_spread=null"])
            metrics, status = seed_spread.run_seeded(path)
            runs.setdefault(ref, {})[seed] = metrics
            record.append({"recipe": ref, "seed": seed, "status": status, "wall_time_s": metrics.get("wall_time_s")})
            load.append(os.getloadavg()[0])
    try:
        start_metrics = json.loads((runs_dir / "quickstart_pretrain" / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        start_metrics = {}
    table = seed_spread.recall_table(runs)
    spread = seed_spread.seed_spread(table) if len(args.seeds) > 1 else None
    from finetune.config import load_recipe

    batch = load_recipe(ROOT / QUICKSTART).train.batch_size
    losses = {seed: structure_loss(m, batch) for seed, m in runs[QUICKSTART].items()}
    rows = recall_rows(runs, start_metrics.get("steps", "?"))
    seeds_text = seed_spread.markdown(table, QUICKSTART, [CLIP_ONLY], args.seeds)
    ahead = ahead_count(table, QUICKSTART, CLIP_ONLY)
    print(f"\nRecall@K on the held-out scenes, mean over seeds {args.seeds} (range):\n")
    print("\n".join(rows))
    print(f"\n{seeds_text}")
    if spread is not None:
        print(f"seed spread (largest R@1 range over seeds {args.seeds}, either recipe): {spread:.1f} points")
    for direction, text in ahead.items():
        print(f"StructXLIP against clip-only, {direction}: {text}")
    for seed, loss in losses.items():
        if loss:
            print(f"seed {seed}: L_I'T' {loss['last']:.2f} at step {loss['step']}, chance ln {batch} = "
                  f"{loss['chance_ln_batch']:.2f}")
    first_run_s = sum(filter(None, [start_metrics.get("total_time_s"),
                                    *(runs[r][args.seeds[0]].get("total_time_s") for r in (QUICKSTART, CLIP_ONLY))]))
    machine = _machine(load)
    print(f"first quickstart (start + both fine-tunes of seed {args.seeds[0]}, training and evaluation): "
          f"{first_run_s:.0f} s; machine: {machine}")
    result = {
        "command": "python bench/quickstart_numbers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "overrides": args.overrides, "seeds": args.seeds, "readme_table": rows, "seed_table": seeds_text,
        "r1": table, "r1_gaps": seed_spread.paired_gaps(table, QUICKSTART, CLIP_ONLY), "seed_spread": spread,
        "structxlip_ahead": ahead, "structure_loss": losses, "first_quickstart_s": round(first_run_s, 1),
        "runs": record, "commit": seed_spread._commit(), "machine": machine, "wall_s": round(time.time() - started, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
