"""A whole run under accelerate's own FSDP2 path on CPU processes: the loop, its checkpoints (accelerate's
``save_fsdp_model``), the final gathering and a resume on another number of processes.

accelerate gives FSDP only to GPU process types (CPU processes are MULTI_CPU), so the launched script switches the
accelerator's state to FSDP2 after the run makes it; from there everything is accelerate's and the run's own code:
``fsdp2_prepare_model`` shards the TrainModule (``fully_shard`` over gloo), the loop trains on DTensors. The first
H200 run of ``bench/engines_gpu.py`` failed at the loop's first read (a DTensor among the weights checked for NaN)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_SCRIPT = textwrap.dedent('''
    import sys
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    import finetune.training.recipe as recipe_module
    from finetune.training import environment

    def fsdp2_accelerator(recipe):
        accelerator = environment.make_accelerator(recipe)
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", state_dict_type="FULL_STATE_DICT",
            reshard_after_forward=True)
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        return accelerator

    recipe_module.make_accelerator = fsdp2_accelerator
    from finetune.cli.train import main
    sys.exit(main(sys.argv[1:]))
''')


def _run(script: Path, processes: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
           str(script), str(REPO / "recipes" / "quickstart_clip.yaml"), "train.max_steps=4",
           "train.accumulation_steps=2", "train.checkpoint_every=2", "train.trackers=[]", "train.log_every=1",
           "train.warmup_steps=1", "model.init_from=null", "eval.compare_with=[]", "eval.before=false",
           "eval.compare_base_length=false", f"output.dir={out}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


@pytest.mark.slow
def test_fsdp2_run_checkpoints_gathers_and_resumes_on_two_processes(tmp_path):
    script = tmp_path / "fsdp2_run.py"
    script.write_text(_SCRIPT)
    first = tmp_path / "run"
    proc = _run(script, 1, first)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((first / "metrics.json").read_text())
    assert metrics["num_processes"] == 1 and metrics["steps"] == 4
    assert (first / "checkpoints" / "step-2" / "pytorch_model_fsdp.bin").is_file()  # accelerate's FSDP save
    assert any((first / "final").glob("*.safetensors"))  # the gathered whole weights

    resumed = tmp_path / "resumed"  # the run stopped after its step-2 checkpoint, requeued on two processes
    shutil.copytree(first, resumed, ignore=shutil.ignore_patterns("final", "metrics.json", "report.md", "plots",
                                                                  "step-4"))
    (resumed / "recipe.yaml").write_text((first / "recipe.yaml").read_text().replace(str(first), str(resumed)))
    proc = _run(script, 2, resumed, "train.resume=latest")
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads((resumed / "metrics.json").read_text())
    assert again["num_processes"] == 2
    assert [h["step"] for h in again["history"]] == [h["step"] for h in metrics["history"]] == [1, 2, 3, 4]
    assert [h["loss"] for h in again["history"]] == pytest.approx([h["loss"] for h in metrics["history"]], abs=1e-4)
