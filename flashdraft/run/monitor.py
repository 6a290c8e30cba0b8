"""Reading runs: find them, reconcile their state, show logs, stop them.

State comes from reconciling what the files say with what the machine shows (docs/run-files.md,
"States"): a non-final status whose supervisor and job are gone is read from the job's own final record,
else LOST; a live job whose heartbeat is older than the stall limit is STALLED. A pid counts only while
its start time matches the recorded one.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError
from flashdraft.run.diagnose import LOG_NAME, diagnose_exit, final_record, log_tail
from flashdraft.run.processes import is_ours, signal_group, signal_process, torchrun_workers
from flashdraft.run_protocol import (
    FINAL_STATES,
    boot_id,
    read_heartbeats,
    read_json,
    records_from_log,
    runs_root,
    write_record,
)
from flashdraft.run_protocol import resume_command as protocol_resume_command

# How far back in the log `status` looks for record lines (the tail is also capped at 256 kB).
LOG_RECORD_LINES = 2000

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


def current_status(run_dir: Path, tail: list[str] | None = None) -> dict[str, Any]:
    """status.json, or the newer status record that the supervisor could only print to the log when the
    file could not be written (a full disk). `updated` orders the two."""
    status = read_json(run_dir / "status.json") or {}
    records = records_from_log(log_tail(run_dir, LOG_RECORD_LINES) if tail is None else tail, "status.json")
    if records and records[-1].get("updated", 0) > status.get("updated", 0):
        status = {**status, **records[-1]}
    return status


def resume_command(run_dir: Path) -> str:
    """The one command that continues a run in its own directory (the phrase is run_protocol's, which the
    trainer's messages use too)."""
    return protocol_resume_command(run_dir, runs_root())


def _reconcile_without_supervisor(run_dir: Path, status: dict[str, Any], tail: list[str]) -> dict[str, Any]:
    """The outcome of a job whose supervisor is gone and which has ended too: from its final record
    (file or log line) or from the forced stop that `flashdraft stop --force` recorded before SIGKILL."""
    final = final_record(run_dir, tail)
    forced = status.get("forced_stop")
    if final is None and not forced:
        return {}
    outcome = (final or {}).get("outcome")
    exit_code = 0 if outcome in ("finished", "stopped") else None if final is None else 1
    sig = "SIGKILL" if final is None else None
    diagnosis = diagnose_exit(run_dir, exit_code, sig, forced_stop=forced)
    state = "killed" if sig else {"finished": "finished", "stopped": "stopped"}.get(outcome, "failed")
    return {
        "state": state,
        "signal": sig,
        "diagnosis": f"{diagnosis.line} (its supervisor was gone; read from the job's own records)",
        "evidence": diagnosis.evidence,
    }


def lead_heartbeat(heartbeats: dict[int, dict]) -> dict:
    """Rank 0's beat; on a node of a multi-node run without rank 0, its lowest rank's."""
    return heartbeats[min(heartbeats)] if heartbeats else {}


def run_state(run_dir: Path) -> dict[str, Any]:
    """Everything `status` shows about one run, reconciled with the live machine."""
    launch = read_json(run_dir / "launch.json") or {}
    tail = log_tail(run_dir, LOG_RECORD_LINES)
    status = current_status(run_dir, tail)
    heartbeats = read_heartbeats(run_dir)
    now = time.time()
    info = _recorded_info(run_dir, launch, status, heartbeats, now)
    hb0 = lead_heartbeat(heartbeats)
    state = status.get("state", "starting")
    diagnosis = status.get("diagnosis")
    info["evidence"] = status.get("evidence", [])
    info["restarts"] = status.get("restarts", [])  # launch --max-restarts: each with its cause and cost
    if state not in FINAL_STATES:
        state, diagnosis = _reconciled_state(run_dir, launch, status, tail, hb0, now, info, diagnosis)
    info["state"] = state
    info["diagnosis"] = diagnosis
    if state in FINAL_STATES and status.get("diagnosis_kind"):
        info["diagnosis_kind"] = status["diagnosis_kind"]
    live = state not in (*FINAL_STATES, "lost")
    if live and hb0.get("step") and hb0.get("total_steps") and hb0.get("step_seconds"):
        info["eta_s"] = round((hb0["total_steps"] - hb0["step"]) * hb0["step_seconds"])  # none once it ended
    if not live and not info["job_alive"] and state != "finished" and (run_dir / "config.yaml").is_file():
        info["resume"] = resume_command(run_dir)
    info["last_log_line"] = next((line for line in reversed(tail[-20:]) if line.strip()), "")
    return info


def _recorded_info(
    run_dir: Path, launch: dict[str, Any], status: dict[str, Any], heartbeats: dict[int, dict], now: float
) -> dict[str, Any]:
    """What the run's files say: launch and status fields, each rank's phase, step and heartbeat age, and
    rank 0's latest numbers."""
    info: dict[str, Any] = {
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "created": launch.get("created"),
        "gpus": launch.get("gpus", []),
        "exit_code": status.get("exit_code"),
        "signal": status.get("signal"),
        "supervisor_pid": status.get("supervisor_pid"),
        "job_pid": status.get("job_pid"),
        "job_alive": False,
        "ranks": {
            r: {
                "phase": hb.get("phase"),
                "step": hb.get("step"),
                "heartbeat_age_s": round(now - hb.get("time", now), 1),
            }
            for r, hb in heartbeats.items()
        },
    }
    hb0 = lead_heartbeat(heartbeats)
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
    return info


def _reconciled_state(
    run_dir: Path,
    launch: dict[str, Any],
    status: dict[str, Any],
    tail: list[str],
    hb0: dict[str, Any],
    now: float,
    info: dict[str, Any],
    diagnosis: str | None,
) -> tuple[str, str | None]:
    """A run not final by its status: its state and diagnosis from which of its processes still live
    (each pid checked against its recorded start time) and its heartbeat's age; records `job_alive` in
    `info` (and the signal and evidence when the outcome is read from the job's own records)."""
    same_boot = status.get("boot_id") in (None, boot_id())
    # Every pid is checked against its recorded start time: a reused pid is not the run's process.
    supervisor_alive = same_boot and is_ours(
        status.get("supervisor_pid"), status.get("supervisor_started"), marker=str(run_dir)
    )
    job_alive = same_boot and is_ours(
        status.get("job_pid"), status.get("job_started"), run_id=launch.get("run_id")
    )
    launcher_alive = same_boot and is_ours(status.get("launcher_pid"), status.get("launcher_started"))
    info["job_alive"] = job_alive
    age = now - hb0["time"] if hb0 else None
    stall = float(launch.get("stall_seconds", 600))
    reconciled = {}
    if not (supervisor_alive or launcher_alive or job_alive):
        reconciled = _reconcile_without_supervisor(run_dir, status, tail)
    if reconciled:
        state, diagnosis, info["signal"] = (
            reconciled["state"],
            reconciled["diagnosis"],
            reconciled["signal"],
        )
        info["evidence"] = reconciled["evidence"]
    elif not supervisor_alive and not launcher_alive and not status.get("supervisor_pid") and not job_alive:
        # The launcher ended (a hang-up, Ctrl-C) during its preflight, before it started a supervisor:
        # nothing ran, nothing is lost but the start.
        state = "lost"
        again = (
            resume_command(run_dir)
            if (run_dir / "config.yaml").is_file()
            else f"flashdraft launch {launch.get('config') or 'CONFIG'}"
        )
        diagnosis = (
            f"the launch was interrupted before the job started (its launcher, pid {status.get('launcher_pid')}, "
            f"ended during the preflight checks); nothing ran: start it again with {again}"
        )
    elif not supervisor_alive and not launcher_alive:
        state = "lost"
        why = "the host rebooted" if not same_boot else "its supervisor is gone"
        diagnosis = f"lost: {why} without a final status" + (
            f"; job pid {status.get('job_pid')} still runs (flashdraft stop {run_dir.name} ends it)"
            if job_alive
            else ""
        )
    elif job_alive and age is not None and age > stall:
        state = "stalled"
        diagnosis = (
            f"hung: no heartbeat for {age:.0f} s (limit {stall:.0f} s) while job pid {status['job_pid']} lives, "
            f"last phase {hb0.get('phase')} at step {hb0.get('step')}; "
            + (
                "every training process's Python stacks at the stall are in the log (flashdraft logs); "
                if status.get("stacks_dumped")
                else ""
            )
            + f"native frames too: py-spy dump --native --pid {status['job_pid']}"
        )
    elif hb0:
        state = PHASE_TO_STATE.get(hb0.get("phase"), "starting")
    else:
        state = "starting"
    return state, diagnosis


def is_live(info: dict[str, Any]) -> bool:
    """Whether the run still has (or is about to have) a process: a lost run whose job runs on is live."""
    return info["state"] not in (*FINAL_STATES, "lost") or bool(info.get("job_alive"))


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


def _append_log(run_dir: Path, message: str) -> None:
    """A line of `stop`'s in the run log, beside the job's own (best effort: the log may be on a full disk)."""
    with contextlib.suppress(OSError), (run_dir / LOG_NAME).open("a") as handle:
        handle.write(f"[stop {time.strftime('%H:%M:%S')}] {message}\n")


def _signal_job(run_dir: Path, status: dict[str, Any], signum: int) -> bool:
    """Signal the run's job, only after checking that its pid is still the job that was started."""
    run_id = (read_json(run_dir / "launch.json") or {}).get("run_id")
    job_pid, started = status.get("job_pid"), status.get("job_started")
    if not is_ours(job_pid, started, run_id=run_id):
        return False
    workers = torchrun_workers(job_pid)
    if workers and signum == signal.SIGTERM:  # signal the ranks, not torchrun: it would count its own
        for worker in workers:  # SIGTERM as a failure
            signal_process(worker, signum)
        sent = True
    else:
        sent = signal_group(job_pid, started, signum, run_id=run_id)
        if signum == signal.SIGKILL:  # torchrun's workers run in sessions of their own: not in its group
            for worker in workers:
                signal_process(worker, signum)
    if sent:
        _append_log(run_dir, f"{signal.Signals(signum).name} to job pid {job_pid} (flashdraft stop)")
    return sent


def _wait_until_ended(run_dir: Path, timeout: float) -> dict[str, Any]:
    deadline = time.time() + timeout
    info = run_state(run_dir)
    while is_live(info) and time.time() < deadline:
        time.sleep(0.5)
        info = run_state(run_dir)
    return info


def waiting_for(heartbeat: dict[str, Any]) -> str:
    """What a SIGTERMed job still does before it exits, from rank 0's heartbeat (the trainer stops after
    the step in progress, writes a checkpoint and waits for the write)."""
    phase, step = heartbeat.get("phase"), heartbeat.get("step")
    after = "and the checkpoint to be written"
    if phase == "evaluating":
        return f"the evaluation pass after step {step} to finish, then step {(step or 0) + 1} {after}"
    if phase == "checkpointing":
        return f"the checkpoint of step {step} to be written, then step {(step or 0) + 1} and its checkpoint"
    if phase in ("training", "compiling") and step is not None:
        return f"step {step + 1} to finish {after}"
    if phase == "finished":
        return "the job to exit (training is done)"
    return f"the job to finish starting (phase {phase or 'starting'}), then its first step {after}"


def stop_run(
    run_dir: Path,
    *,
    force: bool = False,
    timeout: float = 300.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Graceful: SIGTERM lets the trainer finish its step and checkpoint. With `force`, SIGKILL the job's
    process group if it has not ended within `timeout`, after recording in status.json that stop did so.
    A job whose supervisor is gone is stopped the same way. No signal goes to a pid that is not verified
    to be the run's job (docs/run-files.md, "Process identity"). `say` gets what stop waits for and, on
    its timeout, that it gave up and how to end the job anyway."""
    info = run_state(run_dir)
    if not is_live(info):
        return info
    status = current_status(run_dir)
    if not status.get("job_pid"):
        raise FlashdraftError(f"run {run_dir.name}: no job process recorded yet (state {info['state']})")
    _signal_job(run_dir, status, signal.SIGTERM)
    say(
        f"run {run_dir.name}: asked to stop (SIGTERM); waiting up to {timeout:.0f} s for "
        f"{waiting_for(read_json(run_dir / 'rank0' / 'heartbeat.json') or {})}"
    )
    info = _wait_until_ended(run_dir, timeout)
    if is_live(info) and not force:
        heartbeat = read_json(run_dir / "rank0" / "heartbeat.json") or {}
        say(
            f"run {run_dir.name}: not stopped within --timeout {timeout:.0f} s (now phase "
            f"{heartbeat.get('phase')}, step {heartbeat.get('step')}); it still stops on its own once it "
            f"finishes the step; wait longer with flashdraft stop {run_dir.name} --timeout SECONDS, or end it "
            f"now with flashdraft stop {run_dir.name} --force (SIGKILL; the newest complete checkpoint stays)"
        )
    if force and is_live(info):
        say(f"run {run_dir.name}: not stopped within {timeout:.0f} s: --force, SIGKILL")
        heartbeat = read_json(run_dir / "rank0" / "heartbeat.json") or {}
        forced = {
            "time": time.time(),
            "after_s": timeout,
            "phase": heartbeat.get("phase"),
            "step": heartbeat.get("step"),
        }
        # Recorded before the signal, so whoever diagnoses the SIGKILL (supervisor or status) knows its cause.
        status = {**current_status(run_dir), "forced_stop": forced, "updated": time.time()}
        write_record(run_dir / "status.json", status)
        _signal_job(run_dir, status, signal.SIGKILL)
        info = _wait_until_ended(run_dir, 30.0)
    return info
