"""finetune/process_exit.py: an entry point ends as ``sys.exit`` would (status, atexit handlers, threads joined,
output flushed) without the interpreter's teardown of the imported modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from pathlib import Path
    from finetune.process_exit import exit_process

    out = Path(sys.argv[1])

    class Teardown:
        def __del__(self):
            print("module teardown ran", flush=True)

    KEPT = Teardown()  # a module global: deleted only by the interpreter's teardown
    atexit.register(lambda: (out / "atexit").write_text("ran"))

    def late():
        time.sleep(0.5)
        (out / "thread").write_text("joined")

    threading.Thread(target=late).start()  # not a daemon: the exit waits for it
    sys.stdout.write("buffered, no newline")
    {end}
""")


def _run(tmp_path: Path, end: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.replace("{end}", end))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("code", "status"), [("3", 3), ("None", 0)])
def test_the_status_handlers_threads_and_output_survive_and_the_teardown_is_skipped(tmp_path, code, status):
    proc = _run(tmp_path, f"exit_process({code})")
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "buffered, no newline"  # flushed; no "module teardown ran"
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"


def test_sys_exit_would_have_run_the_teardown(tmp_path):
    """What exit_process saves: the same script ended by sys.exit runs the teardown (the check above can fail)."""
    proc = _run(tmp_path, "sys.exit(3)")
    assert proc.returncode == 3 and "module teardown ran" in proc.stdout


def test_a_message_is_printed_and_ends_with_status_1(tmp_path):
    proc = _run(tmp_path, "exit_process('recipe error: no such file')")
    assert proc.returncode == 1 and "recipe error: no such file" in proc.stderr


def test_the_console_script_and_the_module_forms_end_through_it():
    """``xlipkit`` (pyproject's console script) and ``python -m finetune.cli`` give the command's status."""
    import tomllib

    repo = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["xlipkit"] == "finetune.cli.main:console"
    for argv, status in ((["--version"], 0), (["no-such-command"], 2), (["--help"], 0)):
        code = f"import sys; sys.argv = ['xlipkit', *{argv!r}]; from finetune.cli.main import console; console()"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == status, (argv, proc.stderr)
        assert ("xlipkit" in proc.stdout + proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("xlipkit ")
