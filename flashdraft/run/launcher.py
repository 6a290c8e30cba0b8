"""`flashdraft launch CONFIG [key=value ...]`: a detached run that can never fail silently.

1. create the run directory and open its log *first*, so every later failure has somewhere to go;
2. resolve and check the config (a typo'd key is recorded as the run's failure, with the evidence);
3. run the doctor's fast checks; refuse GPUs that a live run holds;
4. start the supervisor in a new session with stdin closed (it outlives ssh, tmux, nohup, container exec);
5. return only when the job reports it is up, or has failed, with the reason
   (../shared/reference/supervision.md §3.3).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from flashdraft.config import dump_yaml, load_config
from flashdraft.errors import FlashdraftError
from flashdraft.run.diagnose import LOG_NAME, classify_message
from flashdraft.run.monitor import is_live, list_runs, run_state, runs_root
from flashdraft.run_protocol import FINAL_STATES, boot_id, read_json, write_json

ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCHINDUCTOR_CACHE_DIR",
    "HF_HOME",
)
UP_PHASES = ("compiling", "training", "evaluating", "checkpointing", "finished")


def _git_commit(cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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
        }
    )
    write_json(run_dir / "status.json", status)
    return run_state(run_dir)


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
) -> dict[str, Any]:
    env = dict(env or {})
    root = runs_root(runs_dir)
    stem = name or (Path(config_path).stem if config_path else "run")
    run_id = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    log = (run_dir / LOG_NAME).open("ab", buffering=0)  # the launcher owns the log, before anything can fail
    log.write(
        f"[launch {time.strftime('%Y-%m-%d %H:%M:%S')}] flashdraft launch {config_path or ''} {' '.join(overrides)}\n".encode()
    )
    cwd = Path.cwd()
    job_python = python or sys.executable
    train_args = ["-m", "flashdraft", "train", str(run_dir / "config.yaml")]
    if nproc_per_node > 1:  # one process per GPU; torchrun keeps per-rank logs in the run directory
        job_cmd = [
            job_python,
            "-X",
            "faulthandler",
            "-u",
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc_per_node}",
            f"--log-dir={run_dir / 'torchrun'}",
            "--redirects=3",
            "--tee=3",
            *train_args,
        ]
    else:
        job_cmd = [job_python, "-X", "faulthandler", "-u", *train_args]
    launch_record = {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "created": time.time(),
        "argv": sys.argv,
        "config": config_path,
        "overrides": overrides,
        "cwd": str(cwd),
        "python": job_python,
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "git_commit": _git_commit(cwd),
        "job_cmd": job_cmd,
        "stall_seconds": stall_seconds,
        "nproc_per_node": nproc_per_node,
        "env": {
            **{k: os.environ[k] for k in ENV_KEYS if k in os.environ},
            **{k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            **env,
        },
    }
    write_json(run_dir / "launch.json", launch_record)
    write_json(
        run_dir / "status.json", {"state": "starting", "launcher_pid": os.getpid(), "boot_id": boot_id()}
    )

    try:
        config = load_config(config_path, [*overrides, f"train.out_dir={run_dir}"])
    except FlashdraftError as exc:
        return _fail(run_dir, log, str(exc))
    (run_dir / "config.yaml").write_text(dump_yaml(config))
    launch_record["gpus"] = _gpus(config.train.device, env, nproc_per_node)
    write_json(run_dir / "launch.json", launch_record)

    if doctor:
        from flashdraft.run.doctor import run_checks

        failed = [c for c in run_checks(config, quick=True) if c.ok is False]
        for check in failed:
            log.write(f"doctor: ✗ {check.name}: {check.detail} — fix: {check.fix}\n".encode())
        if failed:
            return _fail(run_dir, log, failed[0].detail)
    busy = [other for other in list_runs(root) if other != run_dir]
    for other in busy:
        info = run_state(other)
        shared = set(info.get("gpus") or []) & set(launch_record["gpus"])
        if shared and is_live(info):
            return _fail(
                run_dir,
                log,
                f"GPU {', '.join(sorted(shared))} is held by live run {other.name} ({info['state']}); "
                f"stop it first (flashdraft stop {other.name})",
                kind="gpu_busy",
            )

    subprocess.Popen(
        [sys.executable, "-m", "flashdraft.run.supervisor", str(run_dir)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
        cwd=cwd,
    )
    if not wait:
        return run_state(run_dir)
    deadline = time.time() + wait_timeout
    while time.time() < deadline:
        info = run_state(run_dir)
        phases = {r["phase"] for r in info["ranks"].values()}
        if info["state"] in (*FINAL_STATES, "lost") or phases & set(UP_PHASES):
            return info
        time.sleep(0.3)
    info = run_state(run_dir)
    info["warning"] = (
        f"not up after {wait_timeout:.0f} s (state {info['state']}); follow it with flashdraft logs {run_id} -f"
    )
    return info
