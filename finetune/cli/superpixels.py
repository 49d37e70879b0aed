"""``xlipkit superpixels RECIPE OUT``: F-CAST's superpixels computed once, into a copy of a recipe's webdataset shards.

    xlipkit superpixels recipes/fcast_cc3m_recap.yaml data/cc3m_recap_sfcn --device cuda --workers 4
    xlipkit train recipes/fcast_cc3m_recap.yaml data.train.urls="data/cc3m_recap_sfcn/{00000..00331}.tar"

Without it every epoch computes every image's superpixels again in the data workers (SLIC or SEEDS at about a
tenth of a second per 224 px image per core, SFCN one network forward per image on a core): F-CAST's 32 epochs
would be data-bound. This command reads the shards that ``data.train.urls`` names, and writes each one again under
``OUT`` with the same members plus ``KEY.superpixels.png``: the sample's superpixel labels, computed by the
recipe's method and settings (the model's, with ``objective.terms.fcast.superpixels`` applied, exactly as the run
resolves them) on the image as the encoder sees it (resize and centre crop), as a lossless PNG stamped with those
settings (:func:`finetune.preprocess.superpixels.settings_stamp`). A run on the new shards reads the labels back in
its data workers and computes none (:meth:`finetune.objectives.fcast.FCastTerm.stream_map`); an entry made with
other settings stops the run with an error naming both.

SFCN (F-CAST's method) runs in batches of ``--batch-size`` on ``--device`` (a GPU); SLIC and SEEDS are CPU
algorithms, one image at a time. ``--workers`` processes each write whole shards. A shard is written to a temporary
file and renamed when complete, so an interrupted run is continued by running the command again (written shards are
kept when ``OUT/superpixels.json``, written before the first shard, records the same settings). Samples whose image
does not decode are copied without an entry (the stream skips them as bad examples, as it would have).

``OUT`` is checked before anything slow: it may not be a file, nor a folder that cannot be written, nor the folder of
an input shard (its shards would be written over), nor hold a shard this command did not write (no
``superpixels.json``): such a file is never kept as if it were a copy, nor replaced by ``--overwrite``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST", "ShardJob", "main", "precompute", "resolve_settings", "write_shard"]

log = logging.getLogger("xlipkit")

#: the file in ``OUT`` that records the settings, the source shards and the counts
MANIFEST = "superpixels.json"
_SAMPLE_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext, as datasets splits members


def resolve_settings(recipe: Any) -> tuple[Any, int]:
    """The superpixel settings and input side a run of ``recipe`` computes superpixels with: its model as loaded,
    with the ``fcast`` term's ``superpixels`` overrides applied (``FCastTerm.prepare_model``).

    Returns:
        ``(SuperpixelSettings, image_size)``.
    Raises:
        ValueError: the recipe is not an F-CAST recipe (no ``fcast`` term, or not an F-CAST model).
    """
    from finetune.models.finetuned import load_model
    from finetune.models.families import recipe_family

    terms = _fcast_terms(recipe)
    m = recipe.model
    model = load_model(m.name_or_path, family=recipe_family(m), max_text_len=m.max_text_len,
                       trust_remote_code=m.trust_remote_code)
    terms[0].prepare_model(model)  # the term's superpixel overrides, checked against the model
    return model.superpixels, int(model.image_size)


def _fcast_terms(recipe: Any) -> list[Any]:
    """The recipe's ``fcast`` terms (its objective built, no model loaded).

    Raises:
        ValueError: there is none.
    """
    from finetune.objectives import build_objective
    from finetune.objectives.fcast import FCastTerm

    terms = [t for t in build_objective(recipe.objective).all_terms if isinstance(t, FCastTerm)]
    if not terms:
        raise ValueError("xlipkit superpixels is for F-CAST recipes: the recipe's objective has no fcast term "
                         "(objective.terms.fcast)")
    return terms


@dataclass(frozen=True)
class ShardJob:
    """One input shard and where its copy goes, with everything a worker process needs (picklable).

    Attributes:
        source: the input shard (a path or an fsspec url).
        target: the output ``.tar`` path.
        settings: the ``SuperpixelSettings`` fields.
        image_size: the encoder's input side.
        stamp: :func:`~finetune.preprocess.superpixels.settings_stamp` of the two.
        image_key: the recipe's ``data.train.image_column`` (``image``: the first webdataset image key).
        device: where SFCN runs (None: the CPU).
        batch_size: images per SFCN forward.
        max_image_pixels: ``data.max_image_pixels``.
        options: ``data.train.options.storage_options`` (fsspec's keyword arguments for a remote shard).
        policy: how the shard may be read (:class:`~finetune.data.streams.urls.ReadPolicy`: ``pipe:`` commands, the
            timeout of a remote read).
    """

    source: str
    target: str
    settings: dict
    image_size: int
    stamp: str
    image_key: str = "image"
    device: str | None = None
    batch_size: int = 64
    max_image_pixels: int | None = None
    options: dict | None = None
    policy: Any = None


def _samples(fileobj: Any) -> Any:
    """``(key, [(TarInfo, bytes), ...])`` of a webdataset tar stream, a sample's members together, in order; members
    that are not ``KEY.EXT`` files come as ``(None, [member])``."""
    key, members = None, []
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for info in tar:
            data = tar.extractfile(info).read() if info.isfile() else None
            match = _SAMPLE_KEY.match(info.name) if info.isfile() else None
            sample = match.group(1) if match else None
            if members and (sample is None or sample != key):
                yield key, members
                members = []
            if sample is None:
                yield None, [(info, data)]
                key = None
                continue
            key = sample
            members.append((info, data))
    if members:
        yield key, members


def _image_member(members: list[tuple[tarfile.TarInfo, bytes]], image_key: str) -> bytes | None:
    """The bytes of the sample's image entry: ``image_key``, or (``image``, the default) the first of the stream's
    webdataset image keys (``jpg``, ``jpeg``, ``png``, ...), as :class:`~finetune.data.streams.ExampleStream` picks."""
    from finetune.data.streams import WEBDATASET_IMAGE_KEYS

    fields = {_SAMPLE_KEY.match(info.name).group(2): data for info, data in members}
    candidates = (image_key, *WEBDATASET_IMAGE_KEYS) if image_key == "image" else (image_key,)
    return next((fields[k] for k in candidates if k in fields), None)


def write_shard(job: ShardJob) -> dict[str, int]:
    """Copy one shard with a ``KEY.superpixels.png`` entry per sample (see the module docstring).

    Returns:
        ``{"samples", "with_superpixels", "unreadable"}`` counts.
    Raises:
        OSError / tarfile.TarError: the input cannot be read (the partial output is removed).
    """
    from finetune.data.images import ImageReadError, read_image, set_max_image_pixels
    from finetune.data.streams.urls import open_shard
    from finetune.preprocess.superpixels import (ENTRY, compute_superpixels_batch, encode_entry, encoder_view,
                                                 settings_from)

    if job.max_image_pixels is not None:
        set_max_image_pixels(job.max_image_pixels)
    settings = settings_from(job.settings)
    counts = {"samples": 0, "with_superpixels": 0, "unreadable": 0}
    target = Path(job.target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    pending: list[tuple[str | None, list, Any]] = []  # (key, members, encoder view or None)
    queued = [0]  # images in ``pending``

    def flush(out: tarfile.TarFile) -> None:
        views = [view for _, _, view in pending if view is not None]
        labels = iter(compute_superpixels_batch(views, settings, device=job.device) if views else [])
        for key, members, view in pending:
            for info, data in members:
                out.addfile(info, io.BytesIO(data) if data is not None else None)
            if view is not None:
                png = encode_entry(next(labels), job.stamp)
                info = tarfile.TarInfo(f"{key}.{ENTRY}")
                info.size, info.mtime, info.mode = len(png), members[0][0].mtime if members else 0, 0o644
                out.addfile(info, io.BytesIO(png))
                counts["with_superpixels"] += 1
        pending.clear()
        queued[0] = 0

    try:
        with open_shard(job.source, job.options, job.policy) as src, tarfile.open(tmp, "w") as out:
            for key, members in _samples(src):
                if key is None:
                    pending.append((None, members, None))
                    continue
                counts["samples"] += 1
                members = [(i, d) for i, d in members if _SAMPLE_KEY.match(i.name).group(2) != ENTRY]  # a rerun's
                data = _image_member(members, job.image_key)
                view = None
                if data is not None:
                    try:
                        view = encoder_view(read_image(data), job.image_size)
                    except (ImageReadError, OSError, ValueError):
                        view = None
                if view is None:
                    counts["unreadable"] += 1
                pending.append((key, members, view))
                queued[0] += view is not None
                if queued[0] >= job.batch_size:
                    flush(out)
            flush(out)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return counts


def _run_job(job: ShardJob) -> tuple[str, dict[str, int]]:
    import torch

    torch.set_num_threads(1)  # one core per worker process: --workers says how many are used
    return job.source, write_shard(job)


def precompute(recipe: Any, out: str | os.PathLike, *, workers: int = 1, device: str | None = None,
               batch_size: int = 64, overwrite: bool = False) -> dict[str, Any]:
    """Write every shard of ``recipe``'s ``data.train`` again under ``out`` with its superpixels (module docstring).

    Args:
        recipe: a loaded recipe whose ``data.train`` is a webdataset stream.
        out: the output folder (created).
        workers: processes writing shards in parallel (1: this process; each uses one CPU thread).
        device: where SFCN runs (``cuda``, ``cuda:1``; None: the CPU); SLIC and SEEDS need the CPU.
        batch_size: images per SFCN forward.
        overwrite: write every shard again, even those a previous run with the same settings wrote.
    Returns:
        the manifest written to ``out/superpixels.json``: settings, stamp, shards, counts, images/s, and ``urls``,
        the value of ``data.train.urls`` that trains on the new shards.
    Raises:
        ValueError: ``data.train`` is not webdataset shards, two shards share a file name, a method that cannot run
            on ``device``, or ``out`` holds shards of other settings (without ``overwrite``).
    """
    from finetune.data.images import DataError
    from finetune.data.streams.urls import check_commands, shard_urls, storage_options
    from finetune.preprocess.superpixels import settings_stamp
    from finetune.training.inputs import read_policy

    spec = recipe.data.train
    if spec.name != "webdataset":
        raise ValueError(
            f"data.train is {spec.name!r}: xlipkit superpixels writes webdataset shards. A map-style training set "
            "has its superpixels cached by the run itself (objective.terms.fcast.cache_superpixels: each image "
            "computed once); convert other streams to webdataset shards first")
    if workers < 1 or batch_size < 1:
        raise ValueError(f"--workers and --batch-size must be >= 1, got {workers} and {batch_size}")
    _fcast_terms(recipe)
    policy = read_policy(recipe)
    try:
        check_commands(spec, policy)
        sources = shard_urls(spec, ".tar")  # local shards checked to exist
        options = storage_options(spec)
    except DataError as error:
        raise ValueError(str(error)) from None
    names = [Path(s.split("?", 1)[0].rstrip("/")).name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError("data.train.urls names shards with the same file name in different folders: their copies "
                         f"would collide in {out}; write them into separate OUT folders")
    folder = _check_out(Path(out).expanduser(), sources, names)
    settings, image_size = resolve_settings(recipe)
    if device is not None and settings.method != "sfcn" and not device.startswith("cpu"):
        raise ValueError(f"--device {device}: superpixels.method {settings.method} runs on the CPU (scikit-image / "
                         "OpenCV); only sfcn runs on a GPU. Leave --device out and raise --workers")
    stamp = settings_stamp(settings, image_size)
    manifest_path = folder / MANIFEST
    if manifest_path.is_file() and not overwrite:
        previous = _read_manifest(manifest_path).get("stamp")
        if previous != stamp:
            raise ValueError(f"{folder} holds shards written with other settings ({previous}; now {stamp}): choose "
                             "another OUT folder, or pass --overwrite to write every shard again")
    _write_manifest(manifest_path, {"stamp": stamp, "settings": asdict(settings), "image_size": image_size,
                                    "source_urls": spec.urls, "finished": False})  # before the first shard
    jobs = [ShardJob(src, str(folder / name), asdict(settings), image_size, stamp, spec.image_column, device,
                     batch_size, getattr(recipe.data, "max_image_pixels", None), options, policy)
            for src, name in zip(sources, names)]
    todo = [j for j in jobs if overwrite or not Path(j.target).is_file()]
    start = time.perf_counter()
    counts = _run_jobs(todo, workers)
    seconds = time.perf_counter() - start
    urls = spec.urls
    pattern = urls if isinstance(urls, str) else None
    manifest = {
        "settings": asdict(settings), "image_size": image_size, "stamp": stamp, "entry": "superpixels.png",
        "source_urls": urls, "shards": len(jobs), "written": len(todo), "kept": len(jobs) - len(todo), **counts,
        "seconds": round(seconds, 3),
        "images_per_s": round(counts["with_superpixels"] / seconds, 2) if seconds else None,
        "workers": workers, "device": device or "cpu", "batch_size": batch_size,
        "urls": str(folder / Path(pattern).name) if pattern else [str(folder / n) for n in names],
        "finished": True,
    }
    _write_manifest(manifest_path, manifest)
    return manifest


def _run_jobs(todo: list[ShardJob], workers: int) -> dict[str, int]:
    """Write the shards of ``todo`` (in this process, or in ``workers`` spawned processes); their summed counts."""
    counts = {"samples": 0, "with_superpixels": 0, "unreadable": 0}
    if workers == 1:
        results = (_run_job(j) for j in todo)
    else:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(min(workers, max(1, len(todo))))
        results = pool.imap_unordered(_run_job, todo)
    try:
        for done, (source, shard_counts) in enumerate(results, 1):
            for k in counts:
                counts[k] += shard_counts[k]
            log.info("superpixels: %d/%d shards (%s: %d samples)", done, len(todo), Path(source).name,
                     shard_counts["samples"])
    finally:
        if workers > 1:
            pool.close()
            pool.join()
    return counts


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path} is not a manifest this command wrote ({error}): choose another OUT folder") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a manifest this command wrote: choose another OUT folder")
    return data


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    tmp = path.with_name(MANIFEST + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _check_out(folder: Path, sources: list[str], names: list[str]) -> Path:
    """``OUT``, created, checked before anything slow (see the module): not a file, writable, not the folder of an
    input shard, and holding no shard that this command did not write.

    Raises:
        ValueError: naming ``OUT`` and what to do.
    """
    from finetune.data.streams.urls import is_remote

    if folder.exists() and not folder.is_dir():
        raise ValueError(f"OUT {folder} is a file: give a folder for the new shards")
    inputs = {Path(s).resolve().parent for s in sources if not is_remote(s)}
    where = folder.resolve()
    if where in inputs:
        raise ValueError(f"OUT {folder} is the folder of the input shards (data.train.urls): the copies would be "
                         f"written over them; give another folder (e.g. {folder.name}_superpixels)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"cannot create OUT {folder}: {error.strerror or error}; give a folder you can write") \
            from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"OUT {folder} cannot be written (permission denied); give a folder you can write")
    if not (folder / MANIFEST).is_file():
        foreign = [n for n in names if (folder / n).exists() or (folder / n).is_symlink()]
        if foreign:
            raise ValueError(
                f"OUT {folder} holds {foreign[0]}{f' and {len(foreign) - 1} more shard(s)' if len(foreign) > 1 else ''}"
                f" that xlipkit superpixels did not write (no {MANIFEST}): they would be kept as if they were copies "
                "with superpixels (or, with --overwrite, replaced); choose an empty OUT folder, or move them away")
    return folder


def _parser(prog: str = "python -m finetune.cli.superpixels") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Compute F-CAST's superpixels once: write the webdataset shards of a recipe's data.train again "
                    "under OUT with a KEY.superpixels.png entry per sample (the recipe's method and settings), which "
                    "a run on those shards reads back instead of computing superpixels in its data workers.",
        epilog="then: xlipkit train RECIPE data.train.urls=OUT/... (the command prints the value)")
    p.add_argument("recipe", metavar="RECIPE", help="an F-CAST recipe whose data.train is webdataset shards")
    p.add_argument("out", metavar="OUT", help="folder for the new shards (and superpixels.json)")
    p.add_argument("overrides", nargs="*", help="recipe overrides as key.sub=value, as given to xlipkit train (before "
                   "or after the options)")
    p.add_argument("--workers", type=int, default=1, help="processes writing shards in parallel (default 1)")
    p.add_argument("--device", default=None, help="where SFCN runs, e.g. cuda (default: the CPU)")
    p.add_argument("--batch-size", type=int, default=64, help="images per SFCN forward (default 64)")
    p.add_argument("--overwrite", action="store_true", help="write every shard again, even ones already written")
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """Command line entry point; returns the exit status (2 for a recipe or usage error)."""
    args = (_parser(prog) if prog else _parser()).parse_intermixed_args(argv)  # overrides after options too
    from finetune.config import RecipeError, load_recipe

    if not logging.getLogger("xlipkit").handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        manifest = precompute(recipe, args.out, workers=args.workers, device=args.device,
                              batch_size=args.batch_size, overwrite=args.overwrite)
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a shard that cannot be read or written (disk full, permissions): named, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    urls = manifest["urls"]
    value = urls if isinstance(urls, str) else "[" + ",".join(urls) + "]"
    print(f"wrote {manifest['written']} shard(s) ({manifest['kept']} kept) to {args.out}: "
          f"{manifest['with_superpixels']} samples with superpixels ({manifest['settings']['method']}), "
          f"{manifest['unreadable']} unreadable, {manifest['images_per_s']} images/s")
    print(f"train on them with: data.train.urls='{value}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
