"""`flashdraft launch --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`: checked flags, passed to torchrun."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashdraft.errors import FlashdraftError
from flashdraft.run.launcher import Nodes, _job_cmd, check_nodes


def test_multi_node_flags_reach_torchrun(tmp_path):
    nodes = check_nodes(8, 2, 1, "node0.cluster:29500")
    cmd = _job_cmd("python", tmp_path, 8, nodes)
    run = cmd[cmd.index("torch.distributed.run") + 1 :]
    # torchrun's elastic rendezvous, hosted by node 0's agent; a lost node is waited for (join_timeout)
    assert run[:6] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0.cluster:29500",
        "--rdzv-id=flashdraft",
        "--rdzv-conf=is_host=0,join_timeout=600",
        "--nproc-per-node=8",
    ]
    assert "--standalone" not in cmd
    # the node rank reaches the job (its ranks are counted from it), and the agent's store is not shared
    assert nodes.job_env() == {"FLASHDRAFT_NODE_RANK": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    host = check_nodes(8, 2, 0, "node0.cluster:29500", join_timeout=90, rdzv_id="exp-7")
    args = _job_cmd("python", tmp_path, 8, host)
    assert "--rdzv-conf=is_host=1,join_timeout=90" in args and "--rdzv-id=exp-7" in args


def test_one_node_stays_standalone_and_one_process_needs_no_torchrun(tmp_path):
    assert "--standalone" in _job_cmd("python", tmp_path, 2, check_nodes(2, 1, None, None))
    assert "torch.distributed.run" not in _job_cmd("python", tmp_path, 1, Nodes())
    # one GPU on each of two nodes still goes through torchrun
    assert "--nnodes=2" in _job_cmd("python", tmp_path, 1, check_nodes(1, 2, 0, "[fd00::1]:29500"))


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 1, None, None), "--nproc-per-node must be at least 1"),
        ((1, 0, None, None), "--nnodes must be at least 1"),
        ((1, 1, 1, None), "--node-rank: only for multi-node runs; give --nnodes N"),
        ((1, 1, None, "h:1"), "--rdzv-endpoint: only for multi-node runs"),
        ((1, 1, None, None, 30.0), "--join-timeout: only for multi-node runs"),
        ((1, 2, 0, "h:1", 0.0), "--join-timeout must be more than 0 seconds"),
        ((1, 2, 0, "h:1", None, "a b"), "--rdzv-id 'a b': letters, digits"),
        ((1, 2, None, "h:1"), "--node-rank must be given for --nnodes 2"),
        ((1, 2, 2, "h:1"), "--node-rank must be given for --nnodes 2, from 0 to 1"),
        ((1, 2, 0, None), "--rdzv-endpoint HOST:PORT (node 0's address) is required"),
        ((1, 2, 0, "node0"), "--rdzv-endpoint 'node0': expected HOST:PORT"),
        ((1, 2, 0, "node0:99999"), "expected HOST:PORT with a port from 1 to 65535"),
    ],
)
def test_bad_multi_node_flags_are_named(args, message):
    with pytest.raises(FlashdraftError) as err:
        check_nodes(*args)
    assert message in str(err.value)


def test_the_cli_checks_the_flags_before_creating_a_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flashdraft", "launch", "--nnodes", "2", "--runs-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "--node-rank must be given for --nnodes 2" in proc.stderr
    assert not (tmp_path / "runs").exists()
