"""CPU threads of a run: the settings a user or launcher gives are kept, and the OpenMP runtime waits passively
by default.

torch's CPU kernels (MKL's ``sgemm`` among them) run on an OpenMP thread pool whose threads, between two
parallel regions, spin on the core by default (``OMP_WAIT_POLICY=ACTIVE`` behaviour). With another busy process
on the machine, a spinning thread holds a core that the thread it waits for needs: the quickstart's step went
from 0.75 s to 10-17 s (issue 33). Waiting passively (the thread sleeps) costs nothing measurable on a quiet
machine and keeps a contended step close to its quiet time (``bench/cpu_threads.py``; figures in
docs/getting-started.md, "CPU threads").

The OpenMP runtime reads ``OMP_WAIT_POLICY`` once, when torch loads it: :func:`passive_wait_by_default` must run
before ``import torch``, which is why the entry points (``finetune/run.py``, ``xlipkit``) call it first and this
module imports nothing heavy. The thread count itself is never changed by a run: ``OMP_NUM_THREADS``,
``MKL_NUM_THREADS``, ``accelerate launch``'s ``--num_cpu_threads_per_process`` (``OMP_NUM_THREADS=1`` when not
given) or ``torch.set_num_threads`` before the run decide it; without any, torch uses every core.
"""

from __future__ import annotations

import os
import sys

__all__ = ["THREAD_VARIABLES", "WAIT_VARIABLES", "passive_wait_by_default", "thread_settings"]

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


def thread_settings(num_threads: int) -> str:
    """Where a run's CPU thread count and wait policy come from, for its log: ``num_threads`` is
    ``torch.get_num_threads()``; e.g. ``"1 CPU thread (OMP_NUM_THREADS=1), OpenMP threads wait passively
    (OMP_WAIT_POLICY=PASSIVE)"``."""
    given = [f"{v}={os.environ[v]}" for v in THREAD_VARIABLES if v in os.environ]
    source = (", ".join(given) if given else
              "no OMP_NUM_THREADS given: torch's default or torch.set_num_threads; OMP_NUM_THREADS=N chooses N")
    waits = [f"{v}={os.environ[v]}" for v in WAIT_VARIABLES if v in os.environ]
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper()
    if policy == "PASSIVE":
        wait = f"OpenMP threads wait passively ({', '.join(waits)})"
    elif waits:
        wait = f"OpenMP wait settings {', '.join(waits)}"
    else:
        wait = "OpenMP threads spin while they wait (torch was imported before the run set OMP_WAIT_POLICY=PASSIVE)"
    return f"{num_threads} CPU thread{'s' if num_threads != 1 else ''} ({source}), {wait}"
