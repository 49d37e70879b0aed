"""Statistics of a FLISM-processed dataset for the run report (FAST-GOAL III-A)."""

from __future__ import annotations

from typing import Any

import datasets

__all__ = ["flism_stats"]


def flism_stats(dataset: datasets.Dataset, *, bins: int = 10) -> dict[str, Any]:
    """Statistics of a FLISM-processed dataset for the run report: images, candidates per image, the share of
    found (detector / SAM / dataset) vs default boxes among the candidates and among the kept pairs' boxes,
    images without a found box, images with the whole image as their only candidate, images without a pair,
    candidates clipped to and dropped outside what the model's input shows, and a histogram of the kept pairs'
    similarities (``bins`` equal bins over [-1, 1])."""
    kinds = dataset["flism_candidate_kinds"]
    n = max(1, len(kinds))
    all_kinds = [k for ks in kinds for k in ks]
    kept_kinds = [ks[c] for ks, cs, m in zip(kinds, dataset["flism_pair_candidate"], dataset["flism_num_pairs"])
                  for c in cs[:m]]
    sims = [s for ss, m in zip(dataset["flism_pair_similarity"], dataset["flism_num_pairs"]) for s in ss[:m]]
    counts = [0] * bins
    for s in sims:
        counts[min(bins - 1, max(0, int((s + 1) / 2 * bins)))] += 1
    edges = [round(-1 + 2 * i / bins, 4) for i in range(bins + 1)]

    def share(values: list[str], kind: str) -> float:
        return sum(1 for v in values if v == kind) / max(1, len(values))

    return {
        "images": len(kinds),
        "candidates_per_image": len(all_kinds) / n,
        "found_share": share(all_kinds, "found"),
        "default_share": share(all_kinds, "default"),
        "kept_found_share": share(kept_kinds, "found"),
        "kept_default_share": share(kept_kinds, "default"),
        "images_without_found_boxes": sum(1 for ks in kinds if "found" not in ks),
        "whole_image_fallbacks": sum(1 for ks in kinds if ks == ["whole_image"]),
        "images_without_pairs": sum(1 for m in dataset["flism_num_pairs"] if m == 0),
        "candidates_clipped": sum(dataset["flism_candidates_clipped"]),
        "candidates_dropped": sum(dataset["flism_candidates_dropped"]),
        "images_with_dropped_candidates": sum(1 for d in dataset["flism_candidates_dropped"] if d),
        "sentences_per_image": sum(len(s) for s in dataset["flism_sentences"]) / n,
        "mean_similarity": sum(sims) / len(sims) if sims else None,
        "similarity_histogram": {"edges": edges, "counts": counts},
    }
