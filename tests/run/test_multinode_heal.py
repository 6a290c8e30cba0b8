"""Multi-node runs that heal (issue 34, item 2): two "nodes" on one machine, two `flashdraft launch` calls
against one loopback rendezvous endpoint, each node one process (gloo on the CPU).

A lost node (its supervisor, torchrun agent and rank killed at once with SIGKILL) is waited for by node 0's
agent; launched again (`launch --resume`, as a cluster scheduler restarts a node), it rejoins, receives
node 0's newest checkpoint, and the run finishes with final weights bit-identical to an uninterrupted
run's. A node that never comes back stops the run once --join-timeout has passed, with that cause.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from flashdraft.run_protocol import read_heartbeats, read_json

from .test_faults import FLASHDRAFT, assert_clean, final, launch, status, wait_for

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY = 160, 40
SHORT = (f"train.max_steps={STEPS}", f"train.save_every={SAVE_EVERY}")
# Limits on a loaded 2-core machine, not measures of speed.
RUN_LIMIT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_nodes(setup, join_timeout: float) -> tuple[dict, dict]:
    """Both nodes' launches at once, as on two machines (each returns once its supervisor runs: the
    callers wait for the ranks' own heartbeats, which is quicker than `launch` waiting for them)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    common = ("--nnodes", "2", "--rdzv-endpoint", endpoint, "--join-timeout", str(join_timeout), *SHORT)
    with ThreadPoolExecutor(2) as pool:
        nodes = pool.map(lambda rank: launch(setup, *common, "--node-rank", str(rank), "--no-wait"), (0, 1))
    node0, node1 = nodes
    for node in (node0, node1):
        assert node["state"] not in ("failed", "lost"), node
    return node0, node1


def _wait_for_step(run_dir: Path, rank: int, step: int) -> None:
    deadline = time.time() + RUN_LIMIT_S
    while ((read_heartbeats(run_dir).get(rank) or {}).get("step") or 0) < step:
        assert time.time() < deadline, f"rank {rank} never reached step {step}"
        time.sleep(0.05)


def _lose_node(setup, node: dict) -> None:
    """SIGKILL, at once, for every process of a node: its supervisor, torchrun's agent, the agent's ranks."""
    info = read_json(Path(node["run_dir"]) / "status.json")  # not `status`: its start-up takes steps
    processes = []
    for pid in (info["supervisor_pid"], info["job_pid"]):
        process = psutil.Process(pid)
        processes += [process, *process.children(recursive=True)]
    for process in processes:
        process.send_signal(signal.SIGKILL)
    psutil.wait_procs(processes, timeout=30)


def _resume(setup, run: str) -> dict:
    out = subprocess.run(
        [*FLASHDRAFT.split(), "launch", "--resume", run, "--runs-dir", str(setup["root"] / "runs"), "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    return json.loads(out.stdout[out.stdout.index("{") :])


def _weights(info: dict) -> dict[str, torch.Tensor]:
    path = Path(info["run_dir"]) / "checkpoints" / f"step-{STEPS:08d}" / "drafter" / "model.safetensors"
    return load_file(path)


@pytest.fixture(scope="module")
def uninterrupted(setup) -> dict[str, torch.Tensor]:
    """The same world (2 ranks) on one node, never interrupted."""
    info = wait_for(setup, launch(setup, "--nproc-per-node", "2", *SHORT)["run"], final, timeout=RUN_LIMIT_S)
    assert info["state"] == "finished" and info["step"] == STEPS, info
    return _weights(info)


def test_a_lost_node_rejoins_and_the_run_finishes_bit_identically(setup, uninterrupted):
    node0, node1 = _two_nodes(setup, join_timeout=180)
    _wait_for_step(Path(node1["run_dir"]), 1, SAVE_EVERY + 10)  # past the first checkpoint
    _lose_node(setup, node1)
    lost = status(setup, node1["run"])
    assert lost["state"] in ("lost", "killed"), lost
    back = _resume(setup, node1["run"])  # the node comes back, as a scheduler restarts it
    assert back["state"] not in ("failed", "lost"), back
    done0 = wait_for(setup, node0["run"], final, timeout=RUN_LIMIT_S)
    done1 = wait_for(setup, node1["run"], final, timeout=RUN_LIMIT_S)
    assert done0["state"] == "finished" and done0["step"] == STEPS, done0
    assert done1["state"] == "finished", done1
    # node 0 restarted once: it lost its peer on node 1, and resumed from its newest checkpoint
    (restart,) = done0["restarts"]
    assert restart["kind"] == "peer_lost" and restart["node"].startswith("node 0"), restart
    assert restart["resumed_from_step"] >= SAVE_EVERY and restart["lost_steps"] >= 0, restart
    # the node that came back received that checkpoint from rank 0 (its own run directory has none)
    log0 = assert_clean(done0)
    assert f"do not have rank 0's checkpoint step-{restart['resumed_from_step']:08d}" in log0
    assert not (Path(done1["run_dir"]) / "checkpoints").exists()
    final_weights = _weights(done0)
    assert final_weights.keys() == uninterrupted.keys()
    different = [name for name in final_weights if not torch.equal(final_weights[name], uninterrupted[name])]
    assert not different, f"weights differ from the uninterrupted run's: {different}"
    assert_clean(done1)


def test_a_node_that_never_comes_back_stops_the_run_after_the_join_timeout(setup):
    node0, node1 = _two_nodes(setup, join_timeout=20)
    _wait_for_step(Path(node1["run_dir"]), 1, 3)
    lost_at = time.time()
    _lose_node(setup, node1)
    done0 = wait_for(setup, node0["run"], final, timeout=RUN_LIMIT_S)
    waited = time.time() - lost_at
    assert done0["state"] == "failed", done0
    assert done0["diagnosis_kind"] == "node_lost", done0
    assert "did not come back within --join-timeout 20 s" in done0["diagnosis"], done0["diagnosis"]
    assert waited >= 20, waited
    # it names what it waited after; no restart happened (the rendezvous never completed)
    assert "after rank 0 lost its connection to a peer on another node" in done0["diagnosis"]
    assert done0["restarts"] == [], done0["restarts"]
    assert_clean(done0)
