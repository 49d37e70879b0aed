"""How a command-line process of the toolkit ends: what Python does at exit, less the teardown of its modules.

After the last ``atexit`` handler, the interpreter tears down every module it imported. With torch, transformers
and DeepSpeed loaded (``save_pretrained`` imports DeepSpeed through accelerate whenever it is installed) that takes
2.0-2.4 CPU-seconds and 2.4 s of wall time for a tiny run on a 2-core machine (2026-11-29), after the run has
written everything: every process of every run waits for it (``accelerate launch`` on 8 GPUs: 8 of them).
:func:`exit_process` does what the interpreter's exit does that anyone can observe (join the threads that are not
daemons, run the ``atexit`` handlers: logging's, trackers', ``multiprocessing``'s children, ``tempfile``'s folders,
flush stdout and stderr) and then ends the process with the status, skipping the teardown. Only the entry points call it
(``finetune/run.py``, ``xlipkit``, ``python -m finetune.cli``, ``python -m finetune.evaluate``); a ``main()`` called
in a Python session returns as before.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["exit_process"]


def _status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives: None -> 0, an int -> itself, anything else printed -> 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def exit_process(code: object = 0) -> None:
    """End this process with ``code`` (as ``sys.exit(code)`` would) without tearing down the imported modules.

    Args:
        code: the exit status, or a message for stderr (status 1), as ``sys.exit`` takes it.
    """
    status = _status(code)
    run_exit_functions = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_functions is None:  # an interpreter without it: the usual exit
        sys.exit(status)
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    run_exit_functions()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by a caller
            pass
    os._exit(status)
