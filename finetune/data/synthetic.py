"""The embedded long-caption data: synthetic scenes of coloured shapes (DESIGN section 7).

Each scene is a small image of 3-5 flat, saturated shapes (circle, square, triangle, star,
diamond, hexagon, cross, ring) on a plain background, one per cell of a 3 x 3 grid, with a long
caption: a generic preamble, one sentence per object (size, colour, shape, position), a sentence
on a relation between objects and one on the whole scene.

Why a model must read past 77 tokens: scenes come in *families* of 2-4 that share their
background and their first 2-3 objects ("anchors"), described first, with the same words; the
members differ only in their remaining objects ("details"), described after the anchors. With
three anchors the shared prefix is longer than CLIP's 77-token window, so the members of such a
family are identical to a 77-token text encoder and only a long-text encoder tells them apart;
with two anchors the first detail starts just before token 77. The images differ in the detail
objects, drawn as large as the anchors, so a tiny CLIP learns the task from scratch in minutes.

Splits: ``train`` draws from ``numpy.random.SeedSequence(seed, spawn_key=(0,))`` and ``test``
from ``SeedSequence(seed, spawn_key=(1,))``: independent streams, so held-out scenes differ from
the training scenes for any pair of seeds. A dataset of N scenes is a prefix of one of M > N
scenes with the same seed and options (except that the last family may be cut).
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass

import datasets
import numpy as np
import PIL.Image
import PIL.ImageDraw

from finetune.data.sources import DataError, SourceSpec, register_source

__all__ = ["synthetic_scenes", "SHAPES", "COLOURS", "BACKGROUNDS", "SIZES", "POSITIONS", "SPLITS"]

SPLITS = ("train", "test")
SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon", "cross", "ring")
COLOURS = {
    "red": (220, 30, 30),
    "orange": (245, 130, 20),
    "yellow": (240, 210, 0),
    "green": (30, 170, 50),
    "cyan": (0, 190, 210),
    "blue": (30, 70, 220),
    "purple": (130, 40, 190),
    "pink": (240, 90, 170),
}
BACKGROUNDS = {"white": (255, 255, 255), "light grey": (200, 200, 200), "black": (0, 0, 0)}
# Diameter as a fraction of a grid cell: big enough to be seen at 64 px with 8 px patches.
SIZES = {"small": 0.55, "medium": 0.75, "large": 0.95}
# The 3 x 3 grid, row-major: cell index -> words.
POSITIONS = (
    "in the top left corner", "at the top", "in the top right corner",
    "on the left", "in the centre", "on the right",
    "in the bottom left corner", "at the bottom", "in the bottom right corner",
)
_NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
_DETAILS = {
    "circle": "with a smooth round outline",
    "square": "with four straight sides",
    "triangle": "pointing straight upwards",
    "star": "with five sharp points",
    "diamond": "standing on one of its corners",
    "hexagon": "with six equal sides",
    "cross": "shaped like a plus sign",
    "ring": "with a round hole in the middle",
}
_PREAMBLES = (
    "A simple picture of flat, brightly coloured shapes on a plain {bg} background.",
    "This image shows flat shapes in bright colours on a plain {bg} background.",
    "A drawing of simple coloured shapes on a plain {bg} background.",
)
# Anchor sentences carry the shape's detail phrase; detail-object sentences are shorter.
_ANCHOR_TEMPLATES = (
    "There is a {size} {colour} {shape} {detail} {position}.",
    "{Position} there is a {size} {colour} {shape} {detail}.",
    "A {size} {colour} {shape} {detail} sits {position}.",
)
_DETAIL_TEMPLATES = (
    "The picture also contains a {size} {colour} {shape} {position}.",
    "Besides these, there is a {size} {colour} {shape} {position}.",
    "There is also a {size} {colour} {shape} {position}.",
)
_SPLIT_KEYS = {"train": 0, "test": 1}


@dataclass(frozen=True)
class _Object:
    shape: str
    colour: str
    size: str
    cell: int
    template: int

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


def _object_sentence(obj: _Object, templates: tuple[str, ...], with_detail: bool) -> str:
    position = POSITIONS[obj.cell]
    text = templates[obj.template].format(
        size=obj.size,
        colour=obj.colour,
        shape=obj.shape,
        detail=_DETAILS[obj.shape] if with_detail else "",
        position=position,
        Position=position[0].upper() + position[1:] + ",",
    )
    return " ".join(text.split()).replace(" .", ".")


def _relation_sentence(a: _Object, b: _Object) -> str:
    """Where ``a`` lies relative to ``b`` on the grid, in words."""
    row_a, col_a = divmod(a.cell, 3)
    row_b, col_b = divmod(b.cell, 3)
    vertical = "above" if row_a < row_b else "below" if row_a > row_b else ""
    horizontal = "to the left of" if col_a < col_b else "to the right of" if col_a > col_b else ""
    relation = " and ".join(part for part in (vertical, horizontal) if part)
    return f"The {a.name} is {relation} the {b.name}."


def _scene_sentence(objects: list[_Object]) -> str:
    return f"Altogether there are {_NUMBERS[len(objects)]} shapes."


def _draw_shape(draw: PIL.ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float], fill: tuple) -> None:
    x1, y1, x2, y2 = box
    cx, cy, r = (x1 + x2) / 2, (y1 + y2) / 2, (x2 - x1) / 2
    # PIL's boxes are inclusive; the stored boxes are pixel-edge coordinates.
    inclusive = (x1, y1, x2 - 1, y2 - 1)
    if shape == "circle":
        draw.ellipse(inclusive, fill=fill)
    elif shape == "ring":
        draw.ellipse(inclusive, outline=fill, width=max(2, round(r * 0.45)))
    elif shape == "square":
        draw.rectangle(inclusive, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, y1), (x2 - 1, y2 - 1), (x1, y2 - 1)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, y1), (x2 - 1, cy), (cx, y2 - 1), (x1, cy)], fill=fill)
    elif shape == "hexagon":
        draw.polygon([(cx + r * math.cos(a), cy + r * math.sin(a)) for a in np.arange(6) * math.pi / 3], fill=fill)
    elif shape == "star":
        points = []
        for i in range(10):
            radius = r if i % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + i * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=fill)
    elif shape == "cross":
        half = r * 0.36
        draw.rectangle((cx - half, y1, cx + half - 1, y2 - 1), fill=fill)
        draw.rectangle((x1, cy - half, x2 - 1, cy + half - 1), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def _place(obj: _Object, image_size: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """The object's box [x1, y1, x2, y2] (pixel edges) inside its grid cell, with some jitter."""
    cell = image_size / 3
    diameter = max(4, round(SIZES[obj.size] * cell))
    row, col = divmod(obj.cell, 3)
    slack = max(0.0, (cell - diameter) / 2)
    cx = (col + 0.5) * cell + rng.uniform(-slack, slack)
    cy = (row + 0.5) * cell + rng.uniform(-slack, slack)
    x1 = int(np.clip(round(cx - diameter / 2), 0, image_size - diameter))
    y1 = int(np.clip(round(cy - diameter / 2), 0, image_size - diameter))
    return x1, y1, x1 + diameter, y1 + diameter


def _render(objects: list[_Object], boxes: list[tuple[int, int, int, int]], background: str, image_size: int) -> bytes:
    image = PIL.Image.new("RGB", (image_size, image_size), BACKGROUNDS[background])
    draw = PIL.ImageDraw.Draw(image)
    for obj, box in zip(objects, boxes):
        _draw_shape(draw, obj.shape, box, COLOURS[obj.colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _draw_objects(
    rng: np.random.Generator, count: int, free_cells: list[int], taken: set[tuple[str, str]], background: str, n_templates: int
) -> list[_Object]:
    """``count`` objects in distinct free cells, each (colour, shape) new to the scene."""
    colours = [c for c in COLOURS if c != background]
    cells = rng.permutation(free_cells)[:count]
    objects = []
    for cell in cells:
        while True:
            shape = SHAPES[rng.integers(len(SHAPES))]
            colour = colours[rng.integers(len(colours))]
            if (colour, shape) not in taken:
                break
        taken.add((colour, shape))
        size = tuple(SIZES)[rng.integers(len(SIZES))]
        objects.append(_Object(shape, colour, size, int(cell), int(rng.integers(n_templates))))
    return objects


def _features() -> datasets.Features:
    return datasets.Features(
        {
            "id": datasets.Value("string"),
            "image": datasets.Image(),
            "caption": datasets.Value("string"),
            "sentences": datasets.List(datasets.Value("string")),
            "objects": datasets.List(
                {
                    "box": datasets.List(datasets.Value("int32"), length=4),
                    "shape": datasets.Value("string"),
                    "colour": datasets.Value("string"),
                    "size": datasets.Value("string"),
                    "sentence_index": datasets.Value("int32"),
                }
            ),
            "group": datasets.Value("int32"),
        }
    )


def _check_scene_options(size: int, split: str, image_size: int, objects: tuple[int, int],
                         family_size: tuple[int, int]) -> None:
    """:func:`synthetic_scenes`' options checked: a ValueError naming the option and its range."""
    min_objects, max_objects = objects
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"synthetic: size must be a positive integer (number of scenes), got {size!r}")
    if split not in _SPLIT_KEYS:
        raise ValueError(f"synthetic: unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if not 2 <= min_objects <= max_objects <= 9:
        raise ValueError(
            f"synthetic: need 2 <= min_objects <= max_objects <= 9 (one object per cell of a 3x3 grid), "
            f"got min_objects={min_objects}, max_objects={max_objects}"
        )
    if image_size < 24:
        raise ValueError(f"synthetic: image_size must be at least 24 pixels, got {image_size}")
    low, high = family_size
    if not 1 <= low <= high:
        raise ValueError(f"synthetic: family_size must be (low, high) with 1 <= low <= high, got {family_size}")


def synthetic_scenes(
    size: int,
    seed: int = 0,
    *,
    split: str = "train",
    image_size: int = 64,
    min_objects: int = 3,
    max_objects: int = 5,
    family_size: tuple[int, int] = (2, 4),
) -> datasets.Dataset:
    """Generate ``size`` synthetic long-caption scenes (DESIGN section 7), deterministically.

    Args:
        size: number of scenes.
        seed: the seed; the same (seed, split, options) give the same bytes.
        split: ``"train"`` or ``"test"``, drawn from independent seed streams (module docstring).
        image_size: side of the square images in pixels.
        min_objects, max_objects: objects per scene (2 <= min <= max <= 9; one per grid cell).
        family_size: inclusive range of the number of scenes sharing background and anchors.
    Returns:
        a ``datasets.Dataset`` with columns ``id`` (str), ``image`` (``datasets.Image()``, PNG,
        ``image_size`` x ``image_size`` RGB), ``caption`` (str), ``sentences`` (list[str], the
        caption's sentences: ``" ".join(sentences) == caption``), ``objects`` (list of
        ``{"box": [x1, y1, x2, y2] in pixel edges, "shape", "colour", "size",
        "sentence_index"}`` where ``sentences[sentence_index]`` describes the object) and
        ``group`` (int, the family: scenes of a family share their caption's beginning).
    """
    _check_scene_options(size, split, image_size, (min_objects, max_objects), family_size)
    low, high = family_size
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_SPLIT_KEYS[split],)))
    columns: dict[str, list] = {name: [] for name in ("id", "image", "caption", "sentences", "objects", "group")}
    seen: set[str] = set()
    group = 0
    while len(columns["id"]) < size:
        background = tuple(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
        anchors_count = int(min(rng.integers(2, 4), max_objects - 1))
        taken: set[tuple[str, str]] = set()
        anchors = _draw_objects(rng, anchors_count, list(range(9)), taken, background, len(_ANCHOR_TEMPLATES))
        head = [_PREAMBLES[rng.integers(len(_PREAMBLES))].format(bg=background)]
        head += [_object_sentence(obj, _ANCHOR_TEMPLATES, with_detail=True) for obj in anchors]
        head.append(_relation_sentence(anchors[0], anchors[1]) if len(anchors) > 1 else "")
        head = [s for s in head if s]
        anchor_boxes = [_place(obj, image_size, rng) for obj in anchors]
        detail_templates = [int(t) for t in rng.integers(len(_DETAIL_TEMPLATES), size=9)]
        members = int(rng.integers(low, high + 1))
        for _ in range(members):
            if len(columns["id"]) >= size:
                break
            for _attempt in range(50):  # redraw details until the scene's caption is new
                count = int(rng.integers(max(min_objects, anchors_count + 1), max_objects + 1)) - anchors_count
                free = [c for c in range(9) if c not in {a.cell for a in anchors}]
                details = _draw_objects(rng, count, free, set(taken), background, len(_DETAIL_TEMPLATES))
                # the family's wording: only the facts differ between members, not the phrasing
                details = [dataclasses.replace(d, template=t) for d, t in zip(details, detail_templates)]
                tail = [_object_sentence(obj, _DETAIL_TEMPLATES, with_detail=False) for obj in details]
                tail.append(_scene_sentence(anchors + details))
                sentences = head + tail
                caption = " ".join(sentences)
                if caption not in seen:
                    break
            else:
                continue
            seen.add(caption)
            objects = anchors + details
            boxes = anchor_boxes + [_place(obj, image_size, rng) for obj in details]
            sentence_of = list(range(1, 1 + len(anchors))) + [len(head) + i for i in range(len(details))]
            index = len(columns["id"])
            columns["id"].append(f"synthetic-{split}-s{seed}-{index:06d}")
            columns["image"].append({"bytes": _render(objects, boxes, background, image_size), "path": None})
            columns["caption"].append(caption)
            columns["sentences"].append(sentences)
            columns["objects"].append(
                [
                    {"box": list(box), "shape": o.shape, "colour": o.colour, "size": o.size, "sentence_index": s}
                    for o, box, s in zip(objects, boxes, sentence_of)
                ]
            )
            columns["group"].append(group)
        group += 1
    return datasets.Dataset.from_dict(columns, features=_features())


_DEFAULT_SIZES = {"train": 2000, "test": 256}
_OPTIONS = ("image_size", "min_objects", "max_objects", "family_size")


@register_source(
    "synthetic",
    description="embedded synthetic scenes of coloured shapes with long captions (offline; splits train/test)",
    splits=SPLITS,
    takes_path=False,
)
def build_synthetic(spec: SourceSpec) -> datasets.Dataset:
    """Source builder: ``{name: synthetic, size: 2000, seed: 0, split: train|test, options: {...}}``.

    ``size`` defaults to 2000 scenes for ``train`` and 256 for ``test``; ``options`` may set
    ``image_size``, ``min_objects``, ``max_objects`` and ``family_size`` of
    :func:`synthetic_scenes`.
    """
    split = spec.split or "train"
    unknown = sorted(set(spec.options) - set(_OPTIONS))
    if unknown:
        raise DataError(
            f"synthetic: unknown option(s) {', '.join(unknown)}; valid options are {', '.join(_OPTIONS)}"
        )
    options = dict(spec.options)
    if "family_size" in options:
        options["family_size"] = tuple(options["family_size"])
    size = spec.size if spec.size is not None else _DEFAULT_SIZES[split]
    try:
        return synthetic_scenes(size, spec.seed, split=split, **options)
    except (TypeError, ValueError) as error:
        raise DataError(f"data source 'synthetic': {error}") from error
