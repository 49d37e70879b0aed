"""The model as loaded, frozen, for preprocessing that must not see training (DESIGN 3): a fingerprint of its
weights for cache keys (:func:`model_fingerprint`) and its encoders in eval / inference mode
(:class:`FrozenEncoders`), e.g. StructXLIP's chunk -> region matching "based on the pre-trained VLM
encoders" (paper 3.2) and FAST-GOAL's region-sentence matching.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

__all__ = ["FrozenEncoders", "model_fingerprint"]


def model_fingerprint(model: Any) -> str:
    """A short id of a model's weights for cache keys: its description (``config_dict``) and a sha256 of
    every parameter's name, shape and first and last 256 values (cheap, and different for any two
    checkpoints in practice)."""
    digest = hashlib.sha256()
    describe = model.config_dict() if hasattr(model, "config_dict") else {}
    digest.update(repr(sorted(describe.items())).encode())
    digest.update(repr(getattr(getattr(model, "adapter", None), "type", None)).encode())
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = param.detach().reshape(-1)
            sample = torch.cat([flat[:256], flat[-256:]]).float().cpu().numpy().tobytes()
            digest.update(name.encode())
            digest.update(repr(tuple(param.shape)).encode())
            digest.update(sample)
    return digest.hexdigest()[:16]


class FrozenEncoders:
    """A model's encoders as plain functions of images and texts, under ``torch.inference_mode`` (no graph,
    no gradient): the ``encode_images`` / ``encode_texts`` of ``finetune.preprocess.regions.RegionMatcher``
    (StructXLIP 3.2: R_m^K "based on the pre-trained VLM encoders"). The caller runs it before any training
    step, on the model as loaded, and puts the model in eval mode when its dropout matters.

    Args:
        model: a ``DualEncoder`` (``preprocess_images``, ``tokenize``, ``encode_image``, ``encode_text``,
            ``device``, ``dtype``).
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def _inputs(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        device, dtype = self.model.device, self.model.dtype
        return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}

    def images(self, images: list[Any]) -> Tensor:
        """``(n, D)`` float32 embeddings of ``n`` PIL images, through the model's own processor."""
        with torch.inference_mode():
            return self.model.encode_image(**self._inputs(self.model.preprocess_images(images))).embeds.float()

    def texts(self, texts: list[str]) -> Tensor:
        """``(n, D)`` float32 embeddings of ``n`` strings, through the model's own tokenizer."""
        tok = self.model.tokenize(list(texts))
        with torch.inference_mode():
            return self.model.encode_text(
                tok.input_ids.to(self.model.device), tok.attention_mask.to(self.model.device)
            ).embeds.float()
