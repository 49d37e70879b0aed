"""Is the GPU busy? The training loop's steady samples/s through the run's own loop and data path against the
bare step, for every method at its real size, each case in a fresh process, the bare step on batches nobody saw.

Each case (a shipped recipe, a registry model of its architecture with random weights, synthetic scenes written
as 224 px JPEG files in a JSONL dataset, decoded by ``--workers`` DataLoader workers and batched by the real
collator) runs in a process of its own (``bench/loop_case.py``; this process only writes the data, starts the
cases one after the other and gathers their results), so no case inherits another's warm caches, compiled
graphs or attention plans. In that process:

- ``loop``: the run's loop (``FinetuneRecipe.train`` over the parts ``build_loop`` makes) for ``--warmup`` +
  ``--steady`` steps (default 10 + 40 on a GPU); the steady
  rate is taken between the loop's own reads at step ``--warmup`` and at its last step (each read waits for the
  device), with the share of that time spent waiting for data;
- ``bare``: the step alone (``TrainStep`` and the objective's ``after_step``) on the next ``--bare-warmup`` +
  ``--steady`` batches of the same loader (rows after the loop's: neither the loop nor an earlier bare step saw them; every batch's ids are
  recorded and checked), all moved to the device before the clock starts, each used once; ``loop / bare``;
- per steady step: new batch shapes and new attention shapes (``scaled_dot_product_attention``'s query / key /
  mask shapes, noted at no cost in eager runs), and in compiled runs the graphs dynamo compiled after the
  warm-up (recompiles); the attention kernel that ran (one profiled step: the kernels' names on CUDA, the aten
  op on the CPU) and the backend order the run set (``train.attention``);
- FLOPs of a steady step counted by ``torch.utils.flop_counter`` on the padded shapes that ran (padding
  included), TFLOP/s and MFU of loop and bare against the device's dense bf16 peak
  (``finetune.training.throughput.PEAK_BF16_TFLOPS``); peak device memory (the process's peak RSS on the CPU);
  host syncs per bare step on CUDA.

Cases run in the order of ``--cases`` (default: ``CASES``' order, most telling first). ``clip-248-compiled`` is
``clip-248`` with ``train.compile`` on, ``clip-248-torch-attention`` with PyTorch's own SDPA choice (cuDNN first
on sm90): against ``clip-248``, which change gave what. ``--budget`` starts a case only when its estimate
(``--case-s``, ``--compile-s`` for compiled ones) fits what is left, kills one that runs past the budget, and
lists every case it skipped and why. Results: ``bench/results/loop.json``.

The GPU command (one H100/H200, 16 CPU cores, 8 workers; first run ``../shared/tools/gpu-wheels.sh`` in the
checkout so that ``.whl/`` holds open_clip, pydantic and datasets, which the GPU image lacks, and take ``.whl``
along; under 5 minutes: give it ``timeout_s`` 330)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \\
    export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 && \\
    python3 bench/loop.py --device cuda --workers 8 --budget 250; cp bench/results/loop.json $OUT/

On the CPU in seconds (a test runs it): ``python bench/loop.py --tiny`` (the families' tiny configs, the same code
path; a compiled case compiles with ``aot_eager``: the same graphs and recompiles, no C++ code generation). The
CPU figures of the data path and the loop's own overhead, each as a ratio against a baseline measured in
the same run (``--cpu-figures``, ``bench/results/loop_cpu.json``)::

    python bench/loop.py --cpu-figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from finetune.files import write_json_atomic  # noqa: E402
from finetune.training.throughput import peak_tflops  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RECIPES = ROOT / "recipes"


# -- the cases ------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One measured configuration: a shipped recipe, the registry models standing in for its checkpoint (real size
    and tiny), the edits that make it run offline on the bench's data, and its per-GPU batch."""

    name: str
    recipe: str
    model: str
    tiny: str
    edit: Callable[[dict], None] = lambda r: None
    batch: int | None = None  # None: --batch
    clip: bool = False  # a plain CLIP case that --compile on compiles
    compile: bool | None = None  # None: as --compile says for clip cases, off for the rest
    attention: str | None = None  # train.attention; None: the recipe's
    estimate_s: float | None = None  # seconds --budget counts for it on a GPU (None: --case-s / --compile-s)
    note: str = ""
    captions: str | None = None  # the captions' lengths: None (the scenes' own, ~97 CLIP tokens), docci or coco
    buckets: list[int] | None = None  # train.text_buckets (None: the default buckets)


def _set(recipe: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = recipe
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def _clip_only(r: dict) -> None:
    r["objective"] = {"base": "clip"}


def _siglip_only(r: dict) -> None:
    r["objective"] = {"base": "siglip"}


def _length(n: int | None) -> Callable[[dict], None]:
    def edit(r: dict) -> None:
        _set(r, "model.max_text_len", n)
        if n is not None and n <= 77:
            r["model"].pop("kps", None)
    return edit


def _structxlip(encode: str) -> Callable[[dict], None]:
    def edit(r: dict) -> None:  # no FastSAM checkpoint offline: the scenes' own object boxes as regions
        _set(r, "objective.terms.structxlip.regions", {"source": "dataset", "k": 3, "per_image": 3, "encode": encode})
    return edit


def _fastgoal(r: dict) -> None:  # no YOLOS offline: the scenes' object boxes, each linked to its sentence
    _set(r, "objective.terms.fastgoal.regions", {"method": "dataset", "default": True, "pairs": 1})


def _flair(r: dict) -> None:  # the scenes' sentence lists instead of the shards' caption fields
    _set(r, "objective.terms.flair.caption_fields", None)


def _fcast(r: dict) -> None:
    _set(r, "objective.terms.fcast.caption_fields", None)
    _set(r, "objective.terms.fcast.long_fields", None)


def _registry_towers(r: dict) -> None:  # the vision_text family from a registry config, not two hub towers
    r["model"].pop("options", None)


_B16, _TINY = "random:clip-vit-base-patch16", "random:tiny-clip"
CASES = [
    Case("clip-248", "longclip_docci.yaml", _B16, _TINY, clip=True,
         note="CLIP ViT-B/16 full fine-tune, clip loss, 248 tokens (KPS)"),
    Case("clip-248-compiled", "longclip_docci.yaml", _B16, _TINY, compile=True,
         note="clip-248 with train.compile on (the towers' blocks compiled, static shapes)"),
    Case("siglip2", "structxlip_siglip2_docci.yaml", "random:siglip2-base-patch16-224", "random:tiny-siglip",
         _siglip_only, note="SigLIP2-B/16, SigLIP loss, 248 tokens (KPS)"),
    Case("clip-77", "longclip_docci.yaml", _B16, _TINY, _length(77), clip=True,
         note="CLIP ViT-B/16 full fine-tune, clip loss, 77 tokens"),
    Case("lora", "structxlip_lora_docci.yaml", _B16, _TINY, _clip_only,
         note="the recipe's LoRA adapter, clip loss, 248 tokens"),
    Case("dora", "structxlip_dora_docci.yaml", _B16, _TINY, _clip_only,
         note="the recipe's DoRA adapter, clip loss, 248 tokens"),
    Case("structxlip-pool", "structxlip_docci.yaml", _B16, _TINY, _structxlip("pool"), batch=128, estimate_s=60,
         note="batch 128: half the rows to preprocess (edge maps, regions), which took most of its 116 s before"),
    Case("structxlip-crop", "structxlip_docci.yaml", _B16, _TINY, _structxlip("crop"), batch=128,
         note="2B + 3B images per step (crops of the edge maps)"),
    Case("fastgoal", "fastgoal_docci.yaml", _B16, _TINY, _fastgoal, batch=128, estimate_s=55,
         note="batch 128: 1 + 3 crops per image, half the rows to match (FLISM's crop embeddings) and to train"),
    Case("grm", "grm_clip_lora_docci.yaml", _B16, _TINY),
    Case("flair", "flair_cc3m_recap.yaml", "random:flair-vit-b-16", "random:tiny-flair", _flair, batch=128,
         note="K = 8 sub-captions of 77 tokens per image; the recipe's 128 per GPU"),
    Case("fcast", "fcast_cc3m_recap.yaml", "random:fcast-b", "random:fcast-tiny", _fcast, batch=64, estimate_s=90,
         note="superpixels (SFCN, random weights) computed in the workers: every batch computes them"),
    Case("clip-248-torch-attention", "longclip_docci.yaml", _B16, _TINY, attention="torch",
         note="clip-248 with train.attention: torch (PyTorch's own SDPA choice: cuDNN first on sm90, cuDNN > 9.15)"),
    Case("grm-coco", "grm_coco.yaml", "random:vision-text-vit-b16-bert-base", "random:tiny-vision-text-vit",
         _registry_towers, batch=128, captions="coco",
         note="GRM's own setting: ViT-B/16 + BERT-base (512 positions), GRM's loss alone, COCO-length captions, "
              "the recipe's batch 128"),
    Case("clip-docci", "longclip_docci.yaml", _B16, _TINY, captions="docci",
         note="CLIP ViT-B/16, clip loss, DOCCI-length captions (bench/buckets.py), length buckets"),
    Case("clip-docci-248", "longclip_docci.yaml", _B16, _TINY, captions="docci", buckets=[248],
         note="clip-docci padded to 248 (train.text_buckets: [248]): the baseline of the buckets' >= 1.25x goal"),
]
#: the cases no GPU has measured since the fixed shapes (issue 37 item 4): the prepared command runs them first
NEVER_MEASURED = ["lora", "structxlip-pool", "fastgoal", "grm", "flair", "fcast", "grm-coco", "clip-docci",
                  "clip-docci-248"]


# -- data -----------------------------------------------------------------------------------------------------
def _write_chunk(folder: str, chunk: int, rows: int, image_size: int) -> list[str]:
    from finetune.data.synthetic import synthetic_scenes

    lines = []
    for row in synthetic_scenes(rows, chunk, image_size=image_size):
        key = f"c{chunk}-{row['id']}"
        name = f"images/{key}.jpg"
        row["image"].convert("RGB").save(Path(folder) / name, format="JPEG", quality=90)
        lines.append(json.dumps({"id": key, "image": name, "caption": row["caption"], "sentences": row["sentences"],
                                 "objects": row["objects"]}))
    return lines


def write_scenes(folder: Path, rows: int, *, image_size: int = 224, processes: int = 1, chunk: int = 512) -> Path:
    """``rows`` synthetic scenes as JPEG files (quality 90) and a ``train.jsonl`` naming them, with their
    ``caption``, ``sentences`` and ``objects`` (the real JSONL source format), written by ``processes``
    processes in chunks of ``chunk`` (chunk ``i`` drawn with seed ``i``, ids prefixed ``c<i>-``); returns the
    folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    sizes = [min(chunk, rows - start) for start in range(0, rows, chunk)]
    jobs = [(str(folder), i, n, image_size) for i, n in enumerate(sizes)]
    if processes > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(processes, len(jobs))) as pool:
            parts = list(pool.map(_write_chunk, *zip(*jobs)))
    else:
        parts = [_write_chunk(*job) for job in jobs]
    with open(folder / "train.jsonl", "w", encoding="utf-8") as out:
        for part in parts:
            out.write("".join(line + "\n" for line in part))
    return folder


# -- building a case as a run does (in the case's own process: bench/loop_case.py) ------------------------------
def case_batch(case: Case, settings: dict[str, Any]) -> int:
    """The case's per-GPU batch: its own where it has one, unless ``--batch`` was given."""
    return case.batch if (case.batch and not settings["batch_fixed"]) else settings["batch"]


def case_compiled(case: Case, settings: dict[str, Any]) -> bool:
    """Whether the case runs with ``train.compile``: its own setting, else ``--compile`` for the plain CLIP cases."""
    return case.compile if case.compile is not None else (case.clip and settings["compile"] == "on")


def case_recipe(case: Case, spec: dict[str, Any], work: Path) -> Any:
    """The case's recipe as run: the shipped recipe, the case's edits, the bench's data, batch, steps and reads
    (``log_every`` = the warm-up, so that the loop reads at the end of it), no evaluation, no checkpoints."""
    import yaml

    from finetune.config import load_recipe

    raw = yaml.safe_load((RECIPES / case.recipe).read_text())
    raw["model"]["name_or_path"] = case.tiny if spec["tiny"] else case.model
    raw["model"].pop("init_from", None)
    case.edit(raw)
    raw["data"] = {"train": {"name": "jsonl", "path": spec["data"]}, "num_workers": spec["workers"],
                   "cache_dir": str(work / "cache"), "on_error": "raise"}
    raw["eval"] = {"sets": [], "before": False, "after": False}
    raw["train"].update({"batch_size": spec["batch"], "max_steps": spec["warmup"] + spec["steady"],
                         "log_every": spec["warmup"], "checkpoint_every": 0, "trackers": [],
                         "accumulation_steps": 1, "compile": spec["compile"],
                         "mixed_precision": "bf16" if spec["device"] == "cuda" else "no"})
    if case.attention is not None:
        raw["train"]["attention"] = case.attention
    if case.buckets is not None:
        raw["train"]["text_buckets"] = case.buckets
    if case.name == "fcast":  # the recipe's SFCN superpixels, with random weights written here
        _set(raw, "objective.terms.fcast.superpixels", {"method": "sfcn", "n_segments": 36 if spec["tiny"] else 196,
                                                        "checkpoint": _sfcn_weights(work)})
    raw["output"] = {"dir": str(work / "run"), "overwrite": True}
    raw.pop("hub", None)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_recipe(path)


def _sfcn_weights(work: Path) -> str:
    """Random SpixelNet weights (the F-CAST recipe's SFCN superpixels; cost, not quality, is measured)."""
    from safetensors.torch import save_file

    from finetune.preprocess.superpixels import SpixelNet

    path = work / "sfcn_random.safetensors"
    if not path.is_file():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            save_file({k: v.contiguous() for k, v in SpixelNet().state_dict().items()}, str(path))
    return str(path)


def build_run_loop(recipe: Any, accelerator: Any) -> Any:
    """The loop's parts of ``recipe`` (:func:`finetune.training.build_loop`) built the way
    :class:`finetune.training.FinetuneRecipe` builds them (model, adapter, objective, the terms' model changes, cached
    preprocessing, the run's collate stack: skipping dataset, the tensor-path collator)."""
    from finetune.data.skipping import drop_undecodable
    from finetune.data.sources import load_source
    from finetune.models.adapters import apply_adapter, enable_gradient_checkpointing
    from finetune.objectives import build_objective
    from finetune.training import TrainModule, build_loop
    from finetune.training.inputs import preprocesses
    from finetune.training.model import load_start_model

    model = apply_adapter(load_start_model(recipe.model, None), recipe.adapter)
    if recipe.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    objective = build_objective(recipe.objective)
    if model.logit_bias is not None and not any(t.uses_logit_bias for t in objective.all_terms):
        model.logit_bias.requires_grad_(False)
    model.to(accelerator.device)
    objective.prepare_model(model)
    d = recipe.data
    rows = load_source(d.train, on_error=d.on_error, cache_dir=d.cache_dir, validate="header").dataset
    if preprocesses(objective):
        rows, _ = drop_undecodable(rows, on_error=d.on_error, cache_dir=d.cache_dir)
    rows = objective.preprocess(rows, model, cache_dir=d.cache_dir)
    return build_loop(accelerator, TrainModule(model, objective), rows, recipe.train, recipe.output.dir,
                      on_error=d.on_error, num_workers=d.num_workers)


def accelerator(device: str, mixed: str) -> Any:
    """A fresh ``Accelerator`` (``split_batches``, non-blocking copies) on ``device``."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=device == "cpu", mixed_precision=mixed,
                       dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True))


# -- the parent: one fresh process per case ----------------------------------------------------------------------
def case_spec(case: Case, settings: dict[str, Any], data: Path, root: Path) -> dict[str, Any]:
    """What the case's process is told (``bench/loop_case.py``)."""
    work = root / case.name
    return {"case": case.name, "device": settings["device"], "tiny": settings["tiny"],
            "data": str(case_data(case, settings, data)),
            "workers": settings["workers"], "batch": case_batch(case, settings),
            "compile": case_compiled(case, settings),
            "warmup": settings["warmup"], "steady": settings["steady"], "bare_warmup": settings["bare_warmup"],
            "record_ids": settings["record_ids"], "work": str(work), "out": str(root / f"{case.name}.result.json")}


def run_in_fresh_process(spec: dict[str, Any], timeout: float | None) -> tuple[dict[str, Any] | None, str | None]:
    """Run one case in a new Python process (its own session, so that on a timeout the case and its data-loader
    workers are killed together); returns ``(result, None)`` or ``(None, why not)``."""
    Path(spec["work"]).mkdir(parents=True, exist_ok=True)
    path = Path(spec["work"]) / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("loop_case.py")), str(path)],
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, f"ran past the budget: killed after {timeout:.0f} s"
    if rc != 0:
        return None, f"its process exited with status {rc} (the error is in the output above)"
    return json.loads(Path(spec["out"]).read_text()), None


def rows_needed(cases: list[Case], settings: dict[str, Any]) -> int:
    """Rows for the largest case: loop, bare warm-up, bare and two probe steps, each on batches of new rows."""
    return max(case_rows(c, settings) for c in cases)


def case_rows(case: Case, settings: dict[str, Any]) -> int:
    """The rows one case reads: loop, bare warm-up, bare and two probe steps, each on a batch of new rows."""
    steps = settings["warmup"] + settings["bare_warmup"] + 2 * settings["steady"] + 2
    return steps * case_batch(case, settings)


def case_data(case: Case, settings: dict[str, Any], data: Path) -> Path:
    """The case's own training file next to ``data``'s ``train.jsonl``: its first :func:`case_rows` rows (the case
    preprocesses only the rows it reads), with DOCCI- or COCO-length captions for the cases that ask
    (``bench/buckets.py`` writes them; the images stay the scenes')."""
    from buckets import caption_of, coco_words, docci_words

    n = case_rows(case, settings)
    out = data / f"{case.name}.jsonl"
    rng = __import__("random").Random(0)
    words = {"docci": docci_words, "coco": coco_words}.get(case.captions or "")
    with open(data / "train.jsonl", encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for i, line in zip(range(n), src):
            if words is not None:
                row = json.loads(line)
                row["caption"] = caption_of(words(rng), rng)
                row.pop("sentences", None)
                line = json.dumps(row) + "\n"
            dst.write(line)
    return out


# -- the CPU figures --------------------------------------------------------------------------------------------
class _RowByRow:
    """A map-style dataset read row by row (no ``__getitems__``), as the DataLoader read the training set before
    rows were fetched a batch at a time: the baseline's fetching."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return self.dataset[index]


class _WorkerClock:
    """Wraps a collate function: each batch carries its worker's CPU time so far (``time.process_time``), so that
    the worker's own cost per sample can be read apart from what the other processes of a shared machine take."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collate(examples)
        batch["_worker_cpu_s"] = time.process_time()
        return batch


def data_path_rate(collate: Callable, rows: Any, batch: int, batches: int, workers: int) -> tuple[float, float]:
    """``(samples/s, samples per CPU second of one worker)`` of a DataLoader (``workers`` workers, no model)
    over ``rows`` with ``collate``, after its first batch (worker start-up left out)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(rows, batch_size=batch, shuffle=False, num_workers=workers, collate_fn=_WorkerClock(collate),
                        drop_last=True, persistent_workers=False, prefetch_factor=4 if workers else None)
    it = iter(loader)
    cpu0 = next(it)["_worker_cpu_s"]
    start = time.perf_counter()
    n = 0
    for _ in range(batches):
        last = next(it)
        n += len(last["ids"])
    seconds = time.perf_counter() - start
    cpu = last["_worker_cpu_s"] - cpu0
    del it, loader
    return n / seconds, n / cpu


def cpu_figures(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """(a) The data path alone, one worker, for the clip recipe at 224 px (longclip_docci: ViT-B/16's processor
    and tokenizer at 248 tokens): the path as it was (rows read one by one and decoded by PIL, the model's
    processor, float pixels, no text plan) as the baseline against the training loop's (rows read a batch at a
    time, JPEGs decoded by torchvision, uint8 tensor path, text plan), interleaved rounds. (b) The loop's
    own cost per step: the run's loop on a model whose step costs nothing against the same step in a bare Python
    loop."""
    from finetune import load_model
    from finetune.data.collate import Collator
    from finetune.data.skipping import SkippingDataset
    from finetune.data.sources import load_source
    from finetune.objectives import ClipTerm, Objective
    from finetune.objectives.planning import PlannedCollate

    batch, per_round = args.cpu_batch, args.cpu_batches
    data = write_scenes(root / "scenes", batch * (per_round + 1) * 2, image_size=224)
    table = load_source({"name": "jsonl", "path": str(data)}).dataset
    model = load_model("random:clip-vit-base-patch16", max_text_len=248, kps={"keep": 20, "freeze_kept": True})
    objective = Objective(ClipTerm())
    collator = Collator(model, objective, tensor_images=True)
    assert collator.images is not None, "the tensor path does not cover this model's processor"
    paths = {"baseline": (_RowByRow(SkippingDataset(table, "raise")), Collator(model, objective)),  # as it was
             "new": (SkippingDataset(table, "raise", decode=collator.decode),  # as the training loop has it now
                     PlannedCollate(collator, objective, model))}
    rates: dict[str, list[float]] = {"baseline": [], "new": []}
    per_cpu: dict[str, list[float]] = {"baseline": [], "new": []}
    for r in range(args.rounds):
        for name in ("baseline", "new") if r % 2 == 0 else ("new", "baseline"):
            rows, fn = paths[name]
            wall, cpu = data_path_rate(fn, rows, batch, per_round, 1)
            rates[name].append(wall)
            per_cpu[name].append(cpu)
        print(f"  round {r + 1}: baseline {rates['baseline'][-1]:.1f}, new {rates['new'][-1]:.1f} samples/s per "
              f"worker (per worker CPU second: {per_cpu['baseline'][-1]:.1f}, {per_cpu['new'][-1]:.1f})", flush=True)
    best = {k: max(v) for k, v in rates.items()}
    best_cpu = {k: max(v) for k, v in per_cpu.items()}
    round_ratios = [n / b for n, b in zip(rates["new"], rates["baseline"])]
    data_path = {"batch": batch, "batches_per_round": per_round, "rounds": args.rounds, "workers": 1,
                 "samples_per_s_per_worker": rates, "samples_per_worker_cpu_s": per_cpu,
                 "best": best, "ratio_best": best["new"] / best["baseline"],
                 "ratio_median_of_rounds": _median(round_ratios),
                 "ratio_per_worker_cpu_s": best_cpu["new"] / best_cpu["baseline"]}
    overhead = loop_overhead(args, root)
    return {"data_path": data_path, "loop_overhead": overhead}


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


class _NullModel(torch.nn.Module):
    """The smallest model the loop trains: a logit scale and nothing to encode."""

    family = "clip"
    max_text_len = 77

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))


def loop_overhead(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """ms per step of the run's loop (``FinetuneRecipe.train``) on :class:`_NullModel` (a ready batch, no workers)
    against the same forward/backward/optimiser step in a bare Python loop: what the loop adds per step."""
    import yaml

    from finetune.config import load_recipe
    from finetune.objectives.base import Objective, Term
    from finetune.training import FinetuneRecipe, TrainModule, build_loop, build_optimizer

    class Null(Term):
        name = "null"

        def loss(self, model, feats, *, detach_params=False):
            return {"null": (model.logit_scale - 2.0) ** 2}

    steps = args.overhead_steps
    ready = {"ids": ["0"], "input_ids": torch.zeros(1, 1, dtype=torch.long), "image_inputs": {},
             "attention_mask": torch.ones(1, 1, dtype=torch.long)}
    path = root / "null.yaml"
    path.write_text(yaml.safe_dump({"train": {"batch_size": 1, "max_steps": steps, "log_every": 50, "trackers": [],
                                              "lr": 1e-3, "warmup_steps": 0}}))
    cfg = load_recipe(path).train
    loop_ms, bare_ms = [], []
    for _ in range(args.rounds):
        module = TrainModule(_NullModel(), Objective(Null()))
        parts = build_loop(accelerator("cpu", "no"), module, [dict(ready)] * 4, cfg, root / "null-run",
                           collate_fn=lambda ex: dict(ready))
        result = FinetuneRecipe.from_loop(parts).train()
        loop_ms.append(1000 / result.throughput["steady_samples_per_s"])
        module = TrainModule(_NullModel(), Objective(Null()))
        opt = build_optimizer(module, cfg)
        for i in range(steps + 10):
            if i == 10:
                start = time.perf_counter()
            out = module(dict(ready))
            out["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        bare_ms.append(1000 * (time.perf_counter() - start) / steps)
    best = {"loop_ms_per_step": min(loop_ms), "bare_ms_per_step": min(bare_ms)}
    print(f"  loop overhead: loop {best['loop_ms_per_step']:.2f} ms/step, bare step "
          f"{best['bare_ms_per_step']:.2f} ms/step", flush=True)
    return {"steps": steps, "loop_ms_per_step": loop_ms, "bare_ms_per_step": bare_ms, **best,
            "overhead_ms_per_step": best["loop_ms_per_step"] - best["bare_ms_per_step"],
            "ratio_loop_vs_bare": best["loop_ms_per_step"] / best["bare_ms_per_step"]}



# -- main -------------------------------------------------------------------------------------------------------
def _environment(device: str) -> dict[str, Any]:
    import transformers

    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    env = {"device": name,
           "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu_threads": torch.get_num_threads(),
           "peak_bf16_tflops": peak_tflops(device) if device == "cuda" else None}
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    return env


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="all",
                    help="comma-separated, run in this order: " + ", ".join(c.name for c in CASES))
    ap.add_argument("--batch", type=int, default=None, help="per-GPU batch (default 256 on cuda, 4 with --tiny for "
                    "every case; cases with a batch of their own keep it unless --batch is given)")
    ap.add_argument("--warmup", type=int, default=None, help="loop steps before the steady window (default 10; 2 "
                                                             "with --tiny): the loop reads at its end")
    ap.add_argument("--steady", type=int, default=None, help="steady steps timed in the loop and in the bare step "
                                                             "each (default 40; 4 with --tiny)")
    ap.add_argument("--bare-warmup", type=int, default=None, help="untimed bare steps first (default 2; 1 with --tiny)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="the families' tiny configs (CPU, seconds)")
    ap.add_argument("--compile", choices=("on", "off"), default="off",
                    help="train.compile for the plain CLIP cases (clip-248-compiled is compiled either way)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run: a case starts only when its estimate fits what is left, one "
                         "that runs past it is killed; what did not run is listed as skipped")
    ap.add_argument("--case-s", type=float, default=None, help="a case's estimate for --budget (default 40 on cuda)")
    ap.add_argument("--compile-s", type=float, default=None,
                    help="a compiled case's estimate for --budget (default 90 on cuda)")
    ap.add_argument("--record-ids", action="store_true", help="keep every step's batch ids in the results "
                                                              "(on with --tiny)")
    ap.add_argument("--out", default=None, help="the results (default bench/results/loop.json on cuda; "
                    "bench/results/loop_dryrun_cpu.json on the CPU, which never overwrites the GPU results)")
    ap.add_argument("--cpu-figures", action="store_true", help="the CPU figures (data path, loop overhead) only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu-batch", type=int, default=32)
    ap.add_argument("--cpu-batches", type=int, default=20)
    ap.add_argument("--overhead-steps", type=int, default=200)
    return ap


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    tiny = args.tiny
    # --tiny: every case at the one small batch (a CPU run in seconds)
    settings = {"device": args.device, "tiny": tiny, "batch_fixed": args.batch is not None or tiny,
                "batch": args.batch or (4 if tiny or args.device != "cuda" else 256),
                "warmup": args.warmup or (2 if tiny else 10), "steady": args.steady or (4 if tiny else 40),
                "bare_warmup": args.bare_warmup or (1 if tiny else 2), "workers": min(args.workers, 1) if tiny
                else args.workers, "compile": args.compile, "record_ids": args.record_ids or tiny,
                "budget": args.budget, "case_s": args.case_s or (40.0 if args.device == "cuda" else 10.0),
                "compile_s": args.compile_s or (90.0 if args.device == "cuda" else 30.0)}
    if settings["warmup"] < 2:
        raise SystemExit("--warmup must be at least 2: the loop's first read is after step 1, the steady window "
                         "starts at the read that ends the warm-up")
    return settings


def _select(names: str) -> list[Case]:
    if names == "all":
        return list(CASES)
    by_name = {c.name: c for c in CASES}
    wanted = [n for n in names.split(",") if n]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"--cases: unknown case(s) {unknown}; the cases are: {', '.join(by_name)}")
    return [by_name[n] for n in wanted]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line; returns what it writes to ``--out``. The scenes and the cases' folders go to a temporary
    folder, removed at the end."""
    root = Path(tempfile.mkdtemp(prefix="xlipkit-bench-loop-"))
    try:
        return _main(argv, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _main(argv: list[str] | None, root: Path) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    if args.cpu_figures:
        out = Path(args.out or RESULTS / "loop_cpu.json")
        result = {**_environment("cpu"), "note": "a shared machine: baseline and new interleaved in one run",
                  **cpu_figures(args, root)}
        d, o = result["data_path"], result["loop_overhead"]
        print(f"data path, one worker: {d['best']['new']:.1f} vs {d['best']['baseline']:.1f} samples/s "
              f"(x{d['ratio_best']:.2f} best, x{d['ratio_median_of_rounds']:.2f} median of the rounds, "
              f"x{d['ratio_per_worker_cpu_s']:.2f} per worker CPU second); loop overhead "
              f"{o['overhead_ms_per_step']:.2f} ms/step (loop {o['loop_ms_per_step']:.2f}, bare "
              f"{o['bare_ms_per_step']:.2f})")
        write_json_atomic(out, result)
        return result
    settings = _settings(args)
    args.out = args.out or str(RESULTS / ("loop.json" if args.device == "cuda" and not args.tiny
                                          else "loop_dryrun_cpu.json"))
    wanted = _select(args.cases)
    rows = rows_needed(wanted, settings)
    data = write_scenes(root / "scenes", rows, image_size=64 if args.tiny else 224,
                        processes=max(1, min(16, (os.cpu_count() or 1))))
    print(f"data: {rows} scenes written as JPEG ({time.perf_counter() - start:.0f} s)", flush=True)
    budget = settings["budget"]
    results, skipped = [], []

    def record(partial: bool) -> dict[str, Any]:
        out = {**_environment(args.device), "partial": partial, "settings": settings,
               "method": "each case in a fresh process (bench/loop_case.py); loop and bare each over the steady "
                         "steps; bare batches hold rows neither the loop nor the bare step saw",
               "targets": {"loop_vs_bare": 0.9, "bare_clip_compiled_mfu": 0.35, "clip_248_vs_siglip2": 1.0,
                           "docci_buckets_vs_padded": 1.25},
               "cases": results, "skipped": skipped, "summary": summarize(results),
               "total_s": time.perf_counter() - start}
        write_json_atomic(Path(args.out), out)  # what ran so far, should the run be cut off
        return out

    for case in wanted:
        spec = case_spec(case, settings, data, root)
        estimate = settings["compile_s"] if spec["compile"] else settings["case_s"]
        if case.estimate_s and settings["device"] == "cuda" and not settings["tiny"]:
            estimate = max(estimate, case.estimate_s)
        left = None if budget is None else budget - (time.perf_counter() - start)
        if left is not None and left < estimate:
            skipped.append({"case": case.name, "reason": f"{left:.0f} s of the {budget:.0f} s budget left, the case "
                                                         f"needs about {estimate:.0f} s"})
            print(f"{case.name}: skipped ({skipped[-1]['reason']})", flush=True)
            continue
        print(f"{case.name}: {case.recipe}, batch {spec['batch']}, a fresh process", flush=True)
        result, why = run_in_fresh_process(spec, None if left is None else max(1.0, left - 2))
        if result is None:
            if args.tiny and not why.startswith("ran past"):  # a CPU check: a failing case is an error
                raise RuntimeError(f"{case.name}: {why}")
            skipped.append({"case": case.name, "reason": why})
            print(f"  skipped: {why}", flush=True)
            continue
        results.append(result)
        record(partial=True)
        print("  " + _line(result), flush=True)
    out = record(partial=False)
    if skipped:
        print("skipped: " + "; ".join(f"{s['case']} ({s['reason']})" for s in skipped), flush=True)
    print(json.dumps(out["summary"]), f"({out['total_s']:.0f} s) -> {args.out}", flush=True)
    return out


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparisons the targets ask for, from the cases that ran (None where a case is missing)."""
    by = {r["case"]: r for r in results}

    def ratio(a: str, b: str, key: str) -> float | None:
        return by[a][key] / by[b][key] if a in by and b in by and by[a][key] and by[b][key] else None

    return {"min_loop_vs_bare": min((r["loop_vs_bare"] for r in results), default=None),
            "cases_below_0.9": [r["case"] for r in results if r["loop_vs_bare"] < 0.9],
            "clip_248_vs_siglip2_loop": ratio("clip-248", "siglip2", "loop_samples_per_s"),
            "clip_248_vs_siglip2_bare": ratio("clip-248", "siglip2", "bare_samples_per_s"),
            "compiled_vs_eager_bare_clip_248": ratio("clip-248-compiled", "clip-248", "bare_samples_per_s"),
            "compiled_vs_eager_loop_clip_248": ratio("clip-248-compiled", "clip-248", "loop_samples_per_s"),
            "torch_vs_auto_attention_bare_clip_248": ratio("clip-248-torch-attention", "clip-248",
                                                           "bare_samples_per_s"),
            "clip_248_vs_77_bare": ratio("clip-248", "clip-77", "bare_samples_per_s"),
            "bare_mfu_clip_248_compiled": by.get("clip-248-compiled", {}).get("bare_mfu"),
            "docci_buckets_vs_padded_bare": ratio("clip-docci", "clip-docci-248", "bare_samples_per_s"),
            "docci_buckets_vs_padded_loop": ratio("clip-docci", "clip-docci-248", "loop_samples_per_s"),
            "bare_mfu_real_tokens": {r["case"]: r.get("bare_mfu_real_tokens") for r in results}}


def _line(r: dict[str, Any]) -> str:
    s = r["shapes"]["loop"]
    rc = r["recompiles"]
    return (f"loop {r['loop_samples_per_s']:.1f} / bare {r['bare_samples_per_s']:.1f} samples/s = "
            f"{r['loop_vs_bare']:.2f}; data wait {r['data_wait_share']:.0%}; attention {r['attention']['ran']}; "
            f"new attention shapes/step "
            f"{_fmt(s['new_attention_shapes_per_step'], '.2f')}; recompiles after warm-up "
            f"{'-' if rc is None else rc['loop_after_warmup'] + rc['bare_timed']}; bare "
            f"{_fmt(r['bare_tflops'], '.2f')} TFLOP/s MFU {_fmt(r['bare_mfu'], '.1%')} computed / "
            f"{_fmt(r.get('bare_mfu_real_tokens'), '.1%')} real tokens (text padding "
            f"{_fmt((r.get('text_tokens') or {}).get('bare_padding_share'), '.0%')}); peak "
            f"{_fmt(r['peak_memory_gib'] if r['peak_memory_gib'] is not None else r['peak_rss_gib'], '.1f')} GiB")


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


if __name__ == "__main__":
    main()
