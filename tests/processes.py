"""Commands run by the tests with a time limit that, when it passes, fail with every Python stack of the
command's processes instead of a bare timeout: each process of the tree (torchrun's workers run in
sessions of their own, so the whole tree, found through psutil) gets SIGABRT, on which faulthandler
writes all its threads' stacks to stderr (PYTHONFAULTHANDLER=1) before the process dies. A hang, say in a
destructor after the last step, then names its line in the test's failure."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from collections.abc import Sequence

import psutil
import pytest

GRACE_S = 30  # for the dumps to be written, before whatever is left is killed


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_all(processes: list[psutil.Process], signum: int) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signum)


def run_or_dump(
    command: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)`, except that a
    command still running at `timeout` fails the test with its processes' stack dumps and output."""
    env = {**(env if env is not None else os.environ), "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = _tree(process.pid)
        _signal_all(tree, signal.SIGABRT)
        _, alive = psutil.wait_procs(tree, timeout=GRACE_S)
        _signal_all(alive, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"{shlex.join(command)} still ran after {timeout:.0f} s; its {len(tree)} process(es) were "
            f"aborted for their stacks:\n--- stderr (the stacks) ---\n{stderr[-20000:]}\n"
            f"--- stdout ---\n{stdout[-3000:]}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
