"""run.py's process set-up: CPU threads and what a user sees under `accelerate launch` (the shipped configs),
and the parameter count."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.training.environment import cpu_threads, setup_logging

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.fixture
def one_thread(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)


def _accelerator(processes: int = 1, device: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), num_processes=processes)


@pytest.mark.parametrize("env, processes", [({"ACCELERATE_USE_CPU": "False"}, 1),  # accelerate launch, no --cpu
                                            ({"ACCELERATE_USE_CPU": "True"}, 1),  # --cpu: the user's threads
                                            ({"ACCELERATE_USE_CPU": "False"}, 2),  # several processes share cores
                                            ({}, 1)])  # not under accelerate launch
def test_the_thread_count_a_user_gives_is_kept(one_thread, monkeypatch, caplog, env, processes):
    """OMP_NUM_THREADS=1 that did not come from `accelerate launch`'s default (here: this process's parent is no
    launcher) is the user's: the run keeps it and says so (the launcher's default: tests/finetune/test_threads.py)."""
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level("INFO", logger="xlipkit"):
        cpu_threads(_accelerator(processes))
    assert torch.get_num_threads() == 1
    assert "CPU threads: 1 (OMP_NUM_THREADS=1), OpenMP" in caplog.text


def test_torch_set_num_threads_before_the_run_is_kept(monkeypatch, caplog):
    """A library user's `torch.set_num_threads(n)` before `run_recipe`, without any variable, stands."""
    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    torch.set_num_threads(1)
    try:
        with caplog.at_level("INFO", logger="xlipkit"):
            cpu_threads(_accelerator())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    said = "all cores" if CORES == 1 else f"of {CORES} cores: torch.set_num_threads before the run"
    assert f"CPU threads: 1 ({said}; OMP_NUM_THREADS unset)" in caplog.text


def _entry_point_environment(entry: str, env: dict[str, str], first: str = "") -> dict[str, str | None]:
    """The OpenMP and thread variables seen by the run's process after the entry point started (the recipe list: it
    exits before any training), printed by an ``atexit`` handler (the entry points end the process themselves)."""
    listing = "'--list'" if entry.endswith("run.py") else "'recipes'"
    code = (f"import atexit, json, os, runpy, sys\n{first}\n"
            "atexit.register(lambda: print(json.dumps({k: os.environ.get(k) for k in "
            "('OMP_WAIT_POLICY', 'OMP_NUM_THREADS', 'KMP_BLOCKTIME')}), flush=True))\n"
            f"sys.argv = [{entry!r}, {listing}]\nrunpy.run_path({entry!r}, run_name='__main__')\n")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
                                                           "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**base, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode == 0, proc.stderr
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["finetune/run.py", "finetune/cli/__main__.py"])
def test_the_entry_points_make_openmp_wait_passively_unless_told_otherwise(entry):
    """`python finetune/run.py` and `xlipkit` set OMP_WAIT_POLICY=PASSIVE before torch loads its OpenMP runtime;
    a wait policy the user gives, and a thread count, are kept; after `import torch` nothing is set (too late)."""
    seen = _entry_point_environment(entry, {})
    assert seen["OMP_WAIT_POLICY"] == "PASSIVE"
    seen = _entry_point_environment(entry, {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "2"})
    assert (seen["OMP_WAIT_POLICY"], seen["OMP_NUM_THREADS"]) == ("ACTIVE", "2")
    assert _entry_point_environment(entry, {"KMP_BLOCKTIME": "200"})["OMP_WAIT_POLICY"] is None
    assert _entry_point_environment(entry, {}, first="import torch")["OMP_WAIT_POLICY"] is None


def test_the_parameter_count_includes_the_objectives_own_parameters():
    """"trainable parameters 8,008,706 of 8,008,705": StructXLIP's structure temperature trains with the model."""
    from finetune.config import load_recipe
    from finetune.models.registry import build_model
    from finetune.objectives import build_objective
    from finetune.training.model import parameter_counts

    model = build_model("tiny-clip")
    objective = build_objective(load_recipe("recipes/quickstart.yaml").objective)
    in_model = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in objective.parameters()) == 1  # tau' of L_{I',T'}
    assert parameter_counts(model, objective) == (in_model + 1, in_model + 1)
    for p in model.parameters():
        p.requires_grad_(False)
    assert parameter_counts(model, objective) == (1, in_model + 1)


REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs" / "accelerate"


def _launch_warnings(monkeypatch, *argv: str) -> tuple[list[str], object]:
    from accelerate.commands import launch

    said: list[str] = []
    monkeypatch.setattr(launch.logger, "warning", lambda msg, *a, **k: said.append(str(msg)))
    args = launch.launch_command_parser().parse_args([*argv, "finetune/run.py", "recipes/quickstart.yaml"])
    args, _, _ = launch._validate_launch_command(args)
    return said, args


def test_the_shipped_accelerate_configs_leave_nothing_to_accelerates_defaults(monkeypatch):
    said, _ = _launch_warnings(monkeypatch)
    assert any("were not passed to `accelerate launch`" in m for m in said)  # what a bare launch prints
    said, args = _launch_warnings(monkeypatch, "--config_file", str(CONFIGS / "one_process.yaml"), "--quiet")
    assert said == [] and (args.num_processes, args.multi_gpu, args.quiet) == (1, False, True)
    said, args = _launch_warnings(monkeypatch, "--config_file", str(CONFIGS / "multi_gpu.yaml"), "--num_processes", "8")
    assert said == [] and (args.num_processes, args.multi_gpu, args.num_machines) == (8, True, 1)


def _accelerate_launch(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *argv],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("given, said", [({}, f"CPU threads: {CORES} (all cores; OMP_NUM_THREADS=1 was accelerate "
                                              "launch's default, no thread count given)"),
                                         ({"OMP_NUM_THREADS": "1"}, "CPU threads: 1 (OMP_NUM_THREADS=1)")])
def test_a_one_process_cpu_run_under_accelerate_launch_uses_every_core_unless_told(tmp_path, given, said):
    """The launch the docs show, `accelerate launch --config_file configs/accelerate/one_process.yaml finetune/run.py`,
    on the CPU: accelerate exports OMP_NUM_THREADS=1 to its process when the user gave no count, and the run then
    uses every core, as `python finetune/run.py` does; a count the user exported is kept. The log says which as the
    run sets up; the launch is ended once it has (a whole launched run: test_recipes.py)."""
    tiny = ["model.name_or_path=random:tiny-clip", "data.train.size=8", "train.batch_size=8", "train.max_steps=1",
            "train.trackers=[]", "eval.sets=[]", "eval.compare_base_length=false", f"output.dir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", **given)
    launch = subprocess.Popen([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                               str(CONFIGS / "one_process.yaml"), "--quiet", "finetune/run.py",
                               "recipes/quickstart_clip.yaml", *tiny], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                              start_new_session=True)  # a group of its own: the launcher and the run's process

    def end() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)

    guard = threading.Timer(600, end)  # a run that never says it ends the read too
    guard.start()
    seen = []
    try:
        for line in launch.stderr:
            seen.append(line)
            if "CPU threads: " in line:
                break
    finally:
        guard.cancel()
        end()
        launch.communicate(timeout=60)
    assert seen and "CPU threads: " in seen[-1], "".join(seen)[-3000:]
    assert said in seen[-1], seen[-1]


@pytest.mark.slow
def test_a_recipe_error_under_the_readmes_accelerate_launch_is_one_line():
    config = str(CONFIGS / "one_process.yaml")
    proc = _accelerate_launch("--config_file", config, "--quiet", "finetune/run.py", "recipes/quickstart.yaml",
                              "train.learning_rate=1e-5")
    assert proc.returncode == 1  # accelerate's --quiet exit status for a failed script
    assert proc.stderr.strip().splitlines() == [
        "recipe error: command-line override `train.learning_rate=1e-5`: `train.learning_rate` is not a recipe key: "
        "did you mean `train.lr`? (`learning_rate` is transformers' TrainingArguments name)"]
    # without --quiet accelerate adds its traceback; the line before it says what it is
    proc = _accelerate_launch("--config_file", config, "finetune/run.py", "recipes/quickstart.yaml", "train.lr=-1")
    lines = proc.stderr.splitlines()
    assert "were not passed to `accelerate launch`" not in proc.stderr
    assert lines[0].startswith("recipe error: ") and "train.lr" in lines[0]
    assert lines[1].startswith("(accelerate launch answers a failed script with a CalledProcessError traceback")
    assert lines[2] == "Traceback (most recent call last):" and "CalledProcessError" in lines[-1]


# ------------------------------------------------------------------------------- how a stopped or failed run ends


def test_the_resume_command_is_the_launch_command_with_train_resume_latest(monkeypatch):
    from finetune.training.ending import resume_command

    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "finetune/run.py", "recipes/x.yaml", "train.lr=1e-5",
                                           "train.resume=runs/x/checkpoints/step-3", "output.overwrite=true"])
    monkeypatch.setattr(os, "getppid", lambda: 1)  # init: not a launcher
    assert resume_command() == ("/venv/bin/python finetune/run.py recipes/x.yaml train.lr=1e-5 "
                                "train.resume=latest")
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "/venv/bin/xlipkit", "train", "my recipe.yaml"])
    assert resume_command() == "xlipkit train 'my recipe.yaml' train.resume=latest"


def test_a_stopped_run_never_prints_the_hub_token(monkeypatch, tmp_path, capsys):
    """Ctrl-C, SIGTERM and a full disk print the command that continues the run: a token given on the command line
    (flat, in a whole-section override, or one that does not look like one) is left out, and the user is told."""
    import signal

    import finetune.training.ending as ending
    from finetune.training import SaveFailedError, TrainingStopped
    from finetune.training.ending import resume_command

    secret = "mysecret-4f2a9c"
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "/venv/bin/xlipkit", "train", "r.yaml",
                                           "train.lr=1e-5", f"hub.token={secret}",
                                           f"hub={{token: {secret}-2, repo_id: me/x, push: true}}",
                                           "hub.token=hf_abcdefghijklmnopqrstu"])
    monkeypatch.setattr(os, "getppid", lambda: 1)
    monkeypatch.delenv("RANK", raising=False)
    assert resume_command() == "xlipkit train r.yaml train.lr=1e-5 'hub={repo_id: me/x, push: true}' " \
                               "train.resume=latest"
    ckpt = tmp_path / "run" / "checkpoints" / "step-6"
    for exc in (TrainingStopped(signal.SIGTERM, 6, ckpt), TrainingStopped(signal.SIGINT, 6, ckpt),
                SaveFailedError("checkpoint step-8 could not be saved: the disk is full", kept=ckpt, disk_full=True)):
        ending.stopped_or_failed(exc, _recipe_at(tmp_path / "run"))
        err = capsys.readouterr().err
        assert secret not in err and "hf_abcdefghijklmnopqrstu" not in err, err
        assert "\n  xlipkit train r.yaml train.lr=1e-5 'hub={repo_id: me/x, push: true}' train.resume=latest\n  (the " \
               "hub token given on the command line is left out: set HF_TOKEN" in err, err


def test_the_resume_command_of_a_launched_process_is_the_launchers(monkeypatch, tmp_path):
    """Under torchrun or accelerate launch the command to give again is the launcher's, read from /proc."""
    from finetune.training.ending import resume_command

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "torch.distributed.run",
                                 "--nproc_per_node", "8", "finetune/run.py", "r.yaml"])
    try:
        monkeypatch.setattr(os, "getppid", lambda: launcher.pid)
        deadline = time.monotonic() + 30
        while not Path(f"/proc/{launcher.pid}/cmdline").read_bytes().count(b"\0") > 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        command = resume_command()
    finally:
        launcher.kill()
        launcher.wait()
    assert command.endswith("-m torch.distributed.run --nproc_per_node 8 finetune/run.py r.yaml train.resume=latest")


def _recipe_at(out: Path):
    return SimpleNamespace(output=SimpleNamespace(dir=str(out)))


def test_stops_and_failures_end_with_a_status_and_a_message_not_a_traceback(tmp_path, capsys, monkeypatch):
    import signal

    import finetune.training.ending as ending
    from finetune.data.images import DataError
    from finetune.training import DivergedError, RunInterrupted, SaveFailedError, TrainingStopped

    monkeypatch.setattr(ending, "resume_command", lambda: "python finetune/run.py r.yaml train.resume=latest")
    monkeypatch.delenv("RANK", raising=False)
    recipe = _recipe_at(tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step-6"
    cases = [
        (TrainingStopped(signal.SIGTERM, 6, ckpt), 143,
         f"SIGTERM: stopped after step 6; saved {ckpt}. Continue the run with:\n  python finetune/run.py r.yaml "
         "train.resume=latest"),
        (TrainingStopped(signal.SIGINT, 6, ckpt), 130, "SIGINT: stopped after step 6"),
        (RunInterrupted(signal.SIGINT), 130, "SIGINT: stopped before training started"),
        (SaveFailedError("checkpoint step-8 could not be saved in X: the disk is full (...); the newest complete "
                         "checkpoint, checkpoints/step-6, is kept", kept=ckpt, disk_full=True), 1,
         "error: checkpoint step-8 could not be saved in X: the disk is full (...); the newest complete checkpoint, "
         "checkpoints/step-6, is kept. Free some space (or move output.dir and the run folder with it), then continue "
         "with:\n  python finetune/run.py r.yaml train.resume=latest"),
        (DivergedError("the trainable weights became NaN"), 1, "error: the trainable weights became NaN"),
        (DataError("Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                   "  File \"x.py\", line 1\nfinetune.data.images.DataError: data source 'webdataset': shard s.tar "
                   "cannot be read"), 1, "data error: data source 'webdataset': shard s.tar cannot be read"),
    ]
    for exc, status, said in cases:
        assert ending.stopped_or_failed(exc, recipe) == status, exc
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    assert ending.stopped_or_failed(ValueError("a bug"), recipe) is None  # re-raised with its traceback
    monkeypatch.setenv("RANK", "1")  # another rank of an agreed stop prints nothing
    assert ending.stopped_or_failed(TrainingStopped(signal.SIGTERM, 6, ckpt), recipe) == 143
    assert capsys.readouterr().err == ""


def test_a_run_builds_its_objective_once(tmp_path, monkeypatch, capsys):
    """One objective per run (issue 25 item 3, issue 38 item 1): built by the preflight before the data and the
    model, checked, counted and trained; the stream check and the batch check reuse it instead of building their
    own."""
    import finetune.objectives as objectives
    import finetune.training.preflight as preflight_module
    from finetune.cli.train import main

    built = []
    real = objectives.build_objective
    for module in (objectives, preflight_module):
        monkeypatch.setattr(module, "build_objective", lambda cfg: built.append(cfg) or real(cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("# r\nmodel: {name_or_path: random:tiny-clip, max_text_len: null}\n"
                      "data: {train: {name: synthetic, size: 16}}\neval: {before: false, after: false}\n"
                      f"train: {{max_steps: 1, batch_size: 8, trackers: []}}\noutput: {{dir: {tmp_path / 'run'}}}\n")
    status = main([str(recipe)])
    assert status == 0, capsys.readouterr().err[-2000:]
    assert len(built) == 1


def test_the_stream_check_uses_the_objective_it_is_given(monkeypatch):
    """Streams receive the run's objective instead of building one (issue 32): the check lives with the run's
    other checks, takes the objective it is given, and the data layer builds none."""
    import inspect

    import finetune.data.streams as streams
    import finetune.objectives as objectives
    from finetune.config import RecipeError, load_recipe
    from finetune.training.preflight import check_stream_recipe

    assert not hasattr(streams, "check_stream_recipe")
    assert inspect.signature(check_stream_recipe).parameters["objective"].default is inspect.Parameter.empty
    recipe = load_recipe(REPO / "recipes" / "fcast_cc3m_recap.yaml")
    objective = objectives.build_objective(recipe.objective)
    monkeypatch.setattr(objectives, "build_objective", lambda cfg: pytest.fail("built a second objective"))
    check_stream_recipe(recipe, objective)
    recipe.train.max_steps = None
    with pytest.raises(RecipeError, match="train.max_steps"):
        check_stream_recipe(recipe, objective)


def test_the_log_writes_to_the_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's log follows ``sys.stderr`` when a caller swaps it (pytest's capture, a progress bar): a handler
    made under an earlier, now closed stream printed "--- Logging error ---" in place of the message."""
    logger = logging.getLogger("xlipkit")
    saved, logger.handlers[:] = logger.handlers[:], []
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging(True)
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logger.info("the message")
        assert second.getvalue().rstrip().endswith("INFO the message")
        assert "Logging error" not in second.getvalue()
    finally:
        logger.handlers[:] = saved
