"""The per-run supervisor: `python -m flashdraft.run.supervisor RUN_DIR`.

Started by `launch` in a new session with stdin closed and stdout/stderr on the run log, so it outlives
the shell, ssh or container exec that launched it and ignores their hangup. It starts the job, records
its pid, waits, and writes the exit code or signal and a diagnosis to status.json atomically
(../shared/reference/supervision.md §3.3).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flashdraft.run.diagnose import LOG_NAME, classify_message, diagnose_exit, signal_name
from flashdraft.run_protocol import RUN_DIR_ENV, RUN_ID_ENV, boot_id, read_json, write_json


def _log(handle, message: str) -> None:
    handle.write(f"[supervisor {time.strftime('%H:%M:%S')}] {message}\n".encode())
    handle.flush()


def supervise(run_dir: Path) -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a hangup of whoever launched us is not our concern
    launch = read_json(run_dir / "launch.json")
    status = read_json(run_dir / "status.json") or {}
    log = (run_dir / LOG_NAME).open("ab", buffering=0)
    status.update(
        {"state": "starting", "supervisor_pid": os.getpid(), "boot_id": boot_id(), "started": time.time()}
    )
    write_json(run_dir / "status.json", status)

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
        job = subprocess.Popen(
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
        status.update(
            {
                "state": "failed",
                "ended": time.time(),
                "exit_code": None,
                "signal": None,
                "diagnosis": diagnosis.line,
                "diagnosis_kind": "missing_interpreter",
                "evidence": [message],
            }
        )
        write_json(run_dir / "status.json", status)
        return 1

    def forward(signum, _frame):  # `stop` signals the job directly; a signal to us is passed on
        _log(log, f"received {signal.Signals(signum).name}; forwarding to the job")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status.update({"state": "running", "job_pid": job.pid, "job_pgid": job.pid})
    write_json(run_dir / "status.json", status)
    returncode = job.wait()
    sig = signal_name(returncode)
    diagnosis = diagnose_exit(run_dir, returncode if returncode >= 0 else None, sig)
    if returncode == 0:
        state = "stopped" if diagnosis.kind == "stopped" else "finished"
    else:
        state = "killed" if sig else "failed"
    _log(
        log, f"job exited: {'signal ' + sig if sig else 'code ' + str(returncode)}; {state}: {diagnosis.line}"
    )
    status = read_json(run_dir / "status.json") or status
    status.update(
        {
            "state": state,
            "ended": time.time(),
            "exit_code": returncode if returncode >= 0 else None,
            "signal": sig,
            "diagnosis": diagnosis.line,
            "diagnosis_kind": diagnosis.kind,
            "evidence": diagnosis.evidence,
        }
    )
    write_json(run_dir / "status.json", status)
    return 0


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1]).resolve()))
