"""FLISM's global-local pairs as a file (GLIT100k-style, FAST-GOAL's two-stage training, Table V): written
resumably by :func:`write_pairs`, read back one example per image by :func:`pairs_by_image`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import datasets
from PIL import Image

from .matcher import FLISMMatcher, flism_features

__all__ = ["PAIR_FILE_COLUMNS", "pairs_by_image", "write_pairs"]


_TABLE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}


def _source_spec(value: str) -> dict[str, Any]:
    """IMAGES_AND_CAPTIONS -> a data source spec: a jsonl / csv / parquet file or folder, an image folder, or a
    registered source as a name (``synthetic``) or a YAML mapping (``{name: synthetic, size: 64}``)."""
    import yaml

    path = Path(value).expanduser()
    if path.is_file():
        name = _TABLE_SUFFIXES.get(path.suffix.lower())
        if name is None:
            raise ValueError(f"{value!r}: a file of image-caption pairs must be .jsonl, .json, .csv or .parquet")
        return {"name": name, "path": str(path)}
    if path.is_dir():
        found = {_TABLE_SUFFIXES[p.suffix.lower()] for p in path.iterdir() if p.suffix.lower() in _TABLE_SUFFIXES}
        if len(found) == 1 and not (path / "metadata.jsonl").is_file():
            return {"name": found.pop(), "path": str(path)}
        return {"name": "imagefolder", "path": str(path)}
    spec = yaml.safe_load(value) if value.lstrip().startswith("{") else value
    if isinstance(spec, str) and ("/" in spec or "." in Path(spec).name):
        raise FileNotFoundError(f"{value!r} does not exist (give a jsonl/csv/parquet file, an image folder, or a "
                                "registered data source such as synthetic)")
    return spec if isinstance(spec, dict) else {"name": spec}


def _done_ids(out: Path, done: Path) -> set[str]:
    """Ids finished by an earlier run, and ``out`` cut back to their lines (an interrupted run may have left a
    partial block of lines after its last finished image)."""
    if not done.is_file():
        if out.exists():
            out.unlink()
        return set()
    ids = {line.strip() for line in done.read_text(encoding="utf-8").splitlines() if line.strip()}
    if out.is_file():
        from finetune.files import write_text_atomic

        kept = []
        for line in out.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by the interruption
            if str(row.get("id")) in ids:
                kept.append(line)
        write_text_atomic(out, "".join(k + "\n" for k in kept))
    return ids


def _image_ref(example: dict[str, Any], image: Image.Image, images_dir: Path, out: Path) -> str:
    """The image as the pairs file names it: its own file when it has one, else a PNG written beside ``out``."""
    raw = example.get("image_raw")
    path = raw.get("path") if isinstance(raw, dict) else None
    if path and Path(path).is_file():
        return str(Path(path).resolve())
    images_dir.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(example["id"]))
    target = images_dir / f"{safe}.png"
    if not target.is_file():
        tmp = target.with_name(f".{target.name}.tmp")
        image.save(tmp, format="PNG")
        os.replace(tmp, target)
    return os.path.relpath(target, out.parent)


#: the per-pair columns of a pairs file (one line per kept pair); the rest is the image's own
PAIR_FILE_COLUMNS = ("box", "sentence", "sentence_index", "similarity", "weight", "candidates", "image_id")


def _image_key(row_id: str) -> str:
    """The image of a pairs-file line without an ``image_id`` column: its id without ``write_pairs``' ``#p``."""
    head, sep, tail = row_id.rpartition("#")
    return head if sep and tail.isdigit() else row_id


def pairs_by_image(dataset: datasets.Dataset, *, pairs: int = 1) -> tuple[datasets.Dataset, dict[str, Any]]:
    """One example per image from the lines of a pairs file (``write_pairs``), with the columns FLISM adds in a
    recipe (``flism_pair_box``, ``flism_pair_sentence``, ``flism_pair_similarity``, ``flism_pair_weight``,
    ``flism_num_pairs``), so that both routes train alike: an image meets its own pairs in one example, never
    itself as a negative of the global loss (FAST-GOAL eq. 12).

    Lines are grouped by ``image_id`` (else by the id without its ``#p`` suffix); an image keeps its ``pairs``
    most similar lines (the file's order without a ``similarity`` column), padded by repeating the last one with
    weight 0; the kept lines' ``weight`` column (the builder's ``--weighting``; uniform without one) is
    renormalised to sum to 1 over them, as :func:`select_pairs` does in a recipe.

    Returns:
        ``(dataset, info)``: the grouped dataset (``id`` is the image's, the other non-pair columns the first
        line's) and ``{"lines", "images", "most_pairs_per_image"}``.

    Raises:
        DataError: lines of one image with different captions, a ``box`` that is not 4 numbers or a
            ``sentence_index`` that is not an integer (naming the line's id).
    """
    from finetune.data.images import DataError

    n = len(dataset)
    ids = [str(i) for i in dataset["id"]]
    keys = [str(k) for k in dataset["image_id"]] if "image_id" in dataset.column_names else [_image_key(i) for i in ids]
    captions = dataset["caption"]
    boxes = dataset["box"]
    sentence = dataset["sentence_index"]
    sims = dataset["similarity"] if "similarity" in dataset.column_names else [None] * n
    weights = dataset["weight"] if "weight" in dataset.column_names else [None] * n
    groups: dict[str, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    first, columns = [], {name: [] for name in ("flism_pair_box", "flism_pair_sentence", "flism_pair_similarity",
                                                "flism_pair_weight", "flism_num_pairs")}
    for key, rows in groups.items():
        if len({captions[r] for r in rows}) > 1:
            raise DataError(f"pairs file: the lines {ids[rows[0]]!r} and {ids[rows[1]]!r} name the image {key!r} with "
                            "different captions; one image has one caption (write the file again with python -m "
                            "finetune.preprocess.flism)")
        for r in rows:
            box = boxes[r]
            if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
                raise DataError(f"pairs file: line {ids[r]!r} has box {box!r}; a box is 4 numbers (x1, y1, x2, y2) in "
                                "pixels of the original image")
            if not isinstance(sentence[r], int):
                raise DataError(f"pairs file: line {ids[r]!r} has sentence_index {sentence[r]!r}; it is the index of the "
                                "pair's sentence among split_sentences(caption)")
        ranked = all(sims[r] is not None for r in rows)
        kept = (sorted(rows, key=lambda r: -float(sims[r])) if ranked else list(rows))[:pairs]  # stable: file order
        raw = [float(weights[r]) if weights[r] is not None else 1.0 for r in kept]
        total = sum(max(w, 0.0) for w in raw)
        shares = [max(w, 0.0) / total for w in raw] if total > 0 else [1.0 / len(kept)] * len(kept)
        pad = pairs - len(kept)
        first.append(rows[0])
        kept_boxes = [[float(v) for v in boxes[r]] for r in kept]
        columns["flism_pair_box"].append(kept_boxes + [kept_boxes[-1]] * pad)
        columns["flism_pair_sentence"].append([int(sentence[r]) for r in kept] + [int(sentence[kept[-1]])] * pad)
        kept_sims = [float(sims[r]) if sims[r] is not None else math.nan for r in kept]
        columns["flism_pair_similarity"].append(kept_sims + [kept_sims[-1]] * pad)
        columns["flism_pair_weight"].append(shares + [0.0] * pad)
        columns["flism_num_pairs"].append(len(kept))
    base = dataset.select(first)
    base = base.remove_columns([c for c in (*PAIR_FILE_COLUMNS, "id") if c in base.column_names])
    features = flism_features()
    added = datasets.Dataset.from_dict({"id": list(groups), **columns}, features=datasets.Features(
        {"id": datasets.Value("string"), **{name: features[name] for name in columns}}))
    grouped = datasets.concatenate_datasets([base, added], axis=1)
    most = max((len(r) for r in groups.values()), default=0)
    info = {"lines": n, "images": len(groups), "most_pairs_per_image": most}
    return grouped, info


def write_pairs(source: dict[str, Any] | str, out: str | Path, model: Any, *, proposer: Any = None,
                default: bool = True, pairs: int = 1, weighting: str = "uniform", batch_size: int = 16,
                progress: bool = True, model_id: str | None = None) -> dict[str, int]:
    """Write the global-local pairs of a dataset as a jsonl that ``data.train`` reads (``{name: jsonl, path: out}``
    with ``objective.terms.fastgoal.regions.method: pairs``): one line per kept pair with ``id``, ``image_id``
    (the image's own id: training groups an image's pairs into one example by it), ``width`` and ``height`` of
    the image, ``image`` (its file, or a PNG in ``<out stem>_images/``), ``caption``, ``box`` (pixels of the
    original image, clipped to what ``model``'s input shows), ``sentence``, ``sentence_index`` (into
    ``split_sentences(caption)``), ``similarity``, ``weight`` (the pair's share of the image's TSL weight:
    ``1 / m`` for ``uniform``, similarity-proportional for ``weighted``) and ``candidates``; the id of each
    finished image is appended to ``<out>.done`` after its lines are flushed.
    Interrupted, a second call with the same ``out`` skips the images listed there (resume).

    Args:
        source: a data source spec (:func:`finetune.data.sources.load_source`).
        out: the jsonl to write.
        model: the DualEncoder that matches sentences to crops (frozen, eval mode).
        proposer, default, pairs, weighting: as :class:`FLISMMatcher`.
        batch_size: images per matching batch.
        progress: show a progress bar.

    Returns:
        ``{"images": processed now, "skipped": already done, "pairs": lines written now}``.
    """
    from tqdm.auto import tqdm

    from finetune.data.sources import load_source
    from finetune.preprocess.frozen import FrozenEncoders, model_fingerprint

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done_file = out.with_name(out.name + ".done")
    done = _done_ids(out, done_file)
    data = load_source(source).dataset
    raw = data.cast_column("image", datasets.Image(decode=False))
    todo = [i for i, rid in enumerate(data["id"]) if str(rid) not in done]
    encoders = FrozenEncoders(model)
    model.eval()
    matcher = FLISMMatcher(proposer, encoders.images, encoders.texts, model_id=model_id or model_fingerprint(model),
                           default=default, pairs=pairs, weighting=weighting, geometry=model.image_transform_params())
    images_dir = out.with_name(out.stem + "_images")
    written = 0
    bar = tqdm(total=len(data), initial=len(data) - len(todo), desc="FLISM pairs", unit="image", disable=not progress)
    with out.open("a", encoding="utf-8") as fh, done_file.open("a", encoding="utf-8") as dh:
        for start in range(0, len(todo), batch_size):
            rows = todo[start: start + batch_size]
            batch = data.select(rows)[:]
            result = matcher(batch)
            lines, ids = [], []
            for j, index in enumerate(rows):
                example = {k: batch[k][j] for k in batch}
                example["image_raw"] = raw[index]["image"]
                ref = _image_ref(example, batch["image"][j], images_dir, out)
                for p in range(result["flism_num_pairs"][j]):
                    s = result["flism_pair_sentence"][j][p]
                    image = batch["image"][j]
                    lines.append(json.dumps({
                        "id": f"{example['id']}#{p}" if pairs > 1 else str(example["id"]),
                        "image_id": str(example["id"]), "width": image.width, "height": image.height,
                        "image": ref, "caption": example["caption"],
                        "box": [round(float(v), 2) for v in result["flism_pair_box"][j][p]],
                        "sentence": result["flism_sentences"][j][s], "sentence_index": int(s),
                        "similarity": round(float(result["flism_pair_similarity"][j][p]), 6),
                        "weight": round(float(result["flism_pair_weight"][j][p]), 6),
                        "candidates": int(result["flism_num_candidates"][j]),
                    }, ensure_ascii=False))
                ids.append(str(example["id"]))
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
            dh.write("".join(i + "\n" for i in ids))  # only after the lines are on disk
            dh.flush()
            os.fsync(dh.fileno())
            written += len(lines)
            bar.update(len(rows))
    bar.close()
    return {"images": len(todo), "skipped": len(data) - len(todo), "pairs": written}
