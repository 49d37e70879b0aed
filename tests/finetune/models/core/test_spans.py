"""DualEncoder.sentence_spans: each sentence's token range in tokenize()'s ids, for the transformers
(offset_mapping) and open_clip (sentence-by-sentence) tokenizers."""

from __future__ import annotations

import re

import pytest
import torch
from open_clip.tokenizer import canonicalize_text

from finetune.data.text import split_sentences
from finetune.models.core.encoder import DualEncoder, ImageFeatures, TextFeatures, TokenizedText
from finetune.models.longclip import apply_kps
from finetune.models.core.spans import spans_by_pieces

CAPTIONS = [
    "A dog runs. A cat sleeps.",
    "It is 3.5 m tall, e.g. Mr. Lee says so.\nA bird sings",
    "First caption of the image. </s> Second caption, with a comma.",
    "Only one sentence here",
]
SENTENCE = "A red circle is here."  # 6 CLIP tokens: a red circle is here .


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _decode(model, ids: list[int]) -> str:
    tokenizer = getattr(model.tokenizer, "tokenizer", model.tokenizer)  # open_clip's HFTokenizer wraps one
    return tokenizer.decode(ids)


def _check_words(model, captions, spans, clean=lambda text: text) -> None:
    rows = model.tokenize(captions).input_ids
    for caption, row, caption_spans in zip(captions, rows, spans):
        sentences = split_sentences(caption)
        assert len(caption_spans) == len(sentences)
        for sentence, span in zip(sentences, caption_spans):
            assert span is not None, sentence
            start, end = span
            assert _words(_decode(model, row[start:end].tolist())) == _words(clean(sentence))


def test_spans_of_a_simple_caption_start_after_the_start_token(load_tiny):
    model = load_tiny("tiny-clip")
    assert model.sentence_spans(["A dog runs. A cat sleeps."]) == [[(1, 5), (5, 9)]]
    assert model.sentence_spans(["Only one sentence here", ""]) == [[(1, 5)], []]


def test_hf_and_open_clip_tokenizers_agree_and_spans_decode_to_the_sentences(load_tiny):
    hf, oc = load_tiny("tiny-clip"), load_tiny("tiny-openclip")
    spans = hf.sentence_spans(CAPTIONS)
    assert oc.sentence_spans(CAPTIONS) == spans
    assert spans[0] == [(1, 5), (5, 9)]
    assert [len(s) for s in spans] == [2, 2, 2, 1]  # "3.5", "e.g." and "Mr." stay inside their sentence
    # the final punctuation is inside the range, "</s>" between the captions is in none
    assert hf.tokenizer.decode(hf.tokenize(CAPTIONS).input_ids[2, spans[2][0][0] : spans[2][0][1]].tolist()) == (
        "first caption of the image ."
    )
    _check_words(hf, CAPTIONS, spans)
    _check_words(oc, CAPTIONS, spans)


def test_offsets_and_pieces_agree_without_a_start_token(load_tiny):
    model = load_tiny("tiny-siglip")  # a fast WordPiece tokenizer that appends </s> and has no start token
    spans = model.sentence_spans(CAPTIONS)
    assert spans == spans_by_pieces(model, CAPTIONS)
    assert spans[0][0][0] == 0  # the first word is at position 0
    _check_words(model, CAPTIONS, spans)


def test_a_tokenizer_that_cleans_the_text_first(load_tiny):
    model = load_tiny("tiny-openclip-siglip")  # open_clip HFTokenizer: canonicalize drops punctuation
    spans = model.sentence_spans(CAPTIONS)
    assert spans[0][0][0] == 0 and spans[0][0][1] == spans[0][1][0]  # no "." left between the sentences
    _check_words(model, CAPTIONS, spans, clean=canonicalize_text)  # "3.5" reads "35", "e.g." "eg"


def test_spans_follow_left_padding(load_tiny):
    model = load_tiny("tiny-siglip")
    model.tokenizer.padding_side = "left"
    captions = ["A dog. A cat.", "Two blue squares."]
    tok = model.tokenize(captions)
    spans = model.sentence_spans(captions)
    assert spans[1][0][0] == int((tok.attention_mask[1] == 0).sum())  # after the padding
    _check_words(model, captions, spans)


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-openclip"])
def test_sentences_past_token_248_are_none(load_tiny, name):
    model = apply_kps(load_tiny(name), 248, keep=20)
    fits = " ".join([SENTENCE] * 41)  # 1 + 41 * 6 + 1 = 248 tokens: everything fits
    one_more = " ".join([SENTENCE] * 42)
    straddles = "A dog. " + " ".join([SENTENCE] * 41)  # its last sentence covers positions 244-249
    one_token_more = fits + " Yes"  # "yes" would sit at position 247, where the end token is kept
    before = dict(model.truncation_stats)
    spans = model.sentence_spans([fits, one_more, straddles, one_token_more])
    assert model.truncation_stats == before  # spans do not count as captions seen
    assert model.tokenize([fits, one_more, straddles, one_token_more]).truncated.tolist() == [False, True, True, True]
    assert spans[3][40] == (241, 247) and spans[3][41] is None
    assert spans[0][-1] == (241, 247) and spans[1][40] == (241, 247) and spans[1][41] is None
    assert len(spans[2]) == 42 and spans[2][40] == (238, 244) and spans[2][41] is None
    _check_words(model, [fits], spans[:1])
    row = model.tokenize([one_more]).input_ids[0]
    assert _words(_decode(model, row[241:247].tolist())) == _words(SENTENCE)


def test_a_sentence_glued_to_a_separator_keeps_its_words(load_tiny):
    caption = ["A dog.</s>A cat."]
    # BPE reads ".</s>" as "." "</" "s>" but "A dog." alone ends in ".</w>": the offsets keep the period,
    # open_clip (no offsets) leaves the token that differs from the sentence's own out
    for name, first in (("tiny-clip", (1, 4)), ("tiny-openclip", (1, 3))):
        model = load_tiny(name)
        spans = model.sentence_spans(caption)
        assert spans == [[first, (7, 10)]]
        _check_words(model, caption, spans)


def test_sentence_spans_rejects_a_single_string(load_tiny):
    with pytest.raises(TypeError, match="wrap it"):
        load_tiny("tiny-clip").sentence_spans("A dog.")
    with pytest.raises(TypeError, match="wrap it"):
        load_tiny("tiny-openclip").sentence_spans("A dog.")


class WordModel(DualEncoder):
    """A model family of its own: one id per word (punctuation glued to it), no special tokens, a
    placeholder id for an empty caption, truncation that keeps no end token."""

    backend = "words"

    def __init__(self, max_text_len: int = 8) -> None:
        super().__init__(torch.nn.Linear(2, 2))
        self.max_text_len = max_text_len
        self.vocab: dict[str, int] = {}

    def tokenize(self, texts, *, max_length=None):
        length = max_length or self.max_text_len
        rows = [[self.vocab.setdefault(w.lower(), len(self.vocab) + 2) for w in t.split()] or [1] for t in texts]
        truncated = torch.tensor([len(r) > length for r in rows])
        rows = [r[:length] for r in rows]
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        self._count_truncation(truncated)
        return TokenizedText(ids, mask, truncated)

    def encode_image(self, pixel_values, *, states=False, states_rows=None, **kwargs):
        return ImageFeatures(self.model(pixel_values.flatten(1)[:, :2]), None, (1, 1))

    def encode_text(self, input_ids, attention_mask=None, *, states=False):
        return TextFeatures(self.model(input_ids[:, :2].float()), None, torch.ones_like(input_ids))

    @property
    def logit_scale(self):
        return self.model.bias

    def preprocess_images(self, images):
        return {"pixel_values": torch.zeros(len(images), 3, 2, 2)}

    def save_pretrained(self, path):
        raise NotImplementedError("a test model")


def test_any_family_gets_spans_through_its_tokenize():
    model = WordModel(max_text_len=8)
    captions = ["A dog runs. A cat sleeps.", "", "One two three. Four five six seven. Eight nine"]
    assert model.sentence_spans(captions) == [[(0, 3), (3, 6)], [], [(0, 3), (3, 7), None]]  # 9 words, 8 kept
    assert model.truncation_stats == {"captions": 0, "truncated": 0}
