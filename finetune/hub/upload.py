"""Push runs to the Hugging Face hub with a model card, and export them as plain model folders; the command line is
:mod:`finetune.cli.hub` (``xlipkit push`` / ``xlipkit export``, ``python -m finetune.hub push|export``).

A run folder (written by ``finetune/run.py``) holds ``recipe.yaml``, ``metrics.json`` and ``final/``
(what :func:`finetune.load_finetuned` opens); a folder written by ``save_finetuned`` can be pushed
on its own too. What is uploaded (:func:`stage_upload`):

- the model folder: for LoRA/DoRA, peft's ``adapter_config.json`` + ``adapter_model.safetensors``,
  ``xlipkit_extra.safetensors`` (stretched positions, logit scale/bias) and ``xlipkit.json``; for a
  full (or ``merge=True``) model, the backend's native folder plus ``xlipkit.json``;
- the modules the model needs at inference (``model.inference_modules``, e.g. a term's head):
  ``xlipkit_inference.json`` + ``xlipkit_inference.safetensors``, as ``save_finetuned`` wrote them;
- the tokenizer and image processor (``model_max_length`` = the stretched length);
- ``recipe.yaml`` and ``metrics.json`` of the run, and a generated ``README.md`` model card
  (:mod:`finetune.hub.model_card`).

The load side is :func:`finetune.load_finetuned`, which takes a hub id (and ``revision=``).

The token comes from the ``token`` argument, ``HF_TOKEN`` or the ``huggingface_hub`` login; it is
never printed, logged or written: ``hub.token`` keys are dropped from every uploaded copy of the
recipe, and a push stops before uploading if the token string is still found in any staged file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from finetune.config.secrets import clean_recipe, mask_secrets, secret_values
from finetune.credentials import mask_data
from finetune.files import apply_umask, process_tag, replace_dir
from finetune.hub.model_card import hub_model_id, is_local_path, render_model_card
from finetune.models.adapters import _builtin_kind
from finetune.models.finetuned import load_finetuned, read_info, save_finetuned
from finetune.runs.lock import LOCK_NAME

log = logging.getLogger("xlipkit")

FORMATS = ("auto", "transformers", "open_clip")
INFO_NAME = "xlipkit.json"
RECIPE_NAME = "recipe.yaml"
METRICS_NAME = "metrics.json"
CARD_NAME = "README.md"
INFERENCE_CONFIG = "xlipkit_inference.json"
INFERENCE_WEIGHTS = "xlipkit_inference.safetensors"
_SCAN_CHUNK = 1 << 20


class HubPushError(RuntimeError):
    """A push that did not reach the hub (missing token, network, permission, a secret left in a
    file). The message says what to do; the local run folder is left as it was."""


@dataclass
class RunFolder:
    """What :func:`read_run` found.

    Attributes:
        model_dir: the folder ``load_finetuned`` opens (``RUN/final`` or the folder itself).
        run_dir: the run folder, or None when a bare model folder was given.
        info: ``xlipkit.json`` of ``model_dir``.
        recipe: the resolved recipe (``recipe.yaml`` of the run, else the one in ``xlipkit.json``).
        recipe_text: ``recipe.yaml`` as written, when the run has one.
        metrics: ``metrics.json`` of the run, or None.
    """

    model_dir: Path
    run_dir: Path | None
    info: dict[str, Any]
    recipe: dict[str, Any] | None
    recipe_text: str | None
    metrics: dict[str, Any] | None


def read_run(path: str | os.PathLike) -> RunFolder:
    """Read a run folder (``recipe.yaml``, ``metrics.json``, ``final/``) or a model folder written
    by ``save_finetuned``.

    Raises:
        FileNotFoundError: ``path`` is neither.
        ValueError: ``xlipkit.json``, ``recipe.yaml`` or ``metrics.json`` cannot be parsed.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist or is not a folder: give a run folder (with final/) or a "
                                f"model folder written by save_finetuned")
    if (folder / "final" / INFO_NAME).is_file():
        run_dir, model_dir = folder, folder / "final"
    elif (folder / INFO_NAME).is_file():
        run_dir, model_dir = None, folder
    else:
        raise FileNotFoundError(f"{folder} is neither a run folder (no final/{INFO_NAME}: did the run finish?) nor a "
                                f"model folder written by save_finetuned (no {INFO_NAME})")
    info = read_info(model_dir)
    recipe, recipe_text, metrics = info.get("recipe"), None, None
    if run_dir is not None and (run_dir / RECIPE_NAME).is_file():
        recipe_text = (run_dir / RECIPE_NAME).read_text(encoding="utf-8")
        try:
            recipe = yaml.safe_load(recipe_text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{run_dir / RECIPE_NAME} is not valid YAML: {e}") from e
        if not isinstance(recipe, dict):
            raise ValueError(f"{run_dir / RECIPE_NAME} is not a recipe mapping")
    if run_dir is not None and (run_dir / METRICS_NAME).is_file():
        try:
            metrics = json.loads((run_dir / METRICS_NAME).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{run_dir / METRICS_NAME} is not valid JSON: {e}") from e
    return RunFolder(model_dir, run_dir, info, recipe, recipe_text, metrics)


# -- secrets -----------------------------------------------------------------------------------------
def _drop_hub_token(recipe: Any) -> tuple[Any, bool]:
    """A copy of a recipe dict as an uploaded file may hold it (:func:`finetune.config.secrets.clean_recipe`: without
    ``hub.token``, storage credentials and credentials inside URLs masked), and whether that changed it (a run
    written by an older version may hold them)."""
    if not isinstance(recipe, dict):
        return recipe, False
    clean = clean_recipe(recipe)
    return clean, clean != recipe


def _clean_recipe_text(text: str, recipe: dict[str, Any]) -> str:
    """``recipe.yaml`` without ``hub.token`` and with storage credentials masked: the text as written when its
    recipe has none, else the leading comment lines followed by the recipe dumped again; either way with every
    secret in it masked by key (:func:`finetune.config.secrets.mask_secrets`): a ``# overrides:`` line written by
    an older version may hold ``hub.token=...`` or ``'hub={token: ...}'``."""
    clean, had = _drop_hub_token(recipe)
    if had:
        header = []
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        body = yaml.safe_dump(clean, sort_keys=False, allow_unicode=True, default_flow_style=None)
        text = "\n".join(header) + ("\n" if header else "") + body
    return mask_secrets(text, secret_values(recipe))


def _files_containing(folder: Path, secret: str) -> list[str]:
    """Relative paths of the files under ``folder`` whose bytes contain ``secret``."""
    needle = secret.encode()
    hits = []
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        tail = b""
        with open(file, "rb") as fh:
            while chunk := fh.read(_SCAN_CHUNK):
                if needle in tail + chunk:
                    hits.append(str(file.relative_to(folder)))
                    break
                tail = chunk[-(len(needle) - 1):] if len(needle) > 1 else b""
    return hits


def _scrub(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def resolve_token(token: str | None = None) -> str:
    """The hub token: ``token``, else ``HF_TOKEN``, else the ``huggingface_hub`` login.

    Raises:
        HubPushError: none of the three is set (the message says how to set one).
    """
    from huggingface_hub import get_token

    found = token or get_token()
    if not found:
        raise HubPushError("no Hugging Face token: set HF_TOKEN to a token with write access "
                           "(https://huggingface.co/settings/tokens) or run `hf auth login`, then push again")
    return found


# -- staging -----------------------------------------------------------------------------------------
def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def _save_preprocessing(model: Any, folder: Path) -> None:
    """Tokenizer (with the stretched ``model_max_length``) and image processor of ``model``, in the
    backend's own format: transformers files for HF models and open_clip HF tokenizers; open_clip's
    own BPE tokenizer and transforms are rebuilt from the base model's config and need no file."""
    if _builtin_kind(model) == "hf":
        model.tokenizer.save_pretrained(str(folder))
        model.image_processor.save_pretrained(str(folder))
        return
    inner = getattr(model.tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "save_pretrained"):
        inner.save_pretrained(str(folder))


def _check_portable_base(run: RunFolder, merge: bool, base_model: str | None) -> None:
    base = str(run.info.get("base_model"))
    if run.info["kind"] != "adapter" or merge or base_model or not is_local_path(base):
        return
    raise ValueError(f"the adapter in {run.model_dir} was trained on the local base model {base!r}, which nobody else "
                     f"can load: push the merged model instead (merge=True / --merge), or, if that folder is a copy "
                     f"of a hub model, name it with base_model='org/name' / --base-model org/name")


#: written into every folder that ``export`` and ``stage_upload`` write: ``overwrite`` replaces only such a folder
MARKER_NAME = ".xlipkit-output.json"
#: what the marker says wrote the folder, per command
_WRITERS = {"export": "xlipkit export", "stage": "xlipkit push --stage-only"}


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _runs_inside(folder: Path) -> list[Path]:
    """The run and model folders in ``folder`` (itself included, but for the model files an output folder holds at
    its top): a folder holding ``final/``, ``checkpoints/`` or a run lock, or a ``save_finetuned`` folder below the
    top. Symbolic links are not followed."""
    found = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        if {"final", "checkpoints"} & set(dirs) or LOCK_NAME in files or (here != folder and INFO_NAME in files):
            found.append(here)
    return found


def _check_output(dest: str | os.PathLike, overwrite: bool, *, sources: list[Path], command: str) -> Path:
    """The output folder of ``export`` / ``stage_upload``, checked before anything is loaded or written.

    Refused: an output that is, holds or lies inside a source folder (paths resolved, symbolic links followed); a
    file; a non-empty folder without ``overwrite``; with ``overwrite``, a non-empty folder that this command did not
    write (no :data:`MARKER_NAME` naming it) or that holds a run or a model folder.

    Raises:
        ValueError: the output and a source overlap.
        FileExistsError: the output is a file, or a non-empty folder that may not be replaced.
    """
    target = Path(dest).expanduser()
    where = target.resolve()
    writer = _WRITERS[command]
    for source in sources:
        src = source.resolve()
        if where == src:
            relation = "is"
        elif where.is_relative_to(src):
            relation = "lies inside"
        elif src.is_relative_to(where):
            relation = "holds"
        else:
            continue
        raise ValueError(f"the output folder {target} {relation} the folder being read ({source}), which writing "
                         f"there would change or delete; give a folder outside it (e.g. exported/{src.name})")
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is a file; give a folder path")
    if not target.is_dir() or not any(target.iterdir()):
        return target
    if not overwrite:
        raise FileExistsError(f"{target} exists and is not empty; give a new folder, or pass overwrite=True "
                              f"(--overwrite) to replace a folder that {writer} wrote before")
    marker = _read_marker(target)
    if marker is None or marker.get("written_by") != writer:
        wrote = f"{marker.get('written_by')} wrote it" if marker and marker.get("written_by") else \
            f"it holds no {MARKER_NAME}"
        raise FileExistsError(f"{target} was not written by {writer} ({wrote}), so --overwrite does not replace it: "
                              "give a new folder, or remove that one yourself if it holds nothing you need")
    runs = _runs_inside(target)
    if runs:
        raise FileExistsError(f"{target} holds a run or model folder ({', '.join(str(r) for r in runs[:3])}), which "
                              "--overwrite never deletes; give a new folder")
    return target


def _write_into(target: Path, build: Callable[[Path], Any], *, command: str, source: Path) -> None:
    """Build the output in a temporary folder beside ``target`` (``build(folder)``), mark it as written by
    ``command`` and put it in place of ``target`` (atomically); on any error ``target`` is left as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{process_tag()}.", dir=target.parent))
    try:
        folder = work / "out"
        build(folder)
        _write_json(folder / MARKER_NAME, {"written_by": _WRITERS[command], "source": str(source.resolve())})
        apply_umask(folder)
        replace_dir(folder, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stage_upload(
    run_dir_or_folder: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    repo_id: str,
    base_model: str | None = None,
    merge: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write the folder that :func:`push` uploads into ``dest`` (atomically), without network.

    The model is loaded with ``load_finetuned`` first, so a run that does not load is caught here.

    Args:
        run_dir_or_folder: a run folder or a model folder written by ``save_finetuned``.
        dest: a new (or empty) folder, outside the run folder (it may neither be, hold nor lie inside it).
        repo_id: the hub repository the card's snippets name (``user/name``).
        base_model: the hub id of the base when the run loaded it from a local copy; recorded in the
            uploaded ``xlipkit.json`` and ``adapter_config.json`` so that others can load it.
        merge: upload the adapter merged into its base (a plain transformers / open_clip model).
        overwrite: replace a non-empty ``dest`` that an earlier ``stage_upload`` wrote (it holds
            :data:`MARKER_NAME`, which :func:`push` does not upload) and that holds no run or model folder.

    Returns:
        ``dest``.

    Raises:
        ValueError: a bad ``repo_id``; an adapter whose base is a local path (use ``merge`` or
            ``base_model``); ``dest`` is, holds or lies inside the run or model folder.
        FileNotFoundError: not a run or model folder.
        FileExistsError: ``dest`` is not empty and ``overwrite`` is false, or it is a folder that
            ``overwrite`` may not replace.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"repo_id {repo_id!r} is not a hub repository id: use 'user/name' ({e})") from None
    if "/" not in repo_id:
        raise ValueError(f"repo_id {repo_id!r} has no namespace: use 'user/name' or 'org/name'")
    if base_model is not None:
        if hub_model_id(base_model) is None:
            raise ValueError(f"base_model {base_model!r} is not a hub model id ('org/name')")
    run = read_run(run_dir_or_folder)
    _check_portable_base(run, merge, base_model)
    source = Path(run_dir_or_folder).expanduser()
    target = _check_output(dest, overwrite, sources=_sources(source, run), command="stage")
    _write_into(target, lambda folder: _build_upload(run, folder, repo_id=repo_id, base_model=base_model, merge=merge),
                command="stage", source=source)
    return target


def _sources(given: Path, run: RunFolder) -> list[Path]:
    """The folders an output must stay clear of: the one given, its run folder and its model folder."""
    return [given, *([run.run_dir] if run.run_dir is not None else []), run.model_dir]


def _build_upload(run: RunFolder, folder: Path, *, repo_id: str, base_model: str | None, merge: bool) -> None:
    info = run.info
    recipe, _ = _drop_hub_token(run.recipe)
    merged = merge and info["kind"] == "adapter"
    if merged:
        model = load_finetuned(run.model_dir, merge=True)
        model.name_or_path = base_model or info["base_model"]  # recorded as the merged model's origin
        save_finetuned(model, folder, recipe=_drop_hub_token(info.get("recipe"))[0])
    else:
        shutil.copytree(run.model_dir, folder)
        (folder / CARD_NAME).unlink(missing_ok=True)  # peft's generic card; ours replaces it
        if info["kind"] == "adapter":
            _save_preprocessing(load_finetuned(run.model_dir), folder)
    uploaded = json.loads((folder / INFO_NAME).read_text(encoding="utf-8"))
    uploaded["recipe"] = _drop_hub_token(uploaded.get("recipe"))[0]
    if base_model:
        uploaded["base_model"] = base_model
        peft_cfg = folder / "adapter_config.json"
        if peft_cfg.is_file():
            cfg = json.loads(peft_cfg.read_text(encoding="utf-8"))
            cfg["base_model_name_or_path"] = base_model
            _write_json(peft_cfg, cfg)
    _write_json(folder / INFO_NAME, uploaded)

    recipe_text = _clean_recipe_text(run.recipe_text, run.recipe) if run.recipe_text is not None else None
    if recipe_text is not None:
        (folder / RECIPE_NAME).write_text(recipe_text, encoding="utf-8")
    metrics = None
    if run.metrics is not None:
        metrics = mask_data(dict(run.metrics))  # the stream's shard urls may hold credentials
        metrics["recipe"] = _drop_hub_token(run.metrics.get("recipe"))[0]
        _write_json(folder / METRICS_NAME, metrics)
    source_info = {**info, "base_model": base_model or info["base_model"]}
    card = render_model_card(uploaded, repo_id=repo_id, recipe=recipe, recipe_text=recipe_text, metrics=metrics,
                             source_info=source_info)
    (folder / CARD_NAME).write_text(card, encoding="utf-8")


# -- push ----------------------------------------------------------------------------------------------
def _advice(exc: BaseException) -> str:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    name = type(exc).__name__
    if name == "OfflineModeIsEnabled":
        return "HF_HUB_OFFLINE is set: unset it (and check the network) to push"
    if status in (401, 403):
        return "the token was refused: check that it is valid and has write access to this namespace"
    if status == 404:
        return "the repository or namespace was not found: check the repo id (user or organisation name)"
    if isinstance(exc, (ConnectionError, TimeoutError)) or "connect" in name.lower() or "timeout" in name.lower():
        return "the hub could not be reached: check the network connection"
    return "see the error above"


def push(
    run_dir_or_folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = True,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    base_model: str | None = None,
    merge: bool = False,
) -> Any:
    """Upload a run (or a ``save_finetuned`` folder) to the hub with a generated model card.

    Creates the model repository if needed (private by default) and the ``revision`` branch if it
    does not exist, stages the upload folder (:func:`stage_upload`) in a temporary folder, checks
    that no staged file holds the token, and uploads it in one commit with
    ``huggingface_hub.HfApi.upload_folder``. Others load the result with
    ``finetune.load_finetuned(repo_id)``.

    Args:
        run_dir_or_folder: a run folder (``recipe.yaml``, ``metrics.json``, ``final/``) or a model
            folder written by ``save_finetuned``.
        repo_id: ``user/name`` or ``org/name``.
        private: create the repository private (an existing one keeps its visibility).
        token: a hub token with write access; default ``HF_TOKEN`` or the ``huggingface_hub`` login.
        revision: the branch to commit to (created from main when missing); default main.
        commit_message: default ``"Upload <run name> with xlipkit"``.
        base_model, merge: as in :func:`stage_upload`.

    Returns:
        the ``huggingface_hub.CommitInfo`` of the upload (``commit_url``, ``oid``).

    Raises:
        HubPushError: no token, the hub refused or could not be reached, or the token was found in
            a file to upload. The run folder is left as it was; the message says what to do.
        ValueError, FileNotFoundError: bad arguments or not a run folder (nothing was uploaded).
    """
    from huggingface_hub import HfApi

    secret = resolve_token(token)
    source = Path(run_dir_or_folder)
    retry = f"python -m finetune.hub push {source} --repo-id {repo_id}"
    with tempfile.TemporaryDirectory(prefix="xlipkit-push-") as tmp:
        folder = stage_upload(source, Path(tmp) / "upload", repo_id=repo_id, base_model=base_model, merge=merge)
        (folder / MARKER_NAME).unlink()  # says who wrote a staged folder on disk; not part of the model
        leaked = _files_containing(folder, secret)
        if leaked:
            raise HubPushError(f"the hub token was found in {', '.join(leaked)} (copied from {source}): remove it "
                               f"from those files (tokens belong in HF_TOKEN, not in run files) and push again; "
                               f"nothing was uploaded")
        api = HfApi(token=secret)
        message = commit_message or f"Upload {source.resolve().name} with xlipkit"
        log.info("pushing %s to the hub repository %s (revision %s)", source, repo_id, revision or "main")
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            if revision and revision != "main":
                api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
            info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=message,
                                     revision=revision, repo_type="model")
        except Exception as e:  # any hub or network failure becomes one clear, token-free message
            detail = _scrub(f"{type(e).__name__}: {e}", secret).splitlines()[0]
            raise HubPushError(f"push of {source} to {repo_id} failed ({detail}); {_advice(e)}. The run folder "
                               f"{source} is unchanged; retry with `{retry}`") from None
    log.info("pushed to %s", getattr(info, "commit_url", repo_id))
    return info


# -- export --------------------------------------------------------------------------------------------
def export(
    run_dir_or_folder: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    format: str = "auto",
    overwrite: bool = False,
) -> Path:
    """Write the run's model with its adapter merged into the base as a plain model folder.

    ``transformers``: ``config.json`` (``max_position_embeddings`` = the stretched length),
    ``model.safetensors``, tokenizer (``model_max_length`` likewise) and image processor, which
    ``CLIPModel`` / ``SiglipModel`` / ``Siglip2Model.from_pretrained`` load without xlipkit and
    without ``strict=False``. ``open_clip``: ``open_clip_config.json`` (``context_length`` = the
    stretched length) and ``open_clip_model.safetensors``, which
    ``open_clip.create_model_and_transforms("local-dir:OUT_DIR")`` loads. A model of another
    registered family is written by that family's saver. All also hold ``xlipkit.json``, so
    ``finetune.load_finetuned(OUT_DIR)`` works too. Modules the model needs at inference beyond
    its towers (``model.inference_modules``, e.g. FLAIR's pool) are written beside it
    (``xlipkit_inference.json`` + ``.safetensors``), which plain transformers / open_clip do not
    read: the log says so.

    Args:
        run_dir_or_folder: a run folder or a model folder written by ``save_finetuned``.
        out_dir: a new (or empty) folder, outside the run folder (it may neither be, hold nor lie inside it).
        format: ``"auto"`` (the run's model family's own format), ``"transformers"`` (``hf``) or
            ``"open_clip"``.
        overwrite: replace a non-empty ``out_dir`` that an earlier ``export`` wrote (it holds
            :data:`MARKER_NAME`) and that holds no run or model folder.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: an unknown format, or one that is not the run's backend (xlipkit does not
            convert between transformers and open_clip weights); ``out_dir`` is, holds or lies
            inside the run or model folder.
        FileNotFoundError: not a run or model folder.
        FileExistsError: ``out_dir`` is not empty and ``overwrite`` is false, or it is a folder that
            ``overwrite`` may not replace.
    """
    if format not in FORMATS:
        raise ValueError(f"format {format!r} is not one of {FORMATS}")
    run = read_run(run_dir_or_folder)
    backend = run.info.get("model_family") or run.info["backend"]
    native = {"open_clip": "open_clip", "hf": "transformers"}.get(backend, backend)
    if format not in ("auto", native):
        raise ValueError(f"{run.model_dir} is a {native} model (model family {backend!r}); it exports to format "
                         f"{native!r} only" + (f": use --format {native}" if native in FORMATS else
                                               ": use --format auto"))
    source = Path(run_dir_or_folder).expanduser()
    target = _check_output(out_dir, overwrite, sources=_sources(source, run), command="export")
    model = load_finetuned(run.model_dir, merge=run.info["kind"] == "adapter")
    model.name_or_path = run.info["base_model"]
    _write_into(target, lambda folder: save_finetuned(model, folder, recipe=_drop_hub_token(run.info.get("recipe"))[0]),
                command="export", source=source)
    log.info("exported %s to %s (%s format, %d text positions)", run.model_dir, target, native, model.max_text_len)
    if len(model.inference_modules):
        log.info("the model's inference modules (%s) are written beside it in %s + %s: finetune.load_finetuned(%r) "
                 "restores them, plain %s does not read them", ", ".join(model.inference_modules), INFERENCE_CONFIG,
                 INFERENCE_WEIGHTS, str(target), native)
    return target
