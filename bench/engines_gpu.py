"""One GPU, three engines: 20 steps each of DeepSpeed ZeRO-2, DeepSpeed ZeRO-3 and FSDP2 through
``accelerate launch --num_processes 1``, each saved (``final/`` and a checkpoint at step 10), loaded back with
``finetune.load_finetuned`` and evaluated, and resumed from its step-10 checkpoint to the same losses.

Run on a machine with one GPU (and ``deepspeed`` installed)::

    python bench/engines_gpu.py                   # writes bench/results/engines_gpu.json
    python bench/engines_gpu.py --dry-run         # anywhere: writes the accelerate configs, checks the recipe, prints

What each engine is launched with: an ``accelerate`` config file (``distributed_type: DEEPSPEED`` with
``zero_stage`` 2 or 3 and every size left to the run, or ``FSDP`` with ``fsdp_version: 2`` and the transformer wrap
policy, whose layers the run names per family), the recipe ``recipes/quickstart_clip.yaml`` on its synthetic scenes
(``train.max_steps=20``, ``train.accumulation_steps=2``, ``train.checkpoint_every=10``, bf16). Nothing is timed
against another engine here: the numbers are whether each path works, and its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "engines_gpu.json"
RECIPE = ROOT / "recipes" / "quickstart_clip.yaml"

ENGINES = {
    "deepspeed-zero2": {"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "zero_stage": 2, "offload_optimizer_device": "none", "offload_param_device": "none", "zero3_init_flag": False}},
    "deepspeed-zero3": {"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "zero_stage": 3, "offload_optimizer_device": "none", "offload_param_device": "none", "zero3_init_flag": False,
        "zero3_save_16bit_model": True}},
    "fsdp2": {"distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_reshard_after_forward": True, "fsdp_cpu_ram_efficient_loading": False}},
}


def accelerate_config(engine: str, folder: Path) -> Path:
    """The accelerate config file of ``engine`` (as ``accelerate config`` writes it), in ``folder``."""
    config = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "num_machines": 1, "num_processes": 1,
              "mixed_precision": "bf16", "use_cpu": False, "main_training_function": "main", **ENGINES[engine]}
    path = folder / f"{engine}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def overrides(out: Path, *extra: str) -> list[str]:
    return ["train.max_steps=20", "train.accumulation_steps=2", "train.checkpoint_every=10", "train.keep_checkpoints=3",
            "train.mixed_precision=bf16", "train.trackers=[]", "train.log_every=1", "model.init_from=null",
            "eval.compare_with=[]", f"output.dir={out}", *extra]


def launch(config: Path, args: list[str], log: Path) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "1",
           str(ROOT / "finetune" / "run.py"), str(RECIPE), *args]
    started = time.perf_counter()
    with open(log, "w") as f:
        status = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=1200,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}).returncode
    return status, time.perf_counter() - started


def failure_lines(log: str, keep: int = 80) -> str:
    """What a failed launch says: the process's own lines (``[rank0]: ...``, the run's ``error:`` and ``recipe error:``)
    and any line naming an error, the last ``keep`` of them, without the launcher's traceback around them."""
    lines = [line for line in log.splitlines() if line.startswith("[rank") or "error" in line.lower()]
    return "\n".join(lines[-keep:])[-8000:]


def load_back(final: Path) -> dict:
    """``final/`` loaded with ``load_finetuned`` and a batch encoded: finite embeddings of the right shape."""
    import torch

    from finetune import load_finetuned

    model = load_finetuned(str(final)).eval()
    texts = ["a red circle left of a blue square", "three green stars"]
    with torch.no_grad():
        tokens = model.tokenize(texts)
        emb = model.encode_text(tokens.input_ids, tokens.attention_mask).embeds
    return {"text_embeds_shape": list(emb.shape), "finite": bool(torch.isfinite(emb).all())}


def run_engine(engine: str, work: Path) -> dict:
    config = accelerate_config(engine, work)
    out = work / engine
    status, seconds = launch(config, overrides(out), work / f"{engine}.log")
    record: dict = {"status": status, "seconds": round(seconds, 1), "log_tail": None}
    if status != 0:
        record["log_tail"] = failure_lines((work / f"{engine}.log").read_text())
        return record
    metrics = json.loads((out / "metrics.json").read_text())
    record.update(steps=metrics["steps"], final_loss=metrics["final_losses"].get("loss"),
                  after=metrics.get("after"), num_processes=metrics["num_processes"])
    try:
        record["load_back"] = load_back(out / "final")
    except Exception as error:  # noqa: BLE001 - reported, not raised: the other engines still run
        record["load_back"] = {"error": f"{type(error).__name__}: {error}"}
    resumed = work / f"{engine}-resumed"  # the run killed after its step-10 checkpoint, resumed
    shutil.copytree(out, resumed)
    for name in ("final", "metrics.json", "report.md", "plots", "checkpoints/step-20"):
        path = resumed / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    recipe = yaml.safe_load((resumed / "recipe.yaml").read_text())
    recipe["output"]["dir"] = str(resumed)
    (resumed / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    status, seconds = launch(config, overrides(resumed, "train.resume=latest"), work / f"{engine}-resumed.log")
    record["resume"] = {"status": status, "seconds": round(seconds, 1)}
    if status == 0:
        again = json.loads((resumed / "metrics.json").read_text())
        record["resume"]["same_losses"] = [h["loss"] for h in again["history"]] == [h["loss"] for h in
                                                                                    metrics["history"]]
        record["resume"]["max_loss_difference"] = max(abs(a["loss"] - b["loss"]) for a, b in
                                                      zip(again["history"], metrics["history"]))
    else:
        record["resume"]["log_tail"] = failure_lines((work / f"{engine}-resumed.log").read_text())
    return record


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="*", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--dry-run", action="store_true", help="write the configs, check the recipe, print the commands")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--keep", help="keep the runs in this folder (default: a temporary one)")
    args = p.parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix="engines_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        from finetune.config import load_recipe

        for engine in args.engines:
            config = accelerate_config(engine, work)
            load_recipe(RECIPE, overrides(work / engine))
            print(f"{engine}: accelerate launch --config_file {config} --num_processes 1 finetune/run.py {RECIPE.name} "
                  + " ".join(overrides(work / engine)))
        return {}
    import accelerate
    import torch

    results = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
               "torch": torch.__version__, "accelerate": accelerate.__version__, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d"), "engines": {}}
    try:
        import deepspeed

        results["deepspeed"] = deepspeed.__version__
    except ImportError:
        results["deepspeed"] = None
    for engine in args.engines:
        results["engines"][engine] = run_engine(engine, work)
        print(engine, json.dumps({k: v for k, v in results["engines"][engine].items() if k != "log_tail"}), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))  # after each engine: a cut-off run keeps its part
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
