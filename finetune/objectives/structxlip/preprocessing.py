"""StructXLIP's preprocessing of the regions and the lexicon statistics (paper 3.1-3.2, B.3, D.3), run once per
dataset by :meth:`StructXLIPTerm.preprocess <finetune.objectives.structxlip.term.StructXLIPTerm.preprocess>`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.preprocess.frozen import FrozenEncoders, model_fingerprint
from finetune.objectives.structxlip.data import CODE_VERSION

__all__ = ["add_regions", "lexicon_statistics"]


def add_regions(term: Any, dataset: Any, model: Any, root: Path | None, log: Any) -> Any:
    """The region columns (``region_boxes``, ``region_fallback``, ``chunks``, ``chunk_topk``, ...) of the local loss
    added to ``dataset``: FastSAM masks or the default regions ranked per chunk under the frozen model
    (``regions.source: segmenter``, paper 3.2 and D.3), or the dataset's own boxes and sentence links
    (``source: dataset``); ``term.stats["regions"]`` filled."""
    from finetune.preprocess.regions import RegionMatcher, compute_regions

    r = term.options.regions
    if r.source == "dataset":
        regions = _dataset_regions(term, dataset, root, log)
        return _add_region_columns(term, dataset, regions, log)
    segmenter = term.segmenter()
    if r.checkpoint is None:
        log.warning("structxlip: regions.checkpoint is not set, so every image uses the default regions (4 "
                    "quadrants + centre) instead of FastSAM masks; download FastSAM-x.pt (or FastSAM-s.pt) and "
                    "set objective.terms.structxlip.regions.checkpoint for the paper's regions")
    encoders = FrozenEncoders(model)
    was_training = model.training
    model.eval()
    try:
        matcher = RegionMatcher(
            segmenter, encoders.images, encoders.texts, model_id=model_fingerprint(model), k=r.k,
            chunker=term.chunker(), edge_cfg=term.edge_cfg, match_on=r.match_on,
            edges_column="edges" if "edges" in dataset.column_names else None,
        )
        columns = ["image", "filtered_caption"] + (["edges"] if "edges" in dataset.column_names else [])
        regions = compute_regions(dataset.select_columns(columns), matcher, cache_dir=root,
                                  code_version=CODE_VERSION)
    finally:
        model.train(was_training)
    return _add_region_columns(term, dataset, regions, log)

def _dataset_regions(term: Any, dataset: Any, root: Path | None, log: Any) -> Any:
    """``regions.source: dataset``: the dataset's boxes and sentence links (:class:`DatasetRegionLinks`)."""
    from finetune.data.cache import cached_map
    from finetune.preprocess.region_links import DatasetRegionLinks
    from finetune.preprocess.regions import region_features

    missing = [c for c in ("sentences", "objects") if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"objective.terms.structxlip.regions.source: dataset needs the columns 'sentences' (the caption's "
            f"sentences) and 'objects' (a list of {{box: [x1, y1, x2, y2], sentence_index}}), which the "
            f"training set lacks ({', '.join(missing)}; it has {dataset.column_names}); use a dataset that "
            "provides them (synthetic, or dci with options: {caption: complete}) or regions.source: segmenter")
    links = DatasetRegionLinks(k=term.options.regions.k, chunker=term.chunker())
    log.info("structxlip regions: from the dataset (its objects' boxes, each chunk linked to the objects of "
             "its sentence), not FastSAM + frozen matching")
    return cached_map(dataset.select_columns(["filtered_caption", "sentences", "objects"]), links,
                      params=links.params(), name="regions", cache_dir=root, code_version=CODE_VERSION,
                      batched=True, batch_size=256, features=region_features(),
                      desc="StructXLIP regions from the dataset")

def _add_region_columns(term: Any, dataset: Any, regions: Any, log: Any) -> Any:
    import datasets

    from finetune.preprocess.regions import region_features

    r = term.options.regions
    names = list(region_features())
    fallback = regions["region_fallback"]
    n_regions = [len(b) for b in regions["region_boxes"]]
    n_chunks = [len(c) for c in regions["chunks"]]
    n = max(1, len(fallback))
    term.stats["regions"] = {
        "images": len(fallback),
        "fallback_images": int(sum(fallback)),
        "fallback_share": sum(fallback) / n,
        "regions_per_image": sum(n_regions) / n,
        "chunks_per_caption": sum(n_chunks) / n,
        "captions_without_chunks": sum(1 for c in n_chunks if c == 0),
        "segmenter": "dataset" if r.source == "dataset" else "fastsam" if r.checkpoint else "default_regions",
        "source": r.source,
    }
    st = term.stats["regions"]
    log.info("structxlip regions: %d images, %d use the default regions, %.2f regions and %.2f chunks per "
             "image, %d captions without chunks", st["images"], st["fallback_images"], st["regions_per_image"],
             st["chunks_per_caption"], st["captions_without_chunks"])
    base = dataset.remove_columns([c for c in dataset.column_names if c in names])
    return datasets.concatenate_datasets([base, regions.select_columns(names)], axis=1)


def lexicon_statistics(dataset: Any) -> dict[str, Any]:
    """The lexicon filter's statistics over the preprocessed ``dataset`` (paper Supp. Mat. B.3)."""
    from finetune.preprocess.lexicon import FilterResult, lexicon_stats

    results = (
        FilterResult(text, removed, reverted, categories, words)
        for text, removed, reverted, categories, words in zip(
            dataset["filtered_caption"], dataset["lexicon_removed"], dataset["lexicon_reverted"],
            dataset["lexicon_categories"], dataset["caption_words"],
        )
    )
    return lexicon_stats(results)
