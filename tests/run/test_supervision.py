"""Supervision that survives its own faults: a full disk, a killed supervisor, reused pids, a supervisor
that dies at start-up, a user's json.py in the launch directory, resuming a run in place. (A hang ended
by `stop --force` is in test_faults.py.) Each test names the guard it checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flashdraft.run.launcher import ENTRY
from flashdraft.run.monitor import run_state, stop_run
from flashdraft.run.processes import start_time
from flashdraft.run_protocol import RUN_ID_ENV, Heartbeat, read_json, write_json
from tests.filesystems import tmpfs

from .test_faults import (
    FLASHDRAFT,
    assert_clean,
    fault,
    fault_env,
    final,
    launch,
    status,
    wait_for,
)


def flashdraft(
    setup, *args: str, cwd: Path | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """A `flashdraft` command on the test's runs directory."""
    return subprocess.run(
        [*FLASHDRAFT.split(), *args, "--runs-dir", str(setup["root"] / "runs")],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def training(setup, *args: str) -> dict:
    """A long run, returned once it has trained a few steps."""
    info = launch(setup, "train.max_steps=100000", "train.save_every=100000", *args)
    return wait_for(setup, info["run"], lambda s: (s.get("step") or 0) >= 2)


@pytest.mark.parametrize("evidence", ["start time", "run token"])
def test_a_reused_pid_is_not_the_run_and_is_never_signalled(tmp_path, evidence):
    """Guard: process identity (start time when recorded, else the run token or the run dir in the
    command line) before a pid counts as the run's or receives a signal."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "train.log").write_text("")
    write_json(run / "launch.json", {"run_id": "r", "created": time.time()})
    # An unrelated process that now holds every pid the dead run recorded (its own session, so its pgid
    # equals its pid). With recorded start times it may even carry the run's token: the times decide.
    env = {**os.environ, RUN_ID_ENV: "r"} if evidence == "start time" else dict(os.environ)
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True, env=env)
    try:
        record = {"state": "running", "updated": time.time()}
        for role in ("launcher", "supervisor", "job"):
            record[f"{role}_pid"] = stranger.pid
            if evidence == "start time":
                record[f"{role}_started"] = start_time(stranger.pid) - 50.0  # the run's processes were older
        record["job_pgid"] = stranger.pid
        write_json(run / "status.json", record)
        Heartbeat(run).beat("training", force=True, step=5)

        info = run_state(run)
        assert info["state"] == "lost" and not info["job_alive"], info
        stop_run(run, force=True, timeout=1.0)
        time.sleep(0.3)
        assert stranger.poll() is None, "stop signalled a process that is not the run's"
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.slow
def test_a_killed_supervisor_leaves_an_orphan_that_stop_ends_and_status_reconciles(setup):
    """Guards: `stop` acts on a lost run whose job still runs; `status` reads the ended orphan's outcome
    from its final record instead of staying `lost`; both print the resume command."""
    info = training(setup)
    job_pid = info["job_pid"]
    os.kill(info["supervisor_pid"], signal.SIGKILL)
    info = wait_for(setup, info["run"], lambda s: s["state"] == "lost")
    assert info["job_alive"] and f"job pid {job_pid} still runs" in info["diagnosis"]

    out = flashdraft(setup, "stop", info["run"])
    assert "stopped" in out.stdout, out.stdout + out.stderr
    assert f"flashdraft launch --resume {info['run']}" in out.stdout
    info = status(setup, info["run"])
    assert info["state"] == "stopped" and "checkpoint at step" in info["diagnosis"], info
    assert not info["job_alive"]
    assert not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == psutil.STATUS_ZOMBIE
    out = flashdraft(setup, "status", info["run"])
    assert f"resume with flashdraft launch --resume {info['run']}" in " ".join(out.stdout.split())


@pytest.mark.slow
def test_launch_returns_at_once_when_the_supervisor_dies_at_start_up(setup):
    """Guard: the launcher watches its supervisor and stops waiting when it exits."""
    started = time.time()
    info = launch(setup, "--wait-timeout", "170", env=fault_env("supervisor-dies"))
    # Config checks and the doctor take a few seconds on a busy CPU; the wait itself must take none.
    assert time.time() - started < 90
    assert info["state"] == "failed" and "supervisor died at start-up (code 3)" in info["diagnosis"], info
    assert "the supervisor dies at start-up" in assert_clean(info)


@pytest.mark.slow
def test_a_json_py_in_the_launch_directory_does_not_shadow_the_real_module(setup, tmp_path):
    """Guard: supervisor and job start through flashdraft/run/entry.py, with nothing of the launch
    directory on sys.path (`python -m` from there imported the user's json.py)."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("json", "yaml"):
        (work / f"{name}.py").write_text(
            f"raise ImportError('the launch directory\\'s {name}.py was imported')\n"
        )
    out = subprocess.run(
        [
            sys.executable,
            ENTRY,
            "flashdraft",
            "launch",
            str(setup["config"]),
            "train.max_steps=4",
            "--runs-dir",
            str(setup["root"] / "runs"),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=180,
    )
    info = json.loads(out.stdout[out.stdout.index("{") :])
    info = wait_for(setup, info["run"], final)
    assert info["state"] == "finished" and info["step"] == 4, info
    assert "was imported" not in assert_clean(info)


@pytest.mark.slow
def test_launch_resume_continues_a_stopped_run_in_its_own_directory(setup):
    """Guards: `launch --resume` reuses the run directory, its config and log with train.resume=auto,
    and refuses a run that is still live."""
    info = training(setup)
    refused = flashdraft(setup, "launch", "--resume", info["run"])
    assert refused.returncode == 2 and "stop it first" in refused.stderr
    out = flashdraft(setup, "stop", info["run"])
    assert "stopped" in out.stdout
    run_dir = Path(info["run_dir"])
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    stopped_at = int(ckpt.name.split("-")[1])

    shorter = [f"train.max_steps={stopped_at + 2}", "train.resume_allow_changes=true"]  # a shorter schedule
    out = flashdraft(setup, "launch", "--resume", info["run"], *shorter, "--json")
    resumed = json.loads(out.stdout[out.stdout.index("{") :])
    assert resumed["run_dir"] == str(run_dir)
    resumed = wait_for(setup, resumed["run"], final)
    assert resumed["state"] == "finished" and resumed["step"] == stopped_at + 2, resumed
    log = assert_clean(resumed)
    assert f"resumed from {ckpt} at step {stopped_at}" in log
    assert log.count("[launch ") == 2  # one log, appended
    assert (read_json(run_dir / "attempts" / "1" / "status.json") or {}).get("state") == "stopped"


@pytest.fixture
def small_disk(tmp_path):
    """A real, small filesystem for the test."""
    with tmpfs(tmp_path / "disk", "32m") as disk:
        yield disk


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_ends_failed_with_the_cause(setup, small_disk):
    """Guards: the supervisor survives a full disk (every write tolerant, a reserve for the final
    status) and the diagnosis names the full disk even when the job's own records could not be written."""
    runs = small_disk / "runs"
    out = subprocess.run(
        [
            *FLASHDRAFT.split(),
            "launch",
            str(setup["config"]),
            *fault("diskfull@8"),
            "--skip-doctor",  # it would refuse the small disk up front, and rightly
            "--runs-dir",
            str(runs),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    info = json.loads(out.stdout[out.stdout.index("{") :])
    deadline = time.time() + 120
    while not final(info) and time.time() < deadline:
        time.sleep(0.5)
        info = run_state(Path(info["run_dir"]))
    run_dir = Path(info["run_dir"])
    assert info["state"] == "failed", info
    # The cause comes from the job's error record, which it could only print to the log.
    assert not (run_dir / "rank0" / "error.json").exists()
    assert info["diagnosis"].startswith("disk full: checkpoint step 8"), info["diagnosis"]
    # The supervisor lived to write its final status into the file, on the disk the job filled.
    assert (read_json(run_dir / "status.json") or {}).get("state") == "failed"
    assert not (run_dir / "checkpoints" / "step-00000008").exists()
    assert_clean(info)
