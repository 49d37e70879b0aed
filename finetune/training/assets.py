"""The assets a recipe needs from outside the toolkit, found before anything slow starts: the models it loads, the
checkpoint files its terms read, the datasets it trains and evaluates on (benchmark files, local folders, stream
shards) and the extras they need. The runs it builds on are :mod:`finetune.training.upstream`'s; the one check
before a run that puts both together is :func:`finetune.training.preflight.preflight`.

:func:`asset_needs` lists them, each :class:`Need` in one of three states: ``ready`` (on disk or in the hub
cache), ``download`` (fetched on first use: ``xlipkit download RECIPE`` fetches it now) and ``missing`` (the
run would stop on it; ``how`` says what to do). :func:`fetch_need` downloads one need through the library that
owns it (``huggingface_hub.snapshot_download`` for models, :mod:`finetune.data.download` for the benchmarks'
official files, ultralytics' ``attempt_download_asset`` for its checkpoints).

A hub model that is not cached is ``download`` when the hub answers within :data:`PROBE_TIMEOUT_S` seconds, and
``missing`` when it does not or when ``HF_HUB_OFFLINE`` is set, with a message that says how to go on: so an
unreachable hub stops a run in seconds instead of retrying for minutes inside ``from_pretrained``. A local model
whose safetensors files cannot be read (empty, truncated, a Git LFS pointer) is ``missing``, naming the file.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config import recipe_to_dict
from finetune.credentials import mask_text
from finetune.extras import EXTRAS, has_extra, install_command

__all__ = ["PROBE_TIMEOUT_S", "Need", "asset_needs", "fetch_need", "fetchable", "hub_offline", "model_need",
           "planning", "weights_need"]

#: seconds a download host gets to answer before it counts as unreachable
PROBE_TIMEOUT_S = 5.0

_STATES = ("ready", "download", "missing")
#: the official files a benchmark downloads when its entry has no ``path:`` (keys of ``OFFICIAL_FILES``)
_DOWNLOADED_WITHOUT_PATH = {
    "docci": ("docci_descriptions", "docci_images"),
    "docci_fg": ("docci_descriptions", "docci_images"),
    "urban1k": ("urban1k",),
}
_COCO_DOWNLOADED = ("coco_annotations_2017", "coco_val2017_images")  # COCO 2017 val only
#: sources read from ``path:`` (a local file or folder); ``synthetic`` needs nothing, streams read ``urls``
_PATH_SOURCES = ("jsonl", "csv", "parquet", "imagefolder", "dci", "flickr30k", "sharegpt4v", "coco", "docci",
                 "docci_fg", "urban1k")
_ULTRALYTICS_ASSETS = "https://github.com/ultralytics/assets/releases"
_ULTRALYTICS_ASSET_PREFIXES = ("FastSAM-", "yolov", "yolo11", "sam_", "mobile_sam")


@dataclass(frozen=True)
class Need:
    """One thing a recipe needs from outside the toolkit.

    Attributes:
        key: the recipe key that asks for it (``model.name_or_path``, ``eval.sets[2].path``, ...), prefixed with
            ``model.init_from -> `` for a need of a run this one builds on.
        what: what it is, in words (``hub model openai/clip-vit-base-patch16``).
        state: ``ready``, ``download`` or ``missing``.
        how: for ``missing``, what to do; for ``download``, where it is fetched from; for ``ready``, where it is.
        fetch: for ``download`` (and a ``missing`` one that only the network, an offline flag or a run that does not
            download it stands in the way of): ``("hub", repo_id, revision)``,
            ``("url", url, sha256, archive, cache_dir)`` or ``("ultralytics", path)``; what :func:`fetch_need` does.
        blocked: why it cannot be fetched now (an offline flag is set, its host does not answer), ``None`` when
            it can or when nothing was asked (:func:`planning`).
    """

    key: str
    what: str
    state: str
    how: str
    fetch: tuple[Any, ...] | None = field(default=None, compare=False)
    blocked: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:  # what is shown never holds a credential (a URL's password, a signature)
        object.__setattr__(self, "what", mask_text(self.what))
        object.__setattr__(self, "how", mask_text(self.how))

    def line(self) -> str:
        """One line for a listing: ``[state] key: what (how)``."""
        return f"[{self.state}] {self.key}: {self.what} ({self.how})"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set to a true value (read now, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


_probes: dict[str, str | None] = {}
#: set while the needs are planned without asking any host (:func:`planning`)
_plan_only: contextvars.ContextVar[bool] = contextvars.ContextVar("xlipkit_needs_plan_only", default=False)


@contextlib.contextmanager
def planning(plan_only: bool = True) -> Iterator[None]:
    """Within it (``plan_only``), no host is asked and the offline flags are not read: what is not there and can be
    fetched is ``download``, as ``xlipkit download`` would fetch it where the network can be reached."""
    token = _plan_only.set(plan_only)
    try:
        yield
    finally:
        _plan_only.reset(token)


def _blocked(url: str, *, datasets: bool = False) -> str | None:
    """Why ``url`` cannot be downloaded now (offline flags, or its host does not answer); ``None`` when it can."""
    if _plan_only.get():
        return None
    flags = ["HF_HUB_OFFLINE"] + (["HF_DATASETS_OFFLINE"] if datasets else [])
    set_flags = [f for f in flags if os.environ.get(f, "").strip().lower() in ("1", "true", "yes", "on")]
    if set_flags:
        return f"{' and '.join(set_flags)} {'is' if len(set_flags) == 1 else 'are'} set"
    return _unreachable(url)


def _unreachable(url: str) -> str | None:
    """Why the host of ``url`` cannot be reached (``None`` when it answers), asked once per host and process."""
    parts = urllib.parse.urlparse(url)
    if parts.scheme == "file":
        return None
    host = f"{parts.scheme}://{parts.netloc}"
    if host not in _probes:
        try:
            urllib.request.urlopen(urllib.request.Request(host, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
            _probes[host] = None
        except urllib.error.HTTPError:  # it answered (403, 405 ...): reachable
            _probes[host] = None
        except (OSError, ValueError) as exc:
            _probes[host] = f"{host} cannot be reached ({getattr(exc, 'reason', exc)}; {PROBE_TIMEOUT_S:g} s at most)"
    return _probes[host]


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def _hub_need(key: str, repo: str, revision: str | None, recipe_ref: str | None) -> Need:
    from huggingface_hub import constants, snapshot_download

    what = f"hub model {repo}" + (f" at {revision}" if revision else "")
    try:
        path = snapshot_download(repo, revision=revision, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError, or a revision that is not there)
        pass
    else:
        return weights_need(key, what, Path(path), f"in the hub cache: {path}")
    command = f"xlipkit download {recipe_ref}" if recipe_ref else f"hf download {repo}"
    fix = (f"run `{command}` where the hub can be reached, then run with HF_HUB_OFFLINE=1 "
           f"and the same cache (HF_HOME / HF_HUB_CACHE, now {constants.HF_HUB_CACHE}); or set {key} to a local "
           "folder")
    why = _blocked(_hub_endpoint())
    if why is not None:
        fix += "" if hub_offline() else "; with no network, set HF_HUB_OFFLINE=1 so that nothing waits on the hub"
        return Need(key, what, "missing", f"not in the local hub cache and {why}: {fix}", ("hub", repo, revision),
                    blocked=why)
    return Need(key, what, "download", f"from {_hub_endpoint()}, on first use or by `xlipkit download`",
                ("hub", repo, revision))


def weights_need(key: str, what: str, path: Path, where: str) -> Need:
    """A model on disk (a folder or a file, at ``key``; ``where`` says where it is): ``ready``, or ``missing`` when
    one of its safetensors files cannot be read (empty, truncated, a Git LFS pointer:
    :func:`finetune.models.weight_files.check_weight_files` reads their headers only)."""
    from finetune.models.weight_files import DamagedWeightsError, check_weight_files

    try:
        check_weight_files(path)
    except DamagedWeightsError as exc:
        return Need(key, what, "missing", str(exc))
    return Need(key, what, "ready", where)


def _looks_local(name: str) -> bool:
    return (name.startswith((".", "/", "~", "local-dir:")) or name.count("/") > 1
            or name.endswith((".pt", ".pth", ".bin", ".safetensors", ".tar")))


def model_need(name: str, *, key: str = "model", revision: str | None = None) -> Need | None:
    """Whether the model ``name`` (as :func:`finetune.load_model` takes it) is on disk, in the hub cache, can be
    downloaded now or is missing (``HF_HUB_OFFLINE``, or a hub that does not answer: one probe); ``None`` when it
    needs nothing (``random:``, an architecture name). For commands that load a model without a recipe
    (``xlipkit eval MODEL``): a missing one is refused in seconds with what to do."""
    return _model_need(key, name, revision, None)


def _model_need(key: str, name: str, revision: str | None, recipe_ref: str | None, *, bare_hub_ids: bool = False
                ) -> Need | None:
    """A model name as ``finetune.load_model`` reads it: a folder or file, an open_clip name, a hub id (with
    ``bare_hub_ids``, also one without an organisation, ``bert-base-uncased``, as the vision_text towers take)."""
    if name.startswith("random:"):
        return None
    path = Path(name.removeprefix("local-dir:")).expanduser()
    if path.exists():
        return weights_need(key, f"model {name}", path, f"local: {path}")
    if _looks_local(name):
        return Need(key, f"model {name}", "missing", f"the path {str(path)!r} does not exist (relative paths are "
                                                     f"read from {Path.cwd()}); give an existing folder or a hub id")
    if name.startswith("hf-hub:") or name.count("/") == 1 or (bare_hub_ids and ":" not in name):
        return _hub_need(key, name.removeprefix("hf-hub:"), revision, recipe_ref)
    arch, _, tag = name.partition(":")
    if tag:  # an open_clip pretrained tag: its weights live on the hub
        import open_clip

        repo = (open_clip.get_pretrained_cfg(arch.replace("/", "-"), tag) or {}).get("hf_hub", "").strip("/")
        if repo:
            return _hub_need(key, repo, None, recipe_ref)
    return None  # an architecture name: built with random weights, nothing to fetch


def _file_need(key: str, value: str, what: str, how: str, *, extra: str | None = None) -> Iterator[Need]:
    path = Path(value).expanduser()
    if extra is not None and not has_extra(extra):
        e = EXTRAS[extra]
        yield Need(key, f"the `{extra}` extra ({', '.join(e.modules)}, {e.licence})", "missing",
                   f"{install_command(extra)} in the clone, or change {key}")
    if path.exists():
        yield Need(key, f"{what} {value}", "ready", f"local: {path.resolve()}")
    elif extra == "regions" and path.name.startswith(_ULTRALYTICS_ASSET_PREFIXES) and path.suffix == ".pt":
        # a run never downloads it (the term wants the file): missing for a run, fetched by `xlipkit download`
        why = _blocked(_ULTRALYTICS_ASSETS)
        yield Need(key, f"{what} {value}", "missing",
                   f"{path} does not exist (read from {Path.cwd()}); a run does not download it: `xlipkit download` "
                   f"fetches it from the ultralytics assets ({_ULTRALYTICS_ASSETS}) into that path"
                   + (f" where they can be reached (now {why})" if why else "") + f"; or {how}",
                   ("ultralytics", str(path)), blocked=why)
    else:
        yield Need(key, f"{what} {value}", "missing", f"{path} does not exist (read from {Path.cwd()}): {how}")


def _official(names: tuple[str, ...], cache: Path, what: str, key: str) -> Iterator[Need]:
    from finetune.data.benchmarks import OFFICIAL_FILES
    from finetune.data.download import ARCHIVE_SUFFIXES, cached_download

    for name in names:
        url, sha = OFFICIAL_FILES[name]
        archive = url.endswith(ARCHIVE_SUFFIXES)
        found = cached_download(url, cache_dir=cache)
        if found is not None:
            yield Need(key, f"{what}: {Path(url).name}", "ready", f"in the cache: {found}")
            continue
        why = _blocked(url if not url.startswith("hf://") else _hub_endpoint(), datasets=True)
        if why is not None:
            yield Need(key, f"{what}: {Path(url).name}", "missing",
                       f"not in the cache ({cache}) and {why}: download it where it can be reached (`xlipkit "
                       "download`), or set the entry's `path:` to a local copy", ("url", url, sha, archive, str(cache)),
                       blocked=why)
        else:
            yield Need(key, f"{what}: {Path(url).name}", "download",
                       f"from {url}, on first use or by `xlipkit download`", ("url", url, sha, archive, str(cache)))


def _data_needs(key: str, entry: dict[str, Any], cache: Path) -> Iterator[Need]:
    from finetune.data.benchmarks import HOW_TO_GET

    name = entry.get("format") or entry.get("name")
    if _is_stream(entry):
        yield from _stream_needs(key, entry)
        return
    if name not in _PATH_SOURCES:
        return
    path = entry.get("path")
    ids_file = (entry.get("options") or {}).get("ids_file")
    if ids_file:
        yield from _file_need(f"{key}.options.ids_file", ids_file, "id list",
                              "give the file of ids to keep, or remove options.ids_file")
    if path:
        how = HOW_TO_GET.get(name, "point it at the dataset's files") + "; or remove the entry"
        yield from _file_need(f"{key}.path", path, f"{name} files", how)
        return
    protocol_or_split = {entry.get("protocol"), entry.get("split")}
    if name in _DOWNLOADED_WITHOUT_PATH:
        yield from _official(_DOWNLOADED_WITHOUT_PATH[name], cache, name, key)
    elif name == "coco" and "val2017" in protocol_or_split:
        yield from _official(_COCO_DOWNLOADED, cache, name, key)
    else:
        how = HOW_TO_GET.get(name, "give the path of its files")
        yield Need(f"{key}.path", f"{name} files", "missing", f"no `path:` given and it is not downloaded "
                                                              f"automatically: {how}")


def _is_stream(entry: dict[str, Any]) -> bool:
    from finetune.data.sources import SourceSpec

    try:
        return SourceSpec.parse(entry).is_stream
    except ValueError:  # checked when the recipe was loaded
        return False


def _stream_needs(key: str, entry: dict[str, Any]) -> Iterator[Need]:
    """A stream's shards, checked by the run's own check (:func:`finetune.data.streams.check_stream_shards`: local
    shard files listed, not opened; remote ones and ``pipe:`` commands are read as the run trains)."""
    from finetune.data.streams import check_stream_shards

    name = entry.get("format") or entry.get("name")
    where = "urls" if entry.get("urls") is not None else "path"
    try:
        check_stream_shards(entry)
    except ValueError as exc:  # a DataError
        yield Need(f"{key}.{where}", f"{name} shards {entry.get(where)}", "missing", str(exc))


def _term_needs(terms: dict[str, Any], recipe_ref: str) -> Iterator[Need]:
    prefix = "objective.terms"
    sx = terms.get("structxlip")
    if isinstance(sx, dict):
        regions = sx.get("regions") or {}
        if regions.get("checkpoint") and regions.get("source", "segmenter") != "dataset":
            yield from _file_need(f"{prefix}.structxlip.regions.checkpoint", regions["checkpoint"],
                                  "FastSAM checkpoint", "download FastSAM-x.pt or FastSAM-s.pt from the ultralytics "
                                  "assets into that path, or set it to null for the default regions", extra="regions")
        lexicon = (sx.get("lexicon") or {}).get("file")
        if lexicon:
            yield from _file_need(f"{prefix}.structxlip.lexicon.file", lexicon, "lexicon file",
                                  "give the word list, or null for the built-in lexicon")
    fg = terms.get("fastgoal")
    if isinstance(fg, dict):
        regions = fg.get("regions") or {}
        method, detector = regions.get("method"), regions.get("detector")
        if method == "detector" and detector:
            key = f"{prefix}.fastgoal.regions.detector"
            if str(detector).endswith(".pt"):
                yield from _file_need(key, detector, "detector checkpoint", "give an ultralytics YOLO .pt file or a "
                                      "hub id (hustvl/yolos-base)", extra="regions")
            else:
                need = _model_need(key, str(detector), None, recipe_ref)
                if need is not None:
                    yield need
        elif method == "sam" and regions.get("sam_checkpoint"):
            need = _model_need(f"{prefix}.fastgoal.regions.sam_checkpoint", str(regions["sam_checkpoint"]), None,
                               recipe_ref)
            if need is not None:
                yield need
    fc = terms.get("fcast")
    if isinstance(fc, dict):
        sp = fc.get("superpixels") or {}
        if sp.get("method") == "sfcn" and sp.get("checkpoint"):
            yield from _file_need(f"{prefix}.fcast.superpixels.checkpoint", sp["checkpoint"], "SFCN weights",
                                  "put the SFCN (SpixelNet) weights there, or set superpixels.method=slic")


def asset_needs(recipe: Any, recipe_ref: str | None = None) -> list[Need]:
    """Every asset ``recipe`` needs from outside the toolkit (its models, datasets, stream shards, the checkpoint
    files its terms read and the extras they need), without loading a model or a dataset: files on disk and the hub
    cache are looked at; a download host is asked whether it answers (one HEAD request of at most
    :data:`PROBE_TIMEOUT_S` seconds per host) only for what is not there and would be downloaded, and not at all
    under ``HF_HUB_OFFLINE`` or within :func:`planning`. The runs it builds on are not assets
    (:func:`finetune.training.upstream.upstream_needs`).

    Args:
        recipe: a loaded :class:`finetune.config.Recipe`.
        recipe_ref: the recipe (and its overrides) as the commands in messages repeat it (default its file).

    Returns:
        the needs, in recipe order.
    """
    ref = recipe_ref or (str(recipe.source) if recipe.source else "RECIPE")
    d = recipe_to_dict(recipe, keep_secrets=True)  # the values as given (read, never shown: Need masks them)
    needs: list[Need] = []
    model = d["model"]
    if not model.get("init_from"):  # with init_from the start is that run's final/, name_or_path is not loaded
        need = _model_need("model.name_or_path", str(model["name_or_path"]), model.get("revision"), ref)
        needs += [need] if need is not None else []
    for part, name in sorted((model.get("options") or {}).items()):  # vision_text: its two towers
        if part in ("vision", "text") and isinstance(name, str):
            need = _model_need(f"model.options.{part}", name, None, ref, bare_hub_ids=True)
            needs += [need] if need is not None else []
    cache_dir = d["data"].get("cache_dir")
    from finetune.data.download import cache_root

    cache = Path(cache_dir).expanduser() / "xlipkit" if cache_dir else cache_root(None)
    train = d["data"].get("train")
    for i, entry in enumerate(train if isinstance(train, list) else [train] if train else []):
        needs += _data_needs("data.train" + (f"[{i}]" if isinstance(train, list) else ""), entry, cache)
    for i, entry in enumerate(d["eval"].get("sets") or []):
        needs += _data_needs(f"eval.sets[{i}]", entry, cache)
    needs += _term_needs(d["objective"].get("terms") or {}, ref)
    return needs


def fetchable(need: Need) -> bool:
    """Whether ``xlipkit download`` fetches ``need``: one that is ``download``, or a checkpoint a run does not
    download itself but ``xlipkit download`` can (an ultralytics asset); not one whose host was found unreachable
    (``need.blocked``: the same probe answer as ``xlipkit validate``'s)."""
    return (need.fetch is not None and need.blocked is None
            and (need.state == "download" or need.fetch[0] == "ultralytics"))


def fetch_need(need: Need) -> str:
    """Download one need that can be fetched (``need.fetch``); returns where it now is.

    Raises:
        ValueError: ``need`` names nothing to download.
    """
    if need.fetch is None:
        raise ValueError(f"{need.key}: {need.what} is not something to download ({need.how})")
    kind, *args = need.fetch
    if kind == "hub":
        from huggingface_hub import snapshot_download

        repo, revision = args
        return snapshot_download(repo, revision=revision)
    if kind == "url":
        from finetune.data.download import fetch, fetch_archive

        url, sha, archive, cache = args
        return str((fetch_archive if archive else fetch)(url, sha, cache_dir=cache, desc=Path(url).name))
    if kind == "ultralytics":
        from ultralytics.utils.downloads import attempt_download_asset

        (path,) = args
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return str(attempt_download_asset(path))
    raise ValueError(f"unknown download kind {kind!r}")
