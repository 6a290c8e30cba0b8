"""tests/conftest.py's FLASHDRAFT_FAILURES_NOW: with it set (benchmarks/gpu_session.sh's suite), a failed
test's traceback is written the moment it fails, before the tests after it, so a device call cut by its time
limit still shows the cause; without it, pytest's output is its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, failures_now: bool, *args: str) -> str:
    (tmp_path / "test_two.py").write_text(
        "def test_fails():\n    assert 1 == 2, 'the cause'\n\n\ndef test_after():\n    print('after')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FLASHDRAFT_FAILURES_NOW"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if failures_now:
        env["FLASHDRAFT_FAILURES_NOW"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    command += ["--rootdir", str(tmp_path), *args, "test_two.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("args", [(), ("-n", "2")], ids=["one-process", "xdist"])
def test_a_failure_is_written_before_the_summary(tmp_path, args):
    out = _run(tmp_path, True, *args)
    now = out.index("FAILED test_two.py::test_fails (call)")
    assert "AssertionError: the cause" in out[now:]
    assert now < out.index("= FAILURES =")  # pytest's own section, at the end


def test_without_the_variable_pytest_reports_as_usual(tmp_path):
    out = _run(tmp_path, False)
    assert "FAILED test_two.py::test_fails (call)" not in out
    assert "AssertionError: the cause" in out[out.index("= FAILURES =") :]
