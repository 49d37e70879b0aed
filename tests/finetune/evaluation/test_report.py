"""The run report: the verdict against eval.compare_with, and what plots/loss.png and plots/recall.png draw
(read from the matplotlib objects, not from pixels)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from finetune.evaluation.report import chance_level, loss_figure, recall_figure, verdict, write_report


def _result(t2i: float, i2t: float, r5: float = 90.0) -> dict:
    return {"synthetic": {"t2i": {"R@1": t2i, "R@5": r5}, "i2t": {"R@1": i2t, "R@5": r5}}}


THIS = ("recipes/quickstart.yaml", {"objective": "clip, structxlip", "after": _result(62.9, 60.9)})


def _other(t2i: float, i2t: float) -> list[tuple[str, dict]]:
    return [("recipes/quickstart_finetune_clip.yaml", {"objective": "clip", "after": _result(t2i, i2t)})]


def test_verdict_a_win_beyond_the_seed_spread() -> None:
    said = verdict(THIS, _other(59.0, 57.4), seed_spread=2.0)
    assert said == ("`quickstart.yaml` (clip, structxlip) is ahead of `quickstart_finetune_clip.yaml` (clip) on "
                    "synthetic by +3.9 R@1 text→image and +3.5 image→text, beyond the seed spread of 2.0 points "
                    "taken from the recipe (`eval.seed_spread`, measured over seeds beforehand, not by this run): "
                    "it won.")


def test_verdict_a_loss_beyond_the_seed_spread() -> None:
    said = verdict(THIS, _other(65.0, 63.5), seed_spread=2.0)
    assert "is behind `quickstart_finetune_clip.yaml` (clip) on synthetic by -2.1 R@1 text→image and -2.6 " \
           "image→text, beyond the seed spread of 2.0 points" in said
    assert said.endswith(": it lost.")


def test_verdict_a_gap_within_the_seed_spread() -> None:
    said = verdict(THIS, _other(62.5, 59.0), seed_spread=5.9)
    assert "is ahead of `quickstart_finetune_clip.yaml` (clip) on synthetic by +0.4 R@1 text→image and +1.9 " \
           "image→text, within the seed spread of 5.9 points taken from the recipe" in said
    assert said.endswith("the runs cannot be told apart.") and "won" not in said


def test_verdict_mixed_and_partly_beyond() -> None:
    said = verdict(THIS, _other(58.0, 61.4), seed_spread=2.0)
    assert "differs from `quickstart_finetune_clip.yaml` (clip) on synthetic by +4.9 R@1 text→image and -0.5 " \
           "image→text; 1 of these 2 gaps exceed the seed spread of 2.0 points" in said
    assert said.endswith("no clear winner.")


def test_verdict_without_a_measured_spread_says_it_cannot_be_judged() -> None:
    said = verdict(THIS, _other(64.4, 61.3), seed_spread=None)
    assert "is behind `quickstart_finetune_clip.yaml` (clip) on synthetic by -1.5 R@1 text→image and -0.4" in said
    assert "no seed spread is known for this recipe" in said and "cannot be judged" in said
    assert verdict(THIS, [], seed_spread=1.0) is None


def _history(terms: dict[str, float], steps: int = 4) -> list[dict[str, float]]:
    return [{"step": 5 * (i + 1), **{k: v - 0.1 * i for k, v in terms.items()}, "lr": 1e-4, "logit_scale": 14.0}
            for i in range(steps)]


STRUCTXLIP = {"clip": 2.5, "structxlip/structure": 2.8, "structxlip/consistency": 0.9, "structxlip/local": 4.3,
              "loss": 3.6}


def _panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_loss_plot_sets_the_shared_term_against_the_compared_run_never_the_totals() -> None:
    fig = loss_figure(_history(STRUCTXLIP), compare={"recipes/quickstart_finetune_clip.yaml":
                                                     _history({"clip": 2.4, "loss": 2.4})}, batch_size=16,
                      label="quickstart.yaml")
    panels = _panels(fig)
    assert list(panels) == ["clip (shared term)", "structxlip/structure (this run only)",
                            "structxlip/consistency (this run only)", "structxlip/local (this run only)",
                            "total loss (this run's objective)", "lr", "logit_scale"]
    clip = panels["clip (shared term)"]
    assert [line.get_label() for line in clip.get_lines()] == [
        "quickstart.yaml", "quickstart_finetune_clip.yaml", "chance: ln 16 = 2.77"]
    assert list(clip.get_lines()[1].get_ydata()) == pytest.approx([2.4, 2.3, 2.2, 2.1])
    assert list(clip.get_lines()[2].get_ydata()) == pytest.approx([math.log(16)] * 2)
    total = panels["total loss (this run's objective)"]
    assert [line.get_label() for line in total.get_lines()] == ["quickstart.yaml"]  # no other objective's total
    structure = panels["structxlip/structure (this run only)"]
    assert [line.get_label() for line in structure.get_lines()] == ["quickstart.yaml", "chance: ln 16 = 2.77"]
    assert [line.get_label() for line in panels["structxlip/consistency (this run only)"].get_lines()] == [
        "quickstart.yaml", "unrelated embeddings: 1 − cos 0 = 1"]
    assert [line.get_label() for line in panels["structxlip/local (this run only)"].get_lines()] == [
        "quickstart.yaml"]
    assert len(panels["lr"].get_lines()) == 2  # the schedules side by side


def test_loss_plot_of_a_single_term_run_has_no_duplicate_total() -> None:
    fig = loss_figure(_history({"clip": 2.5, "loss": 2.5}), batch_size=64)
    assert list(_panels(fig)) == ["clip", "lr", "logit_scale"]
    assert chance_level("clip", 64)[0] == pytest.approx(math.log(64))
    assert chance_level("structxlip/local", 64) is None and chance_level("siglip", 64) is None


def _bars(ax) -> list[tuple[str, float]]:
    return [(c.get_label(), c.patches[0].get_height()) for c in ax.containers]


def _value_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_recall_plot_draws_every_panel_from_zero_to_100_and_labels_the_values_with_the_compared_runs_and_the_cut(
) -> None:
    compared = [("recipes/quickstart_finetune_clip.yaml",
                 {"after": _result(62.5, 59.0, 96.5), "after_at_base_length": _result(19.1, 18.0, 47.3)})]
    fig = recall_figure(_result(53.5, 52.0, 93.8), _result(62.9, 60.9, 97.7), label="quickstart.yaml",
                        compare=compared, at_base=_result(22.7, 19.9, 49.2), base_text_len=77)
    assert fig._suptitle.get_text() == "Recall@K (%) after training, and the start before it"
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes[:4]] == ["synthetic: text→image R@1", "synthetic: text→image R@5",
                                                   "synthetic: image→text R@1", "synthetic: image→text R@5"]
    full, cut = axes[0], axes[4]
    assert _bars(full) == [("start (before training)", 53.5), ("quickstart.yaml", 62.9),
                           ("quickstart_finetune_clip.yaml", 62.5)]
    assert _value_labels(full) == ["53.5", "62.9", "62.5"]
    for ax in axes:  # never zoomed: 62.9 against 62.5 looks as close as it is (issue 41)
        low, high = ax.get_ylim()
        assert low == 0 and 100 <= high <= 110, (ax.get_title(), low, high)
    assert "read in full" in full.get_ylabel()
    assert _bars(cut) == [("quickstart.yaml", 22.7), ("quickstart_finetune_clip.yaml", 19.1)]
    assert "cut at 77 tokens" in cut.get_ylabel() and _value_labels(cut) == ["22.7", "19.1"]
    assert all(p.get_hatch() == "//" for c in cut.containers for p in c.patches)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["start (before training)", "quickstart.yaml", "quickstart_finetune_clip.yaml"]


def test_recall_plot_without_a_before_is_not_titled_before_and_after() -> None:
    fig = recall_figure(None, _result(62.9, 60.9), label="run")
    texts = [fig._suptitle.get_text(), *(ax.get_title() for ax in fig.axes), *(ax.get_ylabel() for ax in fig.axes)]
    assert not any("before" in t for t in texts)
    assert len([ax for ax in fig.axes if ax.get_title()]) == 4  # no cut row without cut results
    assert _bars(fig.axes[0]) == [("run", 62.9)]


def test_report_opens_with_the_verdict_and_names_what_its_plots_draw(tmp_path) -> None:
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "loss.png").write_bytes(b"png")
    (tmp_path / "plots" / "recall.png").write_bytes(b"png")
    metrics = {**THIS[1], "recipe": {"eval": {"seed_spread": 5.9}, "train": {"batch_size": 16}},
               "history": _history(STRUCTXLIP), "before": None, "model_family": "hf", "architecture": "clip"}
    text = write_report(tmp_path, metrics, table="(table)", compare=_other(62.5, 59.0),
                        label="recipes/quickstart.yaml").read_text()
    lines = text.splitlines()
    assert lines[0] == f"# Run report: {tmp_path.name}"
    assert lines[2].startswith("**Verdict:** `quickstart.yaml` (clip, structxlip) is ahead of") and \
        "within the seed spread of 5.9 points" in lines[2]
    assert "(model family hf, architecture clip)" in text
    assert "### Recall after training" in text and "before" not in text.split("## Plots")[1].split("###")[2]
    assert "Dotted: where a model that has learnt nothing stays, ln B = ln 16 = 2.77 for `clip`, " \
           "`structxlip/structure` (a symmetric InfoNCE" in text
    assert "1 for `structxlip/consistency` (1 − cos of unrelated embeddings)" in text
    assert "No chance line for `structxlip/local`" in text


@pytest.mark.slow
def test_a_run_with_compare_with_writes_the_verdict_the_plots_and_consistent_counts(tmp_path, capsys) -> None:
    """Two tiny runs as the quickstart sets them: clip + StructXLIP against clip only, from the same model."""
    import json

    import yaml
    from accelerate.state import AcceleratorState, GradientState

    from finetune.config import load_recipe
    from finetune.models.registry import save_tiny
    from finetune.training import run_recipe

    tiny = save_tiny("tiny-clip", tmp_path / "tiny-clip")
    data = {"train": {"name": "synthetic", "split": "train", "size": 8, "seed": 100, "options": {"image_size": 32}},
            "num_workers": 0}
    sets = [{"name": "synthetic", "split": "test", "size": 8, "seed": 1, "options": {"image_size": 32}}]
    common = {"model": {"name_or_path": str(tiny), "max_text_len": 248, "kps": {"keep": 20, "freeze_kept": False}},
              "data": data, "train": {"lr": 1e-3, "batch_size": 4, "max_steps": 2, "log_every": 1,
                                      "checkpoint_every": 0, "trackers": []}}
    clip = tmp_path / "clip_only.yaml"
    clip.write_text("# clip only\n" + yaml.safe_dump({
        **common, "objective": {"base": "clip"}, "eval": {"sets": sets, "batch_size": 8, "compare_base_length": True},
        "output": {"dir": str(tmp_path / "runs" / "clip")}}))
    quick = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())
    main = tmp_path / "with_structxlip.yaml"
    main.write_text("# clip + structxlip\n" + yaml.safe_dump({
        **common, "objective": quick["objective"],
        "eval": {"sets": sets, "batch_size": 8, "compare_base_length": True, "compare_with": [str(clip)],
                 "seed_spread": 100.0},
        "output": {"dir": str(tmp_path / "runs" / "main")}}))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert run_recipe(load_recipe(main)) == 0
    out = tmp_path / "runs" / "main"
    metrics = json.loads((out / "metrics.json").read_text())
    report = (out / "report.md").read_text().splitlines()
    assert report[2].startswith("**Verdict:** `with_structxlip.yaml` (clip, structxlip)") and \
        "`clip_only.yaml` (clip)" in report[2] and "within the seed spread of 100.0 points" in report[2]
    assert f"Verdict: {report[2][len('**Verdict:** '):]}" in capsys.readouterr().out
    assert (metrics["model_family"], metrics["architecture"]) == ("hf", "clip")
    assert "backend" not in metrics and "family" not in metrics
    assert metrics["trainable_parameters"] == metrics["total_parameters"]  # full fine-tune + tau'
    assert (out / "plots" / "loss.png").is_file() and (out / "plots" / "recall.png").is_file()
