"""FLISM's matching (FAST-GOAL III-A steps 3-4, eqs. 1-2; Table VIII): crops and sentences encoded by the
frozen model, every sentence matched to its most similar crop, the best pair(s) per image kept, once per dataset
and cached (:func:`compute_flism`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from finetune.data.text import split_sentences
from finetune.data.cache import cached_map
from finetune.preprocess.regions import Box, _encode_in_batches, crop_box

from .detectors import DatasetBoxes, candidate_boxes, clip_to_input

__all__ = ["FLISMMatcher", "Pair", "compute_flism", "flism_features", "match_sentences", "select_pairs", "CODE_VERSION"]


#: bump when the matching code changes its output (part of every cache key)
CODE_VERSION = "2"
#: the keys of ``image_transform_params`` that decide where a box lands (part of the cache key)
_GEOMETRY_KEYS = ("mode", "size", "crop", "patch_size", "crop_offset", "max_num_patches")


def match_sentences(sentence_embeds: Tensor, crop_embeds: Tensor) -> tuple[Tensor, Tensor]:
    """Every sentence's most similar crop (FAST-GOAL eqs. 1-2 and the max-similarity matching of III-A).

    Args:
        sentence_embeds: ``(M, D)`` t_l,i^cls of the image's sentences (raw; normalised here).
        crop_embeds: ``(N, D)`` v_l,i^cls of its candidate crops.

    Returns:
        ``(index (M,) int64, similarity (M,) float32)``: the best crop of each sentence and its cosine.
    """
    if sentence_embeds.ndim != 2 or crop_embeds.ndim != 2 or sentence_embeds.shape[1] != crop_embeds.shape[1]:
        raise ValueError(f"match_sentences expects (M, D) sentences and (N, D) crops, got "
                         f"{tuple(sentence_embeds.shape)} and {tuple(crop_embeds.shape)}")
    if not crop_embeds.shape[0]:
        raise ValueError("match_sentences: an image needs at least one candidate crop")
    sims = F.normalize(sentence_embeds.float(), dim=-1) @ F.normalize(crop_embeds.float(), dim=-1).T
    best, index = sims.max(dim=1)
    return index, best


@dataclass
class Pair:
    """One kept global-local pair: ``sentence`` index into ``split_sentences(caption)``, ``candidate`` index into
    the image's candidates, their cosine ``similarity`` and the pair's loss ``weight``."""

    sentence: int
    candidate: int
    similarity: float
    weight: float


def select_pairs(sentences: Sequence[int], candidates: Sequence[int], similarities: Sequence[float], *,
                 pairs: int = 1, weighting: str = "uniform") -> list[Pair]:
    """The kept pairs of one image from its matched (sentence, crop) pairs: the ``pairs`` most similar (paper:
    the single best; Table VIII: top 3), padded to exactly ``pairs`` by repeating the last one.

    Args:
        sentences, candidates, similarities: the matched pairs (one per sentence).
        pairs: how many to keep.
        weighting: ``uniform`` (each ``1 / m`` for the m real pairs) or ``weighted`` (similarity / sum of the
            kept similarities, negative similarities counted as 0; uniform when all are <= 0).

    Returns:
        ``pairs`` :class:`Pair` s, most similar first (the real ones, then repeats of the last with weight 0),
        or ``[]`` when there is no matched pair.
    """
    if pairs < 1:
        raise ValueError(f"regions.pairs must be >= 1, got {pairs}")
    if weighting not in ("uniform", "weighted"):
        raise ValueError(f"regions.weighting must be uniform or weighted, got {weighting!r}")
    order = sorted(range(len(sentences)), key=lambda i: (-similarities[i], sentences[i]))[:pairs]
    if not order:
        return []
    sims = [float(similarities[i]) for i in order]
    positive = [max(s, 0.0) for s in sims]
    if weighting == "weighted" and sum(positive) > 0:
        weights = [p / sum(positive) for p in positive]
    else:
        weights = [1.0 / len(order)] * len(order)
    kept = [Pair(int(sentences[i]), int(candidates[i]), s, w) for i, s, w in zip(order, sims, weights)]
    return kept + [Pair(kept[-1].sentence, kept[-1].candidate, kept[-1].similarity, 0.0)] * (pairs - len(kept))


def flism_features() -> datasets.Features:
    """The ``datasets`` features of the columns :class:`FLISMMatcher` adds (per image)."""
    floats = datasets.Sequence(datasets.Value("float32"))
    ints = datasets.Sequence(datasets.Value("int32"))
    return datasets.Features({
        "flism_candidates": datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
        "flism_candidate_kinds": datasets.Sequence(datasets.Value("string")),
        "flism_num_candidates": datasets.Value("int32"),
        "flism_candidates_clipped": datasets.Value("int32"),
        "flism_candidates_dropped": datasets.Value("int32"),
        "flism_sentences": datasets.Sequence(datasets.Value("string")),
        "flism_sentence_match": ints,
        "flism_sentence_similarity": floats,
        "flism_pair_sentence": ints,
        "flism_pair_candidate": ints,
        "flism_pair_box": datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
        "flism_pair_similarity": floats,
        "flism_pair_weight": floats,
        "flism_num_pairs": datasets.Value("int32"),
    })


def _linked(objects: list[dict[str, Any]] | None, sentences: list[str], dataset_sentences: list[str] | None
            ) -> list[tuple[int, int]]:
    """``(sentence index into sentences, object index)`` of each object whose ``sentence_index`` (into the
    dataset's own ``sentences`` when it has them, else into ``sentences``) names one of ``sentences``."""
    source = dataset_sentences if dataset_sentences is not None else sentences
    out = []
    for c, o in enumerate(objects or []):
        s = o.get("sentence_index")
        if s is None or not 0 <= int(s) < len(source) or source[int(s)] not in sentences:
            continue
        out.append((sentences.index(source[int(s)]), c))
    return out


class FLISMMatcher:
    """Batched ``datasets.map`` function: FLISM's candidates, sentence matches and kept pairs of each example.

    Args:
        proposer: ``images -> boxes per image`` (:class:`YolosDetector`, :class:`UltralyticsDetector`,
            :class:`SamMasks`), a :class:`DatasetBoxes`, or None (the default regions only).
        encode_images: ``list[PIL.Image] -> (n, D)`` under the frozen model as loaded (crops through its processor).
        encode_texts: ``list[str] -> (m, D)`` under the same model.
        model_id: names the frozen model (``finetune.preprocess.frozen.model_fingerprint``), part of the cache key.
        default: add the four quadrants and the centre box (Table VII).
        pairs, weighting: kept pairs per image (:func:`select_pairs`).
        encode_batch_size: crops / sentences per encoder call.
        geometry: the training model's ``image_transform_params()``: candidates are clipped to the part of the
            image its input shows, and those with nothing left there are dropped (both counted); None: the
            whole image counts as seen.

    ``fn(batch)`` returns the columns of :func:`flism_features` per example: the candidates ``(N, 4)`` in original
    pixels (clipped to what the model sees) and their kinds, how many were clipped and dropped, the sentences,
    each sentence's best candidate and cosine (``-1`` / NaN for a sentence without one, e.g. unlinked under
    dataset links), and the kept pairs (sentence index, candidate index, box, similarity, weight).
    """

    def __init__(self, proposer: Any, encode_images: Callable[[list[Image.Image]], Tensor],
                 encode_texts: Callable[[list[str]], Tensor], *, model_id: str, default: bool = True, pairs: int = 1,
                 weighting: str = "uniform", encode_batch_size: int = 64,
                 geometry: dict[str, Any] | None = None) -> None:
        if not model_id:
            raise ValueError("FLISMMatcher needs `model_id` (the frozen model's fingerprint) for its cache key")
        select_pairs([], [], [], pairs=pairs, weighting=weighting)  # validates both
        self.proposer = proposer
        self.encode_images = encode_images
        self.encode_texts = encode_texts
        self.model_id = model_id
        self.default = default
        self.pairs = pairs
        self.weighting = weighting
        self.encode_batch_size = encode_batch_size
        self.geometry = dict(geometry) if geometry is not None else None
        self.linked = isinstance(proposer, DatasetBoxes) and proposer.links

    def params(self) -> dict[str, Any]:
        """Everything that determines the output, for :func:`finetune.data.cache.cached_map`."""
        proposer = self.proposer.params() if self.proposer is not None else {"detector": None}
        geometry = {k: self.geometry.get(k) for k in _GEOMETRY_KEYS} if self.geometry is not None else None
        return {"proposer": proposer, "model_id": self.model_id, "default": self.default and not self.linked,
                "pairs": self.pairs, "weighting": self.weighting, "geometry": geometry}

    def window(self, image: Image.Image) -> Box:
        """The part of ``image`` the model's input shows (the whole image without a ``geometry``)."""
        if self.geometry is None:
            return (0.0, 0.0, float(image.width), float(image.height))
        from finetune.preprocess.geometry import visible_box

        return visible_box(image.width, image.height, self.geometry)

    def survivors(self, image: Image.Image, boxes: Sequence[Box], kinds: Sequence[str]
                  ) -> tuple[list[Box], list[str], dict[int, int], int, int]:
        """The candidates the model's input shows, clipped to it: ``(boxes, kinds, old index -> new index,
        clipped count, dropped count)``."""
        window = self.window(image)
        kept: list[Box] = []
        kept_kinds: list[str] = []
        index: dict[int, int] = {}
        clipped = dropped = 0
        for c, (box, kind) in enumerate(zip(boxes, kinds)):
            inside = clip_to_input(box, window)
            if inside is None:
                dropped += 1
                continue
            clipped += inside != tuple(float(v) for v in box)
            index[c] = len(kept)
            kept.append(inside)
            kept_kinds.append(kind)
        return kept, kept_kinds, index, clipped, dropped

    def propose(self, batch: dict[str, list[Any]], images: list[Image.Image]) -> list[list[Box]]:
        """The proposer's boxes of each image (none without a proposer)."""
        if self.proposer is None:
            return [[] for _ in images]
        if isinstance(self.proposer, DatasetBoxes):
            return self.proposer.boxes(batch, images)
        found = self.proposer(images)
        if len(found) != len(images):
            raise ValueError(f"the detector returned {len(found)} results for {len(images)} images")
        return found

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for column in ("image", "caption"):
            if column not in batch:
                raise KeyError(f"FLISM needs the column {column!r}; the batch has {sorted(batch)}")
        images = [im if im.mode == "RGB" else im.convert("RGB") for im in batch["image"]]
        found = self.propose(batch, images)
        raw = [candidate_boxes(im.width, im.height, f, default=self.default and not self.linked)
               for im, f in zip(images, found)]
        if self.linked:  # only the dataset's boxes: an image without objects has nothing to pair
            raw = [(b, k) if f else ([], []) for (b, k), f in zip(raw, found)]
        # only what survives the model's resize and crop: TSL pools the global image's patches inside the box
        cands, remaps, clipped, dropped = [], [], [], []
        for im, (boxes, kinds) in zip(images, raw):
            kept, kept_kinds, remap, n_clipped, n_dropped = self.survivors(im, boxes, kinds)
            if not kept and not self.linked:
                kept, kept_kinds = [self.window(im)], ["whole_image"]
            cands.append((kept, kept_kinds))
            remaps.append(remap)
            clipped.append(n_clipped)
            dropped.append(n_dropped)
        sentences = [split_sentences(c or "") for c in batch["caption"]]
        crops = [crop_box(im, box) for im, (boxes, _) in zip(images, cands) for box in boxes]
        crop_emb = _encode_in_batches(self.encode_images, crops, self.encode_batch_size)
        sent_emb = _encode_in_batches(self.encode_texts, [s for ss in sentences for s in ss], self.encode_batch_size)
        out: dict[str, list[Any]] = {name: [] for name in flism_features()}
        r0 = s0 = 0
        for i, ((boxes, kinds), sents) in enumerate(zip(cands, sentences)):
            r1, s1 = r0 + len(boxes), s0 + len(sents)
            match = [-1] * len(sents)
            sims = [math.nan] * len(sents)
            if sents and boxes:
                if self.linked:
                    dataset_sentences = batch["sentences"][i] if "sentences" in batch else None
                    for s, obj in _linked(batch["objects"][i], sents, dataset_sentences):
                        c = remaps[i].get(obj)
                        if c is None:  # the object's box is cut away by the model's crop
                            continue
                        cos = F.cosine_similarity(sent_emb[s0 + s], crop_emb[r0 + c], dim=0)
                        match[s], sims[s] = c, float(cos)
                else:
                    index, best = match_sentences(sent_emb[s0:s1], crop_emb[r0:r1])
                    match, sims = index.tolist(), best.tolist()
            matched = [s for s in range(len(sents)) if match[s] >= 0]
            kept = select_pairs(matched, [match[s] for s in matched], [sims[s] for s in matched],
                                pairs=self.pairs, weighting=self.weighting)
            out["flism_candidates"].append([list(b) for b in boxes])
            out["flism_candidate_kinds"].append(list(kinds))
            out["flism_num_candidates"].append(len(boxes))
            out["flism_candidates_clipped"].append(clipped[i])
            out["flism_candidates_dropped"].append(dropped[i])
            out["flism_sentences"].append(sents)
            out["flism_sentence_match"].append(match)
            out["flism_sentence_similarity"].append(sims)
            out["flism_pair_sentence"].append([p.sentence for p in kept])
            out["flism_pair_candidate"].append([p.candidate for p in kept])
            out["flism_pair_box"].append([list(boxes[p.candidate]) for p in kept])
            out["flism_pair_similarity"].append([p.similarity for p in kept])
            out["flism_pair_weight"].append([p.weight for p in kept])
            out["flism_num_pairs"].append(min(len(matched), self.pairs))
            r0, s0 = r1, s1
        return out


def compute_flism(dataset: datasets.Dataset, matcher: FLISMMatcher, *, cache_dir: str | os.PathLike[str] | None = None,
                  batch_size: int = 16, num_proc: int | None = None) -> datasets.Dataset:
    """``dataset`` plus the :class:`FLISMMatcher` columns, computed once and cached (keyed by the dataset, the
    detector, the frozen model and the options)."""
    return cached_map(dataset, matcher, params=matcher.params(), name="flism", cache_dir=cache_dir,
                      code_version=CODE_VERSION, batched=True, batch_size=batch_size, num_proc=num_proc,
                      features=flism_features(), desc="FAST-GOAL FLISM")
