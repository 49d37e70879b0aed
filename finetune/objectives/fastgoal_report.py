"""FAST-GOAL's section of the run report: where the local pairs came from (FLISM, paper III-A) and how they look."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["flism_report"]


def flism_report(term: Any, run_dir: str | Path, dataset: Any, *, n: int = 6) -> list[str]:
    """The run report's section of a FAST-GOAL term: the FLISM statistics (candidates per image, found vs default
    boxes, similarity histogram) and a preview of ``n`` training examples (``<run_dir>/plots/fastgoal_flism.png``)."""
    from finetune.preprocess.flism import render_flism_preview

    s = term.stats.get("flism")
    lines = ["## FAST-GOAL local pairs (FLISM)", ""]
    if not s or "candidates_per_image" not in s:
        if not s:
            return ["\n".join(lines + ["Local pairs read from a pairs file."])]
        outside = s.get("pairs_outside_input")
        lines.append(f"Local pairs read from a pairs file: {s.get('lines', '?')} pairs of {s['images']} images "
                     f"(at most {s.get('most_pairs_per_image', '?')} per image; {term.options.regions.pairs} kept "
                     "per image, each image one example), "
                     + ("image sizes not in the file, so boxes outside the model's input are counted in training "
                        "only." if outside is None else
                        f"{outside} pair boxes outside what the model's input shows."))
        return ["\n".join(lines)]
    r = term.options.regions
    hist = s["similarity_histogram"]
    lines += [
        f"Candidates: {r.method}"
        + (f" ({r.detector})" if r.method == "detector" and r.detector else "")
        + (" + 4 quadrants + centre" if r.default else "") + f"; {r.pairs} pair(s) per image ({r.weighting}).", "",
        "| statistic | value |", "|---|---|",
        f"| images | {s['images']} |",
        f"| candidates per image | {s['candidates_per_image']:.2f} |",
        f"| found (detector / SAM / dataset) vs default boxes | {100 * s['found_share']:.1f}% / "
        f"{100 * s['default_share']:.1f}% |",
        f"| kept pairs on found vs default boxes | {100 * s['kept_found_share']:.1f}% / "
        f"{100 * s['kept_default_share']:.1f}% |",
        f"| images without a found box | {s['images_without_found_boxes']} |",
        f"| images without a pair | {s['images_without_pairs']} |",
        f"| candidates clipped to / dropped outside the model's input (resize + centre crop) | "
        f"{s.get('candidates_clipped', 0)} / {s.get('candidates_dropped', 0)} |",
        f"| mean similarity of kept pairs | "
        f"{s['mean_similarity']:.3f} |" if s["mean_similarity"] is not None else "| mean similarity | - |",
        "",
        "Similarity of the kept pairs: " + ", ".join(
            f"[{lo:.1f}, {hi:.1f}): {c}" for lo, hi, c in zip(hist["edges"], hist["edges"][1:], hist["counts"]) if c),
        "",
    ]
    n = min(n, len(dataset))
    if n and "flism_candidates" in dataset.column_names:
        path = Path(run_dir) / "plots" / "fastgoal_flism.png"
        render_flism_preview([dataset[i] for i in range(n)], path, title="FLISM: candidates and kept pairs")
        lines += ["![FLISM preview: candidate boxes, the kept box and its sentence](plots/fastgoal_flism.png)", ""]
    return ["\n".join(lines).rstrip()]
