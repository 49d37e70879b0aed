"""Truncation that keeps the end token, padding, and the HF tokenisation wrapper."""

from __future__ import annotations

import pytest
import torch

from finetune.models.offline_tokenizers import clip_tokenizer, word_tokenizer
from finetune.models.core.tokens import hf_tokenize, pad_batch, special_suffix_length, truncate_keep_end


def test_truncate_keep_end() -> None:
    assert truncate_keep_end([1, 2, 3], 5, 1) == ([1, 2, 3], False)
    assert truncate_keep_end([0, 1, 2, 3, 4, 9], 4, 1) == ([0, 1, 2, 9], True)
    assert truncate_keep_end([0, 1, 2, 3, 8, 9], 4, 2) == ([0, 1, 8, 9], True)
    assert truncate_keep_end([0, 1, 2, 3], 2, 0) == ([0, 1], True)
    with pytest.raises(ValueError, match="no room"):
        truncate_keep_end([0, 1, 2, 3], 1, 1)


def test_pad_batch_both_sides() -> None:
    ids, mask = pad_batch([[5, 6, 7], [8]], 4, 0)
    assert ids.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]] and mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    ids, mask = pad_batch([[5, 6, 7], [8]], 4, 1, side="left")
    assert ids.tolist() == [[1, 5, 6, 7], [1, 1, 1, 8]] and mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]


def test_special_suffix_lengths() -> None:
    assert special_suffix_length(clip_tokenizer()) == 1  # <|endoftext|>
    assert special_suffix_length(word_tokenizer()) == 1  # </s>


def test_hf_tokenize_keeps_the_end_token_and_flags_cuts() -> None:
    tok = clip_tokenizer()
    out = hf_tokenize(tok, ["a b c d e f g", "x"], 6, padding="max_length")
    assert out.input_ids.tolist() == [[49406, 320, 321, 322, 323, 49407], [49406, 343, 49407, 49407, 49407, 49407]]
    assert out.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    assert out.truncated.tolist() == [True, False] and out.truncated.dtype == torch.bool
    longest = hf_tokenize(tok, ["x", "y z"], 77, padding="longest")
    assert longest.input_ids.shape == (2, 4) and not longest.truncated.any()
    cleaned = hf_tokenize(word_tokenizer(), ["RED"], 8, clean=lambda s: s + " circle")
    assert cleaned.input_ids[0, :3].tolist() == word_tokenizer()("red circle")["input_ids"]


def test_hf_tokenize_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="list of strings"):
        hf_tokenize(clip_tokenizer(), "one caption", 10)
    with pytest.raises(ValueError, match="padding"):
        hf_tokenize(clip_tokenizer(), ["x"], 10, padding="do_not_pad")


def test_fast_backend_encoding_gives_the_tokenizers_ids():
    """hf_tokenize calls a fast tokenizer's backend directly (encode_batch_fast); the ids are the tokenizer's
    own, and a backend with truncation set goes through the tokenizer."""
    from finetune.models.offline_tokenizers import clip_tokenizer, word_tokenizer
    from finetune.models.core.tokens import _encode
    from finetune.models.families.vision_text import tiny_bert_tokenizer

    texts = ["A red circle sits left of a blue square.", "", "two  cats, one dog!" * 30]
    for tok in (clip_tokenizer(77), word_tokenizer(64), tiny_bert_tokenizer()):
        want = tok(texts, add_special_tokens=True, truncation=False, padding=False, verbose=False)["input_ids"]
        assert _encode(tok, texts) == want
        tok._tokenizer.enable_truncation(8)
        assert _encode(tok, texts) == tok(texts, add_special_tokens=True, truncation=False, padding=False,
                                          verbose=False)["input_ids"]
