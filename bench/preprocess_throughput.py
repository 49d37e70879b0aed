"""Throughput of StructXLIP's preprocessing: the lexicon filter and Canny edge maps.

Run ``python bench/preprocess_throughput.py``: prints the numbers and writes
``bench/results/preprocess.json``. Every ratio compares rates measured in the same run:

- lexicon filter: captions/s on DOCCI-length (~120-word) synthetic captions, in one process and in
  two worker processes (what ``datasets.map(num_proc=2)`` gives on 2 cores), against a baseline
  written the way the public StructXLIP filter is described (one case-insensitive ``\\b(?:...)\\b``
  alternation per category, each applied with ``sub``, then whitespace/punctuation regexes), on
  the same Fig. 5 vocabulary. Target: > 15,000 captions/s on 2 cores.
- Canny: images/s of :func:`edge_map` at 224 x 224 and 1024 x 768, one by one and through a
  2-thread pool of :func:`edge_maps`, against bare ``cv2.Canny`` on a ready gray array.

``bench/structxlip.py`` imports :func:`lexicon_throughput` and :func:`canny_throughput`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import sys
import time
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.preprocess.edges import edge_map, edge_maps  # noqa: E402
from finetune.preprocess.lexicon import DEFAULT_LEXICON, LexiconFilter  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "preprocess.json"

_NOUNS = (
    "tree wall building car person dog window door sign road sidewalk fence roof bench lamp pole "
    "cloud bush table chair plate cup flower leaf branch shadow railing corner step pot"
).split()
_ADJECTIVES = "large small tall short round square wide narrow thin thick old curved straight shiny".split()
_PLACES = (
    "to the left of|to the right of|in front of|behind|above|below|next to|on top of|near|"
    "in the middle of|at the edge of"
).split("|")


def docci_like_captions(n: int, *, words: int = 120, seed: int = 0) -> list[str]:
    """``n`` synthetic captions of about ``words`` words in DOCCI's style (layout sentences),
    with appearance terms on about 5 % of the words as in DOCCI (paper B.3: ~7 of ~136), a share
    of them multi-word or hyphenated."""
    rng = random.Random(seed)
    terms = sorted(DEFAULT_LEXICON)

    def appearance() -> str:
        r = rng.random()
        if r < 0.1:
            return f"{rng.choice(terms)}-{rng.choice(_NOUNS)}ed"
        if r < 0.2:
            return f"{rng.choice(terms)} and {rng.choice(terms)}"
        return rng.choice(terms)

    def sentence() -> str:
        words_ = ["A"]
        if rng.random() < 0.5:
            words_.append(rng.choice(_ADJECTIVES))
        if rng.random() < 0.35:
            words_.append(appearance())
        words_ += [rng.choice(_NOUNS), "is", rng.choice(_PLACES), "the"]
        if rng.random() < 0.25:
            words_.append(appearance())
        words_.append(rng.choice(_NOUNS))
        if rng.random() < 0.5:
            words_ += ["and", "a", rng.choice(_ADJECTIVES), rng.choice(_NOUNS)]
        return " ".join(words_) + rng.choice([".", ".", ".", ";", ","])

    captions = []
    for _ in range(n):
        parts: list[str] = []
        count = 0
        while count < words:
            s = sentence()
            parts.append(s)
            count += len(s.split())
        captions.append(" ".join(parts).rstrip(",;") + ".")
    return captions


class PublicStyleFilter:
    """Baseline: the public filter's structure as described in the notes on its code (one
    IGNORECASE alternation per category applied in turn, matches replaced by a space, then
    whitespace and punctuation regexes, then a content-token check), on the Fig. 5 vocabulary."""

    def __init__(self) -> None:
        by_category: dict[str, list[str]] = {}
        for term, category in DEFAULT_LEXICON.items():
            by_category.setdefault(category, []).append(term)
        def alternation(terms: list[str]) -> str:
            return "|".join(r"\s+".join(map(re.escape, t.split())) for t in sorted(terms, key=len, reverse=True))

        self.patterns = [re.compile(rf"\b(?:{alternation(ts)})\b", re.IGNORECASE) for ts in by_category.values()]
        self.cleanup = [
            (re.compile(r"\s+"), " "),
            (re.compile(r"\s+([,.;:!?])"), r"\1"),
            (re.compile(r"([,.;:!?])\1+"), r"\1"),
            (re.compile(r"\s+,"), ","),
            (re.compile(r",\s*,"), ","),
        ]
        self.tokens = re.compile(r"\b\w+\b")
        self.stop = frozenset("a an the and or of in on at to with is are was were it its this that".split())

    def __call__(self, caption: str) -> str:
        text = caption
        for pattern in self.patterns:
            text = pattern.sub(" ", text)
        for pattern, repl in self.cleanup:
            text = pattern.sub(repl, text)
        text = text.strip()
        content = [t for t in self.tokens.findall(text.lower()) if t not in self.stop]
        return text if len(content) >= 2 else caption


def _rate(fn, items, *, repeats: int = 3) -> float:
    """Best-of-``repeats`` items per second of ``fn`` over ``items`` (best = least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, time.perf_counter() - start)
    return len(items) / best


_WORKER_FILTER: LexiconFilter | None = None


def _filter_shard(captions: list[str]) -> int:
    global _WORKER_FILTER
    if _WORKER_FILTER is None:
        _WORKER_FILTER = LexiconFilter()
    for caption in captions:
        _WORKER_FILTER.filter(caption)
    return len(captions)


def _rate_processes(captions: list[str], processes: int) -> float:
    shards = [captions[i::processes] for i in range(processes)]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        pool.map(_filter_shard, [s[:50] for s in shards])  # warm-up: build the filter in each worker
        start = time.perf_counter()
        pool.map(_filter_shard, shards)
        elapsed = time.perf_counter() - start
    return len(captions) / elapsed


def lexicon_throughput(n: int = 20000) -> dict:
    """Captions/s of the lexicon filter on ``n`` DOCCI-length captions (1 and 2 processes) and of
    the public-style baseline, with the ratio measured in the same run."""
    captions = docci_like_captions(n)
    lexicon = LexiconFilter()
    ours = _rate(lexicon.filter, captions)
    baseline = _rate(PublicStyleFilter(), captions[: max(1, n // 4)])
    two = _rate_processes(captions, 2)
    removed = sum(len(lexicon.filter(c).removed) for c in captions[:1000]) / min(n, 1000)
    return {
        "captions": n,
        "mean_words": sum(len(c.split()) for c in captions) / n,
        "removed_terms_per_caption": removed,
        "captions_per_s_1_process": ours,
        "captions_per_s_2_processes": two,
        "baseline_public_style_captions_per_s": baseline,
        "speedup_vs_baseline": ours / baseline,
        "target_captions_per_s_2_cores": 15000,
    }


def _natural_like(height: int, width: int, seed: int) -> Image.Image:
    """Smooth random colour fields with shapes: an image with a natural amount of edges."""
    rng = np.random.default_rng(seed)
    field = cv2.resize(rng.random((max(1, height // 16), max(1, width // 16), 3)).astype(np.float32), (width, height),
                       interpolation=cv2.INTER_CUBIC)
    img = np.clip(field * 255, 0, 255).astype(np.uint8)
    for _ in range(12):
        center = (int(rng.integers(0, width)), int(rng.integers(0, height)))
        color = tuple(int(c) for c in rng.integers(0, 255, 3))
        cv2.circle(img, center, int(rng.integers(4, max(5, min(height, width) // 4))), color, -1)
    return Image.fromarray(img)


def canny_throughput(n_small: int = 200, n_large: int = 20) -> dict:
    """Images/s of :func:`edge_map` at 224 x 224 and 1024 x 768: one by one, through a 2-thread
    :func:`edge_maps` pool, and bare ``cv2.Canny`` on the gray array for reference."""
    out: dict = {"cv2_threads": cv2.getNumThreads(), "cpu_count": os.cpu_count()}
    for name, (height, width), n in (("224x224", (224, 224), n_small), ("1024x768", (768, 1024), n_large)):
        images = [_natural_like(height, width, seed) for seed in range(n)]
        grays = [cv2.cvtColor(np.asarray(im), cv2.COLOR_RGB2GRAY) for im in images]
        single = _rate(edge_map, images)
        pooled = _rate(lambda batch: edge_maps(batch, num_threads=2), [images]) * n
        bare = _rate(lambda g: cv2.Canny(g, 100, 200), grays)
        out[name] = {
            "images": n,
            "edge_map_images_per_s": single,
            "edge_maps_2_threads_images_per_s": pooled,
            "bare_cv2_canny_images_per_s": bare,
            "edge_map_vs_bare_canny": single / bare,
        }
    return out


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def main() -> dict:
    results = {"lexicon": lexicon_throughput(), "canny": canny_throughput()}
    lex = results["lexicon"]
    print(
        f"lexicon filter: {lex['captions_per_s_1_process']:,.0f} captions/s (1 process), "
        f"{lex['captions_per_s_2_processes']:,.0f} (2 processes); public-style baseline "
        f"{lex['baseline_public_style_captions_per_s']:,.0f}/s: x{lex['speedup_vs_baseline']:.1f}"
    )
    for size in ("224x224", "1024x768"):
        c = results["canny"][size]
        print(
            f"canny {size}: {c['edge_map_images_per_s']:,.0f} images/s (edge_map), "
            f"{c['edge_maps_2_threads_images_per_s']:,.0f} (2-thread pool), bare cv2.Canny "
            f"{c['bare_cv2_canny_images_per_s']:,.0f}: x{c['edge_map_vs_bare_canny']:.2f}"
        )
    _write_json(RESULTS, results)
    print(f"wrote {RESULTS}")
    return results


if __name__ == "__main__":
    main()
