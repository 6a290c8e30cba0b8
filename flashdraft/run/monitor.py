"""Reading runs: find them, reconcile their state, show logs, stop them.

State comes from reconciling what the files say with what the machine shows (SkyPilot-style,
../shared/reference/supervision.md §3.3 item 5): a non-final status whose supervisor is gone is LOST;
a live job whose heartbeat is older than the stall limit is STALLED.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from flashdraft.errors import FlashdraftError
from flashdraft.run.diagnose import LOG_NAME, log_tail
from flashdraft.run_protocol import FINAL_STATES, RUN_ID_ENV, boot_id, read_json

PHASE_TO_STATE = {
    "starting": "starting",
    "loading": "starting",
    "compiling": "compiling",
    "training": "training",
    "checkpointing": "training",
    "evaluating": "evaluating",
    "stopping": "training",
    "finished": "training",
}


def runs_root(runs_dir: str | None = None) -> Path:
    return Path(runs_dir or os.environ.get("FLASHDRAFT_RUNS_DIR", "runs")).resolve()


def list_runs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if (p / "launch.json").is_file()]
    return sorted(runs, key=lambda p: (read_json(p / "launch.json") or {}).get("created", 0))


def find_run(name: str, runs_dir: str | None = None) -> Path:
    path = Path(name)
    if (path / "launch.json").is_file():
        return path.resolve()
    root = runs_root(runs_dir)
    exact = root / name
    if (exact / "launch.json").is_file():
        return exact
    matches = [p for p in list_runs(root) if p.name.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise FlashdraftError(f"no run '{name}' in {root} (flashdraft status lists the runs)")
    raise FlashdraftError(f"'{name}' matches several runs: {', '.join(p.name for p in matches)}")


def _alive(pid: int | None, *, run_id: str | None = None, cmd_marker: str | None = None) -> bool:
    """Alive and really ours: guards against pid reuse by the run id in the environment or the command line."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if cmd_marker is not None and cmd_marker not in " ".join(proc.cmdline()):
            return False
        if run_id is not None:
            try:
                return proc.environ().get(RUN_ID_ENV) == run_id
            except (psutil.AccessDenied, psutil.ZombieProcess):
                return True
        return True
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def gpu_usage() -> list[dict[str, Any]]:
    """Utilisation and memory per GPU through NVML (nvidia-ml-py), when present."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    gpus = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            gpus.append(
                {
                    "index": i,
                    "util_percent": util.gpu,
                    "memory_used_GiB": round(mem.used / 2**30, 1),
                    "memory_total_GiB": round(mem.total / 2**30, 1),
                }
            )
    finally:
        pynvml.nvmlShutdown()
    return gpus


def run_state(run_dir: Path) -> dict[str, Any]:
    """Everything `status` shows about one run, reconciled with the live machine."""
    launch = read_json(run_dir / "launch.json") or {}
    status = read_json(run_dir / "status.json") or {}
    heartbeats = {
        int(p.parent.name.removeprefix("rank")): read_json(p)
        for p in sorted(run_dir.glob("rank*/heartbeat.json"))
    }
    heartbeats = {k: v for k, v in heartbeats.items() if v}
    now = time.time()
    info: dict[str, Any] = {
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "created": launch.get("created"),
        "gpus": launch.get("gpus", []),
        "exit_code": status.get("exit_code"),
        "signal": status.get("signal"),
        "supervisor_pid": status.get("supervisor_pid"),
        "job_pid": status.get("job_pid"),
        "ranks": {
            r: {
                "phase": hb.get("phase"),
                "step": hb.get("step"),
                "heartbeat_age_s": round(now - hb.get("time", now), 1),
            }
            for r, hb in heartbeats.items()
        },
    }
    hb0 = heartbeats.get(0, {})
    for key in (
        "step",
        "total_steps",
        "epoch",
        "loss",
        "tau",
        "eval_tau",
        "tflops",
        "max_memory_GiB",
        "checkpoint",
    ):
        if hb0.get(key) is not None:
            info[key] = hb0[key]
    if hb0.get("step") and hb0.get("total_steps") and hb0.get("step_seconds"):
        info["eta_s"] = round((hb0["total_steps"] - hb0["step"]) * hb0["step_seconds"])
    state = status.get("state", "starting")
    diagnosis = status.get("diagnosis")
    if state not in FINAL_STATES:
        same_boot = status.get("boot_id") in (None, boot_id())
        supervisor_alive = same_boot and _alive(status.get("supervisor_pid"), cmd_marker=str(run_dir))
        job_alive = same_boot and _alive(status.get("job_pid"), run_id=launch.get("run_id"))
        launcher_alive = _alive(status.get("launcher_pid"))
        age = now - hb0["time"] if hb0 else None
        stall = float(launch.get("stall_seconds", 600))
        if not supervisor_alive and not launcher_alive:
            state = "lost"
            why = "the host rebooted" if not same_boot else "its supervisor is gone"
            diagnosis = f"lost: {why} without a final status" + (
                f"; job pid {status.get('job_pid')} still runs" if job_alive else ""
            )
        elif job_alive and age is not None and age > stall:
            state = "stalled"
            diagnosis = (
                f"hung: no heartbeat for {age:.0f} s (limit {stall:.0f} s) while job pid {status['job_pid']} lives, "
                f"last phase {hb0.get('phase')} at step {hb0.get('step')}; inspect with py-spy dump --pid {status['job_pid']}"
            )
        elif hb0:
            state = PHASE_TO_STATE.get(hb0.get("phase"), "starting")
        else:
            state = "starting"
    info["state"] = state
    info["diagnosis"] = diagnosis
    info["evidence"] = status.get("evidence", [])
    info["last_log_line"] = next((line for line in reversed(log_tail(run_dir, 20)) if line.strip()), "")
    return info


def is_live(info: dict[str, Any]) -> bool:
    return info["state"] not in (*FINAL_STATES, "lost")


def rank_logs(run_dir: Path, rank: int) -> list[Path]:
    """torchrun's per-rank logs (stdout, stderr) of the latest attempt: <run>/torchrun/<id>/attempt_<n>/<rank>/."""
    found = sorted(run_dir.glob(f"torchrun/*/attempt_*/{rank}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FlashdraftError(
            f"run {run_dir.name}: no log for rank {rank} (per-rank logs exist for --nproc-per-node runs; "
            f"the combined log is {LOG_NAME})"
        )
    return [found[-1] / "stdout.log", found[-1] / "stderr.log"]


def follow_log(run_dir: Path, rank: int | None, lines: int, follow: bool) -> None:
    paths = [run_dir / LOG_NAME] if rank is None else rank_logs(run_dir, rank)
    handles = []
    for path in paths:
        if not path.exists():
            continue
        if len(paths) > 1:
            print(f"==> {path} <==")
        for line in path.read_text(errors="replace").splitlines()[-lines:]:
            print(line)
        handle = path.open("r", errors="replace")
        handle.seek(0, 2)
        handles.append(handle)
    while follow:
        idle = True
        for handle in handles:
            line = handle.readline()
            if line:
                print(line, end="", flush=True)
                idle = False
        if idle:
            if not is_live(run_state(run_dir)):
                for handle in handles:
                    print(handle.read(), end="")
                return
            time.sleep(0.5)


def _torchrun_workers(job_pid: int | None) -> list[psutil.Process]:
    """The rank processes under a torchrun job (they carry RANK in their environment)."""
    try:
        children = psutil.Process(job_pid).children(recursive=True) if job_pid else []
    except psutil.NoSuchProcess:
        return []
    workers = []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if "RANK" in child.environ():
                workers.append(child)
    return workers


def stop_run(run_dir: Path, *, force: bool = False, timeout: float = 300.0) -> dict[str, Any]:
    """Graceful: SIGTERM lets the trainer finish its step and checkpoint. With `force`, SIGKILL the job's
    process group if it has not ended within `timeout`."""
    info = run_state(run_dir)
    if not is_live(info):
        return info
    status = read_json(run_dir / "status.json") or {}
    pgid = status.get("job_pgid")
    if not pgid:
        raise FlashdraftError(f"run {run_dir.name}: no job process recorded yet (state {info['state']})")
    workers = _torchrun_workers(status.get("job_pid"))
    if workers:  # signal the ranks, not torchrun: it would treat its own SIGTERM as a failure
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.send_signal(signal.SIGTERM)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = run_state(run_dir)
        if not is_live(info):
            return info
        time.sleep(0.5)
    if force:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        for _ in range(60):
            info = run_state(run_dir)
            if not is_live(info):
                break
            time.sleep(0.5)
    return run_state(run_dir)
