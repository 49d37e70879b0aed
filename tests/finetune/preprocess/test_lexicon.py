"""The lexicon filter (StructXLIP 3.1, B.1-B.3): vocabulary, matching, clean-up, revert, statistics."""

from __future__ import annotations

import pytest

from finetune.preprocess.lexicon import (
    DEFAULT_LEXICON,
    FilterResult,
    LexiconFilter,
    lexicon_example_fn,
    lexicon_stats,
    load_lexicon,
    parse_lexicon,
)


@pytest.fixture(scope="module")
def lex() -> LexiconFilter:
    return LexiconFilter()


def test_default_lexicon_is_fig5():
    assert len(DEFAULT_LEXICON) == 106  # Fig. 5 lists 107 items, "teal" twice
    assert sum(c == "colour" for c in DEFAULT_LEXICON.values()) == 59
    assert sum(c == "material" for c in DEFAULT_LEXICON.values()) == 47
    for term, category in [("red", "colour"), ("navy blue", "colour"), ("dark", "colour"), ("colored", "colour"),
                           ("cotton", "material"), ("down", "material"), ("foam", "material")]:
        assert DEFAULT_LEXICON[term] == category


@pytest.mark.parametrize(
    "caption, expected",
    [
        # B.2's own example and orphaned conjunctions
        ("a blue and white pattern", "a pattern"),
        ("red, green and blue balls", "balls"),
        ("a red, white, and blue flag", "a flag"),
        ("cats and dogs", "cats and dogs"),
        ("a red car and a blue bus", "a car and a bus"),
        ("a red and round ball", "a round ball"),
        ("the ball is round and red.", "the ball is round."),
        # multi-word terms win over their words, any whitespace between the words
        ("a light blue sky with dark gray clouds", "a sky with clouds"),
        ("a navy  blue\tcoat", "a coat"),
        # hyphenated forms
        ("A red-brick wall.", "A brick wall."),
        ("a navy-blue coat and a blue-green vase", "a coat and a vase"),
        ("an off-white wall", "a wall"),
        ("a black-and-white photo", "a photo"),
        ("a dark-colored sky", "a sky"),
        # capitals: case-insensitive, sentence-initial capital kept
        ("Red cars park.", "Cars park."),
        ("A RED CAR.", "A CAR."),
        ("Red-brick walls stand.", "Brick walls stand."),
        ("Red and round balls lie here.", "Round balls lie here."),
        # articles
        ("An orange ball.", "A ball."),
        ("an orange-tiled roof", "a tiled roof"),
        # punctuation
        ("a tan, fluffy dog", "a fluffy dog"),
        ("a round, red, large ball", "a round, large ball"),
        ("The car. Red. The bus.", "The car. The bus."),
        ("a shiny (metal) pole", "a shiny pole"),
        ("In the foreground, a yellow, fluffy cat sits.", "In the foreground, a fluffy cat sits."),
        # whole words only: plurals and derived forms are kept (the paper's word-boundary rule)
        ("reds and reddish tones", "reds and reddish tones"),
        ("two stones and a redwood", "two stones and a redwood"),
        # homographs are removed as whole words, as in the paper
        ("He sat down on a bench.", "He sat on a bench."),
        ("The sky is blue.", "The sky is."),
    ],
)
def test_filter_cases(lex, caption, expected):
    assert lex(caption) == expected


def test_filter_reports_what_was_removed(lex):
    r = lex.filter("A Navy Blue coat, a cotton shirt and a red-brick wall.")
    assert r.text == "A coat, a shirt and a brick wall."
    assert r.removed == ["navy blue", "cotton", "red"]
    assert r.categories == ["colour", "material", "colour"]
    assert not r.reverted and r.modified
    assert r.n_words == 11


def test_all_colour_caption_reverts_to_the_original(lex):
    caption = "Red, green and blue."
    r = lex.filter(caption)
    assert r.reverted and r.text == caption and not r.modified
    assert r.removed == ["red", "green", "blue"]


def test_revert_threshold_comes_from_the_config():
    caption = "A red ball."
    assert LexiconFilter()(caption) == "A ball."
    strict = LexiconFilter(min_content_words=2)  # the public code's value
    r = strict.filter(caption)
    assert r.reverted and r.text == caption
    assert LexiconFilter(min_content_words=0)("Blue.") == ""


@pytest.mark.parametrize("caption", ["", "   ", "no appearance words here"])
def test_captions_without_terms_are_returned_unchanged(lex, caption):
    r = lex.filter(caption)
    assert r == FilterResult(caption, [], False, [], len(caption.split()))


def test_non_string_caption_is_a_type_error(lex):
    with pytest.raises(TypeError, match="caption string"):
        lex.filter(None)


def test_custom_lexicon_file_replaces_the_default(tmp_path):
    path = tmp_path / "fashion.txt"
    path.write_text("# fashion\n[colour]\nfuchsia\nroyal blue\n[material]\ngore-tex\n")
    lex = LexiconFilter(file=path)
    assert lex.lexicon == {"fuchsia": "colour", "royal blue": "colour", "gore-tex": "material"}
    assert lex("a fuchsia Gore-Tex jacket with royal  blue red trim") == "a jacket with red trim"
    assert load_lexicon(path) == lex.lexicon


def test_extra_terms_and_categories():
    lex = LexiconFilter(extra_terms=["chrome:material", "sepia"])
    assert lex.lexicon["chrome"] == "material" and lex.lexicon["sepia"] == "other"
    assert lex("a sepia photo of a chrome car") == "a photo of a car"
    colours_only = LexiconFilter(categories=["colour"])
    assert colours_only("a red wooden chair on a wood floor") == "a wooden chair on a wood floor"
    with pytest.raises(ValueError, match="lexicon.categories"):
        LexiconFilter(categories=["texture"])


def test_params_change_with_the_vocabulary():
    assert LexiconFilter().params() == LexiconFilter().params()
    assert LexiconFilter().params() != LexiconFilter(extra_terms=["sepia"]).params()
    assert LexiconFilter().params() != LexiconFilter(min_content_words=2).params()


def test_bad_lexicon_inputs_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="lexicon.file"):
        LexiconFilter(file=tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no term"):
        load_lexicon(empty)
    with pytest.raises(ValueError, match="bad.txt:2"):
        parse_lexicon("red\n---\n", source="bad.txt")
    with pytest.raises(ValueError, match="min_content_words"):
        LexiconFilter(min_content_words=-1)
    with pytest.raises(ValueError, match="extra_terms"):
        LexiconFilter(extra_terms="red")


def test_lexicon_stats_on_a_hand_made_set(lex):
    results = [
        lex.filter("A red ball on a wood table."),  # 7 words; removes red (colour), wood (material)
        lex.filter("A navy blue car."),  # 4 words; removes "navy blue" = 2 colour words
        lex.filter("A cat sleeps."),  # untouched
        lex.filter("Blue."),  # reverted
    ]
    stats = lexicon_stats(results)
    assert stats["captions"] == 4
    assert stats["modified"] == 2 and stats["modified_share"] == pytest.approx(0.5)
    assert stats["reverted"] == 1 and stats["reverted_share"] == pytest.approx(0.25)
    assert stats["removed_words_per_caption"] == pytest.approx(4 / 4)
    assert stats["removed_words_per_modified_caption"] == pytest.approx(4 / 2)
    assert stats["removed_share_of_length"] == pytest.approx((2 / 7 + 2 / 4) / 2)
    assert stats["category_counts"] == {"colour": 3, "material": 1}
    assert stats["category_share"] == {"colour": pytest.approx(0.75), "material": pytest.approx(0.25)}
    assert lexicon_stats([])["captions"] == 0


def test_lexicon_example_fn_adds_filtered_captions(lex):
    fn = lexicon_example_fn(lex, caption_column="text")
    out = fn({"text": ["A red ball.", "Blue.", "A cat."], "id": [1, 2, 3]})
    assert out == {
        "filtered_caption": ["A ball.", "Blue.", "A cat."],
        "lexicon_removed": [["red"], ["blue"], []],
        "lexicon_reverted": [False, True, False],
    }
    with pytest.raises(KeyError, match="'text'"):
        fn({"caption": ["x"]})
