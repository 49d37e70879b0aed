"""``finetune.objectives.structxlip.preview``: the PNG grid of images, edge maps with regions, and original /
filtered captions."""

from __future__ import annotations

import os
import stat

import pytest
from PIL import Image, ImageDraw

from finetune.objectives.structxlip.preview import render_preview


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
    from finetune.objectives.structxlip.preview import _text_lines

    def header(item):
        return [line for line, _ in _text_lines(item, 140, 12) if line.startswith("chunks ->")]

    assert header(_item(0)) == ["chunks -> positive regions (top-3 under the frozen model; encoded ones in colour)"]
    assert header({**_item(0), "region_source": "dataset"}) == [
        "chunks -> positive regions (linked by the dataset; encoded ones in colour)"]


def test_render_preview_needs_an_example(tmp_path):
    with pytest.raises(ValueError, match="at least one example"):
        render_preview([], tmp_path / "none.png")
