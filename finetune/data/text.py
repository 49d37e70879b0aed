"""Caption text utilities: sentence splitting, token-budget chunking, sub-caption sampling.

Long captions are handled sentence by sentence by several methods: FLAIR samples sub-captions of
1-3 sentences (FLAIR paper, section 3 and implementation details), Long-CLIP aligns the first
sentence with a PCA-reduced image embedding (its primary-component matching;
``caption.split(". ")[0]`` in its public code), StructXLIP and F-CAST cut captions into chunks
of sentences. These helpers are the one place where a caption becomes sentences.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

__all__ = [
    "split_sentences",
    "sentence_offsets",
    "chunk_sentences",
    "sample_subcaptions",
    "as_sentence_list",
    "as_captions",
    "lone_surrogate",
    "first_sentence",
    "balanced_chunks",
    "random_chunks",
]

# Words that end in a period without ending the sentence when followed by a capital or digit
# ("Mr. Smith", "Fig. 3", "e.g. Paris"). Lower-case followers never end a sentence anyway, so
# "etc." is left out on purpose: "plates, etc. The table" is two sentences.
_ABBREVIATIONS = frozenset(
    {
        "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "ft", "fig", "figs", "no", "nos",
        "vol", "vs", "cf", "e.g", "i.e", "approx", "ca", "inc", "ltd", "co", "corp", "dept", "gen",
        "gov", "capt", "lt", "col", "sgt", "rev", "hon", "mx", "al", "jan", "feb", "mar", "apr",
        "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "ave", "blvd", "rd", "est",
    }
)
# Hard breaks: line breaks (captions put paragraphs on their own lines) and "</s>", the separator
# between the captions of an image in FLAIR's training data (its code splits at r"\n|</s>|[.]").
_HARD_BREAK = re.compile(r"</s>|\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
# A terminator run with its closing quotes/brackets, followed by whitespace: a candidate boundary.
# The whitespace lookahead is what keeps decimals ("3.5") and "U.S." inside a word together.
_BOUNDARY = re.compile(r"(?P<stop>[.!?…]+)[\"'”’)\]]*(?=\s)")
_LAST_WORD = re.compile(r"(\S+)$")
_INITIAL = re.compile(r"[a-z]")  # "J. K. Rowling"
_DOTTED_ACRONYM = re.compile(r"[a-z](?:\.[a-z])+")  # "U.S", "a.m" (the final period is cut off)


def _period_does_not_end(text_before: str) -> bool:
    """True when the word that ends at a period is a known abbreviation, an initial ("J.") or a
    dotted acronym ("U.S.")."""
    match = _LAST_WORD.search(text_before)
    if match is None:
        return False
    word = match.group(1).lstrip("\"'“‘([").rstrip(".").lower()
    if word in _ABBREVIATIONS:
        return True
    if _INITIAL.fullmatch(word):
        return True
    return bool(_DOTTED_ACRONYM.fullmatch(word))


def _line_sentences(text: str, begin: int, stop: int) -> list[tuple[int, int]]:
    """Sentence ranges of ``text[begin:stop]``, a stretch without hard breaks."""
    ranges: list[tuple[int, int]] = []
    line = text[begin:stop]
    start = 0
    for match in _BOUNDARY.finditer(line):
        end = match.end()
        rest = line[end:].lstrip()
        if not rest:
            continue
        if rest[0].islower():  # "on the mat. then it slept": a lower-case word continues the sentence
            continue
        # only a single period can close an abbreviation: "Z..." or "Dr?" end the sentence
        if match.group("stop") == "." and _period_does_not_end(line[start : match.start() + 1]):
            continue
        ranges.append((begin + start, begin + end))
        start = end
    ranges.append((begin + start, begin + len(line)))
    return ranges


def sentence_offsets(text: str) -> list[tuple[int, int]]:
    """Character ranges of the sentences of ``text``: the splitter of :func:`split_sentences`.

    Args:
        text: a caption.
    Returns:
        ``[(start, end), ...]`` half-open character ranges, in order, one per sentence of
        :func:`split_sentences`: ``text[start:end]`` is that sentence (no surrounding whitespace).
    """
    if not isinstance(text, str):
        raise TypeError(f"split_sentences expects a str, got {type(text).__name__}")
    ranges: list[tuple[int, int]] = []
    begin = 0
    for stop, after in [(m.start(), m.end()) for m in _HARD_BREAK.finditer(text)] + [(len(text), len(text))]:
        for start, end in _line_sentences(text, begin, stop):
            piece = text[start:end]
            lead = len(piece) - len(piece.lstrip())
            trail = len(piece) - len(piece.rstrip())
            if end - trail > start + lead:
                ranges.append((start + lead, end - trail))
        begin = after
    return ranges


def split_sentences(text: str) -> list[str]:
    """Split a caption into sentences, keeping each sentence's own punctuation.

    The one sentence splitter of the toolkit (FLAIR sub-captions, StructXLIP chunks, DOCCI-FG,
    :meth:`finetune.models.core.encoder.DualEncoder.sentence_spans`). A sentence ends at ``.``, ``!``,
    ``?`` or ``…`` (plus closing quotes or brackets) followed by whitespace and a character that
    is not lower-case, unless the word before a single period is a known abbreviation ("Mr.",
    "Dr.", "Fig.", "e.g."), an initial ("J.") or a dotted acronym ("U.S."); an ellipsis ("...",
    "…") always ends the sentence before a capital. Decimals ("3.5 cm") never split since no
    whitespace follows their period. A line break and FLAIR's caption separator ``</s>`` always
    end a sentence (``</s>`` itself is dropped); a missing final period is fine.

    Args:
        text: a caption (any length; may be empty).
    Returns:
        the non-empty sentences, stripped, in order (``text[a:b]`` for each range of
        :func:`sentence_offsets`). ``" ".join(result)`` restores the text up to whitespace and
        ``</s>`` separators.
    """
    return [text[start:end] for start, end in sentence_offsets(text)]


def chunk_sentences(
    sentences: Sequence[str], max_tokens: int, count_tokens: Callable[[str], int]
) -> list[str]:
    """Group consecutive sentences into chunks that fit a token budget (greedy, order kept).

    A generic utility, not a paper's method: it cuts a long caption into pieces that a 77-token
    text encoder reads whole (e.g. to encode a caption chunk by chunk). F-CAST's random and
    balanced chunking (F-CAST appendix C) count sentences instead and live with that method.
    A sentence is added to the current chunk while
    ``count_tokens(chunk + " " + sentence) <= max_tokens``;
    a single sentence longer than the budget becomes a chunk of its own (the tokenizer then
    truncates it), so no text is ever dropped here.

    Args:
        sentences: the sentences in caption order (e.g. from :func:`split_sentences`).
        max_tokens: the budget per chunk, as counted by ``count_tokens`` (include special
            tokens in the count if the encoder's limit includes them).
        count_tokens: maps a text to its number of tokens.
    Returns:
        the chunks, each the space-joined sentences it holds; ``" ".join(result)`` equals
        ``" ".join(sentences)``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    chunks: list[str] = []
    current = ""
    for sentence in sentences:
        sentence = sentence.strip()
        if not sentence:
            continue
        candidate = f"{current} {sentence}" if current else sentence
        if current and count_tokens(candidate) > max_tokens:
            chunks.append(current)
            current = sentence
        else:
            current = candidate
    if current:
        chunks.append(current)
    return chunks


def _as_rng(rng: random.Random | int | None) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    if rng is None or isinstance(rng, int):
        return random.Random(rng)
    raise TypeError(f"rng must be a random.Random, an int seed or None, got {type(rng).__name__}")


def sample_subcaptions(
    sentences: Sequence[str],
    k: int = 8,
    min_s: int = 1,
    max_s: int = 3,
    rng: random.Random | int | None = None,
    *,
    consecutive: float = 0.5,
    join: Callable[[list[str]], str] | None = None,
) -> list[str]:
    """Sample FLAIR's K diverse sub-captions of a long caption (FLAIR paper, section 3).

    For each of the ``k`` sub-captions independently (duplicates across sub-captions are
    possible, as in the FLAIR code): draw ``s`` uniformly in ``[min_s, max_s]`` (capped at the
    number of sentences; a caption of at most ``s`` sentences is taken whole); with probability
    ``consecutive`` take a window of ``s`` consecutive sentences (every window start equally
    likely, the last one included), otherwise ``s`` distinct sentences from random positions,
    kept in caption order ("either randomly sampled, i.e. independently sampled and
    concatenated, or extracted as a consecutive sequence"; implementation details: K=8, S=3;
    the FLAIR code uses K=10 for YFCC15M and Merged-30M). The FLAIR code's window off-by-one
    (the last window never drawn), its random order of sampled sentences and its repeated
    sentences when a caption has fewer than ``s`` sentences are not reproduced.
    ``consecutive=1.0`` gives windows only, ``0.0`` scattered sentences only.

    Args:
        sentences: the caption's sentences (a non-empty list; :func:`as_sentence_list` checks a
            data field before it gets here).
        k: number of sub-captions K (FLAIR: 8; 10 for YFCC15M and Merged-30M).
        min_s, max_s: the range of sentences per sub-caption (FLAIR: 1 and 3).
        rng: a ``random.Random`` (for reproducible sampling in a data loader), a seed, or None.
        consecutive: probability that a sub-caption is a consecutive window.
        join: turns a sub-caption's sentences into its text; None: joined by a space
            (``finetune.objectives.flair.join_public_code`` is the FLAIR code's ``". "``).
    Returns:
        ``k`` sub-captions, each the joined sentences it holds.
    """
    if isinstance(sentences, str):
        raise TypeError("sample_subcaptions expects a list of sentences, got a str (it would sample "
                        "single characters); split it with split_sentences or check it with as_sentence_list")
    items = [s.strip() for s in sentences if s and s.strip()]
    if not items:
        raise ValueError("sample_subcaptions needs at least one non-empty sentence")
    if k < 1:
        raise ValueError(f"k (number of sub-captions) must be at least 1, got {k}")
    if min_s < 1 or max_s < min_s:
        raise ValueError(f"need 1 <= min_s <= max_s, got min_s={min_s}, max_s={max_s}")
    if not 0.0 <= consecutive <= 1.0:
        raise ValueError(f"consecutive is a probability in [0, 1], got {consecutive}")
    generator = _as_rng(rng)
    n = len(items)
    result = []
    for _ in range(k):
        s = min(generator.randint(min_s, max_s), n)
        if s == n:
            chosen = items
        elif generator.random() < consecutive:
            start = generator.randint(0, n - s)
            chosen = items[start : start + s]
        else:
            chosen = [items[i] for i in sorted(generator.sample(range(n), s))]
        result.append(join(list(chosen)) if join is not None else " ".join(chosen))
    return result


def as_sentence_list(value: object, *, field: str) -> list[str]:
    """A data field that must hold pre-split sentences, checked: FLAIR's re-captioned shards
    store each caption field as a list of sentences.

    A string where a list was expected is the FLAIR code's silent failure: its sampler then
    draws single characters and the model trains to chance (its issue #6). Here it is an error
    naming the field.

    Args:
        value: the field's value: a list or tuple of str (a numpy array or any other
            non-string sequence of str, as parquet/webdataset decoders return, is accepted).
        field: the field's name, for the error message (e.g. ``"long_IB_captions"``).

    Returns:
        The sentences, stripped, empty ones dropped (the list may be empty).

    Raises:
        TypeError: ``value`` is a string, bytes, None, not a sequence, or holds non-strings.
    """
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str, bytes)):
        value = value.tolist()  # numpy arrays (a 0-d string array becomes a str: caught below)
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"caption field {field!r} holds a {type(value).__name__} where a list of sentences was "
            f"expected (starting {str(value)[:40]!r}); store the field pre-split (a list of sentences), "
            "or split it with finetune.data.text.split_sentences"
        )
    if not isinstance(value, Sequence):
        raise TypeError(f"caption field {field!r} must be a list of sentences, got {type(value).__name__}")
    sentences = []
    for i, sentence in enumerate(value):
        if not isinstance(sentence, str):
            raise TypeError(f"caption field {field!r}: item {i} is a {type(sentence).__name__}, "
                            "expected a sentence (str)")
        if sentence.strip():
            sentences.append(sentence.strip())
    return sentences


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def lone_surrogate(value: object) -> str | None:
    """The first lone surrogate (``"\\ud800"``, a JSON escape with no pair) in a string, or in the strings
    of a list / mapping, as ``"U+D800"``; None when there is none. Such a string is not valid text: it
    cannot be written as UTF-8 (Arrow, tokenizers and files all refuse it)."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return f"U+{ord(match.group()):04X}" if match else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in [*(value.keys() if isinstance(value, dict) else ()), *items]:
        found = lone_surrogate(item)
        if found:
            return found
    return None


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def as_captions(value: object) -> list[str]:
    """The captions of one example as a list, wherever one caption is accepted: a string is one caption,
    a list (tuple, numpy array) of strings is several (DOCCI-style multi-caption rows).

    Args:
        value: a caption field's value.
    Returns:
        the captions, as given (possibly empty strings: emptiness is the caller's check).
    Raises:
        TypeError: the value is null, a number, a boolean or a mapping, or a list holds one of those
            (the message names what it is, and the list item).
        ValueError: a caption holds a lone surrogate (:func:`lone_surrogate`).
    """
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str, bytes)):
        value = value.tolist()  # numpy arrays
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"the caption is {_kind(value)}, not text; write it as a string (or a list of strings for "
                        "several captions)")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"caption {i} of the list is {_kind(item)}, not text; a caption list holds strings")
        bad = lone_surrogate(item)
        if bad:
            where = "the caption" if isinstance(value, str) else f"caption {i} of the list"
            raise ValueError(f"{where} holds a lone surrogate ({bad}, an unpaired \\u escape), which is not valid "
                             "text; fix the escape")
    return list(items)


def first_sentence(text: str) -> str:
    """The short caption Long-CLIP pairs with its PCA-reduced image features (primary-component matching).

    Follows the public Long-CLIP training code, ``caption.split(". ")[0]``: everything before
    the first ". " (the trailing period of a one-sentence caption is kept, as there), stripped.
    Unlike :func:`split_sentences` it does not know abbreviations; it is kept simple on purpose
    so that the short-caption loss sees what Long-CLIP trained on.

    Args:
        text: a caption.
    Returns:
        the first sentence (the whole text when it has no ". ").
    """
    if not isinstance(text, str):
        raise TypeError(f"first_sentence expects a str, got {type(text).__name__}")
    return text.strip().split(". ")[0].strip()


def balanced_chunks(sentences: Sequence[str], n: int) -> list[list[str]]:
    """F-CAST's balanced chunking for inference (F-CAST, appendix C): ``n`` chunks of consecutive sentences,
    each ``floor(L / n)`` sentences, the ``L mod n`` remaining ones going to the first chunks in order
    (L = 6, n = 4 -> sizes [2, 2, 1, 1]; L = 11 -> [3, 3, 3, 2]). With ``L < n`` the last ``n - L`` chunks
    are empty (the encoder masks them).

    Args:
        sentences: the caption's L sentences, in order (:func:`split_sentences`).
        n: number of chunks N (F-CAST: 4).
    Returns:
        ``n`` lists of sentences whose concatenation is ``sentences``.
    """
    if n < 1:
        raise ValueError(f"balanced_chunks: n (number of chunks) must be at least 1, got {n}")
    items = list(sentences)
    base, extra = divmod(len(items), n)
    chunks, start = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        chunks.append(items[start:start + size])
        start += size
    return chunks


def random_chunks(sentences: Sequence[str], n: int, rng: random.Random | int | None = None,
                  *, max_per_chunk: int = 3) -> list[list[str]]:
    """F-CAST's random chunking for training (F-CAST, appendix C): ``n`` chunks of 1 to ``max_per_chunk``
    (3) consecutive sentences, the number chosen at random.

    - ``L < n``: every sentence makes a chunk of its own, in order, and the remaining ``n - L`` chunks get
      one sentence each drawn uniformly with replacement ("randomly resampled with replacement until all
      chunks are filled");
    - ``n <= L <= 3n``: every sentence is used once, in order; chunk k's size is drawn uniformly among the
      sizes in [1, 3] that still let the remaining chunks hold the remaining sentences (1 to 3 each);
    - ``L > 3n``: each size is drawn uniformly in [1, 3] and the sentences after the last chunk are discarded
      (no chunk may hold more than three sentences).

    Args:
        sentences: the caption's L >= 1 sentences, in order.
        n: number of chunks N (F-CAST: 4).
        rng: a ``random.Random``, a seed or None.
        max_per_chunk: most sentences per chunk (3 in the paper).
    Returns:
        ``n`` non-empty lists of sentences.
    """
    items = [s for s in sentences if s and s.strip()]
    if not items:
        raise ValueError("random_chunks needs at least one non-empty sentence")
    if n < 1 or max_per_chunk < 1:
        raise ValueError(f"random_chunks: need n >= 1 and max_per_chunk >= 1, got n={n}, "
                         f"max_per_chunk={max_per_chunk}")
    generator = _as_rng(rng)
    total = len(items)
    if total < n:
        return [[s] for s in items] + [[generator.choice(items)] for _ in range(n - total)]
    chunks, start = [], 0
    for k in range(n):
        left = n - k - 1  # chunks after this one
        if total > max_per_chunk * n:
            low, high = 1, max_per_chunk
        else:
            remaining = total - start
            low = max(1, remaining - max_per_chunk * left)
            high = min(max_per_chunk, remaining - left)
        size = generator.randint(low, high)
        chunks.append(items[start:start + size])
        start += size
    return chunks
