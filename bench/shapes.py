"""Fixed shapes and fewer launches, counted on the CPU (issue 29 items 1-2): CPU proxies of what a GPU step pays.

For each case (a method's objective on synthetic scenes, the run's own loop parts and data path, bf16 autocast on the
CPU, 12+12-layer towers at a narrow width for the CLIP and SigLIP2 cases) and each code tree (``before``: the tree
at ``--baseline``, unpacked with ``git archive``; ``after``: this checkout), one fresh process trains
``--warmup + --steps`` steps and counts, per measured step (after the warm-up):

- ``ops``: aten ops that launch a kernel (views, ``empty`` and other metadata ops left out), counted with a
  ``TorchDispatchMode`` around the step (``TrainStep``: forward, backward, optimiser). GPU effect it stands for:
  kernel launches per step, which bound a small-batch step when the launching thread is slower than the GPU
  (a hypothesis for the measured 0.15-0.51 loop/bare ratios, issue 29);
- ``casts``: the ``aten._to_copy`` among them, split into casts of parameters (leaves) and of activations;
- ``new_sdpa_shapes``: scaled-dot-product-attention calls whose (query, key, mask) shapes no earlier step had
  (warm-up included). GPU effect: on sm90 with cuDNN >= 9.15 PyTorch prefers cuDNN attention, which builds a
  graph per new shape, and a compiled step or CUDA graph re-records per new shape (hypothesis, issue 29: ~110 ms
  per new forward+backward graph);
- ``text_passes`` / ``image_passes``: calls of the towers' first block per step (GPU effect: each pass is a
  tower's worth of launches at its own shape).

Ratios (after / before, and clip-248 / siglip2 at the same depth) are computed from the one run. No GPU timing is
made here; ``bench/loop.py`` times the GPU loop.

    python bench/shapes.py                     # every case, both trees: bench/results/shapes.json
    python bench/shapes.py --cases clip-248 siglip2 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
#: the commit before fixed shapes (issue 29 items 1-2): the ``before`` tree
BASELINE = "1639af7"

#: case -> (objective section, model, max_text_len, extra train keys)
CASES: dict[str, dict[str, Any]] = {
    "clip-77": {"objective": {"base": "clip"}, "model": "clip12", "length": 77},
    "clip-248": {"objective": {"base": "clip"}, "model": "clip12", "length": 248},
    "siglip2": {"objective": {"base": "siglip"}, "model": "siglip12", "length": 248},
    "longclip-248": {"objective": {"base": "longclip"}, "model": "clip12", "length": 248},
    "structxlip": {"objective": {"base": "clip", "terms": {"structxlip": {
        "regions": {"source": "dataset", "k": 3, "per_image": 3, "encode": "crop"}}}},
        "model": "clip12", "length": 248},
    "fastgoal": {"objective": {"base": "clip", "terms": {"fastgoal": {"regions": {"method": "dataset"}}}},
                 "model": "clip12", "length": 248},
    "flair": {"objective": {"base": "none", "terms": {"flair": {"k": 4}}}, "model": "tiny-flair", "length": None},
}


# -- counting (self-contained: it runs against either tree) ---------------------------------------------------
def _counters() -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    quiet = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten.detach.default, aten.lift_fresh.default, aten.sym_size.int,
             aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default, aten.set_.source_Storage,
             aten.set_.source_Storage_storage_offset, aten.resize_.default, aten.is_same_size.default}

    class Ops(TorchDispatchMode):
        """Kernel-launching aten ops, the casts among them, and the SDPA shapes."""

        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()
            self.casts = {"parameter": 0, "activation": 0}
            self.sdpa: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if func not in quiet and not getattr(func, "is_view", False):
                self.ops[name] += 1
                if func is aten._to_copy.default and isinstance(args[0], torch.Tensor):
                    leaf = isinstance(args[0], torch.nn.Parameter) or (args[0].is_leaf and args[0].requires_grad)
                    self.casts["parameter" if leaf else "activation"] += 1
            if "scaled_dot_product" in name and "backward" not in name:
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                mask = tuple(mask.shape) if isinstance(mask, torch.Tensor) else None
                self.sdpa.append((name, tuple(args[0].shape), tuple(args[1].shape), mask))
            return func(*args, **kwargs)

    return Ops


def _model(name: str, length: int | None) -> Any:
    import torch

    torch.manual_seed(0)
    if name == "tiny-flair":
        from finetune import load_model

        return load_model("tiny-flair")
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, SiglipConfig, SiglipImageProcessor, \
        SiglipModel

    from finetune.models.backends.hf import HFDualEncoder
    from finetune.models.longclip import apply_kps
    from finetune.models.offline_tokenizers import clip_tokenizer, word_tokenizer, word_vocab_size

    width = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 12, "num_attention_heads": 4}
    vision = {**width, "image_size": 32, "patch_size": 8}
    if name == "clip12":
        text = {**width, "vocab_size": 49408, "max_position_embeddings": 77, "bos_token_id": 49406,
                "eos_token_id": 49407, "pad_token_id": 49407, "hidden_act": "quick_gelu"}
        config = CLIPConfig(text_config=text, vision_config={**vision, "hidden_act": "quick_gelu"}, projection_dim=64)
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        model = HFDualEncoder(CLIPModel(config).eval(), clip_tokenizer(77), processor, name_or_path="bench-clip12")
    else:
        text = {**width, "vocab_size": word_vocab_size(), "max_position_embeddings": 64, "pad_token_id": 0,
                "eos_token_id": 1, "bos_token_id": 1, "projection_size": 64, "hidden_act": "gelu_pytorch_tanh"}
        config = SiglipConfig(text_config=text, vision_config={**vision, "hidden_act": "gelu_pytorch_tanh"})
        processor = SiglipImageProcessor(size={"height": 32, "width": 32})
        model = HFDualEncoder(SiglipModel(config).eval(), word_tokenizer(64), processor, name_or_path="bench-siglip12",
                              family="siglip2")
    if length and length != model.max_text_len:
        apply_kps(model, length=length)
    return model


def _first_blocks(model: Any) -> tuple[Any, Any]:
    """The first transformer block of the text and of the image tower (a pass is one call of it)."""
    inner = model.model
    if hasattr(inner, "text_model"):
        return inner.text_model.encoder.layers[0], inner.vision_model.encoder.layers[0]
    return inner.transformer.resblocks[0], inner.visual.transformer.resblocks[0]


def run_case(name: str, steps: int, warmup: int, batch: int, workdir: Path) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of case ``name`` in this process and count (see the module docstring)."""
    import torch
    import yaml
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    from finetune.config import load_recipe
    from finetune.data.sources import load_source
    from finetune.objectives import build_objective
    from finetune.training import TrainModule, build_loop

    case = CASES[name]
    workdir.mkdir(parents=True, exist_ok=True)
    recipe = {"objective": case["objective"],
              "train": {"lr": 1e-4, "batch_size": batch, "max_steps": warmup + steps, "trackers": [],
                        "log_every": 1000, "seed": 0, "mixed_precision": "bf16"}}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    loaded = load_recipe(path)
    objective = build_objective(loaded.objective)
    model = _model(case["model"], case["length"])
    objective.prepare_model(model)
    rows = load_source({"name": "synthetic", "size": batch * (warmup + steps), "seed": 0,
                        "options": {"image_size": 48}}).dataset
    rows = objective.preprocess(rows, model, cache_dir=str(workdir / "cache"))
    AcceleratorState._reset_state(reset_partial_state=True)  # a process that made an Accelerator before (tests)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, mixed_precision="bf16", dataloader_config=DataLoaderConfiguration(split_batches=True))
    parts = build_loop(acc, TrainModule(model, objective), rows, loaded.train, workdir / f"run-{name}")
    text_block, image_block = _first_blocks(model)
    calls = {"text": 0, "image": 0}
    text_block.register_forward_pre_hook(lambda *a: calls.__setitem__("text", calls["text"] + 1))
    image_block.register_forward_pre_hook(lambda *a: calls.__setitem__("image", calls["image"] + 1))
    ops_mode = _counters()
    seen: set = set()
    per_step = []
    parts.wrapped.train()
    for step, (_, batch_) in enumerate(parts.batches.from_step(0), start=1):
        calls.update(text=0, image=0)
        mode = ops_mode()
        with mode:
            parts.step(batch_, step)
        shapes = set(mode.sdpa)
        per_step.append({"step": step, "ops": sum(mode.ops.values()), "casts": dict(mode.casts),
                         "sdpa_calls": len(mode.sdpa), "new_sdpa_shapes": len(shapes - seen),
                         "text_passes": calls["text"], "image_passes": calls["image"],
                         "top_ops": mode.ops.most_common(8)})
        seen |= shapes
        if step == warmup + steps:
            break
    steady = per_step[warmup:]

    def mean(key: str) -> float:
        return sum(s[key] for s in steady) / len(steady)

    return {"case": name, "objective": case["objective"], "model": case["model"], "max_text_len": model.max_text_len,
            "batch": batch, "warmup_steps": warmup, "steps": steps,
            "ops_per_step": mean("ops"), "casts_per_step": sum(sum(s["casts"].values()) for s in steady) / len(steady),
            "parameter_casts_per_step": sum(s["casts"]["parameter"] for s in steady) / len(steady),
            "text_passes_per_step": mean("text_passes"), "image_passes_per_step": mean("image_passes"),
            "new_sdpa_shapes_after_warmup": sum(s["new_sdpa_shapes"] for s in steady),
            "distinct_sdpa_shapes": len(seen), "parameters": sum(1 for p in model.parameters() if p.requires_grad),
            "per_step": per_step}


# -- the driver: fresh process per (tree, case) ---------------------------------------------------------------
def _baseline_tree(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _run_in(tree: Path, name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{tree.name}-{name}.json"
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "XLIPKIT_CACHE": str(workdir / "xlipkit-cache")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", name, "--out", str(out), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--workdir", str(workdir / f"{tree.name}-{name}")]
    proc = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True)
    if proc.returncode:
        return {"case": name, "error": proc.stderr[-2000:]}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=6, help="measured steps per case (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--baseline", default=BASELINE, help="git ref of the 'before' tree")
    p.add_argument("--no-baseline", action="store_true", help="measure this checkout only")
    p.add_argument("--out", type=Path, default=RESULTS / "shapes.json")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:  # the child process: one case in this tree
        result = run_case(args.case, args.steps, args.warmup, args.batch, args.workdir)
        args.out.write_text(json.dumps(result))
        return 0
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        trees = {"after": ROOT}
        if not args.no_baseline:
            base = workdir / "before"
            base.mkdir()
            trees["before"] = _baseline_tree(args.baseline, base)
        results: dict[str, dict[str, Any]] = {}
        for name in args.cases:
            results[name] = {}
            for label, tree in trees.items():
                r = _run_in(tree, name, args, workdir)
                results[name][label] = r
                if "error" in r:
                    print(f"{name} [{label}]: failed\n{r['error']}", file=sys.stderr)
                    continue
                print(f"{name:>13} [{label:>6}] ops/step {r['ops_per_step']:7.0f}  casts {r['casts_per_step']:6.0f} "
                      f"(params {r['parameter_casts_per_step']:4.0f})  text passes {r['text_passes_per_step']:.1f}  "
                      f"image passes {r['image_passes_per_step']:.1f}  new SDPA shapes after warm-up "
                      f"{r['new_sdpa_shapes_after_warmup']}", flush=True)
    ratios: dict[str, Any] = {}
    for name, by_tree in results.items():
        a, b = by_tree.get("after", {}), by_tree.get("before", {})
        if "ops_per_step" in a and "ops_per_step" in b:
            ratios[f"{name}: ops after / before"] = a["ops_per_step"] / b["ops_per_step"]
    for label in ("after", "before"):
        c, s = results.get("clip-248", {}).get(label, {}), results.get("siglip2", {}).get(label, {})
        if "ops_per_step" in c and "ops_per_step" in s:
            ratios[f"clip-248 / siglip2 ops ({label})"] = c["ops_per_step"] / s["ops_per_step"]
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    out = {"device": f"cpu ({platform.machine()})", "torch": torch.__version__, "python": platform.python_version(),
           "cpu_threads": torch.get_num_threads(), "baseline": None if args.no_baseline else args.baseline,
           "settings": {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "autocast": "bf16 (CPU)",
                        "towers": "12 + 12 layers, width 64 (clip12, siglip12); tiny-flair for flair"},
           "note": "CPU proxies: counts, not times; no GPU in the session that made this file",
           "ratios": ratios, "cases": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
