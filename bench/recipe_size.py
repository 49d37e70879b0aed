"""How long ``load_recipe`` takes to refuse an oversized recipe, against loading the largest shipped recipe.

Run ``python bench/recipe_size.py``: prints the numbers and writes ``bench/results/recipe_size.json``.

Issue 31 item 12: a 50 MB recipe of 3.3 million keys took 7.5 minutes and 3.9 GB before its error. The bounds of
``finetune/config/io.py`` (``MAX_RECIPE_BYTES``, ``MAX_RECIPE_VALUES``, ``MAX_OVERRIDES``) refuse it from its size,
before it is read; the slowest documents left are those just under the byte bound, which PyYAML parses until the
value bound stops it (keys) or to their end (blank lines, one long string). Each case is timed ``--repeats``
times in this process and the median reported, with the peak of Python allocations (``tracemalloc``) of one more
run; the ratio is against the median load of the largest shipped recipe, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.config import RecipeError, load_recipe  # noqa: E402
from finetune.config.io import MAX_RECIPE_BYTES, MAX_RECIPE_VALUES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _keys(n: int) -> str:
    return "# many keys\ntrain:\n" + "".join(f"  k{i}: {i}\n" for i in range(n))


def _fill(target: int, unit: str) -> str:
    head = "# filler\ntrain: {lr: 1.0e-5}\n"
    return head + unit * ((target - len(head)) // len(unit))


def _cases(folder: Path) -> dict[str, Path]:
    shipped = max((ROOT / "recipes").glob("*.yaml"), key=lambda p: p.stat().st_size)
    cases = {f"shipped ({shipped.name}, {shipped.stat().st_size:,} bytes)": shipped}
    texts = {
        "3.3M keys (the issue's recipe)": _keys(3_300_000),
        "keys, just under the byte bound": _keys(80_000)[:MAX_RECIPE_BYTES - 100].rpartition("\n")[0] + "\n",
        f"{MAX_RECIPE_VALUES:,} keys (one past the value bound)": _keys(MAX_RECIPE_VALUES // 2),
        "blank lines, just under the byte bound": _fill(MAX_RECIPE_BYTES - 100, "\n"),
        "a comment line, just under the byte bound": "# " + "x" * (MAX_RECIPE_BYTES - 200) + "\ntrain: {lr: 1.0e-5}\n",
    }
    for i, (name, text) in enumerate(texts.items()):
        path = folder / f"case{i}.yaml"
        path.write_text(text, encoding="utf-8")
        cases[f"{name} ({path.stat().st_size:,} bytes)"] = path
    return cases


def _load(path: Path) -> str:
    try:
        load_recipe(path)
        return "loaded"
    except RecipeError as error:
        return "refused: " + str(error).split(": ", 1)[1][:70]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "recipe_size.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in _cases(Path(tmp)).items():
            times, outcome = [], ""
            for _ in range(args.repeats):
                start = time.perf_counter()
                outcome = _load(path)
                times.append(time.perf_counter() - start)
            tracemalloc.start()
            _load(path)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            rows.append({"case": name, "seconds": statistics.median(times), "peak_mb": peak / 2**20,
                         "outcome": outcome})
    base = rows[0]["seconds"]
    for row in rows:
        row["x_shipped"] = row["seconds"] / base
        print(f"{row['case']:66s} {row['seconds']:8.3f} s {row['x_shipped']:8.1f} x {row['peak_mb']:8.1f} MB  "
              f"{row['outcome']}")
    result = {"bench": "recipe_size", "bounds": {"bytes": MAX_RECIPE_BYTES, "values": MAX_RECIPE_VALUES},
              "repeats": args.repeats, "machine": {"python": platform.python_version(), "cpu": platform.machine(),
                                                   "cores": os.cpu_count(), "load_average": os.getloadavg()},
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
