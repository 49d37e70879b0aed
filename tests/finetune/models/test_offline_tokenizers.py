"""The offline tokenizers: the real CLIP BPE ids, and the small deterministic WordPiece one."""

from __future__ import annotations

from transformers import AutoTokenizer

from finetune.models.offline_tokenizers import clip_tokenizer, word_tokenizer, word_vocab_size


def test_clip_tokenizer_equals_open_clip() -> None:
    from open_clip import SimpleTokenizer

    ref = SimpleTokenizer()
    tok = clip_tokenizer()
    assert tok.vocab_size == 49408 and tok.model_max_length == 77
    for text in ["A photo of a cat, sitting on the mat!", "Hello   World 123 don't", "naïve café, 'quotes'"]:
        assert tok(text)["input_ids"] == [ref.sot_token_id, *ref.encode(text), ref.eot_token_id]


def test_word_tokenizer_is_deterministic_and_handles_any_text(tmp_path) -> None:
    tok = word_tokenizer(64)
    text = "A red Circle, top-left; naïve Xylophone 42!"
    ids = tok(text)["input_ids"]
    assert ids == word_tokenizer(64)(text)["input_ids"]
    assert ids[-1] == tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert tok.convert_ids_to_tokens(ids[:4]) == ["a", "red", "circle", ","]
    assert tok.unk_token_id not in ids
    assert max(ids) < word_vocab_size()
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == ids
