"""Split topology (distributed.mode=split) under torchrun with gloo on the CPU: 1 target rank + 2 drafter ranks
train like one process with the same global batch; a slow drafter side makes the target side wait with a
bounded number of features in flight; a hung or dead rank fails the whole job in bounded time, naming it.
Tolerance as in test_distributed_dp.py: losses within 1e-5, gradient norms within 1e-4 (relative)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashdraft.distributed.split import balance, micro_share, split_roles
from flashdraft.errors import FlashdraftError
from flashdraft.run_protocol import RUN_DIR_ENV
from tests.faults import fault_env
from tests.processes import run_or_dump

from .test_distributed_dp import _assert_same, _curve

SPLIT = {
    "train.log_every": 1,
    "train.device": "cpu",
    "train.resume": "never",
    "train.batch_size": 2,
    "distributed.mode": "split",
    "distributed.target_ranks": 1,
}
# A limit for a run that must finish, not a measure of speed: a loaded 2-core machine is slow.
SLOW_LIMIT_S = 900


def _torchrun(setup, out: Path, settings: dict, env: dict | None = None, timeout: float = 170):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    cmd += ["-m", "flashdraft", "train", str(setup["config"]), f"train.out_dir={out}"]
    cmd += [f"{k}={v}" for k, v in {**SPLIT, **settings}.items()]
    return run_or_dump(cmd, timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_one_target_and_two_drafter_ranks_equal_one_process(setup, tmp_path):
    single = tmp_path / "single"
    # Generous limits (a loaded 2-core machine ran past the old 120 s / 170 s ones); a run still going
    # at its limit fails with every process's stacks (tests/processes.py), not a bare timeout.
    alone = run_or_dump(
        [
            *(sys.executable, "-m", "flashdraft", "train", str(setup["config"]), f"train.out_dir={single}"),
            *("train.log_every=1", "train.device=cpu", "train.resume=never", "train.batch_size=4"),
            *("train.grad_accum=2", "train.max_steps=3"),
        ],
        timeout=SLOW_LIMIT_S,
    )
    assert alone.returncode == 0, (alone.stdout + alone.stderr)[-4000:]
    out = tmp_path / "split"
    proc = _torchrun(setup, out, {"train.grad_accum": 2, "train.max_steps": 3}, timeout=SLOW_LIMIT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "x 2 process(es)" in proc.stdout  # two ranks train; the third runs the target
    _assert_same(_curve(single), _curve(out), [1, 2, 3])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("balance/target_waiting_share" in r for r in rows if r["kind"] == "train")


PROBE = textwrap.dedent(
    """
    import atexit, json, os, time
    from flashdraft.distributed import split
    from flashdraft.train import objective

    record = {"lead": 0, "in_flight": 0}
    state = {"exchanges": 0}
    real_send, real_exchange, real_call = (
        split.FeatureSender.send, split.Control.exchange, objective.Objective.__call__
    )

    def send(self, drafter, header, features):
        real_send(self, drafter, header, features)
        record["lead"] = max(record["lead"], header[0] - state["exchanges"])
        record["in_flight"] = max(record["in_flight"], max(len(q) for q in self.in_flight.values()))

    def exchange(self, stop, clock, step):
        out = real_exchange(self, stop, clock, step)
        state["exchanges"] += 1
        return out

    def slow_call(self, *args, **kwargs):  # the drafter side is the slow one
        time.sleep(0.25)
        return real_call(self, *args, **kwargs)

    split.FeatureSender.send, split.Control.exchange = send, exchange
    objective.Objective.__call__ = slow_call
    if os.environ.get("RANK") == "2":
        atexit.register(lambda: open(os.environ["PROBE_OUT"], "w").write(json.dumps(record)))
    """
)


@pytest.mark.slow
def test_a_slow_drafter_side_makes_the_target_wait_with_bounded_features_in_flight(setup, tmp_path):
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    record = tmp_path / "record.json"
    env = {
        "PYTHONPATH": os.pathsep.join([str(probe_dir), os.environ.get("PYTHONPATH", "")]),
        "PROBE_OUT": str(record),
    }
    proc = _torchrun(setup, tmp_path / "out", {"train.max_steps": 8, "distributed.max_in_flight": 2}, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    seen = json.loads(record.read_text())
    # Step s is produced after the exchange of step s - 2: never more than one step ahead of the last
    # step the drafters finished, and at most max_in_flight x grad_accum micro-batches unconfirmed.
    assert seen["lead"] == 1 and 1 <= seen["in_flight"] <= 2
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["kind"] == "train"][-2]
    assert last["balance/target_waiting_share"] > 0.5  # the fast side waits
    assert "balance at step" in proc.stdout and "targets wait" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,expected",
    [("hang@2:2", "target rank 2 did not join the exchange of step"), ("kill@2:2", "rank      : 2")],
)
def test_a_hung_or_dead_target_rank_fails_the_job_in_bounded_time_naming_it(setup, tmp_path, fault, expected):
    started = time.time()
    run_dir = tmp_path / "run"  # the step faults fire from heartbeats, which need a run directory
    run_dir.mkdir()
    proc = _torchrun(
        setup,
        tmp_path / "out",
        {"train.max_steps": 8, "distributed.timeout_minutes": 0.25},
        env={**fault_env(fault), RUN_DIR_ENV: str(run_dir)},
        timeout=150,
    )
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert time.time() - started < 120


def test_split_roles_per_node():
    roles = split_roles(2, 0, 8, 4)  # 2 nodes of 4: the last 2 local ranks of each run the target
    assert roles.target_ranks == (2, 3, 6, 7) and roles.drafter_ranks == (0, 1, 4, 5)
    assert [roles.source_of(d) for d in roles.drafter_ranks] == [2, 3, 6, 7]
    roles = split_roles([3], 0, 4, 4)
    assert roles.served_by(3) == [0, 1, 2] and not roles.is_target


@pytest.mark.parametrize(
    "spec,message",
    [
        (0, "a count per node must be from 1 to 3"),
        (4, "a count per node must be from 1 to 3"),
        ([0, 1], "local rank 0 must train the drafter"),
        ([5], "expected local ranks from 0 to 3"),
        ([1, 2, 3, 0], "and not all of them"),
    ],
)
def test_bad_target_ranks_are_named(spec, message):
    with pytest.raises(FlashdraftError) as err:
        split_roles(spec, 0, 4, 4)
    assert "distributed.target_ranks" in str(err.value) and message in str(err.value)


def test_an_empty_share_is_padding_on_both_sides():
    assert micro_share([7, 8, 9], 1, 2) == ([8], False)
    assert micro_share([7], 1, 2) == ([7], True)


def test_balance_report_names_the_waiting_side_and_the_split():
    # 1 target GPU: 100 samples in 10 busy s; 7 drafter GPUs: 100 samples in 70 busy s (10 s each) plus
    # 30 s waiting in all: the target side is the bottleneck, the drafters wait 30%.
    totals = {
        "stop": 0.0,
        "target_busy": 10.0,
        "target_waiting": 0.0,
        "target_samples": 100.0,
        "drafter_busy": 70.0,
        "drafter_waiting": 30.0,
        "drafter_samples": 100.0,
    }
    report = balance(totals, None, 1, 7)
    assert report["drafter_waiting_share"] == 0.3 and report["target_waiting_share"] == 0.0
    # target: 10 samples per busy GPU-second, drafter: 100/70; 8 GPUs split t:(8-t) with t*10 = (8-t)*1.43
    assert report["balanced_split"] == [1, 7]
    assert report["advice"] == "drafters wait 30%: 1 target + 7 drafter GPUs is the best split of 8"
    slow_target = {**totals, "target_busy": 80.0}  # now 1.25 samples per busy second
    assert balance(slow_target, None, 1, 7)["advice"] == "drafters wait 30%: use 4 target + 4 drafter GPUs"


def test_status_shows_the_balance_report_from_rank_0s_heartbeat(tmp_path):
    from flashdraft.run.status import balance_line, with_balance
    from flashdraft.run_protocol import write_json

    report = {
        "target_samples_per_s_per_gpu": 40.0,
        "target_busy_share": 1.0,
        "target_waiting_share": 0.0,
        "drafter_samples_per_s_per_gpu": 10.0,
        "drafter_busy_share": 0.62,
        "drafter_waiting_share": 0.38,
        "advice": "drafters wait 38%: use 3 target + 5 drafter GPUs",
    }
    (tmp_path / "rank0").mkdir()
    write_json(tmp_path / "rank0" / "heartbeat.json", {"step": 3, "balance": report})
    info = with_balance({"run_dir": str(tmp_path)})
    assert info["balance"] == report
    assert balance_line(info["balance"]) == (
        "balance: target 40.0 samples/s/GPU, busy 100% waiting 0%, drafter 10.0 samples/s/GPU, busy 62% "
        "waiting 38%; drafters wait 38%: use 3 target + 5 drafter GPUs"
    )
    assert "balance" not in with_balance({"run_dir": str(tmp_path / "elsewhere")})
