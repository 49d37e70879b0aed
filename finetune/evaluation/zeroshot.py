"""Zero-shot classification of an image folder (FLAIR section 4.6, appendix "Zero-shot Image
Classification"), for every model family: ``python -m finetune.evaluate MODEL --zeroshot FOLDER``.

``FOLDER`` holds one sub-folder per class (``FOLDER/golden_retriever/*.jpg``); the class name is the
sub-folder's name with ``_`` read as a space. Each class gets the prompt ensemble of the paper (CLIP's and
LaCLIP's): every template filled with the class name, the text embeddings L2-normalised, averaged and
normalised again. Images are scored against the classes by the evaluation scorer (``cosine``: the global
embeddings, the paper's; ``flair``: each image conditioned on each class embedding) and top-1 / top-5
accuracy is reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TEMPLATES", "class_embeddings", "folder_classes", "load_templates", "zeroshot_classify"]

#: the seven ImageNet templates CLIP recommends and FLAIR / LaCLIP use (FLAIR appendix)
SEVEN_TEMPLATES = ("itap of a {}.", "a bad photo of the {}.", "a origami {}.", "a photo of the large {}.",
                   "a {} in a video game.", "art of the {}.", "a photo of the small {}.")


def _open_clip_templates(name: str) -> tuple[str, ...]:
    from open_clip import zero_shot_metadata as meta

    fns = meta.OPENAI_IMAGENET_TEMPLATES if name == "openai" else meta.SIMPLE_IMAGENET_TEMPLATES
    return tuple(fn("{}") for fn in fns)


#: named template sets: ``seven`` (default), ``openai`` (CLIP's 80, from open_clip), ``simple`` (open_clip's)
TEMPLATES = ("seven", "openai", "simple")


def load_templates(spec: str | Sequence[str] = "seven") -> list[str]:
    """Prompt templates: a named set (:data:`TEMPLATES`), a text file with one template per line, or a list;
    every template holds ``{}`` where the class name goes.

    Raises:
        ValueError: an unknown name, a missing file, or a template without ``{}``.
    """
    if isinstance(spec, str):
        if spec == "seven":
            templates = list(SEVEN_TEMPLATES)
        elif spec in ("openai", "simple"):
            templates = list(_open_clip_templates(spec))
        else:
            path = Path(spec)
            if not path.is_file():
                raise ValueError(f"--templates {spec!r}: not one of {', '.join(TEMPLATES)} and not a file (a text "
                                 f"file with one template per line, each with {{}} for the class name)")
            templates = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        templates = [str(t) for t in spec]
    bad = [t for t in templates if "{}" not in t]
    if not templates or bad:
        raise ValueError(f"prompt templates must be non-empty and each hold {{}} for the class name; bad: {bad[:3]}")
    return templates


def folder_classes(folder: str | Path) -> tuple[list[str], list[Path], Tensor]:
    """``(class names, image paths, labels (N,))`` of an image folder with one sub-folder per class (sorted
    by name; images found recursively by extension).

    Raises:
        ValueError: the folder does not exist, has no class sub-folders, a class has no image, or an image is a
            broken symbolic link (naming it).
    """
    from finetune.data.images import IMAGE_EXTENSIONS, broken_link_reason, image_files

    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"--zeroshot {root}: not a folder (give a folder with one sub-folder of images per class)")
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"--zeroshot {root}: no class sub-folders; put each class's images in FOLDER/<class name>/")
    names, paths, labels = [], [], []
    for c, sub in enumerate(classes):
        files = image_files(sub)
        broken = [f"{p.relative_to(root)}: {broken_link_reason(p)}" for p in files if broken_link_reason(p)]
        if broken:  # an image left out of the count would change every accuracy: refused, never skipped silently
            raise ValueError(f"--zeroshot {root}: {len(broken)} image(s) cannot be read ({'; '.join(broken[:5])}); "
                             "fix the links or remove them")
        if not files:
            raise ValueError(f"--zeroshot {root}: class folder {sub.name!r} holds no image "
                             f"({', '.join(sorted(IMAGE_EXTENSIONS))})")
        names.append(sub.name.replace("_", " "))
        paths.extend(files)
        labels.extend([c] * len(files))
    return names, paths, torch.tensor(labels, dtype=torch.long)


@torch.no_grad()
def class_embeddings(model: Any, classnames: Sequence[str], templates: Sequence[str], *,
                     batch_size: int = 256) -> Tensor:
    """``(C, D)`` prompt-ensemble embeddings: for each class the mean of its L2-normalised template
    embeddings, normalised again (CLIP, LaCLIP, FLAIR appendix)."""
    device = next(model.parameters()).device
    prompts = [t.format(c) for c in classnames for t in templates]
    out = []
    for i in range(0, len(prompts), batch_size):
        tok = model.tokenize(prompts[i:i + batch_size])
        out.append(F.normalize(model.encode_text(tok.input_ids.to(device), tok.attention_mask.to(device))
                               .embeds.float(), dim=-1))
    per = torch.cat(out).view(len(classnames), len(templates), -1)
    return F.normalize(per.mean(1), dim=-1)


@torch.no_grad()
def zeroshot_classify(
    model: Any,
    folder: str | Path,
    *,
    templates: str | Sequence[str] = "seven",
    scorer: Any = "cosine",
    batch_size: int = 64,
    ks: Sequence[int] = (1, 5),
    accelerator: Any = None,
) -> dict[str, Any]:
    """Zero-shot top-K accuracy (percent) of ``model`` on an image folder (see the module docstring).

    Args:
        model: any :class:`~finetune.models.core.encoder.DualEncoder`.
        folder: one sub-folder of images per class.
        templates: see :func:`load_templates`.
        scorer: a registered scorer or a :class:`~finetune.evaluation.scorers.Scorer` (texts are the class embeddings).
        batch_size: images per forward pass.
        ks: the K of top-K accuracy (a K above the number of classes counts every image as right).
        accelerator: for the device and autocast, or None.

    Returns:
        ``{"folder", "n_images", "n_classes", "templates", "scorer", "top1", "top5", ...}`` (one ``topK`` per K)
        and ``per_class_top1``.
    """
    from finetune.data.images import read_image
    from finetune.evaluation.scorers import get_scorer

    scorer = get_scorer(scorer)
    names, paths, labels = folder_classes(folder)
    prompts = load_templates(templates)
    dual = accelerator.unwrap_model(model) if accelerator is not None else model
    device = accelerator.device if accelerator is not None else next(dual.parameters()).device
    was_training = dual.training
    dual.eval()
    autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
    chunks = []
    try:
        with autocast:
            classes = class_embeddings(dual, names, prompts)
            for i in range(0, len(paths), batch_size):
                inputs = dual.preprocess_images([read_image(p) for p in paths[i:i + batch_size]])
                inputs = {k: v.to(device=device, dtype=dual.dtype if v.is_floating_point() else v.dtype)
                          for k, v in inputs.items()}
                chunks.append(scorer.encode_images(dual, inputs))
    finally:
        dual.train(was_training)
    from finetune.evaluation.scorers import concat_payloads, exact_float32_matmul

    images = concat_payloads(chunks)
    with exact_float32_matmul(device):
        texts, images = scorer.prepare({"embeds": classes}, images)
        scores = scorer.score(texts, images).T  # (N, C)
    labels = labels.to(scores.device)
    own = scores.gather(1, labels[:, None])
    rank = (scores > own).sum(1)  # classes scoring strictly above the right one
    result: dict[str, Any] = {"folder": str(folder), "n_images": len(paths), "n_classes": len(names),
                              "templates": templates if isinstance(templates, str) else len(prompts),
                              "scorer": scorer.name or type(scorer).__name__}
    for k in ks:
        result[f"top{k}"] = float((rank < k).double().mean() * 100)
    result["per_class_top1"] = {n: float((rank[labels == c] < 1).double().mean() * 100) for c, n in enumerate(names)}
    return result
