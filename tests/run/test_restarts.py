"""Self-healing launches (issue 34): a 2-rank run (gloo on the CPU) whose rank is killed with SIGKILL, or
stopped with SIGSTOP (a hang), at a random moment restarts by itself through torchrun, resumes from its
newest checkpoint and finishes with final weights bit-identical to an uninterrupted run's; `status` lists
each restart; a failure that repeats at the same step stops with its diagnosis.

One kill and one hang run in CI. FLASHDRAFT_HEAL_KILLS=10 FLASHDRAFT_HEAL_HANGS=3 run the issue's 10 and 3
(each case is one test, with the random seed in its id: a failure is replayed with the same moment).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from flashdraft.run_protocol import read_heartbeats

from .test_faults import assert_clean, fault, final, launch, wait_for

KILLS = int(os.environ.get("FLASHDRAFT_HEAL_KILLS", "1"))
HANGS = int(os.environ.get("FLASHDRAFT_HEAL_HANGS", "1"))
# Long enough for an interruption at a random moment (a step of the tiny setup takes ~0.1 s here).
STEPS, SAVE_EVERY = 240, 40
TWO_RANKS = ("--nproc-per-node", "2", f"train.max_steps={STEPS}", f"train.save_every={SAVE_EVERY}")
# Limits a run must finish within on a loaded 2-core machine, not measures of speed.
RUN_LIMIT_S = 600


def _weights(info: dict) -> dict[str, torch.Tensor]:
    return load_file(
        Path(info["run_dir"]) / "checkpoints" / f"step-{STEPS:08d}" / "drafter" / "model.safetensors"
    )


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"weights differ from the uninterrupted run's: {different}"


@pytest.fixture(scope="module")
def uninterrupted(setup) -> dict[str, torch.Tensor]:
    info = wait_for(setup, launch(setup, *TWO_RANKS)["run"], final, timeout=RUN_LIMIT_S)
    assert info["state"] == "finished" and info["step"] == STEPS, info
    return _weights(info)


def _rank_process(run_dir: Path, rank: int) -> psutil.Process:
    beat = read_heartbeats(run_dir)[rank]
    return psutil.Process(beat["pid"])


def _interrupt(setup, seed: int, signum: int, *args: str) -> tuple[dict, int]:
    """Launch, then at a random step and moment send `signum` to a random rank; returns the run's status
    once it has ended and the rank signalled."""
    rng = random.Random(seed)
    at_step, rank, delay = rng.randint(10, STEPS - 40), rng.randint(0, 1), rng.uniform(0.0, 1.0)
    info = launch(setup, *args, *TWO_RANKS)
    run_dir = Path(info["run_dir"])
    deadline = time.time() + RUN_LIMIT_S
    # the heartbeat files themselves, read in a tight loop (a `status` call takes longer than a step)
    while (read_heartbeats(run_dir).get(rank) or {}).get("step") is None or read_heartbeats(run_dir)[rank][
        "step"
    ] < at_step:
        assert time.time() < deadline, f"rank {rank} never reached step {at_step}"
        time.sleep(0.02)
    time.sleep(delay)  # a random moment within the step (or the checkpoint write) that follows
    process = _rank_process(run_dir, rank)
    assert process.is_running(), "the run ended before its interruption"
    process.send_signal(signum)
    print(f"seed {seed}: {signal.Signals(signum).name} to rank {rank} after step {at_step} + {delay:.2f} s")
    return wait_for(setup, info["run"], final, timeout=RUN_LIMIT_S), rank


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(KILLS))
def test_a_kill_9_of_a_random_rank_restarts_and_finishes_bit_identically(setup, uninterrupted, seed):
    info, rank = _interrupt(setup, seed, signal.SIGKILL)
    assert info["state"] == "finished" and info["step"] == STEPS, info
    restarts = info["restarts"]
    assert len(restarts) == 1 and restarts[0]["kind"] == "rank_killed" and restarts[0]["rank"] == rank, (
        restarts
    )
    assert restarts[0]["cause"].startswith(f"rank {rank} was killed by SIGKILL")
    assert restarts[0]["resumed_from_step"] % SAVE_EVERY == 0 and restarts[0]["lost_steps"] >= 0
    _assert_bit_identical(_weights(info), uninterrupted)
    log = assert_clean(info)
    assert "restart 1/3" in log and f"resumed from step {restarts[0]['resumed_from_step']}" in log


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 100 + HANGS))
def test_a_sigstop_hang_of_a_random_rank_restarts_and_finishes_bit_identically(setup, uninterrupted, seed):
    info, rank = _interrupt(setup, seed, signal.SIGSTOP, "--stall-seconds", "20")
    assert info["state"] == "finished" and info["step"] == STEPS, info
    restarts = info["restarts"]
    assert len(restarts) == 1 and restarts[0]["kind"] == "hang", restarts
    assert f"rank {rank} is stopped (SIGSTOP)" in restarts[0]["cause"]
    _assert_bit_identical(_weights(info), uninterrupted)
    log = assert_clean(info)
    assert "asked 2 training process(es) for their Python stacks" in log or "asked 1 training" in log


@pytest.mark.slow
def test_a_failure_that_repeats_at_the_same_step_stops_with_its_diagnosis(setup):
    info = launch(
        setup, "--nproc-per-node", "2", *fault("raise@6:1")
    )  # every attempt fails at step 6 on rank 1
    info = wait_for(setup, info["run"], final, timeout=RUN_LIMIT_S)
    assert info["state"] == "failed", info
    assert info["diagnosis"].startswith(
        "the same failure twice in a row at step 6: Python exception on rank 1, step 6"
    ), info["diagnosis"]
    assert "injected failure at step 6" in info["diagnosis"] and "not restarted again" in info["diagnosis"]
    assert [(r["failed_at_step"], r["resumed_from_step"], r["lost_steps"]) for r in info["restarts"]] == [
        (6, 4, 2)
    ]
    assert_clean(info)


@pytest.mark.slow
def test_restarts_exhausted_end_the_run_with_the_last_cause(setup):
    # a kill at step 3 on rank 1 in every attempt, before the first checkpoint: each resumes from step 0
    info = launch(setup, "--nproc-per-node", "2", "--max-restarts", "1", *fault("kill@3:1"))
    info = wait_for(setup, info["run"], final, timeout=RUN_LIMIT_S)
    assert info["state"] == "failed", info
    assert info["diagnosis"].startswith("rank 1 (local rank 1) was killed by SIGKILL"), info["diagnosis"]
    assert "(after 1 restart(s) of 1: flashdraft status lists them)" in info["diagnosis"]
    assert [(r["kind"], r["failed_at_step"], r["resumed_from_step"]) for r in info["restarts"]] == [
        ("rank_killed", 3, 0)
    ]


def test_status_lists_each_restart(tmp_path, capsys):
    from flashdraft.run.status import show_status
    from flashdraft.run_protocol import write_json

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    write_json(run / "launch.json", {"run_id": "r1", "created": time.time()})
    restart = {
        "time": 43200.0,
        "attempt": 1,
        "of": 3,
        "rank": 1,
        "node": "node 0 (h)",
        "kind": "rank_killed",
        "cause": "rank 1 was killed by SIGKILL at step 7",
        "failed_at_step": 7,
        "resumed_from_step": 4,
        "lost_steps": 3,
    }
    write_json(run / "status.json", {"state": "finished", "restarts": [restart]})
    assert show_status("r1", runs_dir=str(tmp_path / "runs"), as_json=False) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "restart 1/3 at 1970-01-01 " in text
        and "on node 0 (h): rank 1 was killed by SIGKILL at step 7; resumed from step 4, 3 step(s) of work lost"
        in text
    ), text
    assert show_status("r1", runs_dir=str(tmp_path / "runs"), as_json=True) == 0
    assert '"lost_steps": 3' in capsys.readouterr().out


def test_max_restarts_default_3_for_several_processes_0_for_one_and_reach_torchrun(tmp_path):
    from flashdraft.errors import FlashdraftError
    from flashdraft.run.launcher import Nodes, _job_cmd, check_nodes, max_restarts_for

    assert max_restarts_for(None, 2, Nodes()) == 3 and max_restarts_for(None, 1, Nodes()) == 0
    assert max_restarts_for(None, 1, check_nodes(1, 2, 0, "node0:29500")) == 3
    assert max_restarts_for(5, 1, Nodes()) == 5
    with pytest.raises(FlashdraftError, match="--max-restarts must be 0 or more"):
        max_restarts_for(-1, 2, Nodes())
    assert "--max-restarts=3" in _job_cmd("python", tmp_path, 2, Nodes(), 3)
    one = _job_cmd("python", tmp_path, 1, Nodes(), 2)  # one process restarts under torchrun too
    assert "torch.distributed.run" in one and "--max-restarts=2" in one
    assert "torch.distributed.run" not in _job_cmd("python", tmp_path, 1, Nodes(), 0)


def test_a_restarted_attempt_resumes_automatically(tmp_path, monkeypatch, capfd):
    """TORCHELASTIC_RESTART_COUNT > 0 turns train.resume=never into auto before the trainer starts."""
    from flashdraft.train import job

    seen = {}

    def fake_train(config, heartbeat=None):
        seen["resume"], seen["attempt"] = config.train.resume, heartbeat.state["attempt"]
        return {"outcome": "finished", "steps": 0, "skipped_steps": 0}

    import threading

    monkeypatch.setattr("flashdraft.train.trainer.train", fake_train)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)  # run_job installs its own
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    job.run_job(None, ["train.resume=never", "train.device=cpu", "train.compile=false"])
    assert seen == {"resume": "auto", "attempt": 2}
    assert "restart 2: train.resume=never -> auto" in capfd.readouterr().out
