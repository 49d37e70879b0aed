"""Stub encoders and small scenes shared by the FLISM tests (tests/finetune/preprocess/flism/)."""

from __future__ import annotations

from pathlib import Path

import datasets
import torch
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[4]


def image(width: int = 80, height: int = 60) -> Image.Image:
    """White, with a red square at (10, 10)-(40, 40)."""
    im = Image.new("RGB", (width, height), (255, 255, 255))
    ImageDraw.Draw(im).rectangle((10, 10, 40, 40), fill=(200, 0, 0))
    return im


class Colours:
    """Stub encoders: a crop's embedding is its mean colour; a sentence's is the colour it names."""

    COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "white": (1.0, 1.0, 1.0)}

    def images(self, crops: list[Image.Image]) -> torch.Tensor:
        means = [c.convert("RGB").resize((1, 1), Image.BOX).getpixel((0, 0)) for c in crops]
        return torch.tensor(means, dtype=torch.float32) / 255 + 1e-3

    def texts(self, texts: list[str]) -> torch.Tensor:
        out = []
        for t in texts:
            word = next((w for w in self.COLOURS if w in t.lower()), "white")
            out.append(torch.tensor(self.COLOURS[word]))
        return torch.stack(out)


def scenes() -> datasets.Dataset:
    """Two images: a red square top left and a blue one bottom right on white, captions naming them."""
    rows = {"image": [], "caption": [], "objects": []}
    for k in range(2):
        im = Image.new("RGB", (64, 48), (255, 255, 255))
        draw = ImageDraw.Draw(im)
        draw.rectangle((2, 2, 21, 17), fill=(255, 0, 0))
        draw.rectangle((40, 28, 61, 45), fill=(0, 0, 255))
        rows["image"].append(im)
        rows["caption"].append("A plain green picture. There is a blue square at the bottom. A red square sits at the top."
                               if k == 0 else "A red square is in the corner.")
        rows["objects"].append([{"box": [2, 2, 22, 18], "sentence_index": 2 if k == 0 else 0},
                                {"box": [40, 28, 62, 46], "sentence_index": 1 if k == 0 else -1}])
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string"),
                                  "objects": datasets.List({"box": datasets.List(datasets.Value("int32")),
                                                            "sentence_index": datasets.Value("int32")})})
    return datasets.Dataset.from_dict(rows, features=features)


#: CLIP ViT-B/16's transform: shortest side to 224, centre crop 224 x 224, patches of 16
CLIP_GEOMETRY = {"mode": "shortest_center_crop", "size": 224, "crop": (224, 224), "patch_size": 16}


def wide_scene() -> datasets.Dataset:
    """Issue 23's case: a 1000 x 500 image whose red object (10, 100, 240, 400) lies in the strip CLIP's centre crop
    cuts away (the crop keeps x 250-750)."""
    im = Image.new("RGB", (1000, 500), (255, 255, 255))
    ImageDraw.Draw(im).rectangle((10, 100, 239, 399), fill=(255, 0, 0))
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string"),
                                  "objects": datasets.List({"box": datasets.List(datasets.Value("int32")),
                                                            "sentence_index": datasets.Value("int32")})})
    return datasets.Dataset.from_dict({"image": [im], "caption": ["A red square stands on the left."],
                                       "objects": [[{"box": [10, 100, 240, 400], "sentence_index": 0}]]},
                                      features=features)


def tiny_model(tmp_path: Path):
    """A tiny CLIP saved under ``tmp_path`` and loaded with 248 text positions."""
    from finetune import load_model
    from finetune.models.registry import save_tiny

    return load_model(str(save_tiny("tiny-clip", tmp_path / "tiny-clip")), max_text_len=248)
