"""StructXLIP's lexicon filter: structure-centric captions T' = F(T, V^a).

StructXLIP (paper 3.1 "Textual extraction", Supp. Mat. B.1-B.3) removes appearance terms (colours
and materials) from a caption with case-insensitive, whole-word regular expressions built from an
LLM-generated vocabulary V^a (Fig. 5), then cleans up the text (redundant spaces and punctuation,
conjunctions left without their words) and reverts to the original caption when too little
content remains.

How this implementation reads B.2 (the paper gives the rule, not the code):

- One compiled alternation of every term, longest first (multi-word terms before their words),
  with ``\\s+`` between the words of a term, factored as a prefix tree and applied in a single
  scan of the lower-cased caption; the text is then rebuilt around the matches in one pass.
- Whole words only: plurals and derived forms are *kept* ("reds", "reddish", "stones"), as the
  whole-word rule implies. Homographs of the vocabulary are removed wherever they occur as whole
  words ("dark", "down", "felt", "tan", "glass", "iron", "paper", "stone", ...): "sat down" becomes
  "sat", exactly as the paper's filter does.
- Hyphenated compounds containing a term: when the last part is a term, or every part is a term
  or a conjunction, the whole compound is removed ("navy-blue", "blue-green", "off-white",
  "black-and-white"); otherwise only the term parts go ("red-brick" -> "brick", "wood-framed" ->
  "framed"). The public code leaves stray hyphens ("-brick", "-").
- Clean-up: coordinated removed terms collapse with their commas and conjunctions ("a blue and
  white pattern" -> "a pattern", "red, green and blue balls" -> "balls", "cats and dogs" is
  untouched); a conjunction or comma left between a removed term and the start of a clause or an
  article goes ("a red and round ball" -> "a round ball"), so does one left before the end of a
  clause ("round and red." -> "round."); "a"/"an" is fixed when the next word changed ("an orange
  ball" -> "a ball"); a sentence-initial capital is kept ("Red cars park." -> "Cars park.");
  repeated spaces and punctuation are collapsed. Captions without any match are returned as-is.
- Revert: when fewer than ``min_content_words`` words outside a small stop-word list remain, the
  original caption is returned unchanged and ``reverted`` is set. The paper gives no number; the
  default 1 reverts only captions left without any content word ("Red and blue." -> ""), so that
  "a blue and white pattern" -> "a pattern" (B.2's example) stands. The public code uses 2
  (``min_content_tokens``), which reverts that example; set ``min_content_words: 2`` for it.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_LEXICON",
    "DEFAULT_LEXICON_FILE",
    "FilterResult",
    "LexiconFilter",
    "lexicon_example_fn",
    "lexicon_stats",
    "load_lexicon",
    "parse_lexicon",
]

DEFAULT_LEXICON_FILE = "appearance_lexicon.txt"
"""Name of the packaged data file holding the Fig. 5 vocabulary (``finetune/preprocess/``)."""

# A match starts at the character before the term: any whitespace or ASCII/typographic punctuation
# (the input is prefixed with a space, so a term can start the caption). Starting on a literal
# character class lets `re` skip ahead quickly instead of testing `\b` at every position; with the
# prefix tree below, one pass over a 120-word caption takes about ten microseconds.
_LEAD = "[\\s!-/:-@\\[-^`{-~\u00ab\u00bb\u2013\u2014\u2018-\u201f]"
_CONJ = "(?i:and|or|nor|&)"
# What may join two removed terms of one coordination ("blue and white", "red, green, and blue").
_SEP = re.compile(rf"\s*,\s*(?:{_CONJ}\s+)?|\s+{_CONJ}\s+|\s*/\s*|\s+")
# After a removed term at a clause start or after an article: its comma and conjunction go too.
_FOLLOWING_JOINER = re.compile(rf"(?:\s*,)?(?:\s+{_CONJ}(?=\s))?")
# Before a removed term at a clause end: a conjunction (with its comma) left dangling goes too.
_TRAILING_CONJ = re.compile(rf"(?:\s*,)?\s+{_CONJ}\Z")
_COMPOUND_HEAD = re.compile(r"(?:\w+-)+\Z")
_SPACE = " \t"
_CLAUSE_START = frozenset(".;:!?(,")
_SENTENCE_END = frozenset(".!?")
_CLOSING = frozenset(",.;:!?)")

_WORD = re.compile(r"[^\W\d_]+")
_STOP_WORDS = frozenset(
    """a an the and or nor but of in on at to with by for from as is are was were be been being it
    its this that these those there their they them which who while into onto over under near
    behind above below has have had very also some""".split()
)
_CONJ_WORDS = frozenset({"and", "or", "nor", "&"})
_ARTICLES = frozenset({"a", "an", "the"})
_VOWELS = frozenset("aeiouAEIOU")


@dataclass
class FilterResult:
    """What :meth:`LexiconFilter.filter` did to one caption.

    Attributes:
        text: the structure-centric caption T' (the original when ``reverted``).
        removed: the lexicon terms that matched, lower-case, in order of appearance (also filled
            when ``reverted``: they are what the filter found).
        reverted: True when the filtered text kept fewer than ``min_content_words`` content words
            and the original caption was returned instead.
        categories: the category of each entry of ``removed`` (same length), for B.3 statistics.
        n_words: number of (whitespace-separated) words of the original caption.
    """

    text: str
    removed: list[str]
    reverted: bool
    categories: list[str] = field(default_factory=list)
    n_words: int = 0

    @property
    def modified(self) -> bool:
        """True when the returned text differs from the caption because terms were removed."""
        return bool(self.removed) and not self.reverted


def _normalise_term(term: str) -> str:
    return " ".join(term.split()).lower()


def parse_lexicon(text: str, *, source: str = "<string>", default_category: str = "other") -> dict[str, str]:
    """Parse a lexicon file's text into ``{term: category}``.

    Format: one term per line, ``# comments``, and ``[category]`` lines that set the category of
    the terms that follow (``default_category`` before the first one).

    Raises:
        ValueError: naming ``source`` and the line, for an empty category or a term without any
            letter or digit.
    """
    lexicon: dict[str, str] = {}
    category = default_category
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            category = line[1:-1].strip().lower()
            if not category:
                raise ValueError(f"{source}:{lineno}: empty category name '[]'; write e.g. '[colour]'.")
            continue
        term = _normalise_term(line)
        if not re.search(r"\w", term):
            raise ValueError(
                f"{source}:{lineno}: {raw.strip()!r} is not a term (no letter or digit); "
                "write one term per line."
            )
        lexicon.setdefault(term, category)
    return lexicon


def load_lexicon(path: str | Path, *, default_category: str = "other") -> dict[str, str]:
    """Read a lexicon file (format of :func:`parse_lexicon`) into ``{term: category}``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the file holds no term or a malformed line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"lexicon file {str(path)!r} not found; set `lexicon.file` to an existing text file "
            "with one term per line (see finetune/preprocess/appearance_lexicon.txt)."
        )
    lexicon = parse_lexicon(path.read_text(encoding="utf-8"), source=str(path), default_category=default_category)
    if not lexicon:
        raise ValueError(f"lexicon file {str(path)!r} holds no term; write one term per line.")
    return lexicon


def _default_lexicon() -> dict[str, str]:
    text = resources.files(__package__).joinpath(DEFAULT_LEXICON_FILE).read_text(encoding="utf-8")
    return parse_lexicon(text, source=DEFAULT_LEXICON_FILE)


DEFAULT_LEXICON: Mapping[str, str] = _default_lexicon()
"""The Fig. 5 vocabulary as ``{term: "colour" | "material"}`` (106 terms)."""


def _trie_alternation(terms: Iterable[str]) -> str:
    r"""One regex alternation of ``terms`` factored as a prefix tree, longest alternatives first.

    Equivalent to ``"|".join(sorted(terms, key=len, reverse=True))`` (with ``\s+`` between the words
    of a term) but tried in time proportional to the term's length instead of the vocabulary's
    size. Greedy optional tails make the longer term win ("navy blue" over "navy", "blackish" over
    "black"); the trailing ``\b`` of the caller backtracks to the shorter one when needed.
    """
    trie: dict = {}
    for term in terms:
        node = trie
        for char in " ".join(term.split()):
            node = node.setdefault(char, {})
        node[""] = {}

    def emit(node: dict) -> str:
        branches = [
            (r"\s+" if char == " " else re.escape(char)) + emit(child)
            for char, child in sorted(node.items())
            if char
        ]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" in node:
            return "(?:" + body + ")?"
        return body

    return emit(trie)


def _build_regex(terms: Iterable[str], *, ignore_case: bool) -> re.Pattern[str]:
    # Matches the lead character, the term as a whole word, and any hyphenated tail ("red-brick").
    flags = re.IGNORECASE if ignore_case else 0
    return re.compile(rf"{_LEAD}(?:{_trie_alternation(terms)})\b(?:-\w++)*", flags)


class LexiconFilter:
    """The lexicon filter F(T, V^a) of StructXLIP (paper 3.1; Supp. Mat. B.1, B.2).

    Args:
        lexicon: ``{term: category}``; default :data:`DEFAULT_LEXICON` (Fig. 5).
        file: a lexicon file that *replaces* ``lexicon`` (format of :func:`parse_lexicon`).
        extra_terms: terms added to the vocabulary: a mapping ``{term: category}`` or strings,
            each ``"term"`` (category ``"other"``) or ``"term:category"``.
        min_content_words: revert to the original caption when fewer content words (words
            outside a small stop-word list) remain; 0 never reverts.
        categories: only remove terms of these categories (e.g. ``("colour",)``, what the public
            code trains with); ``None`` removes every term.

    Calling the filter returns the filtered text; :meth:`filter` also says what was removed.
    """

    def __init__(
        self,
        lexicon: Mapping[str, str] | None = None,
        *,
        file: str | Path | None = None,
        extra_terms: Mapping[str, str] | Iterable[str] = (),
        min_content_words: int = 1,
        categories: Sequence[str] | None = None,
    ) -> None:
        base = dict(load_lexicon(file) if file is not None else (lexicon if lexicon is not None else DEFAULT_LEXICON))
        base = {_normalise_term(t): c for t, c in base.items()}
        base.update(self._parse_extra(extra_terms))
        if isinstance(min_content_words, bool) or not isinstance(min_content_words, int) or min_content_words < 0:
            raise ValueError(f"lexicon.min_content_words must be an integer >= 0, got {min_content_words!r}.")
        if categories is not None:
            if isinstance(categories, str):
                categories = (categories,)
            wanted = {c.lower() for c in categories}
            unknown = wanted - set(base.values())
            if unknown:
                raise ValueError(
                    f"lexicon.categories names {sorted(unknown)}, which no term has; "
                    f"the lexicon's categories are {sorted(set(base.values()))}."
                )
            base = {t: c for t, c in base.items() if c in wanted}
        if not base:
            raise ValueError("the lexicon is empty: give `lexicon.file`, `lexicon.extra_terms` or keep the default.")
        self.lexicon: dict[str, str] = base
        self.min_content_words = min_content_words
        self.categories = tuple(sorted(set(base.values())))
        self._regex = _build_regex(base, ignore_case=False)
        self._regex_ci: re.Pattern[str] | None = None

    @staticmethod
    def _parse_extra(extra: Mapping[str, str] | Iterable[str]) -> dict[str, str]:
        if isinstance(extra, str):
            raise ValueError(f"lexicon.extra_terms must be a list of terms, got the string {extra!r}.")
        items = extra.items() if isinstance(extra, Mapping) else (
            (e.rsplit(":", 1) if ":" in e else (e, "other")) for e in extra
        )
        out: dict[str, str] = {}
        for term, category in items:
            norm = _normalise_term(term)
            if not re.search(r"\w", norm):
                raise ValueError(f"lexicon.extra_terms: {term!r} is not a term (no letter or digit).")
            out[norm] = category.strip().lower() or "other"
        return out

    def params(self) -> dict:
        """The settings that determine the output, for cache keys (a hash of the vocabulary)."""
        vocab = "\n".join(f"{t}\t{c}" for t, c in sorted(self.lexicon.items()))
        return {
            "vocabulary_sha256": hashlib.sha256(vocab.encode()).hexdigest(),
            "min_content_words": self.min_content_words,
        }

    def __call__(self, caption: str) -> str:
        """Return the structure-centric caption T' of ``caption``."""
        return self.filter(caption).text

    def filter(self, caption: str) -> FilterResult:
        """Filter one caption.

        Returns:
            :class:`FilterResult` with the filtered text, the removed terms and their
            categories, whether it reverted, and the original's word count.

        Raises:
            TypeError: when ``caption`` is not a string.
        """
        if not isinstance(caption, str):
            raise TypeError(f"LexiconFilter expects a caption string, got {type(caption).__name__}.")
        matches, removed = self._find(caption)
        n_words = len(caption.split())
        categories = [self.lexicon.get(t, "other") for t in removed]
        if not matches:
            return FilterResult(caption, removed, False, categories, n_words)
        text = _rebuild(caption, matches)
        if self.min_content_words and not _has_content_words(text, self.min_content_words):
            return FilterResult(caption, removed, True, categories, n_words)
        return FilterResult(text, removed, False, categories, n_words)

    def _find(self, caption: str) -> tuple[list[tuple[int, int, str | None]], list[str]]:
        """Spans of the terms in ``caption``: ``(start, end, kept)``, ``kept`` None when the whole
        span goes, else the non-appearance part of a hyphenated compound ("red-brick" -> "brick")."""
        lowered = caption.lower()
        if len(lowered) == len(caption):
            found = self._regex.finditer(" " + lowered)
        else:  # lower-casing changed the length (rare Unicode): match the original, ignoring case
            if self._regex_ci is None:
                self._regex_ci = _build_regex(self.lexicon, ignore_case=True)
            found = self._regex_ci.finditer(" " + caption)
        lexicon = self.lexicon
        matches: list[tuple[int, int, str | None]] = []
        removed: list[str] = []
        for m in found:
            # In caption coordinates the lead character is at m.start() - 1 and the term at m.start().
            start, end = m.start(), m.end() - 1
            if start > 0 and caption[start - 1] == "-":
                prev_end = matches[-1][1] if matches else 0
                head = _COMPOUND_HEAD.search(caption, prev_end, start)
                if head:
                    start = head.start()
            span = caption[start:end]
            if "-" not in span:
                term = span.lower()
                removed.append(term if term.isalpha() else _normalise_term(term))
                matches.append((start, end, None))
                continue
            parts, norm, is_term = _compound_parts(span, lexicon)
            removed.extend(p for p, t in zip(norm, is_term) if t)
            if is_term[-1] or all(t or p in _CONJ_WORDS for p, t in zip(norm, is_term)):
                matches.append((start, end, None))
            else:
                kept = "-".join(p for p, n, t in zip(parts, norm, is_term) if not t and n not in _CONJ_WORDS)
                matches.append((start, end, kept))
        return matches, removed

    def filter_batch(self, captions: Sequence[str]) -> list[FilterResult]:
        """:meth:`filter` over a list of captions."""
        return [self.filter(c) for c in captions]

    def __repr__(self) -> str:
        return (
            f"LexiconFilter({len(self.lexicon)} terms, categories={list(self.categories)}, "
            f"min_content_words={self.min_content_words})"
        )


def _ends_with_word(text: str, words: frozenset[str]) -> bool:
    """True when the last word of ``text`` (no trailing space) is one of ``words`` (lower-case)."""
    cut = text.rfind(" ") + 1
    return text[cut:].lower() in words


def _compound_parts(span: str, lexicon: Mapping[str, str]) -> tuple[list[str], list[str], list[bool]]:
    """Split a hyphenated span into parts, joining neighbours that form a hyphenated term
    ("gore-tex"), longest first: ``(parts, normalised parts, is_term)``."""
    pieces = span.split("-")
    parts: list[str] = []
    i = 0
    while i < len(pieces):
        for j in range(len(pieces), i, -1):
            candidate = "-".join(pieces[i:j])
            if j == i + 1 or _normalise_term(candidate) in lexicon:
                parts.append(candidate)
                i = j
                break
    norm = [_normalise_term(p) for p in parts]
    return parts, norm, [p in lexicon for p in norm]


def _fix_article(left: str, next_char: str) -> str:
    """Turn a trailing "a"/"an" of ``left`` into the form that fits a word starting with ``next_char``."""
    if left[-1:] not in ("a", "n", "A", "N") or not next_char.isalpha():
        return left
    cut = left.rfind(" ") + 1
    word = left[cut:]
    if word not in ("a", "an", "A", "An", "AN"):
        return left
    return left[:cut] + word[0] + ("n" if next_char in _VOWELS else "")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    return pos


def _rebuild(caption: str, matches: list[tuple[int, int, str | None]]) -> str:
    """Remove the matched spans from ``caption`` and repair the text around them (paper B.2).

    Consecutive removed terms joined only by commas, conjunctions, slashes or spaces form one run,
    removed with their joiners. Each run is then repaired locally: joiners left at a clause
    start or after an article, or before a clause end, go; the article before it is fixed; a
    sentence-initial capital moves to the next word; spaces and punctuation around it are merged.
    """
    pieces: list[str] = []
    pos = 0
    i, n = 0, len(matches)
    while i < n:
        start, end, kept = matches[i]
        capital = caption[start].isupper()
        while kept is None and i + 1 < n and _SEP.fullmatch(caption, end, matches[i + 1][0]):
            i += 1
            _, end, kept = matches[i]
        i += 1
        before = caption[pos:start]
        left = before.rstrip(_SPACE)
        if not left and pieces:  # the run follows the previous one's repair directly
            before = pieces.pop() + before
            left = before.rstrip(_SPACE)
        if kept is not None:
            fixed = _fix_article(left, kept[:1])
            pieces.append(fixed + before[len(left):])
            pieces.append(kept[0].upper() + kept[1:] if capital and kept else kept)
            pos = end
            continue
        last = left[-1:]
        if not left or last in _CLAUSE_START or (last.isalpha() and _ends_with_word(left, _ARTICLES)):
            end = _FOLLOWING_JOINER.match(caption, end).end()
        pos = _skip_space(caption, end)
        nxt = caption[pos : pos + 1]
        if (not nxt or nxt in _CLOSING) and last in ("d", "r", "&", "D", "R"):
            conj = _TRAILING_CONJ.search(left, max(0, len(left) - 8))
            if conj:
                left = left[: conj.start()]
        # Punctuation left doubled or orphaned by the removal.
        while nxt and nxt in ",.;" and (not left or left[-1] in ".!?;,:("):
            if left and left[-1] in ",:" and nxt in ".;":
                left = left[:-1]
                break
            pos = _skip_space(caption, pos + 1)
            nxt = caption[pos : pos + 1]
        if left[-1:] == "(" and nxt == ")":
            left = left[:-1].rstrip(_SPACE)
            pos = _skip_space(caption, pos + 1)
            nxt = caption[pos : pos + 1]
        left = _fix_article(left, nxt)
        if capital and nxt and (not left or left[-1] in _SENTENCE_END):
            pieces.append(left + (" " if left else "") + nxt.upper())
            pos += 1
        elif not nxt or nxt in _CLOSING or nxt in "\r\n" or not left or left[-1] in "(\n":
            pieces.append(left)
        else:
            pieces.append(left + " ")
    pieces.append(caption[pos:])
    return "".join(pieces).strip()


def _has_content_words(text: str, minimum: int) -> bool:
    count = 0
    for m in _WORD.finditer(text):
        if m.group().lower() not in _STOP_WORDS:
            count += 1
            if count >= minimum:
                return True
    return False


def lexicon_stats(results: Iterable[FilterResult]) -> dict:
    """The B.3 statistics of the lexicon filter over a set of captions (paper Supp. Mat. B.3, Fig. 6).

    A caption counts as modified when terms were removed and it was not reverted. Word counts
    count the words of each removed term ("navy blue" = 2).

    Returns:
        ``captions``, ``modified`` / ``modified_share`` (panel A), ``reverted`` /
        ``reverted_share``, ``removed_words_per_caption`` (mean over all captions) and
        ``removed_words_per_modified_caption`` (panel C), ``removed_share_of_length`` (mean over
        modified captions of removed words / original words, panel C's percentage),
        ``category_counts`` and ``category_share`` (removed words per category over modified
        captions, panel B).
    """
    n = modified = reverted = 0
    words_all = 0
    shares: list[float] = []
    per_category: Counter[str] = Counter()
    for r in results:
        n += 1
        if r.reverted:
            reverted += 1
        if not r.modified:
            continue
        modified += 1
        words = [len(t.split()) for t in r.removed]
        words_all += sum(words)
        if r.n_words:
            shares.append(sum(words) / r.n_words)
        for w, c in zip(words, r.categories):
            per_category[c] += w
    total = sum(per_category.values())
    return {
        "captions": n,
        "modified": modified,
        "modified_share": modified / n if n else 0.0,
        "reverted": reverted,
        "reverted_share": reverted / n if n else 0.0,
        "removed_words_per_caption": words_all / n if n else 0.0,
        "removed_words_per_modified_caption": words_all / modified if modified else 0.0,
        "removed_share_of_length": sum(shares) / len(shares) if shares else 0.0,
        "category_counts": dict(sorted(per_category.items())),
        "category_share": {c: v / total for c, v in sorted(per_category.items())} if total else {},
    }


def lexicon_example_fn(
    lexicon: LexiconFilter | None = None,
    *,
    caption_column: str = "caption",
    output_column: str = "filtered_caption",
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function for ``datasets.Dataset.map(batched=True)`` or a collate: adds T' per caption.

    ``fn(batch)`` returns ``{output_column: [T', ...], "lexicon_removed": [[term, ...], ...],
    "lexicon_reverted": [bool, ...]}`` for ``batch[caption_column]``.

    Raises:
        KeyError: naming ``caption_column`` when the batch lacks it.
    """
    lexicon = lexicon or LexiconFilter()

    def fn(batch: dict[str, Any]) -> dict[str, Any]:
        if caption_column not in batch:
            raise KeyError(f"the lexicon filter needs the column {caption_column!r}; the batch has {sorted(batch)}.")
        results = [lexicon.filter(c) for c in batch[caption_column]]
        return {
            output_column: [r.text for r in results],
            "lexicon_removed": [r.removed for r in results],
            "lexicon_reverted": [r.reverted for r in results],
        }

    return fn
