"""The per-run supervisor: `python flashdraft/run/entry.py flashdraft.run.supervisor RUN_DIR`.

Started by `launch` in a new session with stdin closed, stdout/stderr on the run log and the run
directory as its working directory, so it outlives the shell, ssh or container exec that launched it,
ignores their hangup, and imports nothing from the user's directory. It starts the job, records its pid
and start time, waits (asking a stalled job for its Python stacks: docs/run-files.md, "Stalls"), and
writes the exit code or signal and a diagnosis to status.json.

It must not die of its own faults (docs/run-files.md, "Full disk"): every status write goes through
`write_record` (retry, then one record line in the log, which `status` reads back), the final one after
releasing a small reserve file kept for that moment, and anything unexpected is logged with its
traceback and recorded as the supervisor's failure instead of ending it silently.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

from flashdraft.durable import atomic_write_bytes
from flashdraft.run.diagnose import LOG_NAME, classify_message, diagnose_exit, signal_name
from flashdraft.run.processes import signal_process, start_time, torchrun_workers
from flashdraft.run.restarts import RestartWatch, restart_line
from flashdraft.run_protocol import (
    RUN_DIR_ENV,
    RUN_ID_ENV,
    boot_id,
    read_heartbeats,
    read_json,
    write_record,
)

# Kept on disk while the job runs and removed just before the final status is written: on a disk the
# job filled, the final record then still has room (a status.json is a few KiB).
RESERVE_NAME = ".supervisor-reserve"
RESERVE_BYTES = 64 * 2**10


def _log(handle, message: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # a full disk must not end the supervisor
        handle.write(f"[supervisor {time.strftime('%H:%M:%S')}] {message}\n".encode())
        handle.flush()


def _record(run_dir: Path, status: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """Merge `changes` into the current status.json (others, e.g. `stop --force`, also write it) and
    write it, tolerating a full disk. `updated` orders the file against record lines in the log."""
    status = {**status, **(read_json(run_dir / "status.json") or {}), **changes, "updated": time.time()}
    write_record(run_dir / "status.json", status)
    return status


def supervise(run_dir: Path) -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a hangup of whoever launched us is not our concern
    log = (run_dir / LOG_NAME).open("ab", buffering=0)
    try:
        return _supervise(run_dir, log)
    except BaseException as exc:
        text = traceback.format_exc()
        _log(log, f"supervisor failed: {type(exc).__name__}: {exc}\n{text}")
        (run_dir / RESERVE_NAME).unlink(missing_ok=True)
        changes: dict[str, Any] = {"supervisor_error": f"{type(exc).__name__}: {exc}"}
        if not (read_json(run_dir / "status.json") or {}).get("job_pid"):
            changes.update(
                state="failed",
                ended=time.time(),
                diagnosis=f"the supervisor failed before starting the job: {type(exc).__name__}: {exc}",
                diagnosis_kind="supervisor_error",
                evidence=text.strip().splitlines()[-3:],
            )
        # else the job runs on without us: `status` says so, and `stop` can still end it
        _record(run_dir, {}, **changes)
        return 1


def _wait_watching(job: subprocess.Popen, run_dir: Path, stall_seconds: float, log) -> int:
    """`job.wait()`, watching the heartbeats meanwhile: once no rank has beaten for `stall_seconds`, every
    training process that has beaten is asked for its Python stacks (SIGUSR1: the job's faulthandler
    writes all its threads' stacks to its log, and the process carries on), once per stall, so that a
    hang leaves in the log where each rank waits (docs/run-files.md, "Stalls"). Only processes whose pid
    a heartbeat carries: they registered the handler before their first beat, and SIGUSR1 would end any
    other (torchrun's agent, a rank still importing)."""
    poll = max(1.0, min(5.0, stall_seconds / 2))
    dumped_for = None  # the heartbeat time of the stall already dumped
    while True:
        try:
            return job.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            pass
        beats = read_heartbeats(run_dir).values()  # each carries its time and its process's pid
        newest = max((b["time"] for b in beats if isinstance(b.get("time"), int | float)), default=None)
        if newest is None or newest == dumped_for or time.time() - newest <= stall_seconds:
            continue
        dumped_for = newest
        beaten = {b.get("pid") for b in beats}
        try:
            candidates = torchrun_workers(job.pid) or [psutil.Process(job.pid)]
        except psutil.NoSuchProcess:  # it ended meanwhile: the next wait returns its exit
            continue
        ranks = [process for process in candidates if process.pid in beaten]
        asked = (
            f"asked {len(ranks)} training process(es) for their Python stacks (SIGUSR1); they follow in this log"
            if ranks
            else "no live process carries a heartbeat's pid: no stacks asked for"
        )
        # logged before the signals: the stacks the processes write follow this line
        _log(
            log,
            f"no heartbeat for {time.time() - newest:.0f} s (--stall-seconds {stall_seconds:.0f}): {asked}",
        )
        for process in ranks:
            signal_process(process, signal.SIGUSR1)
        if ranks:
            _record(run_dir, {}, stacks_dumped=time.time())  # `status` says where the stacks are


def _wait_restarting(
    job: subprocess.Popen, run_dir: Path, watch: RestartWatch, log
) -> tuple[int, str | None]:
    """`job.wait()` for a torchrun job that restarts its worker group (`launch --max-restarts N`): each
    restart is recorded as it happens, a hang is turned into one, and a failure that repeats at the same
    step with the same cause ends the job. Returns its exit code and, when the watch gave up, why."""
    while True:
        try:
            return job.wait(timeout=1.0), None
        except subprocess.TimeoutExpired:
            pass
        before = len(watch.restarts)
        give_up = watch.check_restart()
        if len(watch.restarts) != before:
            _record(run_dir, {}, restarts=watch.restarts)
        if give_up:
            _log(log, f"giving up: {give_up}")
            workers = torchrun_workers(job.pid)
            # torchrun first, so that it cannot start yet another attempt when its workers die
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)  # our own child, not yet reaped: its pid is still its own
            for worker in workers:
                signal_process(worker, signal.SIGKILL)
            return job.wait(), give_up
        try:
            workers = torchrun_workers(job.pid)
        except psutil.Error:
            continue
        if workers and watch.check_stall(workers):
            _record(run_dir, {}, stacks_dumped=time.time())


def _supervise(run_dir: Path, log) -> int:
    """Start the job, pass signals on to it, watch it until it exits, record how it ended."""
    launch = read_json(run_dir / "launch.json")
    if launch is None:
        raise RuntimeError(f"cannot read {run_dir / 'launch.json'}")
    status = _record(
        run_dir,
        {},
        state="starting",
        supervisor_pid=os.getpid(),
        supervisor_started=start_time(os.getpid()),
        boot_id=boot_id(),
        started=time.time(),
    )
    with contextlib.suppress(OSError):
        atomic_write_bytes(run_dir / RESERVE_NAME, bytes(RESERVE_BYTES))
    job = _start_job(run_dir, launch, status, log)
    if job is None:
        return 1
    _forward_signals(job, log)
    status = _record(
        run_dir, status, state="running", job_pid=job.pid, job_pgid=job.pid, job_started=start_time(job.pid)
    )
    stall_seconds = float(launch.get("stall_seconds", 600))
    max_restarts = int(launch.get("max_restarts") or 0)
    give_up = watch = None
    if max_restarts > 0:
        nodes = launch.get("nodes") or {}
        node = f"node {nodes.get('node_rank') or 0} ({socket.gethostname()})"
        watch = RestartWatch(run_dir, max_restarts, stall_seconds, lambda line: _log(log, line), node)
        returncode, give_up = _wait_restarting(job, run_dir, watch, log)
    else:
        returncode = _wait_watching(job, run_dir, stall_seconds, log)
    _record_exit(run_dir, status, returncode, give_up, watch, max_restarts, log)
    return 0


def _start_job(run_dir: Path, launch: dict, status: dict, log) -> subprocess.Popen | None:
    """The job (launch.json's `job_cmd`) in its own session, its output in the run's log; None, with the
    run recorded as failed, when its interpreter or program cannot be started."""
    env = {
        **os.environ,
        **launch.get("env", {}),
        RUN_DIR_ENV: str(run_dir),
        RUN_ID_ENV: launch["run_id"],
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    }
    cmd = launch["job_cmd"]
    _log(log, f"starting job: {' '.join(cmd)}")
    try:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=launch.get("cwd"),
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        message = f"cannot start the job: interpreter or program not found: {cmd[0]} ({exc.strerror})"
        _log(log, message)
        diagnosis = classify_message(message)
        (run_dir / RESERVE_NAME).unlink(missing_ok=True)
        _record(
            run_dir,
            status,
            state="failed",
            ended=time.time(),
            exit_code=None,
            signal=None,
            diagnosis=diagnosis.line,
            diagnosis_kind="missing_interpreter",
            evidence=[message],
        )
        return None


def _forward_signals(job: subprocess.Popen, log) -> None:
    """SIGTERM and SIGINT sent to the supervisor go on to the job's process group."""

    def forward(signum, _frame):  # `stop` signals the job directly; a signal to us is passed on
        _log(log, f"received {signal.Signals(signum).name}; forwarding to the job")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signum)  # our own child, not yet reaped: its pid cannot have been reused

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)


def _record_exit(
    run_dir: Path,
    status: dict,
    returncode: int,
    give_up: str | None,
    watch: RestartWatch | None,
    max_restarts: int,
    log,
) -> None:
    """The job's end, diagnosed (a forced stop, the restarts it took, a repeated failure), logged and
    recorded as the run's final state."""
    sig = signal_name(returncode)
    (run_dir / RESERVE_NAME).unlink(missing_ok=True)  # room for what follows, on a disk the job filled
    forced = (read_json(run_dir / "status.json") or status).get("forced_stop")
    diagnosis = diagnose_exit(run_dir, returncode if returncode >= 0 else None, sig, forced_stop=forced)
    lost_node = watch.rendezvous_timed_out() if watch is not None and returncode != 0 else None
    if give_up:
        diagnosis.kind, diagnosis.line = "repeated_failure", give_up
        diagnosis.evidence = [restart_line(r) for r in watch.restarts[-2:]]
    elif lost_node:  # a multi-node run whose lost node was waited for, up to --join-timeout
        diagnosis.kind, diagnosis.line = "node_lost", lost_node
        diagnosis.evidence = [restart_line(r) for r in watch.restarts[-2:]]
    elif watch is not None and watch.restarts and returncode != 0:
        diagnosis.line += (
            f" (after {len(watch.restarts)} restart(s) of {max_restarts}: flashdraft status lists them)"
        )
    if returncode == 0:
        state = "stopped" if diagnosis.kind == "stopped" else "finished"
    else:
        state = "killed" if sig and not give_up else "failed"
    _log(
        log, f"job exited: {'signal ' + sig if sig else 'code ' + str(returncode)}; {state}: {diagnosis.line}"
    )
    _record(
        run_dir,
        status,
        state=state,
        ended=time.time(),
        exit_code=returncode if returncode >= 0 else None,
        signal=sig,
        diagnosis=diagnosis.line,
        diagnosis_kind=diagnosis.kind,
        evidence=diagnosis.evidence,
    )


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1]).resolve()))
