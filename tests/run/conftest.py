"""The tiny training setup that the supervision tests launch (a 1-layer drafter on a 6-layer target), and
the cleanup after each test: a run it launched and left live (a failed assertion before its `stop`) is
force-stopped, so that no job outlives its test."""

from __future__ import annotations

import contextlib

import pytest

from .launch_setup import write_launch_setup


@pytest.fixture(scope="session")
def setup(tmp_path_factory, qwen3_target) -> dict:
    return write_launch_setup(tmp_path_factory.mktemp("faults"), qwen3_target)


@pytest.fixture(autouse=True)
def no_run_outlives_its_test(request):
    yield
    if "setup" not in request.fixturenames:
        return
    from flashdraft.errors import FlashdraftError
    from flashdraft.run.monitor import is_live, list_runs, run_state, stop_run

    for run_dir in list_runs(request.getfixturevalue("setup")["root"] / "runs"):
        if is_live(run_state(run_dir)):
            with contextlib.suppress(FlashdraftError):  # no job pid recorded yet: nothing to stop
                stop_run(run_dir, force=True, timeout=5)
