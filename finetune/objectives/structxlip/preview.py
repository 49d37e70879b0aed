"""StructXLIP's preview picture: what the term trains on, one row per example (``python -m finetune.preview``
draws it for a recipe; the run report embeds it, ``StructXLIPTerm.report_sections``).

Each row: the colour image; its edge map I' with the region boxes (the ones encoded for the local loss in
colour, labelled ``r<index>``, the others dashed); the original caption, the appearance terms the lexicon
filter removed, the structure-centric caption T', and each chunk with its positive regions.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from finetune.files import save_png_atomic

__all__ = ["fields", "render_preview", "report_sections"]

_PALETTE = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#9a6324",
            "#469990", "#800000")
_LINE_IN = 0.155  # inches per text line at the font size below
_FONT = 7.6


def _wrapped(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=width, break_long_words=True, break_on_hyphens=False) or [""]


def _text_lines(item: dict[str, Any], width: int, max_chunks: int) -> list[tuple[str, dict[str, Any]]]:
    """The text column of one row as ``(line, matplotlib text kwargs)``."""
    grey, dark = {"color": "#555555", "fontsize": _FONT - 0.4}, {"color": "#111111"}
    lines: list[tuple[str, dict[str, Any]]] = []
    head = f"{item.get('id') or 'example'}"
    lines.append((head, {"fontweight": "bold", "color": "#111111"}))
    lines.append(("original caption T", grey))
    lines += [(line, dark) for line in _wrapped(item["caption"], width)]
    removed = item.get("removed") or []
    note = ", ".join(removed) if removed else "nothing"
    lines += [(line, {"color": "#b8001f"}) for line in _wrapped(f"removed by the lexicon filter: {note}", width)]
    label = "structure-centric caption T'" + (" (too little left: reverted to the original)"
                                              if item.get("reverted") else "")
    lines.append((label, grey))
    lines += [(line, dark) for line in _wrapped(item["filtered_caption"], width)]
    chunks = item.get("chunks") or []
    if chunks:
        kept = item.get("kept") or []
        colour_of = {slot: _PALETTE[i % len(_PALETTE)] for i, slot in enumerate(kept)}
        how = ("linked by the dataset" if item.get("region_source") == "dataset" else
               f"top-{len(item['chunk_topk'][0]) if item['chunk_topk'] else 0} under the frozen model")
        lines.append((f"chunks -> positive regions ({how}; encoded ones in colour)", grey))
        for c, (chunk, topk) in enumerate(zip(chunks[:max_chunks], item["chunk_topk"])):
            positives = [s for s in topk if s in colour_of]
            target = ", ".join(f"r{s}" for s in positives) if positives else "no encoded region"
            style = {"color": colour_of[positives[0]] if positives else "#888888"}
            lines += [(line, style) for line in _wrapped(f"{c + 1}. {chunk}  ->  {target}", width)]
        if len(chunks) > max_chunks:
            lines.append((f"... and {len(chunks) - max_chunks} more chunks", grey))
    return lines


def render_preview(
    items: list[dict[str, Any]],
    path: str | Path,
    *,
    title: str | None = None,
    wrap: int = 140,
    max_chunks: int = 12,
    dpi: int = 100,
) -> Path:
    """Draw the preview grid and write it as a PNG (atomically).

    Args:
        items: one dict per row, as ``StructXLIPTerm.preview_fields`` returns: ``image`` and ``edges`` (PIL),
            ``caption``, ``filtered_caption``, ``removed`` (terms), ``reverted``, ``boxes`` (all regions,
            ``(x1, y1, x2, y2)`` in image pixels), ``kept`` (indices of the encoded regions), ``chunks``,
            ``chunk_topk`` (``(M, K)`` region indices per chunk), ``fallback``, ``id``.
        path: the PNG to write.
        title: figure title.
        wrap: characters per caption line.
        max_chunks: chunks listed per example.

    Returns:
        ``path``.

    Raises:
        ValueError: when ``items`` is empty.
    """
    if not items:
        raise ValueError("render_preview needs at least one example")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    texts = [_text_lines(item, wrap, max_chunks) for item in items]
    heights = [max(2.6, _LINE_IN * (len(t) + 1)) for t in texts]
    head = 0.5 if title else 0.1
    fig = plt.figure(figsize=(16, sum(heights) + head))
    grid = fig.add_gridspec(len(items), 3, width_ratios=[1, 1, 2.9], height_ratios=heights,
                            left=0.01, right=0.995, top=1 - head / (sum(heights) + head), bottom=0.005,
                            wspace=0.04, hspace=0.12)
    for row, (item, lines) in enumerate(zip(items, texts)):
        ax_img, ax_edge, ax_text = (fig.add_subplot(grid[row, col]) for col in range(3))
        ax_img.imshow(item["image"])
        ax_img.set_title("image I", fontsize=_FONT + 0.4, loc="left")
        edges = item["edges"]
        ax_edge.imshow(edges.convert("L") if hasattr(edges, "convert") else edges, cmap="gray", vmin=0, vmax=255)
        kept = item.get("kept") or []
        boxes = item.get("boxes") or []
        source = ("default regions" if item.get("fallback") else
                  "the dataset's regions" if item.get("region_source") == "dataset" else "FastSAM regions")
        ax_edge.set_title(f"edge map I' + {source} ({len(kept)} of {len(boxes)} encoded)" if boxes else "edge map I'",
                          fontsize=_FONT + 0.4, loc="left")
        for slot, box in enumerate(boxes):
            x1, y1, x2, y2 = box
            if slot in kept:
                colour = _PALETTE[kept.index(slot) % len(_PALETTE)]
                ax_edge.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, lw=2.0, ec=colour))
                ax_edge.text(x1, y1, f"r{slot}", fontsize=_FONT, color="white", va="top", ha="left",
                             bbox={"facecolor": colour, "edgecolor": "none", "pad": 1.0})
            else:
                ax_edge.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, lw=0.8, ec="#9a9a9a", ls="--"))
        for ax in (ax_img, ax_edge, ax_text):
            ax.set_xticks([])
            ax.set_yticks([])
        ax_text.axis("off")
        step = 1.0 / max(len(lines) + 1, 1)
        for i, (line, style) in enumerate(lines):
            ax_text.text(0.0, 1.0 - i * step, line, transform=ax_text.transAxes, va="top", ha="left",
                         **{"fontsize": _FONT, "family": "DejaVu Sans", **style})
    if title:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left", y=1 - 0.15 / (sum(heights) + head))
    return save_png_atomic(fig, path, dpi=dpi)


def fields(term: Any, example: dict[str, Any]) -> dict[str, Any]:
    """What the preview shows of one preprocessed example of ``term``'s training set (:func:`render_preview`)."""
    edges = term.edge_image(example)
    shown = {
        "id": str(example.get("id", "")),
        "image": example["image"],
        "edges": edges,
        "caption": example["caption"],
        "filtered_caption": example["filtered_caption"],
        "removed": list(example.get("lexicon_removed") or []),
        "reverted": bool(example.get("lexicon_reverted", False)),
        "boxes": [], "kept": [], "chunks": [], "chunk_topk": [], "fallback": False,
    }
    if term.use_local and "chunk_topk" in example:
        shown.update({
            "boxes": [list(b) for b in example["region_boxes"]],
            "kept": term.kept_regions(example) if example["chunks"] else [],
            "chunks": list(example["chunks"]),
            "chunk_topk": [list(t) for t in example["chunk_topk"]],
            "fallback": bool(example["region_fallback"]),
            "region_source": term.options.regions.source,
        })
    return shown

def report_sections(term: Any, run_dir: str | Path, dataset: Any, *, n: int = 8) -> list[str]:
    """Markdown sections for the run report: the lexicon statistics (paper B.3), the regions, and a
    preview of ``n`` training examples written to ``<run_dir>/plots/structxlip_preview.png``.

    Args:
        run_dir: the run folder.
        dataset: the preprocessed training set (what :meth:`preprocess` returned).
    """
    lines = ["## StructXLIP inputs", ""]
    lex = term.stats.get("lexicon")
    if lex:
        share = ", ".join(f"{k} {100 * v:.1f}%" for k, v in lex["category_share"].items()) or "none"
        lines += [
            "Lexicon filter (paper Supp. Mat. B.3):", "",
            "| statistic | value |", "|---|---|",
            f"| captions | {lex['captions']} |",
            f"| modified | {lex['modified']} ({100 * lex['modified_share']:.1f}%) |",
            f"| reverted to the original | {lex['reverted']} ({100 * lex['reverted_share']:.1f}%) |",
            f"| removed words per caption | {lex['removed_words_per_caption']:.2f} |",
            f"| removed words per modified caption | {lex['removed_words_per_modified_caption']:.2f} "
            f"({100 * lex['removed_share_of_length']:.1f}% of its words) |",
            f"| removed words by category | {share} |",
            "",
        ]
    reg = term.stats.get("regions")
    if reg and reg.get("source") == "dataset":
        lines += [
            f"Regions from the dataset (`regions.source: dataset`: its objects' boxes, each chunk's positives "
            f"the objects its sentence describes; no FastSAM, no frozen matching): {reg['regions_per_image']:.2f} "
            f"per image; {reg['chunks_per_caption']:.2f} linked chunks per caption, "
            f"{reg['captions_without_chunks']} captions without one; encoded as "
            f"`{term.options.regions.encode}`.",
            "",
        ]
    elif reg:
        lines += [
            f"Regions ({reg['segmenter']}): {reg['regions_per_image']:.2f} per image, "
            f"{reg['fallback_images']} of {reg['images']} images on the default regions; "
            f"{reg['chunks_per_caption']:.2f} chunks per caption, {reg['captions_without_chunks']} captions "
            f"without chunks; encoded as `{term.options.regions.encode}`, K = {term.options.regions.k}.",
            "",
        ]
    n = min(n, len(dataset))
    if n:
        path = Path(run_dir) / "plots" / "structxlip_preview.png"
        render_preview([fields(term, dataset[i]) for i in range(n)], path,
                       title=f"StructXLIP training inputs ({term.compat})")
        lines += ["![StructXLIP preview: images, edge maps with regions, captions](plots/structxlip_preview.png)",
                  ""]
    return ["\n".join(lines).rstrip()]
