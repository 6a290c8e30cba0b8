"""Process identity: a pid names a process only while that process lives; afterwards the kernel hands
it to another. Every pid flashdraft records goes with the process's start time (psutil's create_time),
and nothing is read as "ours" or signalled until both match (docs/run-files.md, "Process identity")."""

from __future__ import annotations

import contextlib
import os

import psutil

from flashdraft.run_protocol import RUN_ID_ENV

# create_time comes from the kernel's start tick: the same process reads back the same value. Two
# processes that share a pid cannot both have started within this window of each other.
_START_TOLERANCE_S = 0.05


def start_time(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), to record beside its pid."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_ours(
    pid: int | None,
    started: float | None,
    *,
    run_id: str | None = None,
    marker: str | None = None,
) -> bool:
    """Whether `pid` is still the process that was recorded, alive and not a zombie.

    With a recorded start time, that decides. Without one (a status written before the pid's start time
    was known), positive evidence is required: the run id in its environment, or `marker` in its
    command line. No evidence means not ours: a wrong "no" leaves a process alone, a wrong "yes" could
    signal a stranger."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if started is not None:
            return abs(proc.create_time() - float(started)) <= _START_TOLERANCE_S
        if run_id is not None and proc.environ().get(RUN_ID_ENV) == run_id:
            return True
        return marker is not None and marker in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def signal_group(pid: int, started: float | None, signum: int, *, run_id: str | None = None) -> bool:
    """Send `signum` to the process group that `pid` leads, only once `pid` is verified to be the recorded
    process and the leader of its group. Returns whether a signal was sent."""
    if not is_ours(pid, started, run_id=run_id):
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) != pid:  # started in its own session, so a pgid other than its pid is not ours
            return False
        os.killpg(pid, signum)
        return True
    return False


def signal_process(proc: psutil.Process, signum: int) -> None:
    """Signal a psutil handle: psutil itself refuses if the pid now names another process."""
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        proc.send_signal(signum)


def torchrun_workers(job_pid: int | None) -> list[psutil.Process]:
    """The rank processes under a torchrun job (they carry RANK in their environment); none for a job
    that is itself the one training process."""
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
