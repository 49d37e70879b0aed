"""The processes of a launch, set up before anything else a run does (:func:`start_processes`).

- The launcher's variables are checked first (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and SLURM's under ``srun``,
  :func:`~finetune.training.distributed.slurm_environment`): a rank that is not a number, or one past the world
  size, stops the run at once (:class:`LaunchError`, status 2) instead of waiting on a rendezvous no one else joins.
- The first process group is made here, by accelerate's ``PartialState``, with ``train.process_group_timeout_s``
  (its rendezvous, torch's ``TCPStore``, waits that long too), and every group made after it gets the same timeout
  (torch's default for ``new_group``, which DeepSpeed's groups and the run's stop vote use, is set to it).
- Where the processes have no accelerator, gloo is named as the backend: accelerate picks a backend only for GPU
  process types or under ``--cpu``, so ``accelerate launch --use_deepspeed`` or ``--use_fsdp`` on CPUs would start
  processes that each think they are the only one (two runs writing into one folder).
- The engine asked for is checked against what these processes can have (:func:`engine_problem`): DeepSpeed that
  is not installed, DeepSpeed together with accelerate's ``--cpu`` (which drops it without a word), FSDP version 1
  on CPU processes; each is refused with what to do. FSDP version 2 on CPU processes, which accelerate does not give
  them, is given by the run itself (:func:`fsdp_on_cpu`).
- While the process waits for the others to join, a SIGINT / SIGTERM still ends it at once (:func:`interruptible`):
  the wait is in C++ code, where Python's signal handlers cannot run.
- A collective that timed out is told as one line naming this process, the setting and the remedy
  (:func:`timeout_message`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import select
import signal
import socket
import threading
from typing import Any, Iterator

from finetune.training.distributed import slurm_environment

log = logging.getLogger("xlipkit")

__all__ = ["LaunchError", "engine_problem", "fsdp_on_cpu", "group_timeout", "interruptible", "launch_variables",
           "start_processes", "timeout_message"]

#: how long the main thread has to take a signal itself before :func:`interruptible` ends the process
SIGNAL_GRACE_S = 2.0


class LaunchError(Exception):
    """The processes of a launch cannot form one run (or cannot have the engine asked for): the message says why and
    what to do; the run ends with status 2, before anything is written."""


def _flag(environ: dict[str, str], name: str) -> bool:
    return environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def _integer(environ: dict[str, str], name: str, default: int | None = None) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not a number: the launcher (torchrun, accelerate launch, srun) sets "
                          "it to this process's place in the run; unset it, or start the run through the launcher"
                          ) from None


def launch_variables(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process from its launcher's variables (``(0, 1)`` without a launcher).

    Raises:
        LaunchError: a variable that is not a number, a world size below 1, or a rank outside it.
    """
    env = os.environ if environ is None else environ
    world = _integer(env, "WORLD_SIZE", 1)
    rank = _integer(env, "RANK", 0)
    local = _integer(env, "LOCAL_RANK", 0)
    if world < 1:
        raise LaunchError(f"WORLD_SIZE={world}: a run has at least one process")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is outside the run's {world} process(es) (WORLD_SIZE={world}): no other "
                          "process would ever join it. Give each process a rank from 0 to WORLD_SIZE - 1 (under srun: "
                          "SLURM_PROCID below SLURM_NTASKS)")
    if local < 0:
        raise LaunchError(f"LOCAL_RANK={local} is negative")
    return rank, world


def _srun_variables(environ: dict[str, str]) -> None:
    """SLURM's variables checked, then turned into the process group's (:func:`slurm_environment`)."""
    if "RANK" in environ or "SLURM_PROCID" not in environ or "SLURM_STEP_ID" not in environ:
        return
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_NNODES"):
        _integer(environ, name)
    if _integer(environ, "SLURM_NNODES", 1) < 1:
        raise LaunchError(f"SLURM_NNODES={environ['SLURM_NNODES']}: a job step runs on at least one node")
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if per_node and not per_node.isdigit():
        raise LaunchError(f"SLURM_NTASKS_PER_NODE={environ['SLURM_NTASKS_PER_NODE']!r} is not a task count")
    try:
        slurm_environment(environ)
    except RuntimeError as exc:
        raise LaunchError(str(exc)) from None


def group_timeout(recipe: Any) -> datetime.timedelta:
    """``train.process_group_timeout_s`` as a ``timedelta``."""
    return datetime.timedelta(seconds=int(getattr(recipe.train, "process_group_timeout_s", 7200)))


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def group_kwargs(recipe: Any) -> dict[str, Any]:
    """What accelerate's ``PartialState`` (and ``InitProcessGroupKwargs``) is given for the first process group: the
    timeout, and ``backend="gloo"`` where the processes have no accelerator."""
    kwargs: dict[str, Any] = {"timeout": group_timeout(recipe)}
    if not _has_accelerator():
        kwargs["backend"] = "gloo"
    return kwargs


def _set_default_timeout(timeout: datetime.timedelta) -> None:
    """Every process group made without a timeout of its own (torch's ``new_group``: DeepSpeed's groups, FSDP's
    mesh) waits ``timeout``: torch reads its default from these module values each time it makes one."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    if isinstance(getattr(distributed_c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        distributed_c10d.default_pg_nccl_timeout = timeout


def engine_problem(environ: dict[str, str], *, accelerator: bool, deepspeed: bool) -> str | None:
    """Why the engine the launch asked for (accelerate's ``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_USE_FSDP``,
    from ``accelerate launch --use_deepspeed`` / ``--use_fsdp`` or an accelerate config) cannot be given to these
    processes, or None.

    Args:
        environ: the process's environment.
        accelerator: whether the processes have an accelerator (a GPU).
        deepspeed: whether DeepSpeed can be imported.
    """
    cpu_flag = _flag(environ, "ACCELERATE_USE_CPU")
    if _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        if not deepspeed:
            return ("DeepSpeed was asked for (ACCELERATE_USE_DEEPSPEED=true: accelerate launch --use_deepspeed or a "
                    "DeepSpeed accelerate config) but is not installed: pip install -e \".[deepspeed]\" in the clone, or launch "
                    "without DeepSpeed")
        if cpu_flag:
            return ("DeepSpeed was asked for together with accelerate's CPU mode (ACCELERATE_USE_CPU=true: --cpu or "
                    "use_cpu: true in the accelerate config), under which accelerate drops DeepSpeed and trains plain "
                    "DDP. Leave out --cpu / use_cpu (DeepSpeed runs on CPU processes over gloo), or leave out "
                    "DeepSpeed")
    if _flag(environ, "ACCELERATE_USE_FSDP") and (cpu_flag or not accelerator):
        version = environ.get("FSDP_VERSION", "1").strip()
        if version != "2":
            return (f"FSDP version {version} was asked for on CPU processes, which accelerate shards only on GPUs; "
                    "the run gives CPU processes FSDP version 2 only: launch with --fsdp_version 2 (or "
                    "fsdp_version: 2 in the accelerate config), or without FSDP")
    return None


def _deepspeed_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        return False


def start_processes(recipe: Any, environ: dict[str, str] | None = None) -> None:
    """Check the launch and make its first process group (see the module); nothing when the process was started
    without a launcher and no engine was asked for.

    Raises:
        LaunchError: the launcher's variables, the engine asked for, or a rendezvous that timed out (the message
            names the setting and what to do).
    """
    env = os.environ if environ is None else environ
    _srun_variables(env)
    rank, world = launch_variables(env)
    problem = engine_problem(env, accelerator=_has_accelerator(), deepspeed=_deepspeed_importable())
    if problem:
        raise LaunchError(problem)
    if world == 1 and "LOCAL_RANK" not in env:
        return  # one process without a launcher: no process group
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    kwargs = group_kwargs(recipe)
    _set_default_timeout(kwargs["timeout"])
    seconds = int(kwargs["timeout"].total_seconds())
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    # CPU processes are accelerate's MULTI_CPU (DDP over gloo) even without --cpu: else it leaves them without a
    # distributed type, and each would train its own copy; DeepSpeed makes its own group (over gloo, named above)
    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or (
        "backend" in kwargs and not _flag(env, "ACCELERATE_USE_DEEPSPEED"))
    try:
        with interruptible(f"waiting for the run's {world} processes to join at {where}"):
            state = PartialState(cpu=cpu, **kwargs)
    except RuntimeError as exc:  # torch's DistError, DistStoreError, DistNetworkError are RuntimeErrors
        raise LaunchError(
            f"process {rank} of {world}: the other processes did not join within {seconds} s "
            f"(train.process_group_timeout_s={seconds}) at {where}: {_first_line(exc)}. Check that every process "
            "was started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and that none failed before it "
            "got there (its output says why); raise train.process_group_timeout_s if they start slowly") from None
    if state.num_processes != world or (world > 1 and str(state.distributed_type).endswith("NO")):
        raise LaunchError(
            f"the launcher started {world} processes, but accelerate made a group of {state.num_processes} "
            f"(distributed type {state.distributed_type}): they would train as {world} separate runs into one "
            "folder. Launch with the engine's own flags (accelerate launch --multi_gpu / --use_fsdp / "
            "--use_deepspeed), or on CPUs set ACCELERATE_USE_CPU=true")


def fsdp_on_cpu(accelerator: Any) -> bool:
    """Give FSDP version 2 to CPU processes of a launch that asked for it (``ACCELERATE_USE_FSDP`` with
    ``FSDP_VERSION=2``; :func:`engine_problem` refused any other version): accelerate gives FSDP to GPU process
    types only, so its state is switched to FSDP with the plugin its own variables describe
    (``FullyShardedDataParallelPlugin()``: wrap policy, state-dict type, resharding), after which everything is
    accelerate's (``fsdp2_prepare_model`` shards the module with ``fully_shard`` over gloo; ``save_state`` writes
    sharded checkpoints). One process without a process group has nothing to shard: it trains plain, and says so.
    Returns whether the state was switched."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not _flag(os.environ, "ACCELERATE_USE_FSDP") or accelerator.device.type != "cpu":
        return False
    if accelerator.distributed_type == DistributedType.FSDP:
        return False
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        log.warning("FSDP was asked for (ACCELERATE_USE_FSDP=true), but this one process has no process group: "
                    "nothing to shard, the run trains plain (launch with accelerate launch --use_fsdp, which starts "
                    "torch's launcher, for sharded checkpoints)")
        return False
    plugin = FullyShardedDataParallelPlugin()
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    log.info("FSDP version 2 on %d CPU process(es) over gloo (accelerate gives FSDP to GPU processes only; the run "
             "switched its state to FSDP, state dict %s)", accelerator.num_processes, plugin.state_dict_type)
    return True


@contextlib.contextmanager
def interruptible(what: str) -> Iterator[None]:
    """A block in which the main thread waits in C++ code (a rendezvous, a collective), where Python's signal
    handlers cannot run until the wait ends: a SIGINT / SIGTERM that the main thread has not taken within
    :data:`SIGNAL_GRACE_S` ends the process at once with status 128 + the signal, saying ``what`` it was doing.
    The signal's arrival is learnt from Python's wakeup file descriptor (``signal.set_wakeup_fd``), which the C-level
    handler writes to whatever the main thread does. Elsewhere than the main thread: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        reader.close()
        writer.close()
        yield
        return
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(reader, done, what), daemon=True, name="xlipkit-signal-watch")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        watcher.join(5)
        reader.close()
        writer.close()


def _watch(reader: socket.socket, done: threading.Event, what: str) -> None:
    """:func:`interruptible`'s thread: a stop signal seen, the main thread given :data:`SIGNAL_GRACE_S` to leave the
    block (its handler raises), else the process ended here."""
    stops = {int(s) for s in (signal.SIGINT, signal.SIGTERM)}
    while not done.is_set():
        ready, _, _ = select.select([reader], [], [], 0.2)
        if not ready:
            continue
        try:
            received = [b for b in reader.recv(64) if b in stops]
        except OSError:
            return
        if received and not done.wait(SIGNAL_GRACE_S):
            signum = received[0]
            name = signal.Signals(signum).name
            try:
                os.write(2, f"\n{name}: stopped while {what}, before training started (nothing was trained or "
                            "saved)\n".encode())
            finally:
                os._exit(128 + signum)


def _first_line(exc: BaseException) -> str:
    """An exception's message without the C++ stack torch appends."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__


#: what torch's collectives and stores say when a peer did not answer in time
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def timeout_message(exc: BaseException, recipe: Any) -> str | None:
    """The one line a run prints when a collective timed out (a process stopped answering), or None for any other
    exception: which process waited, the setting and what to do. gloo and the stores raise the timeout into Python
    on every backend's CPU groups (the stop vote's included); NCCL's own watchdog ends a process whose GPU
    collective timed out."""
    import torch

    distributed_error = getattr(torch.distributed, "DistError", ())
    text = _first_line(exc)
    if not (isinstance(exc, RuntimeError) and _TIMED_OUT.search(text)
            and (isinstance(exc, distributed_error) or "gloo" in str(exc).lower() or "Timed out waiting" in text)):
        return None
    seconds = int(group_timeout(recipe).total_seconds())
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    return (f"process {rank} of {world} waited {seconds} s (train.process_group_timeout_s={seconds}) for the other "
            f"processes at a collective and gave up ({text}): another process stopped answering (it hung, was stopped, "
            "or is much slower: its output says which). If the processes are only slow (a first download or "
            "preprocessing on the main process), raise train.process_group_timeout_s; else continue the run with "
            "train.resume=latest")
