"""The run report: ``metrics.json``, ``report.md`` and ``plots/`` (loss curves per term, recall before and
after) of a run folder."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` through a temp file and ``os.replace``."""
    write_text_atomic(path, json.dumps(data, indent=2, default=_jsonable) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from finetune.run_folder import process_tag

    # the writer's PID@HOST in the name: another run's cleanup leaves it alone while this process lives
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{process_tag()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600: give the file the user's usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__dict__"):
        return obj.__dict__
    return str(obj)


def plot_losses(history: list[dict[str, float]], path: str | Path,
                compare: dict[str, list[dict[str, float]]] | None = None) -> Path | None:
    """One panel per logged loss term (and the learning rate) against the step; returns the PNG path.

    ``compare`` maps a label to another run's history (``eval.compare_with``): its curves of the same
    keys are drawn dashed in the same panels."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in history[0] if k not in ("step",)]
    steps = [h["step"] for h in history]
    n = len(keys)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        ax.plot(steps, [h.get(key, float("nan")) for h in history], lw=1.5, label="this run")
        for label, other in (compare or {}).items():
            if other and key in other[0]:
                ax.plot([h["step"] for h in other], [h.get(key, float("nan")) for h in other], lw=1.2, ls="--",
                        label=Path(label).stem)
                ax.legend(fontsize=7)
        ax.set_title("total loss" if key == "loss" else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_recall(before: dict | None, after: dict, path: str | Path) -> Path | None:
    """Grouped bars of R@K before and after training, one panel per evaluation set and direction."""
    if not after:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(s, d) for s in after for d in ("t2i", "i2t") if d in after[s]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (name, direction) in zip(axes.flat, panels):
        ks = list(after[name][direction])
        x = range(len(ks))
        width = 0.38
        if before and name in before:
            ax.bar([i - width / 2 for i in x], [before[name][direction][k] for k in ks], width,
                   label="before", color="#9aa5b1")
        ax.bar([i + width / 2 for i in x], [after[name][direction][k] for k in ks], width,
               label="after", color="#2f6fb0")
        ax.set_xticks(list(x), ks)
        ax.set_ylim(0, 100)
        ax.set_ylabel("recall (%)")
        ax.set_title(f"{name}: {'text→image' if direction == 't2i' else 'image→text'}")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(run_dir: str | Path, metrics: dict[str, Any], *, table: str, extra_sections: list[str] = ()) -> Path:
    """``report.md``: what ran, the recall table before/after, the plots and any extra sections."""
    run_dir = Path(run_dir)
    recipe = metrics.get("recipe", {})
    model = recipe.get("model", {})
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        "## What ran",
        "",
        f"- model: `{model.get('name_or_path')}` (backend {metrics.get('backend', model.get('backend'))}), "
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
    for name, title in (("loss.png", "Loss per term"), ("recall.png", "Recall before and after")):
        if (run_dir / "plots" / name).exists():
            lines += [f"### {title}", "", f"![{title}](plots/{name})", ""]
    for section in extra_sections:
        lines += [section, ""]
    path = run_dir / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path


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
