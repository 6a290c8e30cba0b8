"""Fault injection: every failure leaves a log with the evidence, a right state and a one-line diagnosis,
and nothing left running. Each run is launched with `flashdraft launch` from a shell that then exits
(once from a setsid-less child killed by SIGHUP) and read back with `flashdraft status --json`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flashdraft.run_protocol import read_json
from tests.faults import fault_env

pytestmark = pytest.mark.slow
FLASHDRAFT = shutil.which("flashdraft") or f"{sys.executable} -m flashdraft"


def fault(spec: str) -> list[str]:
    """`launch` options that inject fault `spec` into the job."""
    return [arg for key, value in fault_env(spec).items() for arg in ("--env", f"{key}={value}")]


def launch(setup, *args: str, env: dict | None = None) -> dict:
    """`flashdraft launch` from a shell that exits right after it; returns the run's status."""
    runs = setup["root"] / "runs"
    quoted = " ".join(f"'{a}'" for a in args)
    cmd = f"{FLASHDRAFT} launch '{setup['config']}' {quoted} --runs-dir '{runs}' --json; exit 0"
    out = subprocess.run(
        ["/bin/bash", "-c", cmd],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=180,
    )
    info = json.loads(out.stdout[out.stdout.index("{") :])
    return info


def status(setup, run: str) -> dict:
    out = subprocess.run(
        [*FLASHDRAFT.split(), "status", run, "--runs-dir", str(setup["root"] / "runs"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def wait_for(setup, run: str, predicate, timeout: float = 120.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = status(setup, run)
        if predicate(info):
            return info
        time.sleep(0.5)
    raise AssertionError(f"timed out; last status: {info}")


def final(info: dict) -> bool:
    return info["state"] in ("finished", "failed", "stopped", "killed", "lost")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_clean(info: dict, grace_s: float = 15.0) -> str:
    """The log holds the evidence and no process of the run is left: each is gone within `grace_s` of the
    final status (the supervisor writes it as its last act, then its interpreter still shuts down, which on
    a loaded machine has taken over a second)."""
    log = Path(info["run_dir"]) / "train.log"
    assert log.is_file() and log.stat().st_size > 0
    deadline = time.monotonic() + grace_s
    for key in ("supervisor_pid", "job_pid"):
        pid = info.get(key)
        while pid and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not (pid and _alive(pid)), f"{key} {pid} still running {grace_s} s after the final status"
    return log.read_text()


def test_typo_in_config_key(setup):
    info = launch(setup, "train.lrr=1e-3")
    assert info["state"] == "failed" and "unknown config key 'train.lrr'" in info["diagnosis"]
    assert "did you mean 'train.lr'" in info["diagnosis"]
    assert "unknown config key" in assert_clean(info)


def test_missing_target_path(setup):
    info = launch(setup, "model.target=/nonexistent/model")
    assert (
        info["state"] == "failed"
        and info["diagnosis"].startswith("missing path")
        and "/nonexistent/model" in info["diagnosis"]
    )
    assert "/nonexistent/model" in assert_clean(info)


def test_syntax_error_in_an_imported_module(setup, tmp_path):
    broken = tmp_path / "site" / "transformers"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("def broken(:\n    pass\n")
    info = launch(setup, "--env", f"PYTHONPATH={broken.parent}")
    info = wait_for(setup, info["run"], final)
    assert (
        info["state"] == "failed"
        and info["diagnosis"].startswith("import error")
        and "SyntaxError" in info["diagnosis"]
    )
    assert "SyntaxError" in assert_clean(info)


def test_exception_at_step_3(setup):
    info = wait_for(setup, launch(setup, *fault("raise@3"))["run"], final)
    assert info["state"] == "failed" and info["exit_code"] == 1
    assert (
        "Python exception on rank 0, step 3" in info["diagnosis"]
        and "RuntimeError: injected failure at step 3" in info["diagnosis"]
    )
    assert "flashdraft_test_faults.py" in info["diagnosis"]  # the root-cause frame: where it was raised
    assert "Traceback" in assert_clean(info)


def test_cuda_out_of_memory_is_named(setup):
    info = wait_for(setup, launch(setup, *fault("oom@2"))["run"], final)
    assert info["state"] == "failed" and info["diagnosis"].startswith("out of memory on rank 0")
    assert "Tried to allocate 20.00 GiB" in info["diagnosis"]
    assert_clean(info)


def test_sigkill_of_the_job(setup):
    info = launch(setup, "train.max_steps=100000")
    info = wait_for(setup, info["run"], lambda s: (s.get("step") or 0) >= 2)
    os.kill(info["job_pid"], signal.SIGKILL)
    info = wait_for(setup, info["run"], final)
    assert (
        info["state"] == "killed" and info["signal"] == "SIGKILL" and "killed by SIGKILL" in info["diagnosis"]
    )
    assert "signal SIGKILL" in assert_clean(info)


def test_sigterm_stops_with_a_checkpoint(setup):
    info = launch(setup, "train.max_steps=100000", "train.save_every=100000")
    info = wait_for(setup, info["run"], lambda s: (s.get("step") or 0) >= 2)
    os.kill(info["job_pid"], signal.SIGTERM)
    info = wait_for(setup, info["run"], final)
    assert info["state"] == "stopped" and "checkpoint" in info["diagnosis"]
    assert list((Path(info["run_dir"]) / "checkpoints").glob("step-*"))
    assert "received SIGTERM" in assert_clean(info)


def test_hung_job_is_reported_and_force_stopped(setup):
    info = launch(setup, *fault("hang@2"), "--stall-seconds", "3", "train.max_steps=100000")
    info = wait_for(setup, info["run"], lambda s: s["state"] == "stalled", timeout=60)
    assert (
        info["diagnosis"].startswith("hung: no heartbeat")
        and f"py-spy dump --native --pid {info['job_pid']}" in info["diagnosis"]
    )
    # The supervisor asked the job for its stacks: the log shows where it waits (the injected hang's
    # sleep, under the trainer's heartbeat), and `status` says they are there. The job carries on.
    log = Path(info["run_dir"]) / "train.log"
    deadline = time.time() + 60
    while "flashdraft_test_faults.py" not in log.read_text() and time.time() < deadline:
        time.sleep(0.5)
    text = log.read_text()
    assert "training process(es) for their Python stacks (SIGUSR1)" in text
    stacks = text[text.index("for their Python stacks") :]
    assert "flashdraft_test_faults.py" in stacks and "run_job" in stacks, stacks[-3000:]
    info = status(setup, info["run"])
    assert "Python stacks at the stall are in the log" in info["diagnosis"], info["diagnosis"]
    assert info["state"] == "stalled" and info["job_alive"]
    out = subprocess.run(
        [
            *FLASHDRAFT.split(),
            "stop",
            info["run"],
            "--force",
            "--timeout",
            "2",
            "--runs-dir",
            str(setup["root"] / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "killed" in out.stdout
    info = wait_for(setup, info["run"], final)
    assert info["state"] == "killed" and info["signal"] == "SIGKILL"
    # stop recorded that it forced the kill before sending SIGKILL: not blamed on the OOM killer
    assert info["diagnosis"].startswith("killed by flashdraft stop --force after 2 s"), info["diagnosis"]
    assert "hung at phase training step 2" in info["diagnosis"] and "OOM" not in info["diagnosis"]
    assert_clean(info)


def test_missing_interpreter(setup):
    info = wait_for(setup, launch(setup, "--python", "/nonexistent/bin/python3")["run"], final)
    assert (
        info["state"] == "failed"
        and "interpreter or program not found: /nonexistent/bin/python3" in info["diagnosis"]
    )
    assert "/nonexistent/bin/python3" in assert_clean(info)


def test_launch_works_with_no_python_on_path(setup):
    info = launch(setup, env={"PATH": "/nonexistent"})
    info = wait_for(setup, info["run"], final)
    assert info["state"] == "finished" and info["step"] == 12
    assert_clean(info)


def test_launcher_killed_by_sighup_leaves_the_run_going(setup):
    runs = setup["root"] / "runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    # the job reports "up" only 20 s after start-up: the launcher is surely still waiting when it is hung up
    launcher = subprocess.Popen(
        [
            *FLASHDRAFT.split(), "launch", str(setup["config"]), "train.max_steps=60", "--runs-dir", str(runs),
            *fault("slow-start@20"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # as from a terminal: a test run under nohup would pass SIGHUP on ignored
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.time() + 60
    while time.time() < deadline:
        new = [p for p in runs.iterdir() if p not in before] if runs.exists() else []
        if new and (read_json(new[0] / "status.json") or {}).get("supervisor_pid"):
            break
        time.sleep(0.2)
    assert launcher.poll() is None, "the launcher returned before it could be hung up"
    launcher.send_signal(signal.SIGHUP)
    assert launcher.wait(timeout=30) == -signal.SIGHUP
    info = wait_for(setup, new[0].name, final)
    assert info["state"] == "finished" and info["step"] == 60
    assert_clean(info)


def test_healthy_run_shows_progress_and_stop_leaves_a_resumable_checkpoint(setup):
    info = launch(setup, "train.max_steps=100000", "train.save_every=100000")
    info = wait_for(setup, info["run"], lambda s: (s.get("step") or 0) >= 3 and s.get("loss") is not None)
    assert (
        info["state"] == "training"
        and info["ranks"]["0"]["heartbeat_age_s"] < 10
        and info["total_steps"] == 100000
    )
    out = subprocess.run(
        [*FLASHDRAFT.split(), "stop", info["run"], "--runs-dir", str(setup["root"] / "runs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "stopped" in out.stdout
    info = status(setup, info["run"])
    ckpt = sorted((Path(info["run_dir"]) / "checkpoints").glob("step-*"))[-1]
    stopped_at = int(ckpt.name.split("-")[1])
    assert stopped_at >= 3
    resumed = wait_for(
        setup,
        launch(
            setup,
            f"train.resume={ckpt}",
            f"train.max_steps={stopped_at + 2}",  # a shorter schedule than the checkpoint's: allowed explicitly
            "train.resume_allow_changes=true",
        )["run"],
        final,
    )
    assert resumed["state"] == "finished" and resumed["step"] == stopped_at + 2
    assert f"resumed from {ckpt} at step {stopped_at}" in assert_clean(resumed)
    assert_clean(info)
