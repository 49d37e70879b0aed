"""Regions that the dataset provides (StructXLIP ``regions.source: dataset``): each example's own boxes and the
sentence each describes (the synthetic scenes, DCI), linked to the chunks of the filtered caption instead of matched
by the frozen encoders (:class:`DatasetRegionLinks`; the segmenter's regions are :mod:`finetune.preprocess.regions`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from finetune.preprocess.regions import _callable_name, region_features, split_chunks

__all__ = ["DatasetRegionLinks", "chunk_sentence_indices"]

_WORD = re.compile(r"\w+")


def chunk_sentence_indices(chunks: Sequence[str], sentences: Sequence[str]) -> list[int]:
    """The index of the dataset sentence each chunk of the *filtered* caption comes from.

    The lexicon filter only deletes words, so the words of the chunks, in order, are a subsequence
    of the words of ``sentences``, in order: each chunk word is matched to the next equal word of the
    original (case-insensitive), and a chunk belongs to the sentence of its first matched word. A
    filtered sentence that lost every word has no chunk, and the chunks after it keep their own
    sentence (the reason to align instead of counting chunks).

    Args:
        chunks: ``(M,)`` chunks of the filtered caption (:func:`split_chunks`).
        sentences: ``(S,)`` the original caption's sentences as the dataset gives them.

    Returns:
        ``(M,)`` sentence indices, ``-1`` for a chunk none of whose words is found.

    Example: sentences ``["A red cat sits.", "A blue dog runs."]``, chunks ``["A cat sits", "A dog
    runs"]`` -> ``[0, 1]``; chunks ``["A dog runs"]`` (the first sentence filtered away) -> ``[1]``.
    """
    words = [(w.lower(), i) for i, s in enumerate(sentences) for w in _WORD.findall(s)]
    out: list[int] = []
    pos = 0
    for chunk in chunks:
        first = -1
        for word in (w.lower() for w in _WORD.findall(chunk)):
            j = next((j for j in range(pos, len(words)) if words[j][0] == word), None)
            if j is None:  # a word the original lacks (a filter that rewrote it): skip it, keep the place
                continue
            if first < 0:
                first = words[j][1]
            pos = j + 1
        out.append(first)
    return out


class DatasetRegionLinks:
    """Batched ``datasets.map`` function for ``regions.source: dataset``: the regions and the chunk-to-region
    links a dataset provides, instead of a segmenter and the frozen model's top-K (StructXLIP 3.2 with the
    ground truth as R_m^K).

    The dataset gives, per example, ``sentences`` (the caption's sentences, ``" ".join(sentences)`` being
    the caption up to whitespace) and ``objects``, a list of ``{"box": [x1, y1, x2, y2], "sentence_index":
    i}`` (the synthetic scenes, ``finetune.data.synthetic``; DCI with ``options.caption: complete``, its
    masks' bounds linked to the first sentence of their mask's line). Every object's box is a region; the
    chunks of the filtered caption (``chunker``) are mapped to their sentence (:func:`chunk_sentence_indices`)
    and a chunk's positives are the objects of that sentence (at most ``k``, in object order). Chunks that
    describe no object (a preamble, a relation, the scene) have no positive and are left out, as eq. 1 has
    nothing to pull them to.

    Returns the columns of :func:`region_features`: ``region_boxes`` ``(R, 4)``, ``region_fallback``
    (False), ``chunks`` (the linked chunks), ``chunk_topk`` ``(M, <=k)`` region indices and
    ``chunk_topk_scores`` (1.0 for every link).
    """

    def __init__(self, *, k: int = 3, chunker: Callable[[str], list[str]] = split_chunks,
                 caption_column: str = "filtered_caption") -> None:
        if k < 1:
            raise ValueError(f"regions.k must be >= 1, got {k}.")
        self.k = k
        self.chunker = chunker
        self.caption_column = caption_column

    def params(self) -> dict[str, Any]:
        """Everything that determines the output, for :func:`finetune.data.cache.cached_map`."""
        return {"source": "dataset", "k": self.k, "chunker": _callable_name(self.chunker),
                "caption_column": self.caption_column}

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in region_features()}
        for caption, sentences, objects in zip(batch[self.caption_column], batch["sentences"], batch["objects"]):
            chunks = self.chunker(caption or "")
            owners = chunk_sentence_indices(chunks, sentences or [])
            boxes = []
            for obj in objects or []:
                box = [float(v) for v in obj["box"]]
                if len(box) != 4 or box[2] <= box[0] or box[3] <= box[1]:
                    raise ValueError(f"regions.source: dataset: an object's box must be [x1, y1, x2, y2] with "
                                     f"x2 > x1 and y2 > y1, got {obj['box']!r}")
                boxes.append(box)
            kept, topk = [], []
            for chunk, sentence in zip(chunks, owners):
                linked = [r for r, obj in enumerate(objects or []) if sentence >= 0
                          and obj.get("sentence_index") == sentence][: self.k]
                if linked:
                    kept.append(chunk)
                    topk.append(linked)
            out["region_boxes"].append(boxes)
            out["region_fallback"].append(False)
            out["chunks"].append(kept)
            out["chunk_topk"].append(topk)
            out["chunk_topk_scores"].append([[1.0] * len(row) for row in topk])
        return out
