"""Data parallelism under torchrun (gloo on the CPU): N processes with batch b train exactly like one
process with batch N·b, and a failure on one rank is diagnosed with that rank."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.processes import run_or_dump

from .test_faults import FLASHDRAFT, fault, final, launch, status, wait_for

pytestmark = pytest.mark.slow


def _losses(out) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"}


def test_two_processes_equal_one_process_with_the_global_batch(tmp_path, setup):
    common = [
        f"{k}={v}"
        for k, v in {
            "train.max_steps": 5,
            "train.log_every": 1,
            "train.device": "cpu",
            "train.resume": "never",
        }.items()
    ]
    single = tmp_path / "single"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "flashdraft",
            "train",
            str(setup["config"]),
            *common,
            "train.batch_size=4",
            f"train.out_dir={single}",
        ],
        check=True,
        capture_output=True,
    )
    double = tmp_path / "double"
    proc = run_or_dump(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "flashdraft",
            "train",
            str(setup["config"]),
            *common,
            "train.batch_size=2",
            f"train.out_dir={double}",
        ],
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _losses(single), _losses(double)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert a[step][0] == pytest.approx(b[step][0], abs=1e-5) and a[step][1] == pytest.approx(
            b[step][1], rel=1e-4
        )


def test_failure_on_one_rank_is_diagnosed_with_that_rank(setup):
    info = launch(setup, "--nproc-per-node", "2", "--max-restarts", "0", *fault("raise@3:1"))
    info = wait_for(setup, info["run"], final)
    assert info["state"] == "failed" and "Python exception on rank 1, step 3" in info["diagnosis"]
    out = subprocess.run(
        [*FLASHDRAFT.split(), "logs", info["run"], "--rank", "1", "--runs-dir", str(setup["root"] / "runs")],
        capture_output=True,
        text=True,
    )
    assert "injected failure at step 3" in out.stdout


def test_a_rank_killed_by_a_signal_ends_the_job_with_that_rank_named(setup):
    """kill -9 of one rank (as the OOM killer does): torchrun ends the other, and status names the dead rank,
    not the survivor whose collective lost its peer."""
    info = launch(
        setup, "--nproc-per-node", "2", "--max-restarts", "0", "train.max_steps=100000", *fault("kill@3:1")
    )
    info = wait_for(setup, info["run"], final, timeout=240)
    assert info["state"] == "failed", info
    assert info["diagnosis"].startswith("rank 1 (local rank 1) was killed by SIGKILL"), info["diagnosis"]


def test_healthy_two_process_launch(setup):
    info = wait_for(setup, launch(setup, "--nproc-per-node", "2")["run"], final)
    assert info["state"] == "finished" and info["step"] == 12 and set(info["ranks"]) == {"0", "1"}


def test_stop_of_a_two_process_run_checkpoints_and_ends_cleanly(setup):
    from pathlib import Path

    info = launch(setup, "--nproc-per-node", "2", "train.max_steps=100000", "train.save_every=100000")
    info = wait_for(setup, info["run"], lambda s: (s.get("step") or 0) >= 2)
    out = subprocess.run(
        [*FLASHDRAFT.split(), "stop", info["run"], "--runs-dir", str(setup["root"] / "runs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "stopped" in out.stdout, out.stdout + out.stderr
    info = status(setup, info["run"])
    assert info["state"] == "stopped" and info["exit_code"] == 0
    assert list((Path(info["run_dir"]) / "checkpoints").glob("step-*"))
