"""F-CAST chunking (F-CAST appendix C): balanced chunks at inference, random chunks in training."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from finetune.data.text import balanced_chunks, random_chunks

S = [f"s{i}." for i in range(20)]


@pytest.mark.parametrize("length, sizes", [(6, [2, 2, 1, 1]), (11, [3, 3, 3, 2]), (4, [1, 1, 1, 1]),
                                           (8, [2, 2, 2, 2]), (2, [1, 1, 0, 0])])
def test_balanced_chunks_sizes_and_order(length, sizes):
    chunks = balanced_chunks(S[:length], 4)
    assert [len(c) for c in chunks] == sizes
    assert [s for c in chunks for s in c] == S[:length]


def test_balanced_chunks_rejects_zero_chunks():
    with pytest.raises(ValueError, match="n"):
        balanced_chunks(S[:3], 0)


def test_random_chunks_fewer_sentences_than_chunks_resamples_with_replacement():
    for seed in range(50):
        chunks = random_chunks(S[:2], 4, random.Random(seed))
        assert len(chunks) == 4 and all(len(c) == 1 for c in chunks)
        assert chunks[0] == ["s0."] and chunks[1] == ["s1."]  # every sentence is used, in order
        assert all(c[0] in S[:2] for c in chunks[2:])
    drawn = Counter(random_chunks(S[:2], 4, random.Random(seed))[3][0] for seed in range(200))
    assert set(drawn) == {"s0.", "s1."}  # both sentences get resampled


def test_random_chunks_one_sentence_per_chunk_when_l_equals_n():
    for seed in range(20):
        assert random_chunks(S[:4], 4, seed) == [["s0."], ["s1."], ["s2."], ["s3."]]


@pytest.mark.parametrize("length", [5, 7, 9, 12])
def test_random_chunks_between_n_and_3n_use_every_sentence_once_in_order(length):
    seen_sizes = set()
    for seed in range(100):
        chunks = random_chunks(S[:length], 4, random.Random(seed))
        assert len(chunks) == 4 and all(1 <= len(c) <= 3 for c in chunks)
        assert [s for c in chunks for s in c] == S[:length]
        seen_sizes.add(tuple(len(c) for c in chunks))
    if length < 12:
        assert len(seen_sizes) > 1  # the sizes are random


def test_random_chunks_more_than_3n_discards_the_excess():
    sizes = Counter()
    for seed in range(200):
        chunks = random_chunks(S[:15], 4, random.Random(seed))
        assert len(chunks) == 4 and all(1 <= len(c) <= 3 for c in chunks)
        flat = [s for c in chunks for s in c]
        assert flat == S[:len(flat)] and len(flat) <= 12  # consecutive from the start, the rest discarded
        sizes.update(len(c) for c in chunks)
    assert set(sizes) == {1, 2, 3}


def test_random_chunks_is_reproducible_and_rejects_empty():
    assert random_chunks(S[:9], 4, 3) == random_chunks(S[:9], 4, 3)
    with pytest.raises(ValueError, match="sentence"):
        random_chunks([], 4, 0)
