"""The generic local formats a recipe names as a data source: JSON lines, CSV, parquet and image folders
(``data.train: {name: jsonl, path: ...}``), each a builder registered with
:func:`finetune.data.sources.register_source`; :func:`finetune.data.sources.load_source` validates what they
return."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import datasets

from finetune.data.bad_rows import decode_utf8, read_utf8_text, report_bad_row, utf8_jsonl
from finetune.data.images import IMAGE_EXTENSIONS, DataError, broken_link_reason, image_files
from finetune.data.sources import _first_non_empty, register_source, source_cache_dir
from finetune.data.spec import SourceSpec, _closest
from finetune.data.text import as_captions, lone_surrogate

logger = logging.getLogger("finetune.data.sources")

__all__ = ["build_csv", "build_imagefolder", "build_jsonl", "build_parquet"]


def _require_path(spec: SourceSpec) -> Path:
    if not spec.path:
        raise DataError(f"data source {spec.name!r} needs a path: set path to a file or a folder of files")
    path = Path(spec.path).expanduser()
    if not path.exists():
        raise DataError(f"data source {spec.name!r}: path {str(path)!r} does not exist")
    return path


def _data_files(spec: SourceSpec, extensions: tuple[str, ...]) -> list[Path]:
    """The files of a tabular source: the file itself, or a folder's files (of a split)."""
    path = _require_path(spec)
    if path.is_file():
        return [path]
    if spec.split and (path / spec.split).is_dir():
        path = path / spec.split
        split = None
    else:
        split = spec.split
    files = sorted(p for p in path.rglob("*") if p.name.lower().endswith(extensions)
                   and (p.is_file() or broken_link_reason(p) is not None))
    if split:
        files = [p for p in files if p.stem == split or p.stem.startswith((f"{split}-", f"{split}_", f"{split}."))]
    broken = [(p, broken_link_reason(p)) for p in files if broken_link_reason(p) is not None]
    if broken:  # its rows can be neither read nor counted: never passed over in silence
        shown = "; ".join(f"{str(p)!r}: {reason}" for p, reason in broken[:5])
        raise DataError(f"data source {spec.name!r}: {len(broken)} data file(s) cannot be read ({shown}); fix the "
                        "link (or copy the file in its place) or remove it")
    if not files:
        wanted = " or ".join(f"*{e}" for e in extensions)
        which = f" for split {split!r} (named {split}*{extensions[0]} or in a {split}/ folder)" if split else ""
        raise DataError(f"data source {spec.name!r}: no {wanted} files{which} in {str(path)!r}")
    return files


def _resolve_image_paths(dataset: datasets.Dataset, base: Path) -> datasets.Dataset:
    """Image paths relative to the data file become absolute; bytes are left alone."""

    def resolve(images: list) -> dict:
        out = []
        for image in images:
            if image is not None and image.get("bytes") is None and image.get("path"):
                path = Path(os.path.expanduser(image["path"]))
                image = {"bytes": None, "path": str(path if path.is_absolute() else base / path)}
            out.append(image)
        return {"image": out}

    return dataset.map(resolve, input_columns=["image"], batched=True, desc="resolving image paths")


def _error_text(error: BaseException) -> str:
    """The most telling message of an exception and its causes (``datasets`` wraps the parser's error in
    one that says only "An error occurred while generating the dataset")."""
    messages = []
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).strip()
        if text:
            messages.append(text)
        error = error.__cause__ or error.__context__
    return messages[-1] if messages else type(error).__name__


def _load_table(spec: SourceSpec, builder: str, extensions: tuple[str, ...]) -> datasets.Dataset:
    parts = []
    offset = 0
    empty = []
    for file in _data_files(spec, extensions):
        with tempfile.TemporaryDirectory(prefix="xlipkit-utf8-") as workdir:
            rows = None
            if builder == "json":  # every line checked here: the one bad line is named, and follows on_error
                text_file, rows, first_problem = _clean_json(file, workdir, spec, offset)
                if text_file is None:
                    empty.append(f"{str(file)!r} (" + (f"every row unreadable; first: {first_problem}" if rows
                                                      else "the file is empty") + ")")
                    offset += rows
                    continue
            else:
                text_file = utf8_jsonl(file, workdir) if builder == "csv" else file
            try:
                table = datasets.load_dataset(builder, data_files=str(text_file), split="train",
                                              cache_dir=source_cache_dir())
            except Exception as error:  # datasets wraps parser errors in several types
                raise DataError(f"data source {spec.name!r}: cannot read {str(file)!r} as {builder}: "
                                f"{_error_text(error)}") from error
        columns = table.column_names
        for key in ("image_column", "caption_column"):
            column = getattr(spec, key)
            if column not in columns:
                raise DataError(
                    f"data source {spec.name!r}: {str(file)!r} has no column {column!r}{_closest(column, columns)}; "
                    f"columns: {', '.join(columns)}. Set {key} to the column that holds the "
                    f"{key.split('_')[0]}."
                )
        renames = {spec.image_column: "image", spec.caption_column: "caption"}
        id_source = spec.id_column or ("id" if "id" in columns else None)
        if id_source is not None:
            if id_source not in columns:
                raise DataError(
                    f"data source {spec.name!r}: {str(file)!r} has no id column {id_source!r}"
                    f"{_closest(id_source, columns)}; columns: {', '.join(columns)}"
                )
            renames[id_source] = "id"
        clashes = [target for source, target in renames.items() if target in columns and source != target]
        if clashes:
            table = table.remove_columns(clashes)
        table = table.rename_columns({s: t for s, t in renames.items() if s != t})
        if id_source is None:
            table = table.map(
                lambda _, indices, start=offset: {"id": [str(start + i) for i in indices]},
                input_columns=["caption"],
                with_indices=True,
                batched=True,
                desc="row ids",
            )
        else:
            table = table.cast_column("id", datasets.Value("string"))
        table = table.cast_column("image", datasets.Image(decode=False))
        parts.append(_resolve_image_paths(table, file.parent))
        offset += len(table) if rows is None else rows
    if not parts:
        raise DataError(f"data source {spec.name!r}: no readable rows in {', '.join(empty)}; give a file with one "
                        "JSON object per line, e.g. {\"image\": \"cat.jpg\", \"caption\": \"A cat ...\"}")
    if empty:
        logger.warning("data source %r: no readable rows in %s", spec.name, ", ".join(empty))
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as error:
        raise DataError(f"data source {spec.name!r}: the files in {spec.path!r} have different columns: {error}") from error


def _json_msg(error: json.JSONDecodeError) -> str:
    """``json``'s message without its dangling position words (``Unterminated string starting at``)."""
    return error.msg.removesuffix(" starting at").removesuffix(" at")


def _json_entries(file: Path) -> tuple[list[tuple[str, Any]], bool]:
    """``(where, parsed row or the problem)`` of each row of a JSON-lines file (``"line N"``) or of a JSON
    array (``"item N"``); a row that is not UTF-8 or not JSON comes as a ``DataError`` naming the line. The
    flag says whether ``datasets`` reads the file as it is (False for one object written over several lines)."""
    data = file.read_bytes()
    head = data.lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        try:
            items = json.loads(decode_utf8(data, file))
        except json.JSONDecodeError as error:
            raise DataError(f"{file}: line {error.lineno}, column {error.colno}: not valid JSON ({_json_msg(error)}); "
                            "a JSON "
                            "array is read whole, so fix it (or write one JSON object per line)") from error
        if isinstance(items, list):
            return [(f"item {i + 1}", item) for i, item in enumerate(items)], True
    entries: list[tuple[str, Any]] = []
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            entries.append((f"line {number}", DataError(
                f"line {number}, column {error.start + 1}: not UTF-8 "
                f"(byte 0x{raw[error.start:error.start + 1].hex()}); "
                "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")))
            continue
        try:
            entries.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            entries.append((f"line {number}", DataError(f"line {number}, column {error.colno}: not valid JSON "
                                                        f"({_json_msg(error)})")))
    if entries and all(isinstance(row, DataError) for _, row in entries) and head.startswith(b"{"):
        try:  # one JSON object over several lines
            whole = json.loads(decode_utf8(data, file))
        except (json.JSONDecodeError, DataError):
            return entries, True
        return ([("item 1", whole)], False) if isinstance(whole, dict) else (entries, True)
    return entries, True


def _clean_json(file: Path, workdir: str, spec: SourceSpec, first_id: int) -> tuple[Path | None, int, str | None]:
    """Check every row of a JSON-lines file (or JSON array) before ``datasets`` reads it, so that one bad row
    is named (``FILE:LINE``) and skipped or raised per ``data.on_error`` (:func:`report_bad_row`) instead of
    failing the whole file, and captions of another type are named for what they are.

    A row is bad when it is not UTF-8 or not JSON, not an object, holds a lone surrogate (not valid text),
    lacks the caption key, or its caption is not a string or a list of strings (:func:`as_captions`). When
    some rows hold a list of captions and others one string, every caption becomes a list (the list rows
    are kept: ``captions`` and ``caption``, see :func:`load_source`).

    Returns:
        the file to read (``file`` itself when nothing needs changing, else a cleaned copy under
        ``workdir``, with an ``id`` per row when the rows have none, so that ids stay the row numbers the
        file would give), or None when no row is left; the number of rows read (for the next file's ids); the
        first bad row's problem, or None.
    """
    entries, readable = _json_entries(file)
    column = spec.caption_column
    has_column = any(isinstance(row, dict) and column in row for _, row in entries)
    kept: list[tuple[int, dict]] = []
    dropped = 0
    first_problem = None
    kinds = set()
    for index, (where, row) in enumerate(entries):
        problem = None
        if isinstance(row, DataError):
            problem = str(row)
        elif not isinstance(row, dict):
            problem = (f"{where}: a row must be a JSON object ({{\"image\": ..., \"{column}\": ...}}), "
                       f"got {type(row).__name__}")
        elif has_column and column not in row:
            problem = f"{where} has no {column!r} key"
        else:
            try:
                if has_column:
                    as_captions(row[column])
                    kinds.add(type(row[column]).__name__)
                bad = lone_surrogate(row)
                if bad:
                    raise ValueError(f"holds a lone surrogate ({bad}, an unpaired \\u escape), which is not valid text")
            except (TypeError, ValueError) as error:
                problem = f"{where}: {str(error).split('; ')[0]}"
        if problem is None:
            kept.append((index, row))
        else:
            dropped += 1
            first_problem = first_problem or problem
            report_bad_row(f"{file.name}:{where.split()[-1]}", str(file), problem)
    if not kept:
        return None, len(entries), first_problem
    mixed = {"str", "list"} <= kinds
    if not dropped and not mixed and readable:
        return file, len(entries), None
    give_ids = spec.id_column is None and not any("id" in row for _, row in kept)
    handle, name = tempfile.mkstemp(prefix=file.stem + ".checked-", suffix=".jsonl", dir=workdir)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        for index, row in kept:
            if mixed and isinstance(row[column], str):
                row = {**row, column: [row[column]]}
            if give_ids:
                row = {**row, "id": str(first_id + index)}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return Path(name), len(entries), first_problem


@register_source("jsonl", description="JSON lines file(s): an image path (relative to the file) or bytes, and a caption")
def build_jsonl(spec: SourceSpec) -> datasets.Dataset:
    """JSONL source: a ``.jsonl``/``.json`` file or a folder of them, read by ``datasets``' json builder.

    Each row holds the image (a path relative to its file, an absolute path, or
    ``{"bytes", "path"}``) in ``image_column`` and the caption (a string, or a list of strings:
    then ``captions`` holds the list and ``caption`` its first entry) in ``caption_column``.
    """
    return _load_table(spec, "json", (".jsonl", ".json"))


@register_source("csv", description="CSV file(s): an image path column (relative to the file) and a caption column")
def build_csv(spec: SourceSpec) -> datasets.Dataset:
    """CSV source: a ``.csv`` file or a folder of them; one caption per row, image paths relative to the file."""
    return _load_table(spec, "csv", (".csv",))


@register_source("parquet", description="parquet file(s): image bytes or paths, and a caption")
def build_parquet(spec: SourceSpec) -> datasets.Dataset:
    """Parquet source: a ``.parquet`` file or a folder of them; the image column holds raw bytes,
    ``{"bytes", "path"}`` structs (what ``datasets.Image`` writes) or paths."""
    return _load_table(spec, "parquet", (".parquet",))


def _read_mapping(file: Path, spec: SourceSpec) -> tuple[list[str], list[Any], list[str | None]]:
    """(file names, captions, ids) from ``metadata.jsonl`` or ``captions.json``."""
    names, captions, ids = [], [], []
    if file.name == "metadata.jsonl":
        with open(file, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as error:
                    report_bad_row(f"{file.name}:{number}", str(file),
                                   f"line {number}, column {error.start + 1}: not UTF-8 "
                                   f"(byte 0x{raw[error.start:error.start + 1].hex()}); save the file as UTF-8")
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    report_bad_row(f"{file.name}:{number}", str(file),
                                   f"line {number}, column {error.colno}: not valid JSON ({_json_msg(error)})")
                    continue
                if not isinstance(row, dict) or "file_name" not in row:
                    raise DataError(f"{file}: line {number} needs a 'file_name' key (the image path relative to the folder)")
                if spec.caption_column not in row:
                    raise DataError(
                        f"{file}: line {number} has no {spec.caption_column!r} key{_closest(spec.caption_column, list(row))}; "
                        "set caption_column to the key that holds the caption"
                    )
                problem = _row_problem(row, spec.caption_column)
                if problem:
                    report_bad_row(f"{file.name}:{number}", str(file), f"line {number}: {problem}")
                    continue
                names.append(str(row["file_name"]))
                captions.append(row[spec.caption_column])
                ids.append(str(row[spec.id_column]) if spec.id_column and spec.id_column in row else None)
        return names, captions, ids
    try:
        mapping = json.loads(read_utf8_text(file))
    except json.JSONDecodeError as error:
        raise DataError(f"{file} is not valid JSON ({error})") from error
    if not isinstance(mapping, dict):
        raise DataError(f"{file} must map image file names to captions, e.g. {{\"cat.jpg\": \"A cat ...\"}}")
    for name, caption in mapping.items():
        problem = _row_problem({"name": name, "caption": caption}, "caption")
        if problem:
            report_bad_row(str(name), str(file), f"entry {name!r}: {problem}")
            continue
        names.append(str(name))
        captions.append(caption)
        ids.append(None)
    return names, captions, ids


def _row_problem(row: dict, column: str) -> str | None:
    """Why a mapping row cannot be used (a caption that is not text, a lone surrogate), or None."""
    try:
        as_captions(row[column])
        bad = lone_surrogate(row)
        if bad:
            raise ValueError(f"holds a lone surrogate ({bad}, an unpaired \\u escape), which is not valid text")
    except (TypeError, ValueError) as error:
        return str(error).split("; ")[0]
    return None


def _find_image(root: Path, name: str) -> Path:
    """``name`` under ``root``; a name without extension (captions.json keyed by stem) is looked up."""
    path = root / name
    if path.suffix or path.exists():
        return path
    for extension in sorted(IMAGE_EXTENSIONS):
        candidate = path.with_suffix(extension)
        if candidate.exists():
            return candidate
    return path


@register_source(
    "imagefolder",
    description="a folder of images with NAME.txt captions beside them, or a metadata.jsonl / captions.json mapping",
)
def build_imagefolder(spec: SourceSpec) -> datasets.Dataset:
    """Image-folder source (split: the ``SPLIT/`` sub-folder).

    Captions come from, in order of precedence: ``metadata.jsonl`` (one ``{"file_name": ...,
    CAPTION_COLUMN: ...}`` per line, as ``datasets``' imagefolder writes it), ``captions.json``
    (``{file name or stem: caption}``), or a ``NAME.txt`` beside each ``NAME.jpg``. With a
    mapping, its entries are the examples (a listed file that is missing is counted as
    missing); otherwise every image in the folder tree is, broken symbolic links included, and one
    without a ``.txt`` gets an empty caption (counted as such). A broken link, for an image or its
    caption file, is skipped and counted like a missing file (or stops loading with
    ``on_error="raise"``), never dropped from the listing. Ids are the image paths relative to the folder, without
    extension. Written by hand because ``datasets``' imagefolder reads neither ``.txt``
    captions nor ``captions.json``.
    """
    root = _require_path(spec)
    if not root.is_dir():
        raise DataError(f"data source 'imagefolder': path {str(root)!r} is a file; set path to the folder of images")
    if spec.split:
        if not (root / spec.split).is_dir():
            raise DataError(f"data source 'imagefolder': no {spec.split!r} folder in {str(root)!r} for split {spec.split!r}")
        root = root / spec.split
    mapping_file = next((root / n for n in ("metadata.jsonl", "captions.json") if (root / n).is_file()), None)
    if mapping_file is not None:
        names, captions, given_ids = _read_mapping(mapping_file, spec)
        paths = [_find_image(root, name) for name in names]
    else:
        paths = image_files(root)  # broken symbolic links included: validation skips and counts them
        readable, captions = [], []
        for path in paths:
            text_file = path.with_suffix(".txt")
            link_problem = broken_link_reason(text_file)
            if link_problem is not None:  # skipped or raised per data.on_error, like an unreadable caption
                report_bad_row(path.relative_to(root).with_suffix("").as_posix(), str(text_file),
                               f"caption file: {link_problem}")
                continue
            try:
                captions.append(read_utf8_text(text_file).strip() if text_file.is_file() else "")
            except DataError as error:  # names the file and line; skipped or raised per data.on_error
                report_bad_row(path.relative_to(root).with_suffix("").as_posix(), str(text_file),
                               str(error).removeprefix(f"{text_file}: "))
                continue
            readable.append(path)
        if paths and not readable:
            raise DataError(f"data source 'imagefolder': no caption file in {str(root)!r} is readable as UTF-8")
        paths = readable
        given_ids = [None] * len(paths)
    if not paths:
        raise DataError(
            f"data source 'imagefolder': no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) in {str(root)!r}"
        )
    ids = [
        given if given is not None else path.relative_to(root).with_suffix("").as_posix()
        for path, given in zip(paths, given_ids)
    ]
    columns: dict[str, list] = {"id": ids, "image": [str(p) for p in paths]}
    if any(isinstance(c, list) for c in captions):
        columns["captions"] = [c if isinstance(c, list) else [c] for c in captions]
        columns["caption"] = [_first_non_empty(c) for c in columns["captions"]]
    else:
        columns["caption"] = list(captions)
    return datasets.Dataset.from_dict(columns)
