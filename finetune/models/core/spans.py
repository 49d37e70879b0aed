"""Sentence token spans: where each sentence of a caption lies in ``DualEncoder.tokenize``'s ids.

The implementations behind :meth:`finetune.models.core.encoder.DualEncoder.sentence_spans` (FAST-GOAL's TSL
pools the token states of a sentence's span): through a transformers fast tokenizer's
``offset_mapping`` (:func:`spans_by_offsets`), or for any tokenizer by tokenising the caption sentence
by sentence (:func:`spans_by_pieces`). Sentences are those of
:func:`finetune.data.text.split_sentences`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from finetune.data.text import sentence_offsets
from finetune.models.core.tokens import TokenizedText
from finetune.models.core.tokens import special_suffix_length, truncate_keep_end

__all__ = ["Span", "spans_by_offsets", "spans_by_pieces"]

Span = tuple[int, int]


def _tokenize_untracked(model: Any, texts: list[str]) -> TokenizedText:
    """``model.tokenize(texts)`` without counting the texts in ``model.truncation_stats`` (sentences and
    caption prefixes are not captions a run trains on)."""
    saved = dict(model.truncation_stats)
    try:
        return model.tokenize(texts)
    finally:
        model.truncation_stats.clear()
        model.truncation_stats.update(saved)


def _real_rows(tok: TokenizedText) -> list[tuple[int, list[int]]]:
    """Per row: the position of its first real (unpadded) token and its real ids."""
    rows = []
    for ids, mask in zip(tok.input_ids.tolist(), tok.attention_mask.tolist()):
        real = [i for i, m in enumerate(mask) if m]
        first = real[0] if real else 0
        rows.append((first, ids[first : first + len(real)]))
    return rows


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _special_layout(model: Any) -> tuple[int, int]:
    """How many special tokens ``model.tokenize`` puts before and after a caption's content: what two
    one-letter captions share at their start and at their end."""
    for a, b in (("a", "b"), ("x", "z")):
        (_, ids_a), (_, ids_b) = _real_rows(_tokenize_untracked(model, [a, b]))
        if ids_a != ids_b:
            n_prefix = _common_prefix(ids_a, ids_b)
            n_end = _common_prefix(ids_a[::-1], ids_b[::-1])
            return n_prefix, min(n_end, min(len(ids_a), len(ids_b)) - n_prefix - 1)
    raise ValueError(f"sentence_spans: {type(model).__name__}.tokenize gives the same ids to 'a' and 'b'")


def _tokenize_content(model: Any, texts: list[str], layout: tuple[int, int]) -> list[tuple[list[int], bool]]:
    """Content ids (special tokens removed) and truncation flag of each text; a blank text has no
    tokens (whatever placeholder a tokenizer gives an empty caption)."""
    n_prefix, n_end = layout
    out: list[tuple[list[int], bool]] = [([], False)] * len(texts)
    todo = [i for i, text in enumerate(texts) if text.strip()]
    if todo:
        tok = _tokenize_untracked(model, [texts[i] for i in todo])
        for i, (_, ids), cut in zip(todo, _real_rows(tok), tok.truncated.tolist()):
            out[i] = (ids[n_prefix : len(ids) - n_end], bool(cut))
    return out


def spans_by_pieces(model: Any, captions: list[str]) -> list[list[Span | None]]:
    """:meth:`DualEncoder.sentence_spans` for any tokenizer, through ``model.tokenize`` alone.

    Each caption is cut into its sentences (:func:`finetune.data.text.sentence_offsets`) and the text
    between them; every piece is tokenised on its own, and where the pieces' content ids (special tokens
    removed) concatenate to the caption's content ids each sentence's range is read off the running
    length. A tokenizer that merges tokens across a sentence boundary (a sentence glued to a ``</s>``
    separator, "dog.</s>") breaks the concatenation; for such a caption each boundary is placed by
    tokenising the caption up to it (:func:`_spans_by_prefixes`).
    """
    offsets = [sentence_offsets(caption) for caption in captions]
    row_tok = _tokenize_untracked(model, list(captions))
    rows, row_cut = _real_rows(row_tok), row_tok.truncated.tolist()
    layout = n_prefix, n_end = _special_layout(model)

    pieces: list[str] = []  # per caption: gap, sentence, gap, sentence, ..., trailing gap
    for caption, ranges in zip(captions, offsets):
        previous = 0
        for start, end in ranges:
            pieces += [caption[previous:start], caption[start:end]]
            previous = end
        pieces.append(caption[previous:])
    piece_tokens = _tokenize_content(model, pieces, layout)

    result: list[list[Span | None]] = []
    k = 0
    for caption, ranges, (first, real), truncated in zip(captions, offsets, rows, row_cut):
        kept = real[n_prefix : len(real) - n_end]
        base = first + n_prefix
        spans: list[Span | None] = []
        position, consistent, overflow = 0, True, False
        for j in range(2 * len(ranges) + 1):
            ids, cut = piece_tokens[k + j]
            is_sentence = j % 2 == 1
            if overflow or cut:  # a piece longer than the context: it and everything after are cut
                overflow = True
                if is_sentence:
                    spans.append(None)
                continue
            if ids[: max(len(kept) - position, 0)] != kept[position : position + len(ids)]:
                consistent = False
            if is_sentence:
                end = position + len(ids)
                spans.append((base + position, base + end) if position < end <= len(kept) else None)
            position += len(ids)
        k += 2 * len(ranges) + 1
        if not truncated:
            consistent = consistent and not overflow and position == len(kept)
        result.append(spans if consistent else _spans_by_prefixes(model, caption, ranges, kept, base, layout))
    return result


def _spans_by_prefixes(
    model: Any, caption: str, ranges: list[Span], kept: list[int], base: int, layout: tuple[int, int]
) -> list[Span | None]:
    """Sentence ranges from tokenising ``caption`` up to each boundary: a boundary whose prefix gives a
    prefix of the caption's content ids ``kept`` is exact; otherwise the token at the first difference
    straddles the boundary and is left out of the sentence's range; a boundary past ``kept`` (cut by
    truncation) gives ``None``."""
    prefixes = _tokenize_content(model, [caption[:b] for start, end in ranges for b in (start, end)], layout)
    bounds: list[tuple[int, int] | None] = []  # (as a start, as an end)
    for ids, cut in prefixes:
        lcp = _common_prefix(ids, kept)
        if cut or (lcp == len(kept) and len(ids) > len(kept)):
            bounds.append(None)
        elif lcp == len(ids):
            bounds.append((lcp, lcp))
        else:
            bounds.append((lcp + 1, lcp))
    spans: list[Span | None] = []
    for i in range(len(ranges)):
        start, end = bounds[2 * i], bounds[2 * i + 1]
        if start is None or end is None or start[0] >= end[1]:
            spans.append(None)
        else:
            spans.append((base + start[0], base + end[1]))
    return spans


def spans_by_offsets(model: Any, tokenizer: Any, captions: list[str]) -> list[list[Span | None]]:
    """:meth:`DualEncoder.sentence_spans` for a transformers fast tokenizer that reads the captions as
    they are (no clean-up first): a sentence's range holds the tokens whose characters
    (``offset_mapping``) lie inside the sentence; special tokens (a ``</s>`` that the tokenizer reads as
    its own end token included) belong to no sentence."""
    row_tok = _tokenize_untracked(model, list(captions))
    encoded = tokenizer(
        list(captions), add_special_tokens=True, truncation=False, padding=False, verbose=False,
        return_offsets_mapping=True, return_special_tokens_mask=True,
    )
    n_end = special_suffix_length(tokenizer)
    result: list[list[Span | None]] = []
    for i, ((first, real), truncated) in enumerate(zip(_real_rows(row_tok), row_tok.truncated.tolist())):
        full = encoded["input_ids"][i]
        if truncate_keep_end(full, len(real), n_end)[0] != real or truncated != (len(full) > len(real)):
            raise RuntimeError(
                f"sentence_spans: the offsets' tokens of caption {i} are not those of tokenize(); "
                "this backend's tokenize() changes the ids, so its spans need spans_by_pieces"
            )
        kept = len(real) - n_end if truncated else len(full)  # positions < kept are in the row
        tokens = [
            (p, a, b)
            for p, ((a, b), special) in enumerate(zip(encoded["offset_mapping"][i], encoded["special_tokens_mask"][i]))
            if not special and b > a
        ]
        spans: list[Span | None] = []
        for start, end in sentence_offsets(captions[i]):
            inside = [p for p, a, b in tokens if a >= start and b <= end]
            if not inside or inside[-1] >= kept:
                spans.append(None)
            else:
                spans.append((first + inside[0], first + inside[-1] + 1))
        result.append(spans)
    return result
