"""The model as loaded, frozen: weight fingerprints for cache keys and the inference-mode encoders."""

from __future__ import annotations

import torch
from PIL import Image

from finetune.preprocess.frozen import FrozenEncoders, model_fingerprint


def test_fingerprint_is_stable_and_follows_the_weights(load_tiny) -> None:
    model = load_tiny("tiny-clip")
    first = model_fingerprint(model)
    assert first == model_fingerprint(load_tiny("tiny-clip")) and len(first) == 16
    with torch.no_grad():
        model.logit_scale.add_(0.5)
    assert model_fingerprint(model) != first


def test_frozen_encoders_match_the_model_without_a_graph(load_tiny) -> None:
    model = load_tiny("tiny-clip").eval()
    enc = FrozenEncoders(model)
    images = [Image.new("RGB", (40, 30), c) for c in ("red", "blue")]
    texts = ["a red square", "a blue circle on the left", "x"]
    img, txt = enc.images(images), enc.texts(texts)
    assert img.shape == (2, model.encode_image(**model.preprocess_images(images)).embeds.shape[1])
    assert txt.shape[0] == 3 and img.dtype == txt.dtype == torch.float32
    assert not img.requires_grad and not txt.requires_grad
    tok = model.tokenize(texts)
    with torch.no_grad():
        expected = model.encode_text(tok.input_ids, tok.attention_mask).embeds
    torch.testing.assert_close(txt, expected.float())
