"""Examples whose image fails to decode during training follow ``data.on_error``.

Validation (:func:`finetune.data.sources.load_source`) probes every image, but some damage is
only found by decoding the whole body (a JPEG whose middle is corrupt, a file changed on disk
after validation). :class:`SkippingDataset` decodes each example's image when the DataLoader
asks for it (in a worker process or not): with ``on_error="raise"`` a bad image stops the run
with a :class:`~finetune.data.images.DataError` naming the id and file; with ``"skip"`` the
example is replaced by the next readable one (so every batch keeps its size, which a contrastive
batch split over processes needs) and reported in the batch under :data:`SKIPPED_KEY`, from
where the trainer counts it for ``metrics.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .images import DataError, read_image, read_image_tensor

__all__ = ["SKIPPED_KEY", "SkippingDataset", "SkipReportingCollate", "drop_undecodable", "undecoded"]

SKIPPED_KEY = "_skipped_examples"
_ON_ERROR = ("skip", "raise")


def undecoded(dataset: Any) -> Any:
    """``dataset`` with its ``image`` column left as ``{"bytes", "path"}`` (no decoding by
    ``datasets``), so that :func:`~finetune.data.images.read_image` decodes it and names the file
    on failure; other datasets are returned unchanged. Metadata only: no data is rewritten."""
    import datasets

    features = getattr(dataset, "features", None)
    if isinstance(dataset, datasets.Dataset) and isinstance(features.get("image"), datasets.Image):
        return dataset.cast_column("image", datasets.Image(decode=False))
    return dataset


class SkippingDataset:
    """A map-style dataset whose ``image`` is decoded to RGB here, following ``on_error``.

    Args:
        dataset: rows with ``id``, ``image`` (anything :func:`read_image` reads) and the rest.
        on_error: ``"skip"`` or ``"raise"`` (the recipe's ``data.on_error``).

    ``dataset[i]`` returns row ``i`` with a decoded RGB ``image``; when that image fails and
    ``on_error="skip"`` it returns the next readable row (``i + 1``, ``i + 2``, ... wrapping
    around) with ``SKIPPED_KEY: [{"id", "path", "reason"}, ...]`` listing the rows passed over.

    ``decode="tensor"``: the image as a ``uint8 (3, H, W)`` tensor
    (:func:`~finetune.data.images.read_image_tensor`), for a collator on the tensor path.
    """

    def __init__(self, dataset: Any, on_error: str = "skip", *, decode: str = "pil") -> None:
        if on_error not in _ON_ERROR:
            raise ValueError(f"data.on_error must be one of {', '.join(_ON_ERROR)}, got {on_error!r}")
        if decode not in ("pil", "tensor"):
            raise ValueError(f"decode must be 'pil' or 'tensor', got {decode!r}")
        self.dataset = undecoded(dataset)
        self.on_error = on_error
        self.decode = decode

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """Rows ``indices`` in one columnar read of the table (the DataLoader asks a dataset that has this method
        for a whole batch at once); a row whose image fails goes through :meth:`__getitem__`, which skips it or
        raises."""
        many = getattr(self.dataset, "__getitems__", None)
        if many is None:
            return [self[i] for i in indices]
        out = []
        for index, row in zip(indices, many(list(indices))):
            row = dict(row)
            try:
                row["image"] = read_image(row.get("image")) if self.decode == "pil" else read_image_tensor(row.get("image"))
            except DataError:
                row = self[index]
            out.append(row)
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.dataset)
        passed_over: list[dict] = []
        for k in range(n):
            row = dict(self.dataset[(index + k) % n])
            image = row.get("image")
            path = (image.get("path") if isinstance(image, dict) else None) or "<bytes>"
            try:
                row["image"] = read_image(image) if self.decode == "pil" else read_image_tensor(image)
            except DataError as error:
                reason = getattr(error, "reason", str(error))
                if self.on_error == "raise":
                    raise DataError(
                        f"training example id={row.get('id')!r} (image {path}): {reason}. Fix or remove the "
                        "example, or set data.on_error: skip to skip and count such examples."
                    ) from error
                passed_over.append({"id": str(row.get("id")), "path": path, "reason": reason})
                continue
            if passed_over:
                row[SKIPPED_KEY] = passed_over
            return row
        raise DataError(f"no training example has a readable image (first: {passed_over[:1]})")


class SkipReportingCollate:
    """Wraps a collate function: the rows' :data:`SKIPPED_KEY` lists go to ``batch[SKIPPED_KEY]``
    (the collate function never sees them)."""

    def __init__(self, collate_fn: Callable[[list[dict]], dict[str, Any]]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        skipped = [entry for e in examples for entry in e.get(SKIPPED_KEY, ())]
        batch = self.collate_fn([{k: v for k, v in e.items() if k != SKIPPED_KEY} for e in examples])
        if skipped:
            batch[SKIPPED_KEY] = skipped
        return batch


class _DecodeCheck:
    """``datasets.map`` function (batched): ``decode_error`` is ``""`` for an image that decodes, else
    ``"PATH\tREASON"``."""

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[str]]:
        errors = []
        for image in batch["image"]:
            try:
                read_image(image)
                errors.append("")
            except DataError as error:
                path = (image.get("path") if isinstance(image, dict) else None) or "<bytes>"
                errors.append(f"{path}\t{getattr(error, 'reason', str(error))}")
        return {"decode_error": errors}


def drop_undecodable(
    dataset: Any, *, on_error: str = "skip", cache_dir: str | None = None
) -> tuple[Any, list[dict]]:
    """Decode every image of a map-style ``datasets.Dataset`` once and drop the rows that fail, before
    a term's cached preprocessing decodes the whole set itself (StructXLIP's edge maps and regions),
    where a bad image would otherwise stop the run whatever ``data.on_error`` says.

    The check is cached like the preprocessing (keyed by the dataset's fingerprint and the image-size
    limit), so only the first run decodes. A set where every image decodes is returned unchanged
    (same fingerprint: the preprocessing caches still match).

    Args:
        dataset: rows with ``id`` and ``image``.
        on_error: ``"skip"``: drop the bad rows; ``"raise"``: stop at the first, naming its id and file.
        cache_dir: where the check is cached (``data.cache_dir``).

    Returns:
        ``(dataset, skipped)``: the readable rows, and ``{"id", "path", "reason"}`` per dropped row.

    Raises:
        DataError: with ``on_error="raise"``, for the first image that fails to decode.
    """
    import datasets

    from finetune.data.cache import cached_map

    from .images import max_image_pixels

    if on_error not in _ON_ERROR:
        raise ValueError(f"data.on_error must be one of {', '.join(_ON_ERROR)}, got {on_error!r}")
    checked = cached_map(
        undecoded(dataset).select_columns(["image"]), _DecodeCheck(),
        params={"max_image_pixels": max_image_pixels()}, name="decode_check", cache_dir=cache_dir,
        batched=True, batch_size=64, features=datasets.Features({"decode_error": datasets.Value("string")}),
        desc="checking that every training image decodes",
    )
    errors = checked["decode_error"]
    bad = [i for i, e in enumerate(errors) if e]
    if not bad:
        return dataset, []
    ids = dataset.select_columns(["id"]).select(bad)["id"]
    skipped = []
    for i, id_ in zip(bad, ids):
        path, _, reason = errors[i].partition("\t")
        if on_error == "raise":
            raise DataError(f"training example id={id_!r} (image {path}): {reason}. Fix or remove the example, "
                            "or set data.on_error: skip to skip and count such examples.")
        skipped.append({"id": str(id_), "path": path, "reason": reason})
    keep = sorted(set(range(len(errors))) - set(bad))
    return dataset.select(keep), skipped
