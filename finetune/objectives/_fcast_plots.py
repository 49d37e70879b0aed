"""Pictures of the F-CAST run report: the part-to-whole hierarchy (F-CAST Fig. 6) and the part-level
attention of sub-captions over the stage-2 segments (Fig. 7)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _upsample(labels: np.ndarray, size: int) -> np.ndarray:
    """Nearest upsampling of an ``(h, w)`` map to ``(size, size)``."""
    rows = (np.arange(size) * labels.shape[0] // size)
    cols = (np.arange(size) * labels.shape[1] // size)
    return labels[rows][:, cols]


def _colour(labels: np.ndarray, image: np.ndarray) -> np.ndarray:
    """Each segment painted with its mean image colour, boundaries in white (skimage)."""
    from skimage.segmentation import mark_boundaries

    out = np.zeros_like(image, dtype=np.float64)
    for s in np.unique(labels):
        where = labels == s
        out[where] = image[where].mean(0)
    return mark_boundaries(out / 255.0, labels, color=(1, 1, 1))


def _save(fig: Any, path: Path) -> None:
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@torch.no_grad()
def draw_hierarchy(model: Any, images: list[Any], path: str | Path) -> Path:
    """One row per image: the image, its superpixels, and the segments after each graph pooling (hard
    assignment composed level by level, :func:`finetune.models.cast.hierarchy_labels`). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from finetune.models.cast import hierarchy_labels

    was_training = model.training
    model.eval()
    inputs = model.preprocess_images(images)
    device = model.device
    out = model.encode_image_hierarchy(inputs["pixel_values"].to(device), inputs["superpixels"].to(device))
    levels = [lv.cpu().numpy() for lv in hierarchy_labels(out)]
    model.train(was_training)
    arrays = [model._prepare_image(im) for im in images]
    side = arrays[0].shape[0]
    counts = [int(inputs["superpixels"].amax((1, 2)).max()) + 1] + [a.shape[-1] for a in out.assignments]
    titles = ["image", f"superpixels (~{counts[0]})"] + [f"stage {i + 1}: {c} segments"
                                                           for i, c in enumerate(counts[1:])]
    fig, axes = plt.subplots(len(images), len(titles), figsize=(2.2 * len(titles), 2.2 * len(images)), squeeze=False)
    for r, image in enumerate(arrays):
        panels = [image / 255.0, _colour(inputs["superpixels"][r].numpy(), image)]
        panels += [_colour(_upsample(lv[r], side), image) for lv in levels[1:]]
        for c, panel in enumerate(panels):
            axes[r, c].imshow(panel)
            axes[r, c].axis("off")
            if r == 0:
                axes[r, c].set_title(titles[c], fontsize=8)
    path = Path(path)
    _save(fig, path)
    plt.close(fig)
    return path


@torch.no_grad()
def draw_attention(model: Any, images: list[Any], captions: list[str], path: str | Path, *, per_image: int = 3) -> Path:
    """One row per image: the image and, for its first ``per_image`` balanced chunks (appendix C), the
    attention pool's weights over the 64 stage-2 segments painted on the pixels of each segment (the
    part-level grounding of Fig. 7). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from finetune.data.text import balanced_chunks, split_sentences
    from finetune.models.cast import hierarchy_labels

    was_training = model.training
    model.eval()
    device = model.device
    inputs = model.preprocess_images(images)
    out = model.encode_image_hierarchy(inputs["pixel_values"].to(device), inputs["superpixels"].to(device))
    stage1 = hierarchy_labels(out)[1].cpu().numpy()
    chunk_texts = []
    for caption in captions:
        chunks = [" ".join(c) for c in balanced_chunks(split_sentences(caption), model.n_chunks) if c]
        chunk_texts.append((chunks or [caption])[:per_image])
    arrays = [model._prepare_image(im) for im in images]
    side = arrays[0].shape[0]
    fig, axes = plt.subplots(len(images), per_image + 1, figsize=(2.6 * (per_image + 1), 2.6 * len(images)),
                             squeeze=False)
    for r, texts in enumerate(chunk_texts):
        tok = model.tokenize_chunks(texts)
        query = model.encode_subcaptions(tok.input_ids.to(device), tok.attention_mask.to(device))
        _, weights = model.model.part_pool(query[None], out.fine[r:r + 1], return_weights=True)
        weights = weights[0].float().cpu().numpy()  # (Q, M + 1), the empty slot last
        axes[r, 0].imshow(arrays[r])
        axes[r, 0].axis("off")
        for c in range(per_image):
            ax = axes[r, c + 1]
            ax.axis("off")
            if c >= len(texts):
                continue
            heat = weights[c][:-1][_upsample(stage1[r], side)]
            ax.imshow(arrays[r])
            ax.imshow(heat, cmap="inferno", alpha=0.6)
            title = textwrap.shorten(texts[c], 70)
            ax.set_title("\n".join(textwrap.wrap(title, 28)) + f"\n(empty {weights[c][-1]:.2f})", fontsize=6)
    model.train(was_training)
    path = Path(path)
    _save(fig, path)
    plt.close(fig)
    return path
