"""StructXLIP's data side (paper 3.1-3.2, Supp. Mat. B): the chunks of a caption (the paper's split, or the
public code's sliding windows), the regions of an image that are encoded, and the ``datasets.map``
functions of :meth:`finetune.objectives.structxlip.term.StructXLIPTerm.preprocess` (lexicon-filtered
captions, edge maps). The term (:mod:`finetune.objectives.structxlip.term`) runs them."""

from __future__ import annotations

import math
import re
from typing import Any

from finetune.data.text import split_sentences

#: columns the preprocessing adds (besides ``edges`` and the region columns of ``finetune.preprocess.regions``)
LEXICON_COLUMNS = ("filtered_caption", "lexicon_removed", "lexicon_categories", "lexicon_reverted", "caption_words")
#: bump when the preprocessing code changes its output (part of every cache key)
CODE_VERSION = "2"  # 2: chunks from finetune.data.text.split_sentences


# -- chunks, regions, boxes --------------------------------------------------------------------------
_CLAUSE = re.compile(r"[.,;!?]+")
_WORDS = re.compile(r"\b\w+\b")
#: the public code's window: 2 words for clauses of <= 4 words, then w, w+1, w+2, w+3 with w = 3
_WINDOW_STEPS = ((4, 2), (10, 3), (20, 4), (40, 5))
_MAX_WINDOWS = 64


def official_chunks(text: str) -> list[str]:
    """Chunks as the StructXLIP public code makes them (``compat: official``; notes section 2): the caption
    split into clauses at ``[.,;!?]``, and in each clause a sliding word window with stride 1 whose size
    depends on the clause's word count n (2 if n <= 4, 3 if n <= 10, 4 if n <= 20, 5 if n <= 40, else 6);
    a clause shorter than its window is one chunk; at most 64 chunks per caption.

    Sentence boundaries come from :func:`finetune.data.text.split_sentences` (so a line break or ``</s>``
    ends a clause too, and no window spans two sentences); inside a sentence the clause split is the
    public code's, which also cuts at commas and at the periods of "3.5" or "e.g.".

    Example: ``"A tall tree, a bench."`` -> ``["A tall", "tall tree", "a bench"]``.
    """
    out: list[str] = []
    for sentence in split_sentences(text):
        for clause in _CLAUSE.split(sentence):
            words = _WORDS.findall(clause)
            n = len(words)
            if not n:
                continue
            window = next((w for limit, w in _WINDOW_STEPS if n <= limit), 6)
            if n <= window:
                out.append(" ".join(words))
            else:
                out.extend(" ".join(words[i : i + window]) for i in range(n - window + 1))
            if len(out) >= _MAX_WINDOWS:
                return out[:_MAX_WINDOWS]
    return out


def select_regions(topk: list[list[int]], scores: list[list[float]], per_image: int | None) -> list[int]:
    """The regions of one image that are encoded: every region that is among some chunk's top-K, ranked by
    how many chunks have it (then by its best cosine), the first ``per_image`` of them.

    Args:
        topk: ``(M, k')`` region indices of each chunk, most similar first.
        scores: ``(M, k')`` their cosine similarities under the frozen model.
        per_image: how many to keep; ``None`` keeps all of them.

    Returns:
        Region indices (into the image's region list), best first.
    """
    votes: dict[int, int] = {}
    best: dict[int, float] = {}
    for row, row_scores in zip(topk, scores):
        for r, s in zip(row, row_scores):
            votes[r] = votes.get(r, 0) + 1
            best[r] = max(best.get(r, -math.inf), s)
    ranked = sorted(votes, key=lambda r: (-votes[r], -best[r], r))
    return ranked if per_image is None else ranked[:per_image]


class DefaultRegionSegmenter:
    """Segmenter without a model: every image gets the default regions (4 quadrants + centre), marked as a
    fallback (``regions.checkpoint: null``)."""

    def params(self) -> dict[str, Any]:
        """Cache-key parameters."""
        return {"segmenter": "default_regions"}

    def __call__(self, images: list[Any]) -> list[Any]:
        from finetune.preprocess.regions import RegionProposals, default_regions

        return [RegionProposals(default_regions(*im.size), True) for im in images]


class _LexiconColumns:
    """``datasets.map`` function (batched): the filtered caption and what was removed."""

    def __init__(self, lexicon: Any) -> None:
        self.lexicon = lexicon

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        results = [self.lexicon.filter(c or "") for c in batch["caption"]]
        return {
            "filtered_caption": [r.text for r in results],
            "lexicon_removed": [r.removed for r in results],
            "lexicon_categories": [r.categories for r in results],
            "lexicon_reverted": [r.reverted for r in results],
            "caption_words": [r.n_words for r in results],
        }


class _EdgeColumn:
    """``datasets.map`` function (batched): the edge map of each image, stored as a one-channel PNG."""

    def __init__(self, cfg: Any, num_threads: int | None = None) -> None:
        self.cfg = cfg
        self.num_threads = num_threads

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        import os
        from concurrent.futures import ThreadPoolExecutor

        from PIL import Image

        from finetune.preprocess.edges import edge_array

        images = batch["image"]
        threads = min(self.num_threads or os.cpu_count() or 1, len(images)) or 1
        if threads > 1:
            with ThreadPoolExecutor(max_workers=threads) as pool:  # OpenCV releases the GIL
                arrays = list(pool.map(lambda im: edge_array(im, self.cfg), images))
        else:
            arrays = [edge_array(im, self.cfg) for im in images]
        return {"edges": [Image.fromarray(a) for a in arrays]}
