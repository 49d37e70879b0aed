"""Stopping a run on SIGINT / SIGTERM: the handlers (:class:`StopSignals`), the vote that makes every process
stop after the same step (:class:`StopVote`), the exceptions a stop raises, and the data-loader workers' set-up
(they leave the signals to the training process and tokenize on one thread)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

__all__ = ["REPEAT_WINDOW_S", "RunInterrupted", "STOP_SIGNALS", "StopSignals", "StopVote", "TrainingStopped",
           "graceful_stop", "ignore_stop_signals", "init_worker", "limit_worker_threads", "stop_signals", "vote_group",
           "worker_signals"]


#: the signals a run stops on: Ctrl-C, and what SLURM, Kubernetes and torchrun send before they kill a process
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: a second SIGINT this soon after the first is the same Ctrl-C, forwarded by a launcher (torchrun passes the signal
#: it got to each of its processes, which the terminal signalled too)
REPEAT_WINDOW_S = 1.0


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while no training step runs (loading, evaluation, the final save): raised at once, like
    Ctrl-C's ``KeyboardInterrupt``; :func:`finetune.training.run_recipe` ends with status 128 + the signal, without
    a traceback."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class TrainingStopped(Exception):
    """The loop stopped on SIGINT / SIGTERM: the current step was finished and ``checkpoint`` saved (None when
    saving it failed: then ``error`` says why).

    Attributes:
        signum: the signal (``signal.SIGTERM`` ...); the process exits with 128 + it (130 for SIGINT, 143 for
            SIGTERM), as a shell reports a process killed by it.
        step: the last step trained.
        checkpoint: the checkpoint that continues the run (``train.resume: latest`` finds it).
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None, error: str | None = None) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"{name}: stopped after step {step}" + (f"; saved {checkpoint}" if checkpoint else ""))
        self.signum, self.step, self.checkpoint, self.error = signum, step, checkpoint, error


def _say(message: str) -> None:
    """Write a line to stderr from a signal handler (no logging locks, no buffering)."""
    try:
        os.write(2, f"\n{message}\n".encode())
    except OSError:
        pass


class StopSignals:
    """SIGINT and SIGTERM handlers for one run (installed by :func:`stop_signals`).

    Inside the training loop (``graceful``) the first signal only sets :attr:`received`: the loop finishes the
    step it is in, every process agrees to stop after the same step, a checkpoint is saved and
    :class:`TrainingStopped` raised. Elsewhere the first signal raises :class:`RunInterrupted` at once.

    A later SIGTERM changes nothing: schedulers repeat it (SLURM signals every process of a job step, and torchrun,
    signalled too, forwards it to each of its processes milliseconds later), and none of them means "now" by it. A
    later SIGINT is a person's second Ctrl-C and ends the process at once (``os._exit(130)``), saving nothing more
    (what it was writing is a temporary folder tagged with its PID, which the next run removes) - unless it came
    within :data:`REPEAT_WINDOW_S` of the first signal: then it is the same Ctrl-C forwarded by a launcher.
    """

    #: the handlers installed now, if any
    active: "StopSignals | None" = None

    def __init__(self) -> None:
        self.received: int | None = None
        self.graceful = False
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0

    def install(self) -> bool:
        """Install the handlers (only the main thread may); False where they cannot be installed."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        StopSignals.active = self
        return True

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if StopSignals.active is self:
            StopSignals.active = None

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if signum == signal.SIGINT and time.monotonic() - self._first_at >= REPEAT_WINDOW_S:
                _say(f"{name} again: exiting at once (status {128 + signum}), without saving")
                os._exit(128 + signum)
            if self.graceful:
                _say(f"{name} again: already stopping after this step (Ctrl-C twice exits at once, without saving)")
            return
        self.received, self._first_at = signum, time.monotonic()
        if not self.graceful:
            raise RunInterrupted(signum)
        _say(f"{name} received: finishing this step and saving a checkpoint before stopping (Ctrl-C twice exits at "
             "once, without saving)")


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """:class:`StopSignals` installed for the block (the ones already installed, when a caller did it), and the
    previous handlers restored after it."""
    if StopSignals.active is not None:
        yield StopSignals.active
        return
    stop = StopSignals()
    installed = stop.install()
    try:
        yield stop
    finally:
        if installed:
            stop.uninstall()


@contextlib.contextmanager
def graceful_stop() -> Iterator[StopSignals]:
    """:func:`stop_signals` for the training loop: inside the block a first signal only sets
    :attr:`StopSignals.received` (the loop finishes its step, every process votes to stop after the same one, a
    checkpoint is saved); outside it a signal raises :class:`RunInterrupted` at once, as before the block."""
    with stop_signals() as stop:
        graceful, stop.graceful = stop.graceful, True
        try:
            yield stop
        finally:
            stop.graceful = graceful


#: set (in a worker) to the training process's "exiting" event (:func:`worker_signals`)
_EXITING: Any = None


def _exiting_event() -> Any:
    """An event the training process sets as it exits (``atexit``, which runs before multiprocessing's own
    exit handler terminates the daemonic data-loader workers with SIGTERM)."""
    global _EXITING
    if _EXITING is None:
        import atexit
        import multiprocessing

        _EXITING = multiprocessing.Event()
        atexit.register(_EXITING.set)
    return _EXITING


def _worker_sigterm(signum: int, frame: Any) -> None:
    if _EXITING is not None and _EXITING.is_set():
        os._exit(0)  # the training process is exiting and terminates its workers


def ignore_stop_signals(worker_id: int = 0, exiting: Any = None) -> None:
    """``worker_init_fn`` of the data-loader workers (with ``exiting``: :func:`worker_signals`): they ignore SIGINT
    and SIGTERM (Ctrl-C reaches the whole process group, SLURM signals every process of a job step), so that a
    stopping run still gets the batches it needs and no worker death interrupts its checkpoint; the training
    process decides. A SIGTERM after the training process began to exit (its shutdown of the workers) ends the
    worker; a worker whose training process died ends by itself (torch's worker watchdog)."""
    global _EXITING
    _EXITING = exiting
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _worker_sigterm)


def limit_worker_threads() -> None:
    """Keep a data-loader worker's tokenizer on one thread. Hugging Face's fast tokenizers encode a batch on a
    thread pool as wide as the machine (``TOKENIZERS_PARALLELISM``): with 8 workers on 16 cores that is about 130
    threads competing with the training process, whose one thread must launch thousands of kernels per step.
    Each worker is already one of several processes working in parallel; torch already runs one thread in a
    worker. (OpenCV's pool is left alone: ``cv2.setNumThreads`` in a forked worker can deadlock on the pool it
    inherited.)"""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def init_worker(worker_id: int = 0, exiting: Any = None) -> None:
    """``worker_init_fn`` of the training loaders: stop signals left to the training process
    (:func:`ignore_stop_signals`) and a single-threaded tokenizer (:func:`limit_worker_threads`)."""
    ignore_stop_signals(worker_id, exiting)
    limit_worker_threads()


def worker_signals() -> Callable[[int], None]:
    """The ``worker_init_fn`` of the training loaders (:func:`init_worker`): workers leave SIGINT / SIGTERM to the
    training process and run on one thread each."""
    return functools.partial(init_worker, exiting=_exiting_event())


def vote_group(world_size: int, timeout_s: int) -> Any:
    """The gloo group of :class:`StopVote` for several processes, waiting at most ``timeout_s`` seconds
    (``train.process_group_timeout_s``: a process that stops answering ends the run in that time); None for one."""
    import datetime

    if world_size < 2 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class StopVote:
    """Whether to stop after the current step, the same answer on every process.

    One process: the handler's flag, a host variable (no cost). Several: a signal may reach one process first (or
    only one), and each process must stop after the same step (they meet in every step's gradient all-reduce and
    in the checkpoint's collectives). After each step every process posts its flag in an all-reduce (MAX) over a
    gloo group on the CPU, without waiting, and reads the one it posted after the previous step: all read the
    same value after the same step, so they agree, one step after the first process saw a signal. The device is
    never waited for; the cost is one small CPU collective per step that completes while the step runs (measured
    by ``bench/stop_vote.py``).
    """

    def __init__(self, stop: StopSignals, world_size: int, group: Any = None) -> None:
        self.stop = stop
        self.world_size = world_size
        self.group = group
        self.signum = 0
        self._pending: tuple[Any, Tensor] | None = None

    def __call__(self) -> bool:
        """Post this step's flag; True when the process group agreed to stop now (:attr:`signum` set)."""
        flag = self.stop.received or 0
        if self.world_size == 1:
            self.signum = flag
            return bool(flag)
        import torch.distributed as dist

        if self._pending is not None:
            work, posted = self._pending
            work.wait()
            self.signum = int(posted[0])  # a CPU tensor: no device read
        posted = torch.tensor([flag], dtype=torch.int32)
        self._pending = (dist.all_reduce(posted, op=dist.ReduceOp.MAX, group=self.group, async_op=True), posted)
        return bool(self.signum)

    def close(self) -> None:
        """Wait for the last posted flag (every process posted as many)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

