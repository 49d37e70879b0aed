"""FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes, launched as a user launches them
(``accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 finetune/run.py RECIPE``, ``--use_deepspeed
--zero_stage N``): each trains to the losses of one plain process, writes sharded checkpoints (one shard per
process), resumes on the same number of processes to the same losses and weights, and on another number (FSDP: torch's
distributed checkpoint reshards; ZeRO: refused before the model loads, naming the remedy, shown under ZeRO-2); its
``final/`` loads with ``load_finetuned`` and evaluates to the run's own Recall@K. A request a CPU launch cannot honour
is refused, and nothing is written.

One launched run per engine is shared by what is checked of it; ``random:tiny-clip``, 4 steps."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]
EVAL_SET = {"name": "synthetic", "split": "test", "size": 8, "seed": 1}
RUN = ["model.name_or_path=random:tiny-clip", "data.train.size=16", "train.batch_size=8", "train.max_steps=4",
       "train.checkpoint_every=2", "train.keep_checkpoints=2", "train.trackers=[]", "train.log_every=1",
       "train.warmup_steps=1", f"eval.sets=[{json.dumps(EVAL_SET)}]", "eval.before=false", "eval.batch_size=8",
       "eval.compare_base_length=false", "model.init_from=null", "eval.compare_with=[]"]
ENGINES = {
    "fsdp2": ["--use_fsdp", "--fsdp_version", "2"],
    "zero2": ["--use_deepspeed", "--zero_stage", "2"],
    "zero3": ["--use_deepspeed", "--zero_stage", "3"],
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def _needs(engine: str) -> None:
    """DeepSpeed is in the test environment (``pip install -e ".[dev]"`` installs the ``deepspeed`` extra)."""
    import importlib.util

    if engine.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip('DeepSpeed is not installed: pip install -e ".[dev]" (or ".[deepspeed]") installs it')


def _port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _launch(flags: list[str], processes: int, out: Path, *extra: str, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess:
    """``accelerate launch FLAGS --num_processes N finetune/run.py recipes/quickstart_clip.yaml ...``."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", _port(),
           "--quiet", str(REPO / "finetune" / "run.py"), str(REPO / "recipes" / "quickstart_clip.yaml"), *RUN,
           f"output.dir={out}", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=900)


def _stopped_after_step_2(run: Path, copy: Path) -> Path:
    """``run`` as it was when stopped after its step-2 checkpoint, in ``copy`` (its recipe.yaml names ``copy``)."""
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("final", "metrics.json", "report.md", "plots", "step-4"))
    (copy / "recipe.yaml").write_text((run / "recipe.yaml").read_text().replace(str(run), str(copy)))
    return copy


def _losses(metrics: dict) -> list[float]:
    return [h["loss"] for h in metrics["history"]]


def _final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """The same run on one plain process (no engine), the reference."""
    out = tmp_path_factory.mktemp("plain") / "run"
    cmd = [sys.executable, str(REPO / "finetune" / "run.py"), str(REPO / "recipes" / "quickstart_clip.yaml"), *RUN,
           f"output.dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = _metrics(out)
    assert metrics["engine"]["distributed_type"] == "NO"
    # 4 steps of 8 of 16 samples: two epochs, each every sample once, as the progress bar says
    from finetune.data.sources import load_source
    from finetune.training.epochs import ids_digest

    source = load_source({"name": "synthetic", "split": "train", "size": 16, "seed": 0})
    every = ids_digest(source.dataset[i]["id"] for i in range(16))
    assert metrics["epochs"] == [{"epoch": e, "read": 16, "ids_digest": every, "skipped_ids": []} for e in (0, 1)]
    assert metrics["epoch"] == 2.0
    return out


def _shards(engine: str, checkpoint: Path) -> list[str]:
    """The per-process shard files of a checkpoint."""
    if engine == "fsdp2":
        return sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
    return sorted(p.name for p in (checkpoint / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_trains_checkpoints_resumes_and_its_final_loads_on_two_cpu_processes(engine, plain, tmp_path):
    from finetune.evaluation import evaluate_sets
    from finetune.models.finetuned import load_finetuned

    _needs(engine)
    flags = ENGINES[engine]
    run = tmp_path / "run"
    proc = _launch(flags, 2, run)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics, reference = _metrics(run), _metrics(plain)
    assert metrics["num_processes"] == 2  # the world of two
    used = metrics["engine"]
    assert used["distributed_type"] == ("FSDP" if engine == "fsdp2" else "DEEPSPEED") and used["backend"] == "gloo"
    if engine == "fsdp2":
        assert (used["fsdp_version"], used["state_dict_type"]) == (2, "SHARDED_STATE_DICT")  # accelerate's default
    else:
        assert used["zero_stage"] == int(engine[-1])
    assert len(_shards(engine, run / "checkpoints" / "step-2")) == 2  # one shard per process
    assert _losses(metrics) == pytest.approx(_losses(reference), abs=1e-4)  # the plain run's training
    assert metrics["epochs"] == reference["epochs"]  # the same samples in each epoch, over both processes

    # final/: the whole trained weights (gathered under FSDP and ZeRO-3), loaded as a user loads them, evaluated
    final, whole = _final(run), _final(plain)
    assert set(final) == set(whole)
    for key in whole:
        torch.testing.assert_close(final[key], whole[key], atol=1e-4, rtol=1e-3, msg=key)
    model = load_finetuned(run / "final")
    assert evaluate_sets(model, [EVAL_SET]) == metrics["after"]

    # stopped after the step-2 checkpoint, resumed on the same two processes: the same losses and weights
    same = _stopped_after_step_2(run, tmp_path / "same")
    proc = _launch(flags, 2, same, "train.resume=latest")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _metrics(same)["num_processes"] == 2
    assert f"resumed from {same / 'checkpoints' / 'step-2'} at step 2" in proc.stderr
    assert _losses(_metrics(same)) == pytest.approx(_losses(metrics), abs=1e-5)
    assert _metrics(same)["epochs"] == metrics["epochs"]  # the checkpoint's epochs and the resumed part's
    resumed = _final(same)
    for key in final:
        torch.testing.assert_close(resumed[key], final[key], atol=1e-5, rtol=1e-4, msg=key)

    # and on one process: FSDP reshards; DeepSpeed's ZeRO partitions cannot be, refused before the model loads (the
    # refusal reads the checkpoint's per-process files, the same under ZeRO-2 and ZeRO-3: one launch shows it)
    if engine == "zero3":
        return
    other = _stopped_after_step_2(run, tmp_path / "other")
    proc = _launch(flags, 1, other, "train.resume=latest")
    if engine == "fsdp2":
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert _metrics(other)["num_processes"] == 1 and _metrics(other)["engine"]["distributed_type"] == "FSDP"
        assert _losses(_metrics(other)) == pytest.approx(_losses(metrics), abs=1e-5)
        assert _metrics(other)["epochs"] == metrics["epochs"]
        resumed = _final(other)
        for key in final:
            torch.testing.assert_close(resumed[key], final[key], atol=1e-5, rtol=1e-4, msg=key)
    else:
        assert proc.returncode != 0
        assert (f"recipe error: train.resume: the checkpoint {other / 'checkpoints' / 'step-2'} was written by "
                "DeepSpeed ZeRO on 2 processes, this launch has 1") in proc.stderr, proc.stderr[-4000:]
        assert "Resume with --num_processes 2" in proc.stderr
        assert "model random:tiny-clip" not in proc.stderr  # before the model loaded
        assert not (other / "final").exists()


@pytest.mark.slow
@pytest.mark.parametrize("flags, env, said", [
    (["--use_fsdp"], {}, "launch error: FSDP version 1 was asked for on CPU processes"),
    (ENGINES["zero2"], {"ACCELERATE_USE_CPU": "true"},
     "launch error: DeepSpeed was asked for together with accelerate's CPU mode"),
], ids=["fsdp1-on-cpu", "deepspeed-with-cpu-mode"])
def test_an_engine_a_cpu_launch_cannot_have_is_refused_and_nothing_written(flags, env, said, tmp_path):
    """Before: FSDP's request was dropped (two separate runs wrote into one folder), DeepSpeed's under accelerate's
    CPU mode too (plain DDP, without a word)."""
    proc = _launch(flags, 2, tmp_path / "run", env=_env(**env))
    assert proc.returncode != 0
    # each process refuses; the launcher stops the other one once the first has ended, maybe before it printed
    assert proc.stderr.count(said) in (1, 2), proc.stderr[-4000:]
    assert not (tmp_path / "run").exists()
