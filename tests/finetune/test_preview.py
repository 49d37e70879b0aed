"""``finetune.preview``: the PNG grid of images, edge maps with regions, and original / filtered captions."""

from __future__ import annotations

import os
import stat

import pytest
from PIL import Image, ImageDraw

from finetune.models.registry import save_tiny
from finetune.preview import main, render_preview


pytestmark = pytest.mark.usefixtures("quiet_datasets")


def _item(index: int, chunks: int = 2) -> dict:
    image = Image.new("RGB", (80, 60), (200, 40, 40))
    ImageDraw.Draw(image).ellipse((10, 10, 50, 50), fill=(30, 30, 220))
    edges = Image.new("L", (80, 60), 0)
    ImageDraw.Draw(edges).ellipse((10, 10, 50, 50), outline=255)
    return {
        "id": f"example-{index}",
        "image": image,
        "edges": edges,
        "caption": "A blue circle sits on a red background. " * 6,
        "filtered_caption": "A circle sits on a background. " * 6,
        "removed": ["blue", "red"] * 6,
        "reverted": False,
        "boxes": [[0, 0, 40, 30], [40, 0, 80, 30], [10, 10, 50, 50]],
        "kept": [2, 0],
        "chunks": [f"A circle sits on a background {c}" for c in range(chunks)],
        "chunk_topk": [[2, 1, 0]] * chunks,
        "fallback": False,
    }


def test_render_preview_writes_one_row_per_example(tmp_path):
    one = render_preview([_item(0)], tmp_path / "one.png")
    three = render_preview([_item(i) for i in range(3)], tmp_path / "three.png", title="three examples")
    with Image.open(one) as a, Image.open(three) as b:
        assert a.width == b.width == 1600
        assert b.height > 2.5 * a.height  # rows stack
    # a long chunk list grows the row instead of overflowing it
    many = render_preview([_item(0, chunks=12)], tmp_path / "many.png")
    with Image.open(many) as c, Image.open(one) as a:
        assert c.height > a.height
    assert not list(tmp_path.glob(".*.png"))  # written through a temp file, nothing left behind
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(one).st_mode) == 0o666 & ~mask  # not mkstemp's 0600


def test_preview_names_where_the_regions_came_from():
    """Regions from the dataset are labelled as the dataset's links, not as FastSAM's top-K."""
    from finetune.preview import _text_lines

    def header(item):
        return [line for line, _ in _text_lines(item, 140, 12) if line.startswith("chunks ->")]

    assert header(_item(0)) == ["chunks -> positive regions (top-3 under the frozen model; encoded ones in colour)"]
    assert header({**_item(0), "region_source": "dataset"}) == [
        "chunks -> positive regions (linked by the dataset; encoded ones in colour)"]


def test_render_preview_needs_an_example(tmp_path):
    with pytest.raises(ValueError, match="at least one example"):
        render_preview([], tmp_path / "none.png")


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

    import finetune.preview as preview
    from finetune.objectives.structxlip import build_structxlip

    terms, drawn = [], []
    real_term, real_render = preview._structxlip_term, preview.render_preview

    def spy_term(recipe):
        terms.append(real_term(recipe))
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
