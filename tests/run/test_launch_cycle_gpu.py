"""The launch -> status -> logs -> stop cycle on every GPU of the machine, one rank per GPU with the drafter
compiled (flex attention) on each, and a kill of one rank ending the job with that rank named (issue 17's
8-rank checks; any machine with 2 or more GPUs runs them): `python -m pytest -m gpu
tests/run/test_launch_cycle_gpu.py`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from .launch_setup import write_launch_setup
from .test_faults import FLASHDRAFT, fault, final, launch, status, wait_for

GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs (device kind nvidia-h200-x2 or larger)"),
]
COMPILE_S = 600  # every rank compiles its drafter before step 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory, qwen3_target) -> dict:
    """Named as tests/run/conftest.py's fixture, so its cleanup stops whatever this module leaves running."""
    return write_launch_setup(tmp_path_factory.mktemp("gpu-cycle"), qwen3_target, device="cuda")


def _flashdraft(setup, *args: str) -> subprocess.CompletedProcess:
    command = [*FLASHDRAFT.split(), *args, "--runs-dir", str(setup["root"] / "runs")]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def test_launch_status_logs_stop_on_every_gpu(setup):
    info = launch(setup, "--nproc-per-node", str(GPUS), "train.max_steps=100000", "train.save_every=100000")
    info = wait_for(setup, info["run"], lambda s: (s.get("step") or 0) >= 3 or final(s), timeout=COMPILE_S)
    assert info["state"] == "running", info
    assert set(info["ranks"]) == {str(rank) for rank in range(GPUS)}
    for rank in range(GPUS):  # each rank's own output: no eager (dense) flex_attention, no traceback
        logs = _flashdraft(setup, "logs", info["run"], "--rank", str(rank))
        assert logs.returncode == 0 and "without torch.compile" not in logs.stdout
        assert "Traceback" not in logs.stdout, logs.stdout[-3000:]
    log = (Path(info["run_dir"]) / "train.log").read_text()
    assert f" x {GPUS} process(es) (flex attention, compiled=True)" in log
    assert "step 1: " in log and " graph(s) compiled in " in log  # the main rank's compile report
    stopped = _flashdraft(setup, "stop", info["run"])
    assert "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    info = status(setup, info["run"])
    assert info["state"] == "stopped" and info["exit_code"] == 0
    assert list((Path(info["run_dir"]) / "checkpoints").glob("step-*"))


def test_a_rank_killed_on_a_gpu_ends_the_job_with_that_rank_named(setup):
    last = GPUS - 1
    info = launch(
        setup,
        "--nproc-per-node",
        str(GPUS),
        "--max-restarts",
        "0",
        "train.max_steps=100000",
        *fault(f"kill@3:{last}"),
    )
    info = wait_for(setup, info["run"], final, timeout=COMPILE_S)
    assert info["state"] == "failed", info
    assert info["diagnosis"].startswith(f"rank {last} (local rank {last}) was killed by SIGKILL"), info[
        "diagnosis"
    ]
