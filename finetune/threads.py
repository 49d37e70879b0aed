"""CPU threads of a run: a one-process CPU run uses every core unless the user gave a thread count, and the OpenMP
runtime waits passively by default.

torch's CPU kernels (MKL's ``sgemm`` among them) run on an OpenMP thread pool whose threads, between two
parallel regions, spin on the core by default (``OMP_WAIT_POLICY=ACTIVE`` behaviour). With another busy process
on the machine, a spinning thread holds a core that the thread it waits for needs: the quickstart's step went
from 0.75 s to 10-17 s (issue 33). Waiting passively (the thread sleeps) costs nothing measurable on a quiet
machine and keeps a contended step close to its quiet time (``bench/cpu_threads.py``; figures in
docs/guides/benchmarks.md, "CPU threads").

The OpenMP runtime reads ``OMP_WAIT_POLICY`` once, when torch loads it: :func:`passive_wait_by_default` must run
before ``import torch``, which is why the entry points (``finetune/run.py``, ``xlipkit``) call it first and this
module imports nothing heavy.

The thread count: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` the user sets, ``accelerate launch
--num_cpu_threads_per_process N``, or ``torch.set_num_threads`` before the run are kept. ``accelerate launch``
without any of them exports ``OMP_NUM_THREADS=1`` to the process it starts (accelerate 1.x
``_validate_launch_command``: ``num_cpu_threads_per_process`` defaults to ``OMP_NUM_THREADS`` or 1, raised to the
physical cores only with ``--cpu`` / ``use_cpu: true``); a one-process CPU run tells that default from a user's
``OMP_NUM_THREADS=1`` by the launcher's own environment and command line (``/proc/<ppid>/environ`` and
``cmdline``, Linux) and then uses every core, as ``python finetune/run.py`` does (:func:`cpu_thread_plan`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["THREAD_VARIABLES", "WAIT_VARIABLES", "accelerate_default_threads", "available_cores", "cpu_thread_plan",
           "passive_wait_by_default", "thread_line"]

#: variables that set the number of CPU threads (read by the OpenMP runtime and MKL when torch loads)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: variables that set how idle OpenMP threads wait (GNU libgomp: the first two; Intel's runtime: the last)
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def passive_wait_by_default() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set a wait policy, or torch is already imported (its
    OpenMP runtime has read the environment; setting it then would claim what does not hold). Child processes
    (``accelerate launch``'s, data-loader workers) inherit it. Returns whether it was set."""
    if any(v in os.environ for v in WAIT_VARIABLES) or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one, else ``os.cpu_count()``): what
    torch's OpenMP pool uses when no thread count is given."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _parent(kind: str) -> list[str] | None:
    """The parent process's ``cmdline`` or ``environ`` entries (``/proc/<ppid>/...``, Linux), None where unreadable."""
    try:
        raw = Path(f"/proc/{os.getppid()}/{kind}").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _is_accelerate_launch(argv: list[str]) -> bool:
    names = [Path(a).name for a in argv]
    modules = {"accelerate.commands.launch", "accelerate.commands.accelerate_cli"}
    return ("accelerate" in names and "launch" in argv) or any(
        a == "-m" and b in modules for a, b in zip(argv, argv[1:]))


def accelerate_default_threads() -> bool | None:
    """Whether this process's ``OMP_NUM_THREADS`` is the default that ``accelerate launch``'s single-process
    launcher exported (True), or a count the user gave (False): the user's ``OMP_NUM_THREADS`` /
    ``MKL_NUM_THREADS`` in the launcher's environment or ``--num_cpu_threads_per_process`` on its command line, or
    no ``accelerate launch`` at all. None when the launcher's environment cannot be read (no ``/proc``): the two
    cannot be told apart, and the count is kept."""
    if "ACCELERATE_USE_CPU" not in os.environ or os.environ.get("WORLD_SIZE", "1") != "1" \
            or "OMP_NUM_THREADS" not in os.environ:
        return False  # not accelerate's single-process launcher (it always exports both variables)
    argv, environ = _parent("cmdline"), _parent("environ")
    if argv is None or environ is None:
        return None
    if not _is_accelerate_launch(argv):
        return False
    if any(entry.split("=", 1)[0] in THREAD_VARIABLES for entry in environ):
        return False
    script = next((i for i, a in enumerate(argv) if i > 1 and (a.endswith(".py") or a == "-m")), len(argv))
    for arg in argv[:script]:  # launcher options come before the script; argparse takes unique prefixes
        name = arg.split("=", 1)[0].replace("-", "_")
        if len(name) >= len("__num_c") and "__num_cpu_threads_per_process".startswith(name):
            return False
    return True


def cpu_thread_plan(num_threads: int, num_processes: int) -> tuple[int | None, str]:
    """The CPU thread count a run should set (None: keep ``num_threads``, ``torch.get_num_threads()``) and where
    the count comes from, for :func:`thread_line` (e.g. ``"all cores; OMP_NUM_THREADS unset"``). A one-process run
    started by ``accelerate launch`` with its default ``OMP_NUM_THREADS=1`` (:func:`accelerate_default_threads`)
    gets every core; every count a user gave is kept."""
    cores = available_cores()
    given = [f"{v}={os.environ[v]}" for v in THREAD_VARIABLES if v in os.environ]
    target = None
    default = accelerate_default_threads()
    if default and num_processes == 1:
        target = cores
        source = (f"all cores; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} was accelerate launch's default, "
                  "no thread count given")
    elif default:
        source = (f"{', '.join(given)}: accelerate launch's default for {num_processes} processes; "
                  "--num_cpu_threads_per_process N chooses N")
    elif default is None:
        source = (f"{', '.join(given)}: yours or accelerate launch's default, which cannot be told apart here; "
                  "OMP_NUM_THREADS=N chooses N")
    elif given:
        source = ", ".join(given)
    elif num_threads == cores:
        source = "all cores; OMP_NUM_THREADS unset"
    else:
        source = f"of {cores} cores: torch.set_num_threads before the run; OMP_NUM_THREADS unset"
    return target, source


def thread_line(num_threads: int, source: str) -> str:
    """The run's log line of its CPU threads: ``num_threads`` (``torch.get_num_threads()`` once the plan is
    applied), where the count comes from (:func:`cpu_thread_plan`) and how idle OpenMP threads wait, e.g.
    ``"CPU threads: 1 (OMP_NUM_THREADS=1), OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE)"``."""
    return f"CPU threads: {num_threads} ({source}), {_wait_policy()}"


def _wait_policy() -> str:
    waits = [f"{v}={os.environ[v]}" for v in WAIT_VARIABLES if v in os.environ]
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper()
    if policy == "PASSIVE":
        return f"OpenMP threads wait passively ({', '.join(waits)})"
    if waits:
        return f"OpenMP wait settings {', '.join(waits)}"
    return "OpenMP threads spin while they wait (torch was imported before the run set OMP_WAIT_POLICY=PASSIVE)"
