"""A picture of FLISM's candidates and kept pairs (``plots/fastgoal_flism.png``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["render_flism_preview"]


def render_flism_preview(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "FLISM pairs") -> Path:
    """Draw each example (image with its candidate boxes dashed, found boxes in blue, defaults in grey, the kept
    pairs' boxes in red) beside its caption's kept sentence and similarity; written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt

    from finetune.data.images import read_image
    from finetune.files import save_png_atomic

    rows = list(rows)
    fig, axes = plt.subplots(max(1, len(rows)), 2, figsize=(10, 2.6 * max(1, len(rows))), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 2.2]})
    for (ax_im, ax_text), row in zip(axes, rows):
        image = read_image(row["image"])
        ax_im.imshow(image)
        ax_im.axis("off")
        for box, kind in zip(row["flism_candidates"], row["flism_candidate_kinds"]):
            colour = "#4363d8" if kind == "found" else "#888888"
            ax_im.add_patch(patches.Rectangle((box[0], box[1]), box[2] - box[0], box[3] - box[1], fill=False,
                                              lw=0.8, ls="--", ec=colour))
        lines = [str(row.get("id", ""))]
        for j in range(int(row["flism_num_pairs"])):
            box = row["flism_pair_box"][j]
            ax_im.add_patch(patches.Rectangle((box[0], box[1]), box[2] - box[0], box[3] - box[1], fill=False,
                                              lw=2.0, ec="#e6194b"))
            sentence = row["flism_sentences"][row["flism_pair_sentence"][j]]
            lines.append(f"pair {j + 1} (cos {row['flism_pair_similarity'][j]:.3f}, weight "
                         f"{row['flism_pair_weight'][j]:.2f}): {sentence}")
        found = sum(1 for k in row["flism_candidate_kinds"] if k == "found")
        lines.append(f"{row['flism_num_candidates']} candidates ({found} found, dashed blue; defaults dashed grey); "
                     "kept box in red")
        import textwrap

        wrapped = [w for line in lines for w in (textwrap.wrap(line, 90) or [""])]
        ax_text.axis("off")
        ax_text.text(0, 1, "\n".join(wrapped), va="top", ha="left", fontsize=7.5, family="DejaVu Sans")
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return save_png_atomic(fig, path, dpi=110)
