"""``xlipkit preview`` (:mod:`finetune.cli.preview`): the command that draws a recipe's StructXLIP inputs (the drawing itself:
tests/finetune/objectives/structxlip/test_preview.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from finetune.models.registry import save_tiny
from finetune.cli.preview import main


pytestmark = pytest.mark.usefixtures("quiet_datasets")
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_preview_command_on_a_recipe(tmp_path, capsys):
    tiny = save_tiny("tiny-clip", tmp_path / "tiny-clip")
    out = tmp_path / "preview.png"
    code = main(["recipes/quickstart.yaml", f"model.name_or_path={tiny}", "data.train.size=4",
                 f"data.cache_dir={tmp_path / 'cache'}", "--n", "2", "--out", str(out)])
    assert code == 0 and out.is_file()
    assert f"wrote {out}" in capsys.readouterr().out
    with Image.open(out) as png:
        assert png.width == 1600 and png.height > 300
    # the preprocessing was cached like a run's: the lexicon, edges and regions steps are on disk
    steps = {p.name.split("-")[0] for p in (tmp_path / "cache" / "preprocess").iterdir()}
    assert steps == {"lexicon", "edges", "regions"}


def test_preview_of_a_recipe_without_structxlip_uses_the_default_options(tmp_path, monkeypatch, caplog):
    import logging

    import finetune.cli.preview as preview
    from finetune.objectives.structxlip import build_structxlip

    terms, drawn = [], []
    real_term, real_render = preview._structxlip_term, preview.render_preview

    def spy_term(recipe, objective=None):
        terms.append(real_term(recipe, objective))
        return terms[-1]

    def spy_render(items, out, **kwargs):
        drawn.append((items, kwargs))
        return real_render(items, out, **kwargs)

    monkeypatch.setattr(preview, "_structxlip_term", spy_term)
    monkeypatch.setattr(preview, "render_preview", spy_render)
    tiny = save_tiny("tiny-clip", tmp_path / "tiny-clip")
    out = tmp_path / "plain.png"
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        assert main(["recipes/quickstart_clip.yaml", f"model.name_or_path={tiny}", "data.train.size=2",
                     f"data.cache_dir={tmp_path / 'cache'}", "--n", "1", "--out", str(out)]) == 0
    assert "no structxlip term: previewing with its default options" in caplog.text
    default = build_structxlip(None)[0]
    [term] = terms
    assert term.options == default.options and term.compat == default.compat
    [(items, kwargs)] = drawn
    assert len(items) == 1 and items[0]["chunks"] and items[0]["filtered_caption"]
    assert f"compat {default.compat}, regions encoded as {default.options.regions.encode}" in kwargs["title"]
    with Image.open(out) as png:
        assert png.format == "PNG" and png.size[0] > 100


def test_preview_reports_recipe_errors(tmp_path, capsys):
    assert main(["recipes/quickstart.yaml", "objective.terms.structxlip.regions.k=0",
                 "--out", str(tmp_path / "x.png")]) == 2
    assert "regions.k" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_preview_before_the_start_is_trained_says_so_without_a_random_weights_warning(tmp_path, caplog):
    """`xlipkit preview recipes/quickstart.yaml` on a fresh clone: the start (model.init_from) is not trained yet;
    the preview says so as INFO and warns about nothing, and trains nothing."""
    import logging

    pretrain = (REPO / "recipes" / "quickstart_pretrain.yaml").read_text()
    start = tmp_path / "start.yaml"
    start.write_text(pretrain.replace("dir: runs/quickstart_pretrain", f"dir: {tmp_path / 'runs' / 'start'}"))
    out = tmp_path / "p.png"
    with caplog.at_level(logging.INFO, logger="xlipkit"):
        assert main(["recipes/quickstart.yaml", "--n", "1", "--out", str(out), f"model.init_from={start}",
                     "data.train.size=2", f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    assert out.is_file()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert f"model.init_from: {start} is not trained yet" in caplog.text
    assert not (tmp_path / "runs").exists()
