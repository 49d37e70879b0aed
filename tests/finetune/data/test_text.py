"""Sentence splitting, chunking, FLAIR sub-caption sampling and Long-CLIP's first sentence."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from finetune.data.text import (
    as_sentence_list,
    chunk_sentences,
    first_sentence,
    sample_subcaptions,
    sentence_offsets,
    split_sentences,
)


# One case per rule of the splitter, each protected by that rule alone: removing the rule from
# split_sentences fails exactly its case (checked by hand for every rule).
RULE_CASES = {
    # no whitespace after the period, so "3.5" is no candidate ("5" is not lower-case, "3" no abbreviation)
    "decimal": ("It is 3.5 Metres tall.", ["It is 3.5 Metres tall."]),
    # the closing quote belongs to the terminator: '."' followed by a space ends the sentence
    "closing_quote": ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    # a line break ends a sentence even before a lower-case word and without a period
    "line_break": ("A dog on grass\nthe sky is blue", ["A dog on grass", "the sky is blue"]),
    # FLAIR's caption separator ends a sentence and is dropped
    "separator": ("a dog</s>a cat", ["a dog", "a cat"]),
    # a known abbreviation before a capital ("dr" is neither an initial nor an acronym)
    "abbreviation": ("Dr. Jones waves. He smiles.", ["Dr. Jones waves.", "He smiles."]),
    # a single-letter initial before a capital
    "initial": ("J. Smith signs books.", ["J. Smith signs books."]),
    # a dotted acronym before a capital ("u.s" is in no list and not a single letter)
    "dotted_acronym": ("A U.S. Army truck passes.", ["A U.S. Army truck passes."]),
    # a lower-case word after a period continues the sentence ("mat" is no abbreviation)
    "lower_case_next": ("The cat sat on the mat. then it slept.", ["The cat sat on the mat. then it slept."]),
    # an ellipsis ends the sentence even after an initial-like word ("Z")
    "ellipsis": ("It ends with the letter Z... Then silence.", ["It ends with the letter Z...", "Then silence."]),
}


@pytest.mark.parametrize("rule", list(RULE_CASES))
def test_split_sentences_tricky_inputs(rule):
    text, expected = RULE_CASES[rule]
    assert split_sentences(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Mr. Smith holds a 3.5 kg bag. Dr. Jones waves!",
            ["Mr. Smith holds a 3.5 kg bag.", "Dr. Jones waves!"],
        ),
        ("A red car on a road. A tree behind it", ["A red car on a road.", "A tree behind it"]),
        ("A dog\nA cat on a mat.\n\nA bird", ["A dog", "A cat on a mat.", "A bird"]),
        ("Fruit, e.g. Apples and pears. Plates, etc. The table is wooden.",
         ["Fruit, e.g. Apples and pears.", "Plates, etc.", "The table is wooden."]),
        ("The U.S. flag waves. J. K. Rowling signs books.", ["The U.S. flag waves.", "J. K. Rowling signs books."]),
        ('He said "stop." Then he left. Is it red? Yes.', ['He said "stop."', "Then he left.", "Is it red?", "Yes."]),
        ("Version 2.0 ships in 2024. Prices rise... Nobody cares.",
         ["Version 2.0 ships in 2024.", "Prices rise...", "Nobody cares."]),
        ("A sign reads no. entry allowed.", ["A sign reads no. entry allowed."]),
        ("A dog.</s>A cat. </s> A bird\r\nA fish", ["A dog.", "A cat.", "A bird", "A fish"]),
        ("Only one sentence", ["Only one sentence"]),
        ("   ", []),
        ("", []),
    ],
)
def test_split_sentences_on_mixed_captions(text, expected):
    assert split_sentences(text) == expected


def test_sentence_offsets_locate_each_sentence():
    text = "  Mr. Lee waves.\nA dog</s> A cat!  "
    offsets = sentence_offsets(text)
    assert [text[a:b] for a, b in offsets] == split_sentences(text) == ["Mr. Lee waves.", "A dog", "A cat!"]
    assert offsets[0] == (2, 16)


def test_split_sentences_rejects_non_strings():
    with pytest.raises(TypeError, match="expects a str"):
        split_sentences(None)
    with pytest.raises(TypeError, match="expects a str"):
        sentence_offsets(b"A dog.")


def _words(text: str) -> int:
    return len(text.split())


def test_chunk_sentences_respects_the_budget_and_keeps_all_text():
    sentences = ["one two three.", "four five.", "six seven eight nine.", "ten.", "a b c d e f g h i j k l."]
    chunks = chunk_sentences(sentences, 6, _words)

    assert chunks == ["one two three. four five.", "six seven eight nine. ten.", "a b c d e f g h i j k l."]
    assert " ".join(chunks) == " ".join(sentences)
    assert all(_words(c) <= 6 for c in chunks[:-1])  # the last is a lone over-long sentence
    assert chunk_sentences([], 10, _words) == []
    with pytest.raises(ValueError, match="max_tokens"):
        chunk_sentences(sentences, 0, _words)


SENTENCES = ["S0.", "S1.", "S2.", "S3.", "S4."]


def _parts(subcaption: str) -> list[str]:
    return subcaption.split(" ")


def test_sample_subcaptions_counts_and_determinism():
    first = sample_subcaptions(SENTENCES, 8, rng=random.Random(3))
    again = sample_subcaptions(SENTENCES, 8, rng=random.Random(3))
    assert first == again and len(first) == 8
    many = sample_subcaptions(SENTENCES, 300, rng=0)
    lengths = [len(_parts(c)) for c in many]
    assert set(lengths) == {1, 2, 3}
    for caption in many:
        parts = _parts(caption)
        assert len(set(parts)) == len(parts)  # never a repeated sentence
        assert set(parts) <= set(SENTENCES)


def test_sample_subcaptions_windows_include_the_last_one():
    windows = sample_subcaptions(SENTENCES, 400, 2, 2, rng=1, consecutive=1.0)
    starts = {SENTENCES.index(_parts(w)[0]) for w in windows}
    assert starts == {0, 1, 2, 3}  # the FLAIR code's off-by-one would never draw start 3
    for window in windows:
        a, b = _parts(window)
        assert SENTENCES.index(b) == SENTENCES.index(a) + 1


def test_sample_subcaptions_random_positions_keep_caption_order_and_short_captions():
    scattered = sample_subcaptions(SENTENCES, 300, 2, 2, rng=2, consecutive=0.0)
    gaps = {SENTENCES.index(_parts(c)[1]) - SENTENCES.index(_parts(c)[0]) for c in scattered}
    assert min(gaps) > 0  # in caption order, never repeated
    assert any(g > 1 for g in gaps)  # not only windows
    assert sample_subcaptions(["Only.", "Two."], 3, 3, 3, rng=0) == ["Only. Two."] * 3


LONG = [f"S{i}." for i in range(7)]


def test_sample_subcaptions_statistics_over_many_draws():
    """FLAIR 3.1 with the defaults: K = 8 per image, s ~ U{1, 2, 3}, half windows (every start,
    the last included, equally often), half scattered sentences in caption order."""
    rng = random.Random(0)
    draws = [sample_subcaptions(LONG, rng=rng) for _ in range(1500)]
    assert {len(d) for d in draws} == {8}  # K per image
    captions = [c for d in draws for c in d]  # 12,000 sub-captions
    positions = [[LONG.index(p) for p in _parts(c)] for c in captions]
    lengths = [len(p) for p in positions]
    for s in (1, 2, 3):  # s spread evenly over 1-3
        assert abs(lengths.count(s) / len(lengths) - 1 / 3) < 0.02
    for pos in positions:
        assert pos == sorted(pos) and len(set(pos)) == len(pos)  # caption order, no repeat
    for s in (2, 3):
        of_s = [p for p in positions if len(p) == s]
        windows = [p for p in of_s if p == list(range(p[0], p[0] + s))]
        # scattered picks are windows by chance in (n - s + 1) / C(n, s) of the cases
        chance = (len(LONG) - s + 1) / math.comb(len(LONG), s)
        assert abs(len(windows) / len(of_s) - (0.5 + 0.5 * chance)) < 0.04
        starts = Counter(p[0] for p in windows)
        assert set(starts) == set(range(len(LONG) - s + 1))  # every start, the last one included
        expected = len(windows) / (len(LONG) - s + 1)
        assert all(abs(count - expected) < 0.25 * expected for count in starts.values())
    singles = Counter(p[0] for p in positions if len(p) == 1)
    assert set(singles) == set(range(len(LONG)))


def test_sample_subcaptions_windows_only_draw_every_start_evenly():
    windows = sample_subcaptions(LONG, 6000, 3, 3, rng=5, consecutive=1.0)
    starts = Counter(LONG.index(_parts(w)[0]) for w in windows)
    assert sorted(starts) == [0, 1, 2, 3, 4]  # the FLAIR code never draws start 4 = n - s
    assert all(abs(c / 6000 - 1 / 5) < 0.02 for c in starts.values())
    assert sample_subcaptions(LONG, rng=1) == sample_subcaptions(LONG, rng=1)
    assert sample_subcaptions(LONG, rng=1) != sample_subcaptions(LONG, rng=2)


def test_sample_subcaptions_refuses_a_string():
    with pytest.raises(TypeError, match="single characters"):
        sample_subcaptions("A dog. A cat.", 2)


def test_as_sentence_list_accepts_lists_and_arrays():
    assert as_sentence_list(["A dog. ", "", "  ", "A cat."], field="raw_caption") == ["A dog.", "A cat."]
    assert as_sentence_list(("A dog.",), field="raw_caption") == ["A dog."]
    np = pytest.importorskip("numpy")
    assert as_sentence_list(np.array(["A dog.", "A cat."], dtype=object), field="f") == ["A dog.", "A cat."]
    assert as_sentence_list([], field="f") == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("A dog on the grass. A red ball.", "'long_IB_captions' holds a str where a list of sentences"),
        (b"A dog.", "'long_IB_captions' holds a bytes"),
        (None, "'long_IB_captions' must be a list of sentences, got NoneType"),
        (["A dog.", 3], "'long_IB_captions': item 1 is a int"),
    ],
)
def test_as_sentence_list_names_the_field_of_a_string_caption(value, message):
    with pytest.raises(TypeError, match=message):
        as_sentence_list(value, field="long_IB_captions")
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="holds a str"):
        as_sentence_list(np.array("A dog. A cat."), field="long_IB_captions")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sentences": [], "k": 2}, "at least one"),
        ({"sentences": ["  "], "k": 2}, "at least one"),
        ({"sentences": SENTENCES, "k": 0}, "k"),
        ({"sentences": SENTENCES, "k": 2, "min_s": 0}, "min_s"),
        ({"sentences": SENTENCES, "k": 2, "min_s": 3, "max_s": 2}, "min_s"),
        ({"sentences": SENTENCES, "k": 2, "consecutive": 1.5}, "probability"),
    ],
)
def test_sample_subcaptions_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample_subcaptions(**kwargs)


def test_first_sentence_follows_long_clip_split():
    assert first_sentence("A red car. A blue sky. Trees.") == "A red car"
    assert first_sentence("  Just one sentence.  ") == "Just one sentence."
    assert first_sentence("No period at all") == "No period at all"
    assert first_sentence("Mr. Smith waves. Hi") == "Mr"  # exactly caption.split(". ")[0]
    assert first_sentence("Version 2.5 is out. More") == "Version 2.5 is out"


def test_as_captions_takes_one_or_several_and_names_what_is_not_text():
    import numpy as np

    from finetune.data.text import as_captions, lone_surrogate

    assert as_captions("A dog.") == ["A dog."]
    assert as_captions(["A dog.", ""]) == ["A dog.", ""]
    assert as_captions(np.array(["a", "b"])) == ["a", "b"]
    for value, message in [(42, r"the caption is a number \(42\), not text"), (None, "the caption is null"),
                           (False, r"a boolean \(false\)"), ({"en": "x"}, "a mapping"),
                           (["ok", 3.5], r"caption 1 of the list is a number \(3\.5\)")]:
        with pytest.raises(TypeError, match=message):
            as_captions(value)
    with pytest.raises(ValueError, match=r"caption 1 of the list holds a lone surrogate \(U\+DC00"):
        as_captions(["fine", "half \udc00 pair"])
    assert lone_surrogate({"caption": "ok", "image": ["x\ud83d"]}) == "U+D83D"
    assert lone_surrogate("a paired \U0001F600 emoji") is None
