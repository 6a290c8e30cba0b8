"""The tests' time-limited command runner (tests/processes.py): a command that outlives its limit fails the
test with the stacks of its whole process tree, a child in a session of its own included."""

from __future__ import annotations

import sys

import pytest

from .processes import run_or_dump

# A parent that starts a child in a session of its own (as torchrun starts its workers), then both wait.
HANGING = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time\\ndef child_waits():\\n    time.sleep(600)\\nchild_waits()"],
                 start_new_session=True)
def parent_waits():
    time.sleep(600)
parent_waits()
"""


def test_a_command_within_its_limit_returns_as_subprocess_run_would():
    done = run_or_dump([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], 60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n")


def test_a_hung_tree_fails_with_the_stacks_of_every_process():
    with pytest.raises(pytest.fail.Exception) as failure:
        run_or_dump([sys.executable, "-c", HANGING], timeout=3)
    message = str(failure.value)
    assert "still ran after 3 s" in message and "2 process(es)" in message
    assert "parent_waits" in message  # the parent's stack
    assert "child_waits" in message  # the child's, from its own session (its stderr is the parent's)
