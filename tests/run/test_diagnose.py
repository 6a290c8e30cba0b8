"""Diagnoses that need a GPU or a cluster to happen for real, checked on their recorded evidence; lost
runs; GPUs held by a live run; the doctor's report."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from flashdraft.config import load_config
from flashdraft.run.diagnose import diagnose_exit
from flashdraft.run.doctor import print_checks, run_checks
from flashdraft.run.launcher import launch
from flashdraft.run.monitor import run_state
from flashdraft.run_protocol import Heartbeat, write_json


def _run_dir(tmp_path, log: str):
    run = tmp_path / "r"
    run.mkdir()
    (run / "train.log").write_text(log)
    return run


@pytest.mark.parametrize(
    "log,kind,needle",
    [
        (
            "step 10\n[rank0]:[E ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
            "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n",
            "nccl_timeout",
            "NCCL timeout",
        ),
        (
            "flashdraft: error: flex_attention was called outside torch.compile (it would fall back to dense attention)\n",
            "dense_flex_fallback",
            "dense flex_attention fallback refused",
        ),
        (
            "torch._dynamo.exc.FailOnRecompileLimitHit: recompile_limit reached with fullgraph=True\n",
            "recompile_storm",
            "recompile storm",
        ),
        (
            'Traceback (most recent call last):\n  File "x.py", line 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n',
            "out_of_memory",
            "out of memory",
        ),
        ("Fatal Python error: Segmentation fault\n", "fatal", "interpreter crashed"),
    ],
)
def test_log_evidence_is_named(tmp_path, log, kind, needle):
    diagnosis = diagnose_exit(_run_dir(tmp_path, log), 1, None)
    assert diagnosis.kind == kind and needle in diagnosis.line and diagnosis.evidence


# torchrun's failure summary as torch 2.13 prints it when local rank 1 of 2 is killed with SIGKILL
TORCHRUN_SUMMARY = """[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
E1201 03:10:00.000000 4242 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: -9) local_rank: 1 (pid: 4244) of binary: python
Traceback (most recent call last):
  File "torch/distributed/run.py", line 900, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
flashdraft FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_03:10:00
  host      : node0
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4243)
  error_file: /run/rank0/error.json
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_03:09:59
  host      : node0
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4244) SIGKILL
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4244
============================================================
"""


def test_a_rank_killed_by_a_signal_is_named_not_the_peer_that_lost_it(tmp_path):
    """A killed rank writes no error record; its peer, losing the connection, writes one. torchrun's summary
    names the rank it saw die first, and the diagnosis says that one."""
    run = _run_dir(tmp_path, TORCHRUN_SUMMARY)
    (run / "rank0").mkdir()
    write_json(
        run / "rank0" / "error.json",
        {"type": "RuntimeError", "message": "Connection closed by peer", "time": time.time(), "rank": 0},
    )
    diagnosis = diagnose_exit(run, 1, None)
    assert diagnosis.kind == "rank_killed"
    assert diagnosis.line.startswith("rank 1 (local rank 1) was killed by SIGKILL (the kernel OOM killer")
    assert any("Signal 9 (SIGKILL) received by PID 4244" in line for line in diagnosis.evidence)


def test_torchrun_s_root_cause_names_the_rank_when_nothing_else_does(tmp_path):
    summary = TORCHRUN_SUMMARY.replace("exitcode  : -9 (pid: 4244) SIGKILL", "exitcode  : 3 (pid: 4244)")
    summary = summary.replace("Signal 9 (SIGKILL) received by PID 4244", "os._exit(3) in a C extension")
    diagnosis = diagnose_exit(_run_dir(tmp_path, summary), 1, None)
    assert diagnosis.kind == "rank_failed"
    assert (
        diagnosis.line == "rank 1 (local rank 1) failed first, with exit code 3: os._exit(3) in a C extension"
    )


def test_first_rank_to_fail_is_the_root_cause(tmp_path):
    run = _run_dir(tmp_path, "")
    for rank, (t, message) in enumerate([(20.0, "follow-on failure"), (10.0, "the root cause")]):
        write_json(
            run / f"rank{rank}" / "error.json",
            {"type": "ValueError", "message": message, "time": t, "traceback": ""},
        )
    assert (
        "rank 1" in diagnose_exit(run, 1, None).line and "the root cause" in diagnose_exit(run, 1, None).line
    )


def test_run_without_final_status_and_dead_supervisor_is_lost(tmp_path):
    run = _run_dir(tmp_path, "starting\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_json(run / "launch.json", {"run_id": "r", "created": time.time()})
    write_json(run / "status.json", {"state": "running", "supervisor_pid": dead.pid, "job_pid": dead.pid})
    Heartbeat(run).beat("training", force=True, step=5)
    info = run_state(run)
    assert info["state"] == "lost" and "supervisor is gone without a final status" in info["diagnosis"]


def test_launch_refuses_gpus_held_by_a_live_run(tmp_path, qwen3_target):
    runs = tmp_path / "runs"
    holder = runs / "holder"
    holder.mkdir(parents=True)
    write_json(holder / "launch.json", {"run_id": "holder", "created": time.time(), "gpus": ["0"]})
    keeper = subprocess.Popen(
        ["bash", "-c", "sleep 60; true", str(holder)]
    )  # a live "supervisor" for that run
    try:
        write_json(holder / "status.json", {"state": "running", "supervisor_pid": keeper.pid})
        Heartbeat(holder).beat("training", force=True, step=1)
        data = tmp_path / "d.jsonl"
        data.write_text(json.dumps({"input_ids": list(range(40)), "loss_mask": [1] * 40}) + "\n")
        info = launch(
            None,
            [
                f"model.target={qwen3_target}",
                "model.mask_token_id=300",
                f"data.train=[{data}]",
                "train.device=cuda:0",
            ],
            runs_dir=str(runs),
            wait=False,
        )
        assert info["state"] == "failed" and "GPU 0 is held by live run holder" in info["diagnosis"]
    finally:
        keeper.kill()


def test_doctor_reports_each_check_with_a_fix(tmp_path, qwen3_target, capsys):
    config = load_config(
        None,
        [
            f"model.target={qwen3_target}",
            "model.mask_token_id=300",
            "data.train=[/nope.jsonl]",
            f"train.out_dir={tmp_path}",
            "model.target_layer_ids=[1,40]",
        ],
    )
    checks = {c.name: c for c in run_checks(config)}
    assert checks["target"].ok and checks["packages"].ok and checks["output"].ok
    assert checks["data"].ok is False and "/nope.jsonl" in checks["data"].detail
    assert checks["drafter"].ok is False and "[40]" in checks["drafter"].detail
    assert print_checks(list(checks.values())) == 1
    out = capsys.readouterr().out
    assert "✗ data" in out and "fix:" in out and "✓ target" in out


def test_doctor_says_when_python_cannot_cache_its_bytecode(monkeypatch, tmp_path):
    """A machine that forbids bytecode caching (PYTHONDONTWRITEBYTECODE, no .pyc shipped) starts every
    process seconds slower: the doctor says so and how to cache it elsewhere; otherwise it says all is well."""
    import importlib.util

    from flashdraft.run import doctor

    monkeypatch.setattr(importlib.util, "cache_from_source", lambda path: str(tmp_path / "absent.pyc"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    check = doctor._bytecode(None)
    assert check.ok is True and "forbids writing it" in check.detail and "PYTHONPYCACHEPREFIX" in check.detail
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert "the first process writes it" in doctor._bytecode(None).detail
    (tmp_path / "absent.pyc").write_bytes(b"")
    assert doctor._bytecode(None).detail.startswith("cached")
