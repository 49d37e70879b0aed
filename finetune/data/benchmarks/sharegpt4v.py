"""ShareGPT4V (Chen et al. 2024) share-captioner captions as the data source ``sharegpt4v``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from finetune.data.protocols import available_protocols
from finetune.data.sources import DataError, SourceSpec, register_source

from ._common import _finish, _local_root, _read_json, _Rows, _selection

__all__ = ["build_sharegpt4v", "SHAREGPT4V_JSON", "SHAREGPT4V_HOLDOUT"]


SHAREGPT4V_JSON = "share-captioner_coco_lcs_sam_1246k_1107.json"
SHAREGPT4V_HOLDOUT = 1000  # Long-CLIP trains on rows [1000:] and tests on the first 1,000

_SHAREGPT4V_HOW = (
    f"get {SHAREGPT4V_JSON} from the hub dataset Lin-Chen/ShareGPT4V and its images (COCO, SAM "
    "from SA-1B, LLaVA sets) under one folder as the JSON's `image` paths expect, and set path to "
    "that folder (options.json_file if the JSON lives elsewhere)"
)


def _sharegpt4v_caption(row: Any) -> tuple[str, str, str] | str:
    """(id, image, caption) of a row, or a problem string."""
    if not isinstance(row, dict):
        return "not a JSON object"
    conversations = row.get("conversations")
    if not isinstance(row.get("image"), str) or row.get("id") is None:
        return "no id / image"
    if not (isinstance(conversations, list) and len(conversations) >= 2
            and isinstance(conversations[1], dict)
            and isinstance(conversations[1].get("value"), str)):
        return "no second conversation turn with a value"
    # Long-CLIP's loader flattens the caption's line breaks.
    return str(row["id"]), row["image"], conversations[1]["value"].replace("\n", " ").strip()


@register_source(
    "sharegpt4v",
    description="ShareGPT4V (Chen et al. 2024) share-captioner 1.2M captions; "
    "protocols first 1k / 10k rows",
    protocols=tuple(available_protocols("sharegpt4v")),
    splits=("train", "test"),
)
def build_sharegpt4v(spec: SourceSpec) -> datasets.Dataset:
    """ShareGPT4V from ``share-captioner_coco_lcs_sam_1246k_1107.json``: a list of ``{id, image,
    conversations}``; the caption is the second turn (the model's answer), line breaks flattened.

    Protocols: ``1k`` = the first 1,000 rows (Long-CLIP, its issues #8 / #60), ``10k`` = the
    first 10,000 (LoTLIP, FLAIR). ``split: train`` is every row after the first
    ``options.holdout`` (default 1,000, Long-CLIP's; use 10000 when evaluating on ``10k``),
    ``split: test`` the first ``holdout`` rows. Images are ``options.image_root`` (default: the
    JSON's folder) / ``image``.
    """
    protocol = _selection(spec, "sharegpt4v")
    root = _local_root(spec, "sharegpt4v", _SHAREGPT4V_HOW)
    default_json = root if root.is_file() else root / SHAREGPT4V_JSON
    json_file = Path(spec.options.get("json_file", default_json)).expanduser()
    if not json_file.is_file():
        raise DataError(f"sharegpt4v: no {json_file}; {_SHAREGPT4V_HOW}")
    default_images = root if root.is_dir() else json_file.parent
    image_root = Path(spec.options.get("image_root", default_images)).expanduser()
    data = _read_json(json_file, "sharegpt4v")
    if not isinstance(data, list):
        raise DataError(f"sharegpt4v: {json_file} must hold a JSON list of rows")
    holdout = int(spec.options.get("holdout", SHAREGPT4V_HOLDOUT))
    if protocol is not None:
        selected = data[: protocol.expected]
        offset = 0
    elif spec.split == "test":
        selected, offset = data[:holdout], 0
    else:
        selected, offset = data[holdout:], holdout
    rows = _Rows()
    for position, row in enumerate(selected, start=offset):
        item = _sharegpt4v_caption(row)
        if isinstance(item, str):
            rows.problem(f"{json_file.name} row {position}", item)
            continue
        row_id, image, caption = item
        rows.add(row_id, image_root / image, caption)
    return _finish(rows, spec, protocol)
