"""Run folders for the hub and model-card tests, built without the training loop: a tiny model
with KPS and an adapter whose trainable weights are perturbed (so that the adapter changes the
outputs), saved with ``save_finetuned`` into ``RUN/final``, plus ``recipe.yaml`` and
``metrics.json`` in the shape ``finetune/run.py`` writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from PIL import Image

FAKE_TOKEN = "hf_FAKEtokenXLIPKIT0123456789abcdef"
CAPTIONS = [" ".join(f"A red circle number {i} sits at the top left of the scene." for i in range(12)),
            "two blue squares on the right", "a small green star"]

AFTER = {"synthetic": {"protocol": "default", "n_images": 8, "n_texts": 8,
                       "t2i": {"R@1": 25.0, "R@5": 75.0}, "i2t": {"R@1": 37.5, "R@5": 87.5}}}
BEFORE = {"synthetic": {"protocol": "default", "n_images": 8, "n_texts": 8,
                        "t2i": {"R@1": 12.5, "R@5": 50.0}, "i2t": {"R@1": 12.5, "R@5": 62.5}}}


def images() -> list[Image.Image]:
    """Two small RGB images."""
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 255, (32, 40, 3), dtype=np.uint8)) for _ in range(2)]


def recipe_dict(base: str, adapter: str, *, train: str = "docci", terms: dict | None = None,
                token: str | None = None) -> dict[str, Any]:
    """A resolved recipe (the sections ``finetune/run.py`` dumps); ``token`` puts a ``hub.token``
    in it, as a hand-edited or old recipe might hold."""
    hub: dict[str, Any] = {"push": True, "repo_id": "me/tiny", "private": True, "revision": None}
    if token:
        hub["token"] = token
    return {
        "model": {"name_or_path": base, "backend": "auto", "max_text_len": 248},
        "adapter": {"type": adapter, "r": 4, "alpha": 8},
        "data": {"train": {"name": train, "split": "train"}},
        "objective": {"base": "clip", "terms": terms if terms is not None else {"structxlip": {}}},
        "train": {"lr": 1.0e-5, "weight_decay": 0.05, "batch_size": 8, "epochs": 1, "schedule": "cosine"},
        "eval": {"sets": [{"name": "synthetic", "split": "test", "size": 8}]},
        "hub": hub,
    }


def make_run(root: Path, base: str, adapter: str = "lora", *, token: str | None = None, seed: int = 0,
             metrics_extra: dict[str, Any] | None = None, train: str = "docci") -> Path:
    """Write a run folder under ``root`` for base model ``base`` (a registry name or a saved
    folder) with a ``full`` / ``lora`` / ``dora`` adapter; return the run folder."""
    from finetune import load_model
    from finetune.models.adapters import apply_adapter
    from finetune.models.finetuned import save_finetuned

    model = load_model(base, max_text_len=248)
    apply_adapter(model, {"type": adapter, "r": 4, "alpha": 8})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    recipe = recipe_dict(base, adapter, token=token, train=train)
    run = root
    save_finetuned(model, run / "final", recipe=recipe)
    (run / "recipe.yaml").write_text("# tiny test run\n" + yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    metrics = {"recipe": recipe, "model_family": model.backend, "architecture": model.family, "max_text_len": 248,
               "objective": "clip, structxlip", "train_set": train, "train_examples": 64, "steps": 8,
               "before": BEFORE, "after": AFTER, "final_losses": {"loss": 1.5}, **(metrics_extra or {})}
    (run / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    (run / "report.md").write_text("# Run report\n", encoding="utf-8")
    return run


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def embeddings(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(text (3, D), image (2, D))`` embeddings of :data:`CAPTIONS` and :func:`images`."""
    tok = model.tokenize(CAPTIONS)
    with torch.no_grad():
        return (model.encode_text(tok.input_ids, tok.attention_mask).embeds,
                model.encode_image(**model.preprocess_images(images())).embeds)
