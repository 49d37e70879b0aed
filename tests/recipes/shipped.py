"""Run a shipped recipe as shipped: only its data and its model size change (issue 23, item 12).

:func:`as_shipped_overrides` gives the ``key=value`` overrides that point a recipe at fixtures and swap its
model for its family's tiny config, and nothing else:

- ``model.name_or_path`` (``model.options.vision`` / ``model.options.text`` for the ``vision_text`` family): the family's
  tiny config, saved like a hub checkpoint where the recipe names a hub id, or the family's tiny registry
  name where it names a registry config (:data:`TINY_REGISTRY`). Registry configs that are already CPU-size
  (``small-clip``, ``small-flair``, ``fcast-tiny``) stay as they are.
- ``data.train`` / ``eval.sets[i]``: ``path`` (``urls`` for webdataset shards) of a fixture in that
  dataset's on-disk format (``tests/finetune/data/fixtures.py``, DreamLIP shards here), with one global batch
  of training examples; the synthetic scenes are generated, so their ``size`` is what changes (one batch
  for training, :data:`SYNTHETIC_EVAL` scenes for an evaluation set).
- ``objective.terms.fastgoal.regions.detector``: a hub id (YOLOS) is pointed at a tiny random-weight YOLOS
  saved like a hub checkpoint. Files a recipe names by a path it cannot have here (FastSAM's
  ``checkpoints/FastSAM-x.pt``, F-CAST's ``checkpoints/sfcn_bsds.safetensors``) are written, tiny and with
  random weights, at that very path under :class:`Project`'s root, the current directory of the run, so the
  recipe's own key and loading code are used unchanged.
- ``train.batch_size`` of the five recipes in :data:`CPU_BATCH` only, whose shipped batch is meant for 8-32
  GPUs (the reason is there).

:func:`changed_keys` compares the resolved recipe with the shipped one; the tests assert that only the keys
above differ (:func:`allowed`), so an override that hides a real path cannot creep in. The recipes a run
builds on (``model.init_from``, ``eval.compare_with``) get the same overrides when the run loads them
(:func:`prerequisites_as_shipped`).

A run is stopped after :data:`STEPS` optimiser steps by :func:`cap_steps`, which lowers the loop's
step count after it is built: the recipe's keys, the learning-rate schedule (built from the recipe's own
``epochs`` / ``max_steps`` and warm-up) and the data loader stay as shipped. ``train.max_steps=2`` would
not do: it changes the schedule (a 2,000-step warm-up inside 2 steps), the recorded recipe, and for
map-style data replaces the epochs -> steps count the recipe relies on.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.finetune.data.fixtures import (
    write_coco_fixture,
    write_dci_fixture,
    write_docci_fixture,
    write_flickr30k_fixture,
    write_urban1k_fixture,
)

ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = ROOT / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))

#: optimiser steps of an as-shipped run
STEPS = 2
#: scenes in a synthetic evaluation set (the benchmark fixtures hold 6-10 test images)
SYNTHETIC_EVAL = 16

#: a registry config -> its family's tiny registry config
TINY_REGISTRY = {"flair-vit-b-16": "tiny-flair", "fcast-b": "fcast-tiny", "fcast-s": "fcast-tiny"}
#: registry configs small enough to train as they are on a CPU (kept)
CPU_REGISTRY = {"small-clip", "small-flair", "fcast-tiny", "tiny-clip", "tiny-flair"}

#: the keys an as-shipped run may change, as ``fnmatch``-like patterns over dotted paths (``*``: one list
#: index or key); everything else must resolve exactly as in the shipped file
ALLOWED_CHANGES = (
    "model.name_or_path", "model.options.vision", "model.options.text",
    "data.train.path", "data.train.urls", "data.train.urls.*",
    "eval.sets.*.path",
    "data.train.size", "eval.sets.*.size",  # the synthetic scenes: generated data, as many as a fixture holds
    "objective.terms.fastgoal.regions.detector",
)

#: the only recipes that do not train at their shipped global batch: the five whose batch (1,024 to 6,144) is
#: meant for 8-32 GPUs. FLAIR's L_tcs and F-CAST's L_part score B x (K + B - 1) text-conditioned image
#: embeddings at once, O(B^2) time and memory in one process: the tiny FLAIR model's loss alone, forward and
#: backward at flair_cc3m_recap's 1,024, peaks at 3.6 GB on the CPU (that case alone took 65 s of CI, the
#: suite's slowest as-shipped run); F-CAST's 2,048 would need about 14 GB and FLAIR's 6,144 about 130 GB. These
#: run at the batch below, every other key as shipped; no code path depends on the batch size beyond its
#: divisibility by processes x accumulation.
CPU_BATCH = {"fcast_cc3m_recap": 64, "flair_cc3m_recap": 64, "flair_cc12m_recap": 64, "flair_merged30m": 64,
             "flair_yfcc15m_recap": 64}

#: DreamLIP's re-captioned fields in the FLAIR / F-CAST shards (KEY.json), pre-split into sentence lists
DREAMLIP_FIELDS = ("raw_caption", "shortIB_captions", "longIB_captions", "shortSV_captions", "longSV_captions",
                   "shortLLA_captions", "longLLA_captions")


def changed_keys(shipped: Any, tested: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two resolved recipes (``recipe_to_dict``) differ (list items by index)."""
    if isinstance(shipped, dict) and isinstance(tested, dict):
        out: list[str] = []
        for key in sorted(set(shipped) | set(tested)):
            out += changed_keys(shipped.get(key), tested.get(key), f"{prefix}{key}.")
        return out
    if isinstance(shipped, list) and isinstance(tested, list) and len(shipped) == len(tested):
        out = []
        for i, (a, b) in enumerate(zip(shipped, tested)):
            out += changed_keys(a, b, f"{prefix}{i}.")
        return out
    return [] if shipped == tested else [prefix.rstrip(".")]


def allowed(key: str, recipe: str = "") -> bool:
    """Whether ``key`` (a dotted path) is one of :data:`ALLOWED_CHANGES` (or ``train.batch_size`` of a recipe
    named in :data:`CPU_BATCH`)."""
    if key == "train.batch_size" and recipe in CPU_BATCH:
        return True
    return any(re.fullmatch(p.replace(".", r"\.").replace("*", r"[^.]+"), key) for p in ALLOWED_CHANGES)


# ------------------------------------------------------------------------------------------ the project


@dataclass
class Project:
    """A folder standing in for a user's checkout: the current directory of every as-shipped run.

    ``recipes/`` links to the shipped recipes (``model.init_from`` / ``eval.compare_with`` name them by
    relative path), ``checkpoints/`` holds the tiny random-weight files the recipes name there, ``runs/``
    the run folders (``output.dir``); fixtures and tiny models are made on first use and kept for the
    session.
    """

    root: Path
    _made: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        link = self.root / "recipes"
        if not link.exists():
            link.symlink_to(RECIPES_DIR, target_is_directory=True)
        self.fixtures = self.root / "fixtures"

    def _once(self, key: str, make) -> Any:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    # -- models --------------------------------------------------------------------------------
    def tiny_model(self, name: str) -> Path:
        """Registry model ``name`` saved like a hub checkpoint (``save_pretrained``)."""
        from finetune.models.registry import save_tiny

        return self._once(f"model:{name}", lambda: save_tiny(name, self.fixtures / "models" / name))

    def towers(self) -> dict[str, Path]:
        from finetune.models.families.vision_text import save_tiny_towers

        return self._once("towers", lambda: save_tiny_towers(self.fixtures / "models" / "towers"))

    def yolo(self) -> Path:
        """An ultralytics detector checkpoint (FLISM's alternative to YOLOS), narrow, random weights."""
        return self._once("yolo", lambda: save_narrow_yolo(self.fixtures / "models" / "yolo.pt"))

    def yolos(self) -> Path:
        """The tiny random-weight YOLOS, saved like ``hustvl/yolos-base``, sure of its boxes (see
        :func:`save_confident_yolos`)."""
        return self._once("yolos", lambda: save_confident_yolos(self.fixtures / "models" / "yolos"))

    # -- files the recipes name by path ----------------------------------------------------------
    def place(self, relative: str) -> None:
        """Write the tiny random-weight version of the file a recipe names at ``relative`` (under the root)."""
        target = self.root / relative
        if target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        name = target.name.lower()
        if "fastsam" in name:
            save_tiny_fastsam(target)
        elif "sfcn" in name:
            save_random_sfcn(target)
        else:
            raise AssertionError(f"no tiny stand-in for {relative!r}: teach tests/recipes/shipped.py to make one")

    # -- data ------------------------------------------------------------------------------------
    def dataset(self, name: str, n_train: int) -> Path:
        """A fixture of benchmark ``name`` with at least ``n_train`` training examples (and small test splits)."""
        n_train = max(n_train, 4)
        key = f"data:{name}:{n_train}"
        folder = self.fixtures / "data" / f"{name}-{n_train}"
        if name in ("docci", "docci_fg"):
            return self._once(f"data:docci:{n_train}", lambda: write_docci_fixture(
                self.fixtures / "data" / f"docci-{n_train}", n_train=n_train, n_test=6, n_qual_test=2))
        if name == "dci":
            return self._once(key, lambda: write_dci_fixture(folder, n_train=n_train, n_valid=2, n_test=4))
        if name == "urban1k":
            return self._once(key, lambda: write_urban1k_fixture(folder, 6))
        if name == "flickr30k":  # five captions an image: the training examples are captions (expand_captions)
            return self._once(key, lambda: write_flickr30k_fixture(folder, n_train=n_train, n_val=1, n_test=6))
        if name == "coco":  # 10 test images: the 1k protocol averages 5 folds of equal size
            return self._once(key, lambda: write_coco_fixture(folder, 0, karpathy=(n_train, 1, 10)))
        if name == "jsonl":  # FAST-GOAL's pairs file: step 1's output on a DOCCI-format fixture
            return self._once(key, lambda: self.pairs(n_train))
        raise AssertionError(f"no fixture for data source {name!r}: add one to tests/recipes/shipped.py")

    def pairs(self, n_images: int) -> Path:
        """A FAST-GOAL pairs file as users build it (``python -m finetune.preprocess.flism``, README step 1): FLISM
        on a DOCCI-format fixture of ``n_images`` training images with the tiny CLIP and its default regions
        (4 quadrants + the centre box)."""
        from finetune import load_model
        from finetune.preprocess.flism import write_pairs

        docci = self.dataset("docci", n_images)
        out = self.fixtures / "data" / f"pairs-{n_images}" / "pairs.jsonl"
        model = load_model(str(self.tiny_model("tiny-clip")), max_text_len=248)
        write_pairs({"name": "docci", "split": "train", "path": str(docci)}, out, model, progress=False)
        return out

    def shards(self, urls: str | list[str], n_examples: int) -> str | list[str]:
        """Webdataset shards in DreamLIP's re-captioned layout for each url pattern, together at least
        ``n_examples`` examples; the patterns keep their form (a list stays a list)."""
        patterns = [urls] if isinstance(urls, str) else list(urls)
        per_pattern = -(-n_examples // len(patterns))
        out = []
        for i, pattern in enumerate(patterns):
            stem = re.sub(r"[^A-Za-z0-9]+", "_", pattern.split("{")[0]).strip("_") or f"shards{i}"
            n_shards = 4
            folder = self.fixtures / "shards" / f"{stem}-{per_pattern}"
            self._once(f"shards:{folder}", lambda f=folder: write_dreamlip_webdataset(
                f, n_shards=n_shards, per_shard=-(-per_pattern // n_shards)))
            out.append(str(folder / f"{{00000..{n_shards - 1:05d}}}.tar"))
        return out[0] if isinstance(urls, str) else out


# ------------------------------------------------------------------------------------------ overrides


def _entry(spec: Any) -> dict:
    from finetune.config import parse_source_shorthand

    return dict(parse_source_shorthand(spec)) if isinstance(spec, str) else dict(spec)


def model_overrides(raw: dict, project: Project) -> list[str]:
    """The model swapped for its family's tiny config."""
    model = raw.get("model") or {}
    if model.get("family") == "vision_text":  # GRM's ViT / Swin + BERT towers: tiny ones saved as hub checkpoints
        towers = project.towers()
        vision = towers["swin" if "swin" in str((model.get("options") or {}).get("vision", "")).lower() else "vit"]
        return [f"model.options.vision={vision}", f"model.options.text={towers['bert']}"]
    from finetune.models.registry import RANDOM_PREFIX

    name = str(model.get("name_or_path", ""))
    bare = name.removeprefix(RANDOM_PREFIX)
    if bare in CPU_REGISTRY:
        return []
    if bare in TINY_REGISTRY:  # random weights stay asked for as the recipe asks for them
        return [f"model.name_or_path={RANDOM_PREFIX if name != bare else ''}{TINY_REGISTRY[bare]}"]
    lowered = name.lower()
    if "siglip" in lowered:  # SigLIP2's fixed-resolution checkpoints are SiglipModel in transformers
        return [f"model.name_or_path={project.tiny_model('tiny-siglip')}"]
    if "clip" in lowered:
        return [f"model.name_or_path={project.tiny_model('tiny-clip')}"]
    raise AssertionError(f"model {name!r}: no tiny config of its family known to tests/recipes/shipped.py")


def batch_overrides(path: Path) -> list[str]:
    """``train.batch_size`` of the recipes in :data:`CPU_BATCH`; none for every other recipe."""
    return [f"train.batch_size={CPU_BATCH[path.stem]}"] if path.stem in CPU_BATCH else []


def _train_examples(raw: dict, path: Path) -> int:
    """Examples a map-style training fixture needs: one global batch (later steps start new epochs)."""
    return CPU_BATCH.get(path.stem) or int((raw.get("train") or {}).get("batch_size", 16))


def data_overrides(raw: dict, project: Project, path: Path) -> list[str]:
    """``path`` / ``urls`` of every data set pointed at a fixture in that dataset's format."""
    out = []
    batch = _train_examples(raw, path)
    train = _entry((raw.get("data") or {}).get("train") or {"name": "synthetic"})
    name = train["name"]
    if name == "webdataset":
        steps = STEPS * batch  # each step reads a global batch from the stream
        out.append(f"data.train.urls={json.dumps(project.shards(train['urls'], steps))}")
    elif name in ("parquet", "hub"):
        raise AssertionError(f"data.train {name!r}: no stream fixture in tests/recipes/shipped.py yet")
    elif name == "synthetic":
        out.append(f"data.train.size={batch}")
    else:
        n = batch
        if name in ("coco", "flickr30k"):  # five captions an image, each its own training example
            n = -(-batch // 5)
        out.append(f"data.train.path={project.dataset(name, n)}")
    for i, spec in enumerate((raw.get("eval") or {}).get("sets") or []):
        spec = _entry(spec)
        if spec["name"] == "synthetic":
            out.append(f"eval.sets.{i}.size={SYNTHETIC_EVAL}")
        else:
            out.append(f"eval.sets.{i}.path={project.dataset(spec['name'], 4)}")
    return out


def file_overrides(raw: dict, project: Project) -> list[str]:
    """Tiny random-weight stand-ins for the files a recipe loads: written where the recipe names them, or
    (a hub id) the recipe's key pointed at one saved like a hub checkpoint."""
    out = []
    terms = (raw.get("objective") or {}).get("terms") or {}
    regions = (terms.get("fastgoal") or {}).get("regions") or {}
    if "fastgoal" in terms and regions.get("method", "detector") == "detector":
        detector = str(regions.get("detector") or "")
        if detector.endswith(".pt"):
            project.place(detector)
        else:
            out.append(f"objective.terms.fastgoal.regions.detector={project.yolos()}")
    checkpoint = ((terms.get("structxlip") or {}).get("regions") or {}).get("checkpoint")
    if checkpoint:
        project.place(checkpoint)
    superpixels = (terms.get("fcast") or {}).get("superpixels") or {}
    if superpixels.get("checkpoint"):
        project.place(superpixels["checkpoint"])
    return out


def as_shipped_overrides(path: Path, project: Project) -> list[str]:
    """Overrides that run recipe ``path`` as shipped on fixtures and its family's tiny model."""
    raw = yaml.safe_load(path.read_text())
    return (model_overrides(raw, project) + data_overrides(raw, project, path) + file_overrides(raw, project)
            + batch_overrides(path))


def output_dir(path: Path, project: Project) -> Path:
    """Where the run of recipe ``path`` goes: its ``output.dir`` under the project root."""
    raw = yaml.safe_load(path.read_text())
    return project.root / str((raw.get("output") or {}).get("dir", "runs/quickstart"))


# ------------------------------------------------------------------------------------------ the step cap


def cap_steps(monkeypatch: Any, steps: int = STEPS) -> None:
    """Stop every run (prerequisites included) after ``steps`` optimiser steps: the loop's step count is lowered
    once its parts are built, after its learning-rate schedule was made from the recipe's own length."""
    from finetune.training import recipe

    original = recipe.build_loop

    def capped(*args: Any, **kwargs: Any) -> Any:
        loop = original(*args, **kwargs)
        assert hasattr(loop.batches, "total_steps"), "the loop's batches have no total_steps: update cap_steps"
        loop.batches.total_steps = min(loop.batches.total_steps, steps)
        return loop

    monkeypatch.setattr(recipe, "build_loop", capped)


def prerequisites_as_shipped(monkeypatch: Any, project: Project) -> None:
    """The recipes a run builds on (``model.init_from``, ``eval.compare_with``), which the run loads and trains
    itself (:mod:`finetune.training.upstream`), get the same data and model overrides as a recipe run directly."""
    from finetune.training import upstream
    from finetune.config import RecipeError, load_recipe

    def load(ref: str, key: str, trust: bool = False) -> Any:
        try:
            return load_recipe(ref, as_shipped_overrides(Path(ref), project), trust_imports=trust)
        except RecipeError as exc:
            raise upstream.PrerequisiteError(f"{key}: {ref} is not a valid recipe: {exc}") from exc

    monkeypatch.setattr(upstream, "_load", load)


def enter(monkeypatch: Any, project: Project) -> None:
    """What every as-shipped run needs: the project root as the current directory, the step cap, the
    prerequisites loaded like the recipe, and no log handler left by an earlier run in this process (it
    would write to that test's closed stderr)."""
    import logging

    monkeypatch.setattr(logging.getLogger("xlipkit"), "handlers", [])
    monkeypatch.chdir(project.root)
    cap_steps(monkeypatch)
    prerequisites_as_shipped(monkeypatch, project)


# ------------------------------------------------------------------------------------------ tiny files


def save_confident_yolos(folder: Path, seed: int = 0) -> Path:
    """The tiny random-weight YOLOS of ``tests/finetune/preprocess/tiny_detectors.py`` with its class head's bias
    raised for one label, so that its (random) boxes score above the shipped threshold (0.9) and FLISM keeps
    detector boxes, as it does with the real weights; with plain random weights no box passes and only the
    default regions would be tested."""
    import torch
    from transformers import YolosForObjectDetection

    from tests.finetune.preprocess.tiny_detectors import save_tiny_yolos

    save_tiny_yolos(folder, seed=seed)
    model = YolosForObjectDetection.from_pretrained(folder)
    with torch.no_grad():
        model.class_labels_classifier.layers[-1].bias[1] += 10.0  # "person"
    model.save_pretrained(folder)
    return folder


def save_narrow_yolo(path: Path, model_yaml: str = "yolov8n.yaml", *, nc: int = 80, seed: int = 0) -> Path:
    """An ultralytics model of ``model_yaml``'s layout at 1/16 of YOLOv8n's width (about 3 GFLOPs at 640 px
    instead of 9-12), ``nc`` classes, random weights, saved as a ``.pt`` checkpoint as ultralytics saves one."""
    import torch
    pytest.importorskip("ultralytics")  # the `regions` extra
    from ultralytics import YOLO
    from ultralytics.nn.tasks import yaml_model_load

    from finetune.preprocess.regions import preserve_thread_settings

    cfg = {k: v for k, v in yaml_model_load(model_yaml).items() if k not in ("yaml_file", "scale")}
    cfg.update(nc=nc, scales={"n": [0.33, 0.0625, 1024]})
    spec = path.with_name(f"{path.stem}-narrow.yaml")
    spec.write_text(yaml.safe_dump(cfg))
    torch.manual_seed(seed)
    with preserve_thread_settings():
        YOLO(str(spec)).save(str(path))
    spec.unlink()
    return path


def save_tiny_fastsam(path: Path, seed: int = 0) -> Path:
    """FastSAM's layout (a one-class YOLOv8-seg) narrowed by :func:`save_narrow_yolo`, like ``FastSAM-x.pt``."""
    return save_narrow_yolo(path, "yolov8n-seg.yaml", nc=1, seed=seed)


def save_random_sfcn(path: Path, seed: int = 0) -> Path:
    """The SFCN superpixel network (:class:`finetune.preprocess.superpixels.SpixelNet`) with random weights,
    saved as safetensors like converted SFCN weights."""
    import torch
    from safetensors.torch import save_file

    from finetune.preprocess.superpixels import SpixelNet

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state = {k: v.contiguous() for k, v in SpixelNet().state_dict().items()}
    save_file(state, str(path))
    return path


def write_dreamlip_webdataset(folder: Path, *, n_shards: int, per_shard: int, size: tuple[int, int] = (16, 16),
                              fields: tuple[str, ...] = DREAMLIP_FIELDS) -> Path:
    """Webdataset shards ``00000.tar ...`` as DreamLIP's re-captioned CC3M / CC12M / YFCC15M after pre-splitting:
    ``KEY.jpg`` + ``KEY.json`` holding every field of ``fields`` as a list of sentences (the long fields three
    sentences, the short ones one)."""
    from PIL import Image

    from tests.finetune.data.fixtures import long_caption

    folder.mkdir(parents=True, exist_ok=True)
    index = 0
    for s in range(n_shards):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for _ in range(per_shard):
                key = f"{s:05d}{index:06d}"
                buf = io.BytesIO()
                colour = ((37 * index) % 256, (91 * index + 40) % 256, (151 * index + 80) % 256)
                Image.new("RGB", size, colour).save(buf, format="JPEG")
                sentences = long_caption("dreamlip", index).replace(". ", ".|").split("|")
                meta = {name: (sentences if name.startswith("long") else sentences[:1]) for name in fields}
                for name, data in ((f"{key}.jpg", buf.getvalue()), (f"{key}.json", json.dumps(meta).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                index += 1
    return folder


def clear_run(folder: Path) -> None:
    """Remove a previous run folder of the same recipe (a session runs each recipe once, but prerequisites
    may have trained it already)."""
    if folder.is_dir():
        shutil.rmtree(folder)
