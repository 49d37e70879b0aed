"""Zero-shot classification of an image folder (finetune/evaluation/zeroshot.py) and ``evaluate --zeroshot``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from finetune.data.images import read_image
from finetune.cli.evaluate import main
from finetune.models.registry import build_model
from finetune.evaluation.zeroshot import SEVEN_TEMPLATES, class_embeddings, folder_classes, load_templates, zeroshot_classify

COLOURS = {"red_thing": (220, 20, 20), "green_thing": (20, 200, 20), "blue_thing": (20, 20, 220),
           "white_thing": (240, 240, 240), "black_thing": (5, 5, 5), "grey_thing": (128, 128, 128)}


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "classes"
    for c, (name, rgb) in enumerate(COLOURS.items()):
        (root / name).mkdir(parents=True)
        for j in range(2):
            shade = tuple(min(255, v + 10 * j) for v in rgb)
            Image.new("RGB", (40, 40), shade).save(root / name / f"{j}.png")
    (root / "notes.txt").write_text("not a class")
    return root


def test_folder_classes_and_templates(folder, tmp_path):
    names, paths, labels = folder_classes(folder)
    assert names == sorted(n.replace("_", " ") for n in COLOURS) and len(paths) == 12
    assert labels.tolist() == [c for c in range(6) for _ in range(2)]
    assert load_templates("seven") == list(SEVEN_TEMPLATES) and len(load_templates("openai")) == 80
    (tmp_path / "t.txt").write_text("a photo of a {}.\n\na drawing of a {}.\n")
    assert load_templates(str(tmp_path / "t.txt")) == ["a photo of a {}.", "a drawing of a {}."]
    with pytest.raises(ValueError, match=r"hold \{\}"):
        load_templates(["a photo"])
    (folder / "empty_class").mkdir()
    with pytest.raises(ValueError, match="'empty_class' holds no image"):
        folder_classes(folder)


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-openclip", "tiny-flair"])
def test_accuracy_equals_a_hand_computation_for_every_family(name, folder):
    model = build_model(name, seed=5).eval()
    result = zeroshot_classify(model, folder, templates=["a photo of a {}.", "a {}."], batch_size=5)
    names, paths, labels = folder_classes(folder)
    with torch.no_grad():
        per_template = []
        for t in ("a photo of a {}.", "a {}."):
            tok = model.tokenize([t.format(n) for n in names])
            per_template.append(F.normalize(model.encode_text(tok.input_ids, tok.attention_mask).embeds, dim=-1))
        classes = F.normalize((per_template[0] + per_template[1]) / 2, dim=-1)
        torch.testing.assert_close(class_embeddings(model, names, ["a photo of a {}.", "a {}."]), classes,
                                   rtol=0, atol=1e-5)
        pixels = model.preprocess_images([read_image(p) for p in paths])["pixel_values"]
        scores = F.normalize(model.encode_image(pixels).embeds, dim=-1) @ classes.T
    top5 = scores.topk(5, dim=1).indices
    assert result["n_images"] == 12 and result["n_classes"] == 6
    assert result["top1"] == pytest.approx(float((scores.argmax(1) == labels).double().mean() * 100))
    assert result["top5"] == pytest.approx(float((top5 == labels[:, None]).any(1).double().mean() * 100))


def test_evaluate_cli_zeroshot(folder, tmp_path, capsys):
    out = tmp_path / "zs.json"
    assert main(["tiny-flair", "--zeroshot", str(folder), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["sets"] == {} and written["zeroshot"]["n_classes"] == 6
    assert written["zeroshot"]["scorer"] == "cosine"
    assert "zero-shot" in capsys.readouterr().out
    assert main(["tiny-flair", "--zeroshot", str(folder), "--scorer", "flair", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["zeroshot"]["scorer"] == "flair"
    assert main(["tiny-flair", "--zeroshot", str(tmp_path / "missing")]) == 2
    assert "not a folder" in capsys.readouterr().err
