"""``PID@HOST`` in the names of temporary files and folders, so that a cleanup can tell a live writer's files
from those of a process that is gone (:mod:`finetune.run_folder`). Imports nothing of the toolkit, so that
any module that writes atomically (the recipe writer of :mod:`finetune.config.io` included) can use it."""

from __future__ import annotations

import os
import re
import socket

__all__ = ["host", "process_tag"]


def host() -> str:
    """This machine's name as it goes into a tag: letters, digits and ``-`` only, at most 63 characters."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "localhost"


def process_tag() -> str:
    """``PID@HOST``: what this process puts in the names of the temporary files and folders it writes
    (followed by a ``.``), so that a cleanup can tell a live writer's files from a killed one's."""
    return f"{os.getpid()}@{host()}"
