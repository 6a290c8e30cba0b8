"""A stop that says what it waits for and what to do when it gives up; one resume hint everywhere; no ETA
for a run that has ended; a launch hung up during its preflight is told apart from a lost supervisor."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashdraft.run.monitor import run_state, waiting_for
from flashdraft.run.processes import start_time
from flashdraft.run_protocol import RUN_DIR_ENV, Heartbeat, resume_hint, write_json

from .test_faults import FLASHDRAFT, fault, launch, status, wait_for


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _run(tmp_path: Path, status: dict, config: bool = True) -> Path:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    write_json(run / "launch.json", {"run_id": "r1", "created": time.time(), "config": "cfg.yaml"})
    write_json(run / "status.json", status)
    (run / "train.log").write_text("[launch] flashdraft launch cfg.yaml\n")
    if config:
        (run / "config.yaml").write_text("train: {}\n")
    return run


def test_a_launch_hung_up_during_its_preflight_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _run(tmp_path, {"state": "starting", "launcher_pid": _dead_pid(), "launcher_started": 1.0})
    info = run_state(run)
    assert info["state"] == "lost"
    assert "interrupted before the job started" in info["diagnosis"], info["diagnosis"]
    assert "supervisor is gone" not in info["diagnosis"]
    assert (
        "flashdraft launch --resume r1" in info["diagnosis"]
        and info["resume"] == "flashdraft launch --resume r1"
    )


def test_a_launch_hung_up_before_its_config_was_written_says_to_launch_anew(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _run(tmp_path, {"state": "starting", "launcher_pid": _dead_pid()}, config=False)
    info = run_state(run)
    assert "start it again with flashdraft launch cfg.yaml" in info["diagnosis"] and "resume" not in info


def test_an_ended_run_shows_no_eta_a_live_one_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    me = os.getpid()  # a live "supervisor": this test's own process, with its start time
    run = _run(tmp_path, {"state": "running", "supervisor_pid": me, "supervisor_started": start_time(me)})
    Heartbeat(run).beat("training", force=True, step=5, total_steps=100, step_seconds=2.0)
    assert run_state(run)["eta_s"] == 190
    write_json(run / "status.json", {"state": "stopped", "diagnosis": "stopped on request"})
    info = run_state(run)
    assert info["state"] == "stopped" and "eta_s" not in info and info["resume"].endswith("--resume r1")


def test_the_resume_hint_is_the_launch_command_under_launch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "runs" / "r1"))
    assert resume_hint() == "resume with flashdraft launch --resume r1"
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "elsewhere" / "r1"))
    assert resume_hint() == f"resume with flashdraft launch --resume r1 --runs-dir {tmp_path / 'elsewhere'}"


@pytest.mark.parametrize(
    "heartbeat,says",
    [
        ({"phase": "training", "step": 7}, "step 8 to finish and the checkpoint to be written"),
        ({"phase": "evaluating", "step": 7}, "the evaluation pass after step 7 to finish"),
        ({"phase": "loading"}, "the job to finish starting (phase loading)"),
    ],
)
def test_stop_names_what_it_waits_for(heartbeat, says):
    assert says in waiting_for(heartbeat)


def _stop(setup, run: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FLASHDRAFT.split(), "stop", run, "--runs-dir", str(setup["root"] / "runs"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_stop_says_what_it_waits_for_and_the_log_gives_the_one_resume_command(setup):
    info = launch(setup, "train.max_steps=100000", "train.save_every=100000")
    info = wait_for(setup, info["run"], lambda s: (s.get("step") or 0) >= 2)
    out = _stop(setup, info["run"])
    text = " ".join(out.stdout.split())
    assert out.returncode == 0 and "to finish and the checkpoint to be written" in text, (
        out.stdout + out.stderr
    )
    info = status(setup, info["run"])
    assert info["state"] == "stopped" and "eta_s" not in info
    log = (Path(info["run_dir"]) / "train.log").read_text()
    assert f"resume with flashdraft launch --resume {info['run']}" in log and "train.resume=auto" not in log


@pytest.mark.slow
def test_a_stop_that_times_out_says_so_and_names_force(setup):
    info = launch(setup, "train.max_steps=100000", *fault("hang@3"))
    info = wait_for(setup, info["run"], lambda s: s.get("step") == 3)
    out = _stop(setup, info["run"], "--timeout", "2")  # the job hangs: no stop can end it gracefully
    text = " ".join(out.stdout.split())
    assert out.returncode == 1 and "not stopped within --timeout 2 s" in text, out.stdout + out.stderr
    assert f"flashdraft stop {info['run']} --force" in text
    out = _stop(setup, info["run"], "--timeout", "2", "--force")
    assert "killed by flashdraft stop --force" in out.stdout, out.stdout + out.stderr
