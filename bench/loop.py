"""Is the GPU busy? The training loop's steady samples/s through the real ``Trainer`` and data path against the
bare step on the same batches already on the device, for every method at its real size.

For each case (a shipped recipe, with a registry model of its architecture and random weights, and synthetic
scenes written as 224 px JPEG files in a JSONL dataset, decoded by ``--workers`` DataLoader workers and batched
by the real collator):

- ``loop``: steady samples/s of ``Trainer.train()`` (steps after the first log interval, where the loop reads
  the device: ``finetune.training.throughput.LoopClock``), the share of that time spent waiting for data;
- ``bare``: samples/s of ``Trainer.train_step`` alone on batches of the same loader already on the device
  (synchronised before and after), and ``loop / bare``;
- peak accelerator memory, FLOPs per sample (``torch.utils.flop_counter`` on the first step: matmul, conv and
  SDPA forward and backward, element-wise work not counted), TFLOP/s and MFU of the bare step and the loop
  against the device's dense bf16 peak (``finetune.training.throughput.PEAK_BF16_TFLOPS``);
- on a GPU, host syncs per bare step (``torch.cuda.set_sync_debug_mode("warn")``: every D2H read, blocking copy
  and stream synchronisation warns) and in the whole loop (which makes one read per logging step by design).

After the cases, ``--variants`` times the bare CLIP ViT-B/16 77-token step as fp32 eager, bf16 eager (the
cases' setting: bf16 autocast, fused AdamW, SDPA attention) and bf16 with the towers' blocks compiled
(``train.compile``), to say which helps; ``--compile on`` compiles the clip cases. Results go to
``bench/results/loop.json`` with the device, versions and settings.

The GPU command (one H100/H200, 16 CPU cores, 8 workers; first ``../shared/tools/gpu-wheels.sh`` here, and
``.whl`` carried along; about 4-5 minutes: give it ``timeout_s`` 420; ``--budget 280`` starts a case only with
20 s left and the compiled variant with 120 s, and lists what it skipped)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \\
    export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 && \\
    python3 bench/loop.py --device cuda --workers 8 --variants --budget 280 && cp bench/results/loop.json $OUT/

On the CPU in seconds (a test runs it): ``python bench/loop.py --tiny``. The CPU figures of the data path and
the loop's own overhead, each as a ratio against a baseline measured in the same run (``--cpu-figures``,
``bench/results/loop_cpu.json``)::

    python bench/loop.py --cpu-figures
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from finetune.files import write_json_atomic  # noqa: E402
from finetune.training.throughput import peak_tflops  # noqa: E402

RESULTS = ROOT / "bench" / "results"
#: seconds of --budget a case (CASE_S) and the compiled variant (COMPILE_S) must have left to start
CASE_S, COMPILE_S = 20, 120
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
    clip: bool = False  # a plain CLIP case that --compile auto may compile
    note: str = ""


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


def _chain(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
    def edit(r: dict) -> None:
        for e in edits:
            e(r)
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


def _adapter(kind: str) -> Callable[[dict], None]:
    def edit(r: dict) -> None:
        r["adapter"] = {"type": kind, "r": 16, "alpha": 32, "dropout": 0.05, "targets": "preset", "include_mlp": True}
    return edit


CASES = [
    Case("clip-77", "longclip_docci.yaml", "random:clip-vit-base-patch16", "random:tiny-clip", _length(77), clip=True),
    Case("clip-248", "longclip_docci.yaml", "random:clip-vit-base-patch16", "random:tiny-clip", clip=True),
    Case("lora", "structxlip_lora_docci.yaml", "random:clip-vit-base-patch16", "random:tiny-clip", _clip_only,
         note="LoRA r 16 on the attention and MLP linears, clip loss, 248 tokens"),
    Case("dora", "structxlip_dora_docci.yaml", "random:clip-vit-base-patch16", "random:tiny-clip", _clip_only,
         note="DoRA r 16 on the attention and MLP linears, clip loss, 248 tokens"),
    Case("structxlip-crop", "structxlip_docci.yaml", "random:clip-vit-base-patch16", "random:tiny-clip", _structxlip("crop"),
         batch=128, note="2B + 3B images per step (crops of the edge maps)"),
    Case("structxlip-pool", "structxlip_docci.yaml", "random:clip-vit-base-patch16", "random:tiny-clip", _structxlip("pool")),
    Case("fastgoal", "fastgoal_docci.yaml", "random:clip-vit-base-patch16", "random:tiny-clip", _fastgoal),
    Case("grm", "grm_clip_lora_docci.yaml", "random:clip-vit-base-patch16", "random:tiny-clip"),
    Case("flair", "flair_cc3m_recap.yaml", "random:flair-vit-b-16", "random:tiny-flair", _flair, batch=128,
         note="K = 8 sub-captions of 77 tokens per image; the recipe's 128 per GPU"),
    Case("fcast", "fcast_cc3m_recap.yaml", "random:fcast-b", "random:fcast-tiny", _fcast, batch=64,
         note="superpixels (SFCN, random weights) computed in the workers and cached: the first epoch computes them"),
    Case("siglip2", "structxlip_siglip2_docci.yaml", "random:siglip2-base-patch16-224", "random:tiny-siglip", _siglip_only,
         note="SigLIP loss, 248 tokens (KPS), captions padded to 248"),
]


# -- data -----------------------------------------------------------------------------------------------------
def write_scenes(folder: Path, rows: int, *, image_size: int = 224, seed: int = 0) -> Path:
    """``rows`` synthetic scenes as JPEG files (quality 90) and a ``train.jsonl`` naming them, with their
    ``caption``, ``sentences`` and ``objects`` (the real JSONL source format); returns the folder."""
    from finetune.data.synthetic import synthetic_scenes

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    scenes = synthetic_scenes(rows, seed, image_size=image_size)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as out:
        for row in scenes:
            name = f"images/{row['id']}.jpg"
            row["image"].convert("RGB").save(folder / name, format="JPEG", quality=90)
            record = {"id": row["id"], "image": name, "caption": row["caption"], "sentences": row["sentences"],
                      "objects": row["objects"]}
            out.write(json.dumps(record) + "\n")
    return folder


# -- building a case as a run does --------------------------------------------------------------------------
def _recipe(case: Case, args: argparse.Namespace, data: Path, work: Path, compile_: bool) -> Any:
    import yaml

    from finetune.config import load_recipe

    raw = yaml.safe_load((RECIPES / case.recipe).read_text())
    raw["model"]["name_or_path"] = case.tiny if args.tiny else case.model
    raw["model"].pop("init_from", None)
    case.edit(raw)
    raw["data"] = {"train": {"name": "jsonl", "path": str(data)}, "num_workers": args.workers,
                   "cache_dir": str(work / "cache"), "on_error": "raise"}
    raw["eval"] = {"sets": [], "before": False, "after": False}
    batch = case.batch if (case.batch and not args.batch_fixed) else args.batch
    raw["train"].update({"batch_size": batch, "max_steps": args.steps, "log_every": args.log_every,
                         "checkpoint_every": 0, "trackers": [], "accumulation_steps": 1, "compile": compile_,
                         "mixed_precision": "bf16" if args.device == "cuda" else "no"})
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


def build_trainer(recipe: Any, accelerator: Any) -> Any:
    """The ``Trainer`` of ``recipe`` built the way :class:`finetune.training.FinetuneRecipe` builds it (model,
    adapter, objective, the terms' model changes, cached preprocessing, skipping dataset, the tensor-path collator)."""
    from finetune.data.collate import Collator
    from finetune.data.skipping import SkippingDataset, SkipReportingCollate, drop_undecodable
    from finetune.data.sources import load_source
    from finetune.models.adapters import apply_adapter, enable_gradient_checkpointing
    from finetune.objectives import build_objective
    from finetune.training import TrainModule, Trainer
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
    collator = Collator(model, objective, tensor_images=True)
    return Trainer(accelerator, TrainModule(model, objective), SkippingDataset(rows, d.on_error, decode=collator.decode),
                   SkipReportingCollate(collator), recipe.train, recipe.output.dir, num_workers=d.num_workers)


def _accelerator(device: str, mixed: str) -> Any:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=device == "cpu", mixed_precision=mixed,
                       dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def count_syncs(device: str):
    """Counts CUDA host syncs inside the block (``torch.cuda.set_sync_debug_mode("warn")``); yields a list that
    holds one message per sync afterwards (always empty off CUDA)."""
    found: list[str] = []
    if device != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower())


def _device_batches(trainer: Any, n: int) -> list[dict]:
    """``n`` batches of the trainer's own loader, moved to the device as the loop moves them."""
    out = []
    trainer.sampler.start_step, trainer.sampler.total_steps = 0, n
    for batch in trainer.loader:
        trainer._note_skipped(batch)
        out.append(trainer.to_device(batch))
        if len(out) == n:
            break
    return out


def time_bare(trainer: Any, batches: list[dict], steps: int, device: str) -> tuple[float, list[str]]:
    """Seconds per ``train_step`` on device batches (one warm-up step first), and the host syncs of the timed
    steps."""
    trainer.wrapped.train()
    trainer.train_step(batches[0], 10_000)
    _sync(device)
    with count_syncs(device) as syncs:
        start = time.perf_counter()
        for i in range(steps):
            trainer.train_step(batches[(i + 1) % len(batches)], 10_001 + i)
        _sync(device)
        seconds = time.perf_counter() - start
    return seconds / steps, syncs


def run_case(case: Case, args: argparse.Namespace, data: Path, root: Path, compile_: bool) -> dict[str, Any]:
    """Build the case, run the loop (``args.steps`` steps), then time the bare step on batches of its loader."""
    work = Path(tempfile.mkdtemp(prefix=f"{case.name}-", dir=root))
    recipe = _recipe(case, args, data, work, compile_)
    if case.name == "fcast":  # the recipe's SFCN superpixels, with random weights written here
        import yaml

        from finetune.config import load_recipe

        raw = yaml.safe_load((work / "recipe.yaml").read_text())
        _set(raw, "objective.terms.fcast.superpixels", {"method": "sfcn", "n_segments": 196 if not args.tiny else 36,
                                                        "checkpoint": _sfcn_weights(work)})
        (work / "recipe.yaml").write_text(yaml.safe_dump(raw))
        recipe = load_recipe(work / "recipe.yaml")
    t0 = time.perf_counter()
    acc = _accelerator(args.device, recipe.train.mixed_precision)
    trainer = build_trainer(recipe, acc)
    model = trainer._model
    built = time.perf_counter() - t0
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with count_syncs(args.device) as loop_syncs:
        result = trainer.train()
    loop_s = time.perf_counter() - t0 - built
    thr = result.throughput
    batch = recipe.train.batch_size
    batches = _device_batches(trainer, min(4, args.bare_steps))
    per_step, bare_syncs = time_bare(trainer, batches, args.bare_steps, args.device)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    bare = batch / per_step
    loop = thr["steady_samples_per_s"]
    flops = thr["flops_per_sample"]
    peak = peak_tflops(acc.device)
    out = {
        "case": case.name, "recipe": case.recipe, "model": recipe.model.name_or_path, "note": case.note,
        "batch": batch, "text_len": int(model.max_text_len), "adapter": recipe.adapter.type,
        "objective": recipe.objective.base + "".join(f" + {t}" for t in recipe.objective.terms),
        "compiled": bool(compile_), "attn_implementation": _attn(model),
        "loop_samples_per_s": loop, "bare_samples_per_s": bare,
        "loop_vs_bare": (loop / bare) if loop else None,
        "data_wait_share": thr["data_wait_share"], "steady_steps": thr["steady_steps"],
        "flops_per_sample_g": flops / 1e9 if flops else None,
        "bare_tflops": flops * bare / 1e12 if flops else None,
        "loop_tflops": flops * loop / 1e12 if flops and loop else None,
        "bare_mfu": flops * bare / 1e12 / peak if flops and peak else None,
        "loop_mfu": flops * loop / 1e12 / peak if flops and loop and peak else None,
        "peak_memory_gib": peak_mem,
        "host_syncs_per_bare_step": len(bare_syncs) / args.bare_steps if args.device == "cuda" else None,
        "host_syncs_in_loop": len(loop_syncs) if args.device == "cuda" else None,
        "loop_reads": len(trainer.clock.marks) - 1,
        "first_syncs": sorted(set(bare_syncs))[:3],
        "seconds": {"build": built, "loop": loop_s},
    }
    del trainer, model, batches
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def _attn(model: Any) -> str | None:
    cfg = getattr(getattr(model, "model", None), "config", None)
    return getattr(cfg, "_attn_implementation", None) if cfg is not None else None


# -- variants of the bare CLIP step -----------------------------------------------------------------------------
def run_variants(args: argparse.Namespace, data: Path, root: Path) -> list[dict[str, Any]]:
    """The bare clip-77 step as fp32 eager, bf16 eager and bf16 with compiled blocks (``train.compile``)."""
    case = CASES[0]
    out = []
    variants = [("bf16 eager", "bf16", False), ("fp32 eager", "no", False), ("bf16 compiled", "bf16", True)]
    if args.device != "cuda":
        variants = [("fp32 eager", "no", False), ("fp32 compiled", "no", True)]
    for label, mixed, compile_ in variants:
        # compilation takes minutes on a GPU machine's CPU: it starts only with COMPILE_S of the budget left
        reserve = COMPILE_S if compile_ else CASE_S
        if args.budget and time.perf_counter() - args.started > args.budget - reserve:
            out.append({"variant": label, "skipped": f"less than {reserve} s of the {args.budget:.0f} s budget left"})
            continue
        work = Path(tempfile.mkdtemp(prefix="variant-", dir=root))
        recipe = _recipe(case, args, data, work, compile_)
        recipe.train.mixed_precision = mixed
        acc = _accelerator(args.device, mixed)
        trainer = build_trainer(recipe, acc)
        batches = _device_batches(trainer, 2)
        t0 = time.perf_counter()
        from finetune.training.throughput import count_flops

        trainer.wrapped.train()
        _, flops = count_flops(lambda: trainer.train_step(batches[0], 1))
        for i in range(2 if compile_ else 0):  # compilation (and recompilation for the next shapes)
            trainer.train_step(batches[i % 2], 2 + i)
        _sync(args.device)
        warm = time.perf_counter() - t0
        per_step, _ = time_bare(trainer, batches, args.bare_steps, args.device)
        batch = recipe.train.batch_size
        peak = peak_tflops(acc.device)
        tflops = flops / per_step / 1e12
        out.append({"variant": label, "batch": batch, "samples_per_s": batch / per_step, "tflops": tflops,
                    "mfu": tflops / peak if peak else None, "warmup_s": warm,
                    "flops_per_sample_g": flops / batch / 1e9})
        print(f"  {label:15s} {batch / per_step:9.1f} samples/s  {tflops:7.1f} TFLOP/s"
              + (f"  MFU {100 * tflops / peak:.1f} %" if peak else "") + f"  (warm-up {warm:.0f} s)", flush=True)
        del trainer, batches
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
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
    own cost per step: ``Trainer.train()`` on a model whose step costs nothing against the same step in a bare
    Python loop."""
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
    """ms per step of ``Trainer.train()`` on :class:`_NullModel` (a ready batch, no workers) against the same
    forward/backward/optimiser step in a bare Python loop: what the loop adds per step."""
    import yaml

    from finetune.config import load_recipe
    from finetune.objectives.base import Objective, Term
    from finetune.training import TrainModule, Trainer, build_optimizer

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
    trainer_ms, bare_ms = [], []
    for _ in range(args.rounds):
        module = TrainModule(_NullModel(), Objective(Null()))
        trainer = Trainer(_accelerator("cpu", "no"), module, [dict(ready)] * 4, lambda ex: dict(ready), cfg,
                          root / "null-run")
        result = trainer.train()
        trainer_ms.append(1000 / result.throughput["steady_samples_per_s"])
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
    best = {"trainer_ms_per_step": min(trainer_ms), "bare_ms_per_step": min(bare_ms)}
    print(f"  loop overhead: Trainer {best['trainer_ms_per_step']:.2f} ms/step, bare step "
          f"{best['bare_ms_per_step']:.2f} ms/step", flush=True)
    return {"steps": steps, "trainer_ms_per_step": trainer_ms, "bare_ms_per_step": bare_ms, **best,
            "overhead_ms_per_step": best["trainer_ms_per_step"] - best["bare_ms_per_step"],
            "ratio_trainer_vs_bare": best["trainer_ms_per_step"] / best["bare_ms_per_step"]}


# -- main -------------------------------------------------------------------------------------------------------
def _environment(device: str) -> dict[str, Any]:
    import transformers

    env = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
           "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu_threads": torch.get_num_threads(), "peak_bf16_tflops": peak_tflops(device) if device == "cuda" else None}
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    return env


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="all", help="comma-separated, run in this order: " + ", ".join(c.name for c in CASES))
    ap.add_argument("--batch", type=int, default=None, help="per-GPU batch (default 256 on cuda; cases with a batch "
                                                            "of their own keep it unless --batch is given)")
    ap.add_argument("--steps", type=int, default=None, help="loop steps per case (default 15 on cuda: the steady "
                                                            "window is steps 5-15)")
    ap.add_argument("--log-every", type=int, default=None, help="loop reads (default 5): the steady window starts "
                                                                 "at the first read after the warm-up")
    ap.add_argument("--bare-steps", type=int, default=None, help="timed bare steps per case (default 6 on cuda)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=None, help="scenes written (default 2 x the largest batch)")
    ap.add_argument("--tiny", action="store_true", help="the families' tiny configs (CPU, seconds)")
    ap.add_argument("--variants", action="store_true", help="also time the bare clip-77 step eager vs compiled")
    ap.add_argument("--compile", choices=("on", "off"), default="off",
                    help="train.compile for the clip cases (--variants measures whether it pays)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run: a case or variant starts only with 20 s left (the compiled "
                         "variant 120 s); what does not start is listed as skipped")
    ap.add_argument("--out", default=str(RESULTS / "loop.json"))
    ap.add_argument("--cpu-figures", action="store_true", help="the CPU figures (data path, loop overhead) only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu-batch", type=int, default=32)
    ap.add_argument("--cpu-batches", type=int, default=20)
    ap.add_argument("--overhead-steps", type=int, default=200)
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    start = args.started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="xlipkit-bench-loop-"))
    if args.cpu_figures:
        out = Path(args.out if args.out != str(RESULTS / "loop.json") else RESULTS / "loop_cpu.json")
        result = {**_environment("cpu"), "note": "a shared machine: baseline and new interleaved in one run",
                  **cpu_figures(args, root)}
        d, o = result["data_path"], result["loop_overhead"]
        print(f"data path, one worker: {d['best']['new']:.1f} vs {d['best']['baseline']:.1f} samples/s "
              f"(x{d['ratio_best']:.2f} best, x{d['ratio_median_of_rounds']:.2f} median of the rounds, "
              f"x{d['ratio_per_worker_cpu_s']:.2f} per worker CPU second); loop overhead "
              f"{o['overhead_ms_per_step']:.2f} ms/step (Trainer {o['trainer_ms_per_step']:.2f}, bare "
              f"{o['bare_ms_per_step']:.2f})")
        write_json_atomic(out, result)
        return result
    gpu = args.device == "cuda"
    args.batch_fixed = args.batch is not None
    args.batch = args.batch or (256 if gpu and not args.tiny else 4)
    args.steps = args.steps or (15 if gpu else 6)
    args.log_every = args.log_every or (5 if gpu else 2)
    args.bare_steps = args.bare_steps or (6 if gpu else 2)
    if args.tiny:
        args.workers = min(args.workers, 1)
    by_name = {c.name: c for c in CASES}  # in the order asked for: the first ones run if the budget runs out
    wanted = CASES if args.cases == "all" else [by_name[n] for n in args.cases.split(",") if n in by_name]
    unknown = set(args.cases.split(",")) - {c.name for c in CASES} if args.cases != "all" else set()
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c.name for c in CASES)}")
    biggest = max([args.batch] + [c.batch or 0 for c in wanted if not args.batch_fixed])
    data = write_scenes(root / "scenes", args.rows or 2 * biggest, image_size=224 if not args.tiny else 64)
    print(f"data: {args.rows or 2 * biggest} scenes written as JPEG ({time.perf_counter() - start:.0f} s)", flush=True)
    compile_clip = args.compile == "on"
    results, skipped = [], []
    for case in wanted:
        if args.budget and time.perf_counter() - start > args.budget - CASE_S:
            skipped.append({"case": case.name, "reason": f"less than {CASE_S} s of the {args.budget:.0f} s budget left"})
            continue
        print(f"{case.name}: {case.recipe}", flush=True)
        try:
            r = run_case(case, args, data, root, bool(compile_clip and case.clip))
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others still run
            if args.tiny:
                raise
            skipped.append({"case": case.name, "reason": f"{type(exc).__name__}: {exc}"[:500]})
            print(f"  failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        results.append(r)
        write_json_atomic(Path(args.out), {**_environment(args.device), "partial": True, "cases": results,
                                           "skipped": skipped})  # what ran so far, should the run be cut off
        print(f"  loop {_fmt(r['loop_samples_per_s'])} / bare {r['bare_samples_per_s']:.1f} samples/s = "
              f"{_fmt(r['loop_vs_bare'], '.2f')}; data wait {_fmt(r['data_wait_share'], '.0%')}; "
              f"bare {_fmt(r['bare_tflops'], '.1f')} TFLOP/s MFU {_fmt(r['bare_mfu'], '.1%')}; "
              f"syncs/step {_fmt(r['host_syncs_per_bare_step'], '.1f')}; peak {_fmt(r['peak_memory_gib'], '.1f')} GiB",
              flush=True)
    variants = None
    if args.variants:
        print("variants of the bare clip-77 step:", flush=True)
        variants = run_variants(args, data, root)
    by = {r["case"]: r for r in results}
    summary = {}
    if "clip-77" in by and "clip-248" in by:
        summary["clip_248_vs_77_loop"] = _ratio(by["clip-248"]["loop_samples_per_s"], by["clip-77"]["loop_samples_per_s"])
        summary["clip_248_vs_77_bare"] = _ratio(by["clip-248"]["bare_samples_per_s"], by["clip-77"]["bare_samples_per_s"])
    if results:
        summary["min_loop_vs_bare"] = min((r["loop_vs_bare"] for r in results if r["loop_vs_bare"]), default=None)
    out = {**_environment(args.device),
           "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
           "flops": "torch.utils.flop_counter on the first step (matmul, conv, SDPA forward and backward)",
           "targets": {"loop_vs_bare": 0.9, "bare_clip_mfu_batch_256": 0.35, "clip_248_vs_77": 0.8},
           "variants": variants, "compiled_clip_cases": bool(compile_clip), "cases": results, "skipped": skipped,
           "summary": summary, "total_s": time.perf_counter() - start}
    write_json_atomic(Path(args.out), out)
    print(json.dumps(summary), f"({out['total_s']:.0f} s) -> {args.out}", flush=True)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


if __name__ == "__main__":
    main()
