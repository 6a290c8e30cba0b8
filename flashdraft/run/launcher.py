"""`flashdraft launch CONFIG [key=value ...]`: a detached run that can never fail silently.

1. create the run directory and open its log *first*, so every later failure has somewhere to go;
2. resolve and check the config (a typo'd key is recorded as the run's failure, with the evidence);
3. run the doctor's fast checks; refuse GPUs that a live run holds;
4. start the supervisor in a new session with stdin closed (it outlives ssh, tmux, nohup, container exec);
5. return only when the job reports it is up, or has failed, with the reason; at once when the
   supervisor itself dies before that (docs/run-files.md, "Start-up").

`launch --resume RUN` continues a stopped, failed, killed or lost run in its own directory: the same
config with train.resume=auto, the same log (appended), a new supervisor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.config import dump_yaml, load_config
from flashdraft.durable import atomic_write_bytes, atomic_write_text, disk_full_reason, fsync_dir, fsync_tree
from flashdraft.errors import FlashdraftError
from flashdraft.progress import phase
from flashdraft.provenance import git_commit
from flashdraft.run.diagnose import LOG_NAME, classify_message, diagnose_exit, signal_name
from flashdraft.run.monitor import find_run, is_live, list_runs, run_state, runs_root
from flashdraft.run.processes import start_time
from flashdraft.run_protocol import FINAL_STATES, NODE_RANK_ENV, boot_id, read_json, write_json, write_record

ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCHINDUCTOR_CACHE_DIR",
    "HF_HOME",
)
UP_PHASES = ("compiling", "training", "evaluating", "checkpointing", "finished")
# Supervisor and job start through this script, not `python -m`: nothing of the launch directory on
# sys.path (a user's json.py there would shadow the real module). It is run, never imported.
ENTRY = str(Path(__file__).with_name("entry.py"))
# What a resumed run leaves behind of its earlier attempt: kept under attempts/<n>/ for the record.
ATTEMPT_FILES = ("status.json", "heartbeat.json", "final.json", "error.json")


def _gpus(device: str, env: dict[str, str], nproc: int = 1) -> list[str]:
    """The physical GPUs the job will hold (by CUDA_VISIBLE_DEVICES entry when set)."""
    if device == "cpu":
        return []
    visible = env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    index = device.split(":", 1)[1] if device.startswith("cuda:") else "0"
    if nproc > 1:  # rank r uses local GPU r
        ids = (
            [v.strip() for v in visible.split(",") if v.strip()]
            if visible
            else [str(i) for i in range(nproc)]
        )
        return ids[:nproc]
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return [ids[int(index)]] if index.isdigit() and int(index) < len(ids) else ids
    if device == "auto":
        try:
            import torch

            if not torch.cuda.is_available():
                return []
        except ImportError:
            return []
    return [index]


def _fail(run_dir: Path, log, message: str, kind: str | None = None) -> dict[str, Any]:
    with contextlib.suppress(OSError):
        log.write(f"flashdraft: error: {message}\n".encode())
    diagnosis = classify_message(message)
    status = read_json(run_dir / "status.json") or {}
    status.update(
        {
            "state": "failed",
            "ended": time.time(),
            "diagnosis": diagnosis.line,
            "diagnosis_kind": kind or diagnosis.kind,
            "evidence": [message],
            "updated": time.time(),
        }
    )
    write_record(run_dir / "status.json", status)
    return run_state(run_dir)


# Seconds a multi-node run's rendezvous waits for every node: at start, and after a lost node, for it to
# come back (torchrun's join_timeout); then the run stops, saying so (docs/distributed.md).
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_RDZV_ID = "flashdraft"


@dataclass(frozen=True)
class Nodes:
    """Where this node stands in a multi-node run: torchrun's elastic c10d rendezvous, hosted by node 0's
    agent, which every node's agent rejoins after a restart (docs/distributed.md, "Several nodes")."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0, reachable from every node
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S
    rdzv_id: str = DEFAULT_RDZV_ID

    def torchrun_args(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone"]
        # A fixed number of nodes (min = max): a lost node is waited for, not trained without. Node 0's
        # agent hosts the rendezvous store (is_host), whichever agent starts first. --node-rank is not
        # torchrun's here (the c10d rendezvous orders nodes its own way): the job counts its ranks from
        # it (run_protocol.global_rank).
        return [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf=is_host={int(self.node_rank == 0)},join_timeout={self.join_timeout:g}",
        ]

    def job_env(self) -> dict[str, str]:
        """What the job of a multi-node launch needs in its environment (none for one node)."""
        if self.nnodes == 1:
            return {}
        # the store the ranks meet in is then a fresh one per attempt, hosted by torchrun's rank 0 (the
        # agent's shared one would keep the keys of an attempt before: distributed/topology.py)
        return {NODE_RANK_ENV: str(self.node_rank), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def check_nodes(
    nproc_per_node: int,
    nnodes: int,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    join_timeout: float | None = None,
    rdzv_id: str | None = None,
) -> Nodes:
    """The launch flags of a (multi-node) run, checked before anything is created; errors name the flag."""
    if nproc_per_node < 1:
        raise FlashdraftError(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
    if nnodes < 1:
        raise FlashdraftError(f"--nnodes must be at least 1, got {nnodes}")
    if nnodes == 1:
        given = [
            flag
            for flag, value in (
                ("--node-rank", node_rank not in (None, 0)),
                ("--rdzv-endpoint", rdzv_endpoint is not None),
                ("--join-timeout", join_timeout is not None),
                ("--rdzv-id", rdzv_id is not None),
            )
            if value
        ]
        if given:
            raise FlashdraftError(
                f"{' and '.join(given)}: only for multi-node runs; give --nnodes N (N > 1) as well"
            )
        return Nodes()
    if node_rank is None or not 0 <= node_rank < nnodes:
        raise FlashdraftError(
            f"--node-rank must be given for --nnodes {nnodes}, from 0 to {nnodes - 1} (0 on the node that "
            f"--rdzv-endpoint names), got {node_rank}"
        )
    if rdzv_endpoint is None:
        raise FlashdraftError(f"--nnodes {nnodes}: --rdzv-endpoint HOST:PORT (node 0's address) is required")
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise FlashdraftError(
            f"--rdzv-endpoint {rdzv_endpoint!r}: expected HOST:PORT with a port from 1 to 65535, e.g. node0:29500"
        )
    if join_timeout is not None and not join_timeout > 0:
        raise FlashdraftError(f"--join-timeout must be more than 0 seconds, got {join_timeout:g}")
    if rdzv_id is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", rdzv_id):
        raise FlashdraftError(f"--rdzv-id {rdzv_id!r}: letters, digits, '_', '.' and '-' only")
    return Nodes(
        nnodes,
        node_rank,
        rdzv_endpoint,
        DEFAULT_JOIN_TIMEOUT_S if join_timeout is None else float(join_timeout),
        rdzv_id or DEFAULT_RDZV_ID,
    )


# Restarts of the worker group a multi-process run gets unless --max-restarts says otherwise.
DEFAULT_MAX_RESTARTS = 3


def max_restarts_for(max_restarts: int | None, nproc_per_node: int, nodes: Nodes) -> int:
    """--max-restarts, checked; by default 3 for a run of several processes, 0 for one process."""
    if max_restarts is None:
        return DEFAULT_MAX_RESTARTS if nproc_per_node > 1 or nodes.nnodes > 1 else 0
    if max_restarts < 0:
        raise FlashdraftError(f"--max-restarts must be 0 or more, got {max_restarts}")
    return max_restarts


def _job_cmd(
    python: str, run_dir: Path, nproc_per_node: int, nodes: Nodes = Nodes(), max_restarts: int = 0
) -> list[str]:
    train = [ENTRY, "flashdraft", "train", str(run_dir / "config.yaml")]
    # one process per GPU, per-rank logs in the run directory; torchrun's agent also restarts the group
    if nproc_per_node > 1 or nodes.nnodes > 1 or max_restarts > 0:
        return [
            python,
            "-X",
            "faulthandler",
            "-u",
            ENTRY,
            "torch.distributed.run",
            *nodes.torchrun_args(),
            f"--nproc-per-node={nproc_per_node}",
            f"--max-restarts={max_restarts}",
            f"--log-dir={run_dir / 'torchrun'}",
            "--redirects=3",
            "--tee=3",
            *train,  # torchrun runs the workers as `python -u ENTRY flashdraft train ...`
        ]
    return [python, "-X", "faulthandler", "-u", *train]


def _archive_attempt(run_dir: Path) -> Path:
    """Move the earlier attempt's status, config and per-rank records to attempts/<n>/, so that the new
    attempt starts from clean files and the old evidence stays readable."""
    attempts = run_dir / "attempts"
    number = 1 + sum(1 for p in attempts.glob("*") if p.name.isdigit()) if attempts.is_dir() else 1
    dest = attempts / str(number)
    dest.mkdir(parents=True)
    if (run_dir / "status.json").exists():
        os.replace(run_dir / "status.json", dest / "status.json")
    # A copy: the run keeps its config until the new attempt's replaces it, so a resume that fails
    # before that can itself be resumed.
    atomic_write_bytes(dest / "config.yaml", (run_dir / "config.yaml").read_bytes())
    for rank in sorted(run_dir.glob("rank*")):
        for name in ATTEMPT_FILES:
            if (rank / name).exists():
                (dest / rank.name).mkdir(exist_ok=True)
                os.replace(rank / name, dest / rank.name / name)
    fsync_tree(dest)
    fsync_dir(run_dir)
    return dest


def _resume_target(resume: str, runs_dir: str | None) -> Path:
    """The run to continue, refused while any process of it lives."""
    run_dir = find_run(resume, runs_dir)
    info = run_state(run_dir)
    if is_live(info):
        running = f" (its job pid {info['job_pid']} still runs)" if info.get("job_alive") else ""
        raise FlashdraftError(
            f"--resume {resume}: run {run_dir.name} is {info['state']}{running}; "
            f"stop it first (flashdraft stop {run_dir.name})"
        )
    if not (run_dir / "config.yaml").is_file():
        raise FlashdraftError(
            f"--resume {resume}: {run_dir} has no config.yaml (the run failed before its config was "
            "resolved); start it anew with flashdraft launch CONFIG"
        )
    return run_dir


@dataclass
class Attempt:
    """What one launch starts: the run directory and id, the config and overrides, and the settings that a
    resumed run takes over from its earlier launch (`previous`, its launch.json)."""

    run_dir: Path
    run_id: str
    config_path: str | None
    overrides: list[str]
    env: dict[str, str]
    python: str | None
    nproc_per_node: int
    nodes: Nodes
    max_restarts: int | None
    cwd: Path
    previous: dict[str, Any]


def launch(
    config_path: str | None,
    overrides: list[str],
    *,
    runs_dir: str | None = None,
    name: str | None = None,
    python: str | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
    wait_timeout: float = 600.0,
    stall_seconds: float = 600.0,
    doctor: bool = True,
    nproc_per_node: int = 1,
    resume: str | None = None,
    nodes: Nodes = Nodes(),
    max_restarts: int | None = None,
) -> dict[str, Any]:
    """The steps of the module's docstring; returns the run's state once its job is up or has failed (at
    once with `wait` off)."""
    if resume is not None:
        attempt = _resumed_attempt(
            resume,
            config_path,
            overrides,
            runs_dir,
            dict(env or {}),
            python,
            nproc_per_node,
            nodes,
            max_restarts,
        )
    else:
        attempt = _new_attempt(
            config_path,
            overrides,
            runs_dir,
            name,
            dict(env or {}),
            python,
            nproc_per_node,
            nodes,
            max_restarts,
        )
    run_dir = attempt.run_dir
    max_restarts = max_restarts_for(attempt.max_restarts, attempt.nproc_per_node, attempt.nodes)
    log = (run_dir / LOG_NAME).open("ab", buffering=0)  # the launcher owns the log, before anything can fail
    command = (
        f"--resume {run_dir.name} {' '.join(attempt.overrides)}"
        if resume
        else f"{attempt.config_path or ''} {' '.join(attempt.overrides)}"
    )
    log.write(f"[launch {time.strftime('%Y-%m-%d %H:%M:%S')}] flashdraft launch {command}\n".encode())
    launch_record = _launch_record(attempt, bool(resume), stall_seconds, max_restarts)
    _write_start_files(run_dir, launch_record)

    try:
        config = load_config(attempt.config_path, [*attempt.overrides, f"train.out_dir={run_dir}"])
    except FlashdraftError as exc:
        return _fail(run_dir, log, str(exc))
    atomic_write_text(run_dir / "config.yaml", dump_yaml(config))
    with phase("looking for the run's GPUs"):  # device auto imports torch: 14 s on a busy machine
        launch_record["gpus"] = _gpus(config.train.device, attempt.env, attempt.nproc_per_node)
    write_json(run_dir / "launch.json", launch_record)
    refused = _preflight(config, run_dir, log, launch_record["gpus"], doctor)
    if refused is not None:
        return refused

    supervisor = _start_supervisor(run_dir, log)
    if not wait:
        return run_state(run_dir)
    return _wait_until_up(run_dir, supervisor, log, wait_timeout)


def _new_attempt(
    config_path: str | None,
    overrides: list[str],
    runs_dir: str | None,
    name: str | None,
    env: dict[str, str],
    python: str | None,
    nproc_per_node: int,
    nodes: Nodes,
    max_restarts: int | None,
) -> Attempt:
    """A fresh run directory under the runs root, named after --name or the config file, the time and a
    random suffix."""
    root = runs_root(runs_dir)
    stem = name or (Path(config_path).stem if config_path else "run")
    run_id = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    return Attempt(
        run_dir,
        run_id,
        config_path,
        overrides,
        env,
        python,
        nproc_per_node,
        nodes,
        max_restarts,
        Path.cwd(),
        {},
    )


def _resumed_attempt(
    resume: str,
    config_path: str | None,
    overrides: list[str],
    runs_dir: str | None,
    env: dict[str, str],
    python: str | None,
    nproc_per_node: int,
    nodes: Nodes,
    max_restarts: int | None,
) -> Attempt:
    """--resume RUN: the run's own directory and config (train.resume=auto, the earlier attempt archived),
    its environment, interpreter, world and working directory; the flags given add to them."""
    if config_path is not None:
        raise FlashdraftError(
            f"--resume {resume}: a resumed run keeps its own config; give overrides only, not {config_path}"
        )
    run_dir = _resume_target(resume, runs_dir)
    previous = read_json(run_dir / "launch.json") or {}
    config_path = str(_archive_attempt(run_dir) / "config.yaml")
    if "nodes" in previous:  # a resumed node rejoins the same world
        nodes = Nodes(**previous["nodes"])
    if max_restarts is None and "max_restarts" in previous:
        max_restarts = int(previous["max_restarts"])
    return Attempt(
        run_dir=run_dir,
        run_id=previous.get("run_id", run_dir.name),
        config_path=config_path,
        overrides=["train.resume=auto", *overrides],
        env={**previous.get("env", {}), **env},
        python=python or previous.get("python"),
        nproc_per_node=int(previous.get("nproc_per_node", nproc_per_node)),
        nodes=nodes,
        max_restarts=max_restarts,
        # relative paths in its config meant the first launch's
        cwd=Path(previous.get("cwd") or Path.cwd()),
        previous=previous,
    )


def _launch_record(
    attempt: Attempt, resumed: bool, stall_seconds: float, max_restarts: int
) -> dict[str, Any]:
    """launch.json: what was launched, how, where and from which commit; what the supervisor runs."""
    previous, run_dir, nodes = attempt.previous, attempt.run_dir, attempt.nodes
    job_python = attempt.python or sys.executable
    record = {
        **previous,
        "run_id": attempt.run_id,
        "run_dir": str(run_dir),
        "created": previous.get("created", time.time()),
        "argv": sys.argv,
        "config": previous.get("config", attempt.config_path),
        "overrides": attempt.overrides,
        "cwd": str(attempt.cwd),
        "python": job_python,
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "git_commit": git_commit(attempt.cwd),
        "job_cmd": _job_cmd(job_python, run_dir, attempt.nproc_per_node, nodes, max_restarts),
        "stall_seconds": stall_seconds,
        "max_restarts": max_restarts,
        "nproc_per_node": attempt.nproc_per_node,
        "nodes": dataclasses.asdict(nodes),
        "env": {
            **{k: os.environ[k] for k in ENV_KEYS if k in os.environ},
            **{k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            **attempt.env,
            **nodes.job_env(),
        },
    }
    if resumed:
        record["resumed"] = [*previous.get("resumed", []), time.time()]
    return record


def _write_start_files(run_dir: Path, launch_record: dict[str, Any]) -> None:
    """launch.json and a `starting` status naming this launcher; a full disk is one line."""
    try:
        write_json(run_dir / "launch.json", launch_record)
        write_json(
            run_dir / "status.json",
            {
                "state": "starting",
                "launcher_pid": os.getpid(),
                "launcher_started": start_time(os.getpid()),
                "boot_id": boot_id(),
                "updated": time.time(),
            },
        )
    except OSError as exc:
        raise FlashdraftError(
            f"cannot write the run directory {run_dir}: {disk_full_reason(exc, run_dir) or exc}"
        ) from None


def _preflight(config, run_dir: Path, log, gpus: list[str], doctor: bool) -> dict[str, Any] | None:
    """The doctor's fast checks and the GPUs a live run holds: the failed run's state when one refuses,
    None when the job may start."""
    if doctor:
        from flashdraft.run.doctor import run_checks

        with phase("doctor: preflight checks"):
            failed = [c for c in run_checks(config, quick=True) if c.ok is False]
        for check in failed:
            log.write(f"doctor: ✗ {check.name}: {check.detail} — fix: {check.fix}\n".encode())
        if failed:
            return _fail(run_dir, log, failed[0].detail)
    busy = [other for other in list_runs(run_dir.parent) if other != run_dir]
    for other in busy:
        info = run_state(other)
        shared = set(info.get("gpus") or []) & set(gpus)
        if shared and is_live(info):
            return _fail(
                run_dir,
                log,
                f"GPU {', '.join(sorted(shared))} is held by live run {other.name} ({info['state']}); "
                f"stop it first (flashdraft stop {other.name})",
                kind="gpu_busy",
            )
    return None


def _start_supervisor(run_dir: Path, log) -> subprocess.Popen:
    """The supervisor in a new session with stdin closed, so it outlives the shell that launched it."""
    return subprocess.Popen(
        [sys.executable, ENTRY, "flashdraft.run.supervisor", str(run_dir)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
        cwd=run_dir,  # nothing of the user's directory on its path (docs/run-files.md, "Start-up")
    )


def _wait_until_up(run_dir: Path, supervisor: subprocess.Popen, log, timeout: float) -> dict[str, Any]:
    """Until the job reports a phase past start-up, or the run ends; at once if the supervisor dies."""
    deadline = time.time() + timeout
    # the job's start-up (imports, the target, the first compile) takes minutes on a busy CPU machine:
    # what it is doing is said while the launcher waits (docs/newcomer-walk.md)
    with phase(f"starting run {run_dir.name}: waiting for its job to come up") as waiting:
        while time.time() < deadline:
            info = run_state(run_dir)
            phases = {r["phase"] for r in info["ranks"].values()}
            if info["state"] in (*FINAL_STATES, "lost") or phases & set(UP_PHASES):
                return info
            returncode = supervisor.poll()
            if returncode is not None:
                return _supervisor_ended(run_dir, returncode, log)
            waiting.advance(0, state=info["state"], **({"job": ",".join(sorted(phases))} if phases else {}))
            time.sleep(0.3)
    info = run_state(run_dir)
    info["warning"] = (
        f"not up after {timeout:.0f} s (state {info['state']}); follow it with flashdraft logs {run_dir.name} -f"
    )
    return info


def _supervisor_ended(run_dir: Path, returncode: int, log) -> dict[str, Any]:
    """The supervisor exited while the launcher still waited for the job to come up."""
    info = run_state(run_dir)  # it may have written a final status just before it exited
    if info["state"] in FINAL_STATES:
        return info
    how = f"signal {signal_name(returncode)}" if returncode < 0 else f"code {returncode}"
    if info["job_alive"]:
        info["state"] = "lost"
        info["diagnosis"] = (
            f"lost: the supervisor exited ({how}) after starting the job; job pid {info['job_pid']} still "
            f"runs (flashdraft stop {run_dir.name} ends it)"
        )
        return info
    diagnosis = diagnose_exit(run_dir, returncode if returncode >= 0 else None, signal_name(returncode))
    message = f"the supervisor died at start-up ({how}): {diagnosis.line}"
    with contextlib.suppress(OSError):
        log.write(f"flashdraft: error: {message}\n".encode())
    status = read_json(run_dir / "status.json") or {}
    status.update(
        {
            "state": "failed",
            "ended": time.time(),
            "diagnosis": message,
            "diagnosis_kind": "supervisor_died",
            "evidence": diagnosis.evidence,
            "updated": time.time(),
        }
    )
    write_record(run_dir / "status.json", status)
    return run_state(run_dir)
