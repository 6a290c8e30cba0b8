"""A command's own process ends without the interpreter's teardown (seconds of silence after the last line
on a busy machine), yet its atexit handlers run, its output is flushed, and a running non-daemon thread is
waited for as in a normal exit (flashdraft/cli/__init__.py::exit_without_teardown)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )


def test_exit_runs_atexit_handlers_flushes_and_keeps_the_code(tmp_path: Path) -> None:
    done = _run(
        f"""
        import atexit, sys, tempfile, weakref
        from flashdraft.cli import exit_without_teardown
        atexit.register(lambda: print("atexit ran", flush=True))
        kept = tempfile.TemporaryDirectory(dir={str(tmp_path)!r})  # cleaned up by its weakref finalizer
        sys.stdout.write("unflushed line")
        exit_without_teardown(3)
        print("not reached")
        """
    )
    assert done.returncode == 3
    assert "unflushed line" in done.stdout and "atexit ran" in done.stdout
    assert "not reached" not in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_running_non_daemon_thread_means_a_normal_exit() -> None:
    done = _run(
        """
        import threading, time
        from flashdraft.cli import exit_without_teardown
        worker = threading.Thread(target=lambda: (time.sleep(0.5), print("worker finished", flush=True)))
        worker.start()
        exit_without_teardown(5)
        print("returned", flush=True)
        """
    )
    assert done.returncode == 0
    assert "returned" in done.stdout and "worker finished" in done.stdout
