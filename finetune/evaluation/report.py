"""The run report: ``metrics.json``, ``report.md`` and ``plots/`` (loss curves per term, recall before and
after) of a run folder."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from finetune.files import write_text_atomic


#: history entries that are not loss terms (drawn, and compared, in panels of their own)
_SCALARS = ("lr", "logit_scale", "logit_bias")
#: loss terms that are a symmetric InfoNCE over the B pairs of the global batch: chance level ln B
_BATCH_INFONCE = ("clip", "structxlip/structure")
#: loss terms of 1 - cos between paired embeddings: unrelated (orthogonal) embeddings give 1
_ONE_MINUS_COS = ("structxlip/consistency",)
#: the top of every Recall@K axis (%): the axis runs from 0, and the space above 100 holds a bar's value label
RECALL_AXIS_TOP = 108.0


def chance_level(key: str, batch_size: int | None) -> tuple[float, str] | None:
    """The loss a term has when the model has learnt nothing, as ``(value, label)``, or None when it is not
    fixed by the recipe: ``ln B`` for the symmetric InfoNCE terms over the global batch of B pairs (``clip``,
    StructXLIP's L_{I',T'}: uniform logits give ``ln B`` whatever the label smoothing), 1 for StructXLIP's
    L_{I,I'} = 1 - cos (unrelated embeddings). Terms whose candidates vary per batch (StructXLIP's
    L^local over the batch's regions) and sigmoid losses get none."""
    if key in _BATCH_INFONCE and batch_size and batch_size > 1:
        return math.log(batch_size), f"chance: ln {batch_size} = {math.log(batch_size):.2f}"
    if key in _ONE_MINUS_COS:
        return 1.0, "unrelated embeddings: 1 − cos 0 = 1"
    return None


def loss_figure(history: list[dict[str, float]], *, compare: dict[str, list[dict[str, float]]] | None = None,
                batch_size: int | None = None, label: str = "this run") -> Any:
    """The loss curves of a run as a matplotlib ``Figure``, one panel per history key.

    Terms that a compared run (``eval.compare_with``) also logs (``clip``) are drawn against each other
    (the compared runs dashed), and so are the learning rate and logit scale; terms only this run has (the
    method's added terms) stand on their own; the total ``loss`` is this run's own objective and is never
    set against another run's total (a different sum). A dotted line marks the chance level of a term where
    :func:`chance_level` knows it.

    Args:
        history: this run's loss history (``metrics.json``), entries ``{"step", <term>: value, ...}``.
        compare: label -> another run's history.
        batch_size: the global batch B of this run (``train.batch_size``), for the ``ln B`` lines.
        label: this run's name in the legends.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    compare = {ref: other for ref, other in (compare or {}).items() if other}
    keys = [k for k in history[0] if k != "step"]
    terms = [k for k in keys if k not in _SCALARS and k != "loss"]
    shared = [k for k in terms if any(k in other[0] for other in compare.values())]
    own = [k for k in terms if k not in shared]
    panels = shared + own + (["loss"] if "loss" in keys and len(terms) != 1 else []) + [
        k for k in keys if k in _SCALARS]
    steps = [h["step"] for h in history]
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig = Figure(figsize=(4.4 * cols, 3.1 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, panels):
        ax.plot(steps, [h.get(key, float("nan")) for h in history], lw=1.5, label=label)
        overlaid = key != "loss" and (key in shared or key in _SCALARS)
        if overlaid:
            for ref, other in compare.items():
                if key in other[0]:
                    ax.plot([h["step"] for h in other], [h.get(key, float("nan")) for h in other], lw=1.2, ls="--",
                            label=Path(ref).name)
        chance = chance_level(key, batch_size) if key != "loss" else None
        if chance is not None:
            ax.axhline(chance[0], color="0.45", ls=":", lw=1.2, label=chance[1])
        if key == "loss":
            title = "total loss (this run's objective)" if compare else "total loss"
        elif key in shared:
            title = f"{key} (shared term)"
        elif key in own and compare:
            title = f"{key} (this run only)"
        else:
            title = key
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if (overlaid and compare) or chance is not None:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_losses(history: list[dict[str, float]], path: str | Path,
                compare: dict[str, list[dict[str, float]]] | None = None, *,
                batch_size: int | None = None, label: str = "this run") -> Path | None:
    """Write :func:`loss_figure` to ``path`` (PNG); returns the path, None without history."""
    if not history:
        return None
    return _save(loss_figure(history, compare=compare, batch_size=batch_size, label=label), path)


def recall_figure(before: dict | None, after: dict, *, label: str = "this run",
                  compare: list[tuple[str, dict[str, Any]]] | None = None, at_base: dict | None = None,
                  base_text_len: int = 77, ks: tuple[str, ...] = ("R@1", "R@5")) -> Any:
    """Recall@K after training as a matplotlib ``Figure``: one panel per evaluation set, direction and K, every
    axis the whole 0-100 % (bars from zero, never zoomed: a gap of a few tenths of a point looks as small as it is)
    with the value on every bar.

    Bars: the start (before training, grey, when evaluated), this run, and each compared run
    (``eval.compare_with``) after training, read up to the model's text length; a second row holds the same
    runs with every caption cut at ``base_text_len`` tokens, when that was evaluated (``at_base``, and the
    compared runs' ``after_at_base_length``).

    Args:
        before, after: ``{set: {"t2i": {"R@1": ..}, "i2t": ..}}`` of this run (``before`` may be None).
        label: this run's name in the legend.
        compare: ``(label, metrics)`` of the compared runs (``after``, ``after_at_base_length``).
        at_base: this run's results with captions cut at ``base_text_len``.
        base_text_len: the model's original text length (77 for CLIP).
        ks: the K drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    compare = compare or []
    sets = list(after)
    panels = [(d, k) for d in ("t2i", "i2t") for k in ks if any(k in ((after[s].get(d) or {})) for s in sets)]
    readings = [("full", "read in full")]
    if at_base or any(m.get("after_at_base_length") for _, m in compare):
        readings.append(("cut", f"cut at {base_text_len} tokens"))
    palette = ["#2f6fb0", "#d9822b", "#3a9e5f", "#9b59b6", "#c0392b"]
    runs_full = ([("start (before training)", before, "#9aa5b1")] if before else []) + [
        (label, after, palette[0])] + [(Path(ref).name, m.get("after") or {}, palette[(i + 1) % len(palette)])
                                       for i, (ref, m) in enumerate(compare)]
    runs_cut = [(label, at_base or {}, palette[0])] + [
        (Path(ref).name, m.get("after_at_base_length") or {}, palette[(i + 1) % len(palette)])
        for i, (ref, m) in enumerate(compare)]
    rows = [(name, reading, text) for name in sets for reading, text in readings]
    fig = Figure(figsize=(3.3 * len(panels), 2.7 * len(rows) + 0.8), layout="constrained")
    axes = fig.subplots(len(rows), len(panels), squeeze=False)
    for r, (name, reading, text) in enumerate(rows):
        runs = runs_full if reading == "full" else runs_cut
        for c, (direction, k) in enumerate(panels):
            ax = axes[r][c]
            drawn = [(run, ((res.get(name) or {}).get(direction) or {}).get(k), colour) for run, res, colour in runs]
            drawn = [(run, v, colour) for run, v, colour in drawn if v is not None]
            for i, (run, value, colour) in enumerate(drawn):
                bars = ax.bar([i], [value], 0.7, color=colour, label=run,
                              hatch="//" if reading == "cut" else None, edgecolor="white")
                ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
            ax.set_ylim(0.0, RECALL_AXIS_TOP)  # room above 100 for a bar's value label
            ax.set_yticks([0, 25, 50, 75, 100])
            ax.set_xticks([])  # the runs are told by colour (legend), the same in every panel
            arrow = "text→image" if direction == "t2i" else "image→text"
            ax.set_title(f"{name}: {arrow} {k}", fontsize=9)
            if c == 0:
                ax.set_ylabel(f"{text}\n(%)", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.suptitle("Recall@K (%) after training" + (", and the start before it" if before else ""), fontsize=10)
    fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    return fig


def plot_recall(before: dict | None, after: dict, path: str | Path, *, label: str = "this run",
                compare: list[tuple[str, dict[str, Any]]] | None = None, at_base: dict | None = None,
                base_text_len: int = 77) -> Path | None:
    """Write :func:`recall_figure` to ``path`` (PNG); returns the path, None without results after training."""
    if not after:
        return None
    return _save(recall_figure(before, after, label=label, compare=compare, at_base=at_base,
                               base_text_len=base_text_len), path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def verdict(this: tuple[str, dict[str, Any]], compared: list[tuple[str, dict[str, Any]]],
            seed_spread: float | None) -> str | None:
    """One sentence per compared run: which run is ahead on Recall@1, by how much in each direction and on
    each evaluation set, and whether that gap exceeds the recipe's seed spread (``eval.seed_spread``: how far
    R@1 moves between seeds of the same recipe, in points). A run has one seed: the spread is the number the
    recipe gives (measured beforehand, e.g. by ``bench/seed_spread.py``), and the sentence says so. Without
    one the sentence says that the gap cannot be judged. None without anything to compare.

    Args:
        this: ``(label, metrics)`` of this run (``after``, ``objective``).
        compared: ``(label, metrics)`` of the runs of ``eval.compare_with``.
        seed_spread: R@1 points; None when not measured.
    """
    label, metrics = this
    after = metrics.get("after") or {}
    sentences = []
    for ref, other in compared:
        theirs = other.get("after") or {}
        parts, gaps = [], []
        for name in [s for s in after if s in theirs]:
            diffs = []
            for direction, arrow in (("t2i", "text→image"), ("i2t", "image→text")):
                a = ((after[name].get(direction) or {}).get("R@1"))
                b = ((theirs[name].get(direction) or {}).get("R@1"))
                if a is not None and b is not None:
                    diffs.append((a - b, arrow))
            if diffs:
                gaps += [d for d, _ in diffs]
                parts.append((name, diffs))
        if not parts:
            continue
        me = f"`{Path(label).name}` ({metrics.get('objective', '?')})"
        them = f"`{Path(ref).name}` ({other.get('objective', '?')})"
        if all(g == 0 for g in gaps):
            relation = f"{me} is level with {them}"
        elif all(g >= 0 for g in gaps):
            relation = f"{me} is ahead of {them}"
        elif all(g <= 0 for g in gaps):
            relation = f"{me} is behind {them}"
        else:
            relation = f"{me} differs from {them}"
        where = "; ".join(f"on {name} by " + " and ".join(
            f"{d:+.1f} R@1 {arrow}" if i == 0 else f"{d:+.1f} {arrow}" for i, (d, arrow) in enumerate(diffs))
                          for name, diffs in parts)
        if seed_spread is None:
            judged = ("; no seed spread is known for this recipe (set `eval.seed_spread` to the R@1 range "
                      "measured over seeds, e.g. by bench/seed_spread.py), so whether this gap is more than seed "
                      "noise cannot be judged.")
        else:
            spread = (f"the seed spread of {seed_spread:.1f} points taken from the recipe (`eval.seed_spread`, "
                      "measured over seeds beforehand, not by this run)")
            beyond = [abs(g) > seed_spread for g in gaps]
            if all(beyond) and all(g > 0 for g in gaps):
                judged = f", beyond {spread}: it won."
            elif all(beyond) and all(g < 0 for g in gaps):
                judged = f", beyond {spread}: it lost."
            elif not any(beyond):
                judged = f", within {spread}: the runs cannot be told apart."
            else:
                n = sum(beyond)
                judged = (f"; {n} of these {len(gaps)} gaps exceed {spread}, the others do not: no clear "
                          "winner.")
        sentences.append(f"{relation} {where}{judged}")
    return " ".join(sentences) or None


def write_report(run_dir: str | Path, metrics: dict[str, Any], *, table: str, extra_sections: list[str] = (),
                 compare: list[tuple[str, dict[str, Any]]] | None = None, label: str | None = None) -> Path:
    """``report.md``: the verdict against the compared runs (:func:`verdict`, first), what ran, the recall table
    before/after, the plots (and what they draw) and any extra sections.

    Args:
        run_dir: the run folder.
        metrics: this run's ``metrics.json``.
        table: the recall table (markdown).
        extra_sections: markdown sections appended at the end.
        compare: ``(label, metrics)`` of the runs of ``eval.compare_with``.
        label: this run's name in the verdict (default: the folder's name).
    """
    run_dir = Path(run_dir)
    recipe = metrics.get("recipe", {})
    model = recipe.get("model", {})
    spread = (recipe.get("eval") or {}).get("seed_spread")
    said = verdict((label or run_dir.name, metrics), compare or [], spread) if compare else None
    lines = [f"# Run report: {run_dir.name}", ""]
    if said:
        lines += [f"**Verdict:** {said}", ""]
    family = metrics.get("model_family", metrics.get("backend", model.get("family")))
    architecture = metrics.get("architecture", metrics.get("family"))
    lines += [
        "## What ran",
        "",
        f"- model: `{model.get('name_or_path')}` (model family {family}, architecture {architecture}), "
        f"text positions {metrics.get('max_text_len')}",
        *([f"- started from: `{metrics['init_from']['run_dir']}/final` (`model.init_from: "
             f"{metrics['init_from']['ref']}`, {metrics['init_from']['status']})"] if metrics.get("init_from") else []),
        f"- adapter: {recipe.get('adapter', {}).get('type')}; trainable parameters "
        f"{metrics.get('trainable_parameters', 0):,} of {metrics.get('total_parameters', 0):,}",
        f"- objective: {metrics.get('objective')}",
        f"- training data: {metrics.get('train_set')} ({metrics.get('train_examples')} examples, "
        f"{metrics.get('skipped', {}).get('train', 0)} skipped)",
        f"- steps: {metrics.get('steps')} at global batch {recipe.get('train', {}).get('batch_size')}, "
        f"{metrics.get('wall_time_s', 0):.1f} s of training, {metrics.get('samples_per_s', 0):.1f} samples/s "
        f"on {metrics.get('num_processes', 1)} process(es)",
        f"- captions longer than {metrics.get('max_text_len')} tokens (truncated): "
        f"{metrics.get('truncated_captions', 0)}",
        "",
        "## Retrieval (Recall@K, %)",
        "",
        table,
        "",
    ]
    if metrics.get("final_losses"):
        lines += ["## Final losses", "", "| term | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in metrics["final_losses"].items()]
        lines.append("")
    lines += ["## Plots", ""]
    batch = (recipe.get("train") or {}).get("batch_size")
    if (run_dir / "plots" / "loss.png").exists():
        lines += ["### Loss per term", "", "![Loss per term](plots/loss.png)", "", _loss_caption(
            metrics.get("history") or [], batch, bool(compare)), ""]
    if (run_dir / "plots" / "recall.png").exists():
        title = "Recall before and after training" if metrics.get("before") else "Recall after training"
        lines += [f"### {title}", "", f"![{title}](plots/recall.png)", "", _recall_caption(metrics, bool(compare)), ""]
    for section in extra_sections:
        lines += [section, ""]
    path = run_dir / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path


def _loss_caption(history: list[dict[str, float]], batch: int | None, compared: bool) -> str:
    """What :func:`loss_figure` draws, in words."""
    keys = [k for k in (history[0] if history else {}) if k not in ("step", "loss", *_SCALARS)]
    lines = [f"Each point is a term's mean over the steps since the point before (`train.log_every`)."]
    if compared:
        lines.append("Dashed: the runs of `eval.compare_with`, on the terms they share with this run (and the "
                     "learning rate and logit scale); this run's added terms stand alone, and its total loss is "
                     "not set against another objective's total.")
    infonce = [f"`{k}`" for k in keys if k in _BATCH_INFONCE and chance_level(k, batch)]
    cosine = [f"`{k}`" for k in keys if k in _ONE_MINUS_COS]
    drawn = []
    if infonce:
        drawn.append(f"ln B = ln {batch} = {math.log(batch):.2f} for {', '.join(infonce)} (a symmetric InfoNCE: each "
                     f"image against the B captions of the global batch, and back)")
    if cosine:
        drawn.append(f"1 for {', '.join(cosine)} (1 − cos of unrelated embeddings)")
    if drawn:
        lines.append("Dotted: where a model that has learnt nothing stays, " + "; ".join(drawn) + ".")
    none = [f"`{k}`" for k in keys if chance_level(k, batch) is None]
    if none:
        lines.append("No chance line for " + ", ".join(none) + ": its level depends on counts that vary per batch "
                     "(regions, chunks) or it is not a softmax over the batch.")
    return " ".join(lines)


def _recall_caption(metrics: dict[str, Any], compared: bool) -> str:
    """What :func:`recall_figure` draws, in words."""
    text = "R@1 and R@5 after training of this run"
    if compared:
        text += " and of the runs of `eval.compare_with`"
    if metrics.get("before"):
        text += ", and of the model it started from, before training (grey)"
    text += "; every axis runs from 0 to 100 %, with the value on every bar"
    if metrics.get("after_at_base_length"):
        text += (f"; the hatched row scores the same trained models with every caption cut at "
                 f"{metrics.get('base_text_len', 77)} tokens")
    return text + "."


def comparison_section(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Markdown section setting runs side by side (``eval.compare_with``): Recall@1 / @5 per evaluation set
    and direction of each run after training, read up to its text length and cut at its base length (77
    for CLIP), and of the first run's start (before training).

    Args:
        runs: ``(label, metrics)`` pairs, this run first; ``metrics`` as in ``metrics.json`` (``after``,
            ``after_at_base_length``, ``before``, ``objective``, ``steps``, ``max_text_len``,
            ``base_text_len``).
    """
    first = runs[0][1]
    sets = list(first.get("after") or {})
    header = "| run | objective | steps | text tokens | " + " | ".join(
        f"{name} {arrow} R@{k}" for name in sets for arrow in ("t→i", "i→t") for k in (1, 5)) + " |"
    lines = ["## Comparison (same start, same evaluation)", "",
             "Recall@K (%) of each run after training, with captions read up to the model's text length and "
             "cut at the original length; the first row is the starting model before training.", "",
             header, "|" + "---|" * (4 + 4 * len(sets))]

    def row(label: str, objective: str, steps: Any, tokens: Any, res: dict | None) -> str:
        cells = []
        for name in sets:
            for direction in ("t2i", "i2t"):
                values = ((res or {}).get(name) or {}).get(direction) or {}
                cells += [f"{values[k]:.1f}" if k in values else "" for k in ("R@1", "R@5")]
        return f"| {label} | {objective} | {steps} | {tokens} | " + " | ".join(cells) + " |"

    if first.get("before"):
        lines.append(row("start (before training)", "", 0, first.get("max_text_len", ""), first["before"]))
    for label, m in runs:
        lines.append(row(label, m.get("objective", ""), m.get("steps", ""), m.get("max_text_len", ""), m.get("after")))
        if m.get("after_at_base_length"):
            lines.append(row(label, m.get("objective", ""), m.get("steps", ""),
                             f"cut at {m.get('base_text_len', 77)}", m["after_at_base_length"]))
    return "\n".join(lines)
