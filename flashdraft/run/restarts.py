"""Restarts of a self-healing run, as the supervisor sees them (docs/run-files.md, "Restarts").

torchrun's elastic agent restarts the worker group when a rank dies (`launch --max-restarts N`); the
restarted trainer resumes from the newest complete checkpoint by itself (train/job.py). This module is the
supervisor's side: it notices each restart (torchrun opens a new `attempt_<n>` log directory), says why the
attempt before failed (its own hang kill, else the rank torchrun saw fail first, else the earliest error
record), records when, which rank and node, the step it failed at, the step it resumes from and the steps
lost, in status.json and the log, and gives up on a failure that repeats at the same step with the same
cause. A hang (no heartbeat for --stall-seconds) is made a restart: the ranks are asked for their stacks,
then killed, so that torchrun restarts them.

Like the rest of `run/`, nothing here imports the trainer.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from flashdraft.run.diagnose import LOG_NAME, _from_error_file, signal_name
from flashdraft.run_protocol import read_heartbeats, read_json

# torchrun's line for the first worker of an attempt that failed (torch.distributed.elastic.multiprocessing)
FAILED_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
STEP_DIR = re.compile(r"^step-(\d{8})$")
# A rank's error when a peer's process or node is gone (gloo; NCCL), the peer's address in group 1 if given.
PEER_LOST = re.compile(
    r"Connection closed by peer (\S+)|Connection reset by peer|remote process exited|NCCL communicator was aborted"
)
# torchrun's agent, when the nodes did not all join its rendezvous within join_timeout.
RENDEZVOUS_TIMEOUT = "RendezvousTimeoutError"
# After asking hung ranks for their stacks, the seconds they get to write them before they are killed.
STACK_DUMP_GRACE_S = 5.0


@dataclass
class Failure:
    """Why one attempt of the job ended."""

    kind: str  # rank_killed, exception, rank_failed, hang, peer_lost
    rank: int | None
    cause: str  # one line for people
    step: int | None  # the furthest step the attempt reached
    same_as: str  # two failures with this key at the same step are the same failure

    def repeats(self, other: Failure | None) -> bool:
        # a peer lost on another node says nothing of this node's data or code: that node judges it
        if self.kind == "peer_lost":
            return False
        return other is not None and self.same_as == other.same_as and self.step == other.step


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest checkpoint directory (renamed into place only once complete)."""
    root = run_dir / "checkpoints"
    steps = [int(m.group(1)) for p in root.glob("step-*") if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return max(steps, default=None)


def attempt_dirs(run_dir: Path) -> dict[Path, int]:
    """torchrun's per-attempt log directories, <run>/torchrun/<id>/attempt_<n>, with their n."""
    found = {}
    for path in run_dir.glob("torchrun/*/attempt_*"):
        number = path.name.removeprefix("attempt_")
        if number.isdigit():
            found[path] = int(number)
    return found


def _beat_attempt(beat: dict[str, Any]) -> int:
    return int(beat.get("attempt") or 0)


class RestartWatch:
    """Follows one job (one torchrun) of a run: its attempts, the stall of the current one, its restarts."""

    def __init__(
        self,
        run_dir: Path,
        max_restarts: int,
        stall_seconds: float,
        say: Callable[[str], None],
        node: str,
    ):
        self.run_dir, self.max_restarts, self.stall_seconds, self.say = (
            run_dir,
            max_restarts,
            stall_seconds,
            say,
        )
        self.node = node
        self.earlier = set(attempt_dirs(run_dir))  # an earlier job's (a resumed run's first launch)
        self.attempt = 0
        self.attempt_started = time.time()
        self.furthest: int | None = None  # the furthest step the current attempt reached
        self.hang: Failure | None = None  # set when the watch itself killed the current attempt
        self.dumped_for: float | None = None
        self.restarts: list[dict[str, Any]] = []
        self.last_failure: Failure | None = None
        with contextlib.suppress(OSError):
            self.log_offset = (run_dir / LOG_NAME).stat().st_size

    # ------------------------------------------------------------------ reading the attempt
    def current_beats(self) -> dict[int, dict[str, Any]]:
        return {r: b for r, b in read_heartbeats(self.run_dir).items() if _beat_attempt(b) == self.attempt}

    def observe(self) -> dict[int, dict[str, Any]]:
        beats = self.current_beats()
        steps = [b["step"] for b in beats.values() if isinstance(b.get("step"), int)]
        if steps:
            self.furthest = max([*steps, self.furthest or 0])
        return beats

    def _log_since_attempt(self) -> list[str]:
        try:
            with (self.run_dir / LOG_NAME).open("rb") as handle:
                handle.seek(getattr(self, "log_offset", 0))
                return handle.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return []

    def _error_records(self) -> list[tuple[float, int, dict[str, Any]]]:
        found = []
        for path in self.run_dir.glob("rank*/error.json"):
            data = read_json(path)
            if data and float(data.get("time") or 0) >= self.attempt_started:
                found.append((float(data["time"]), int(path.parent.name.removeprefix("rank") or 0), data))
        return sorted(found, key=lambda item: item[0])

    def failure_of_attempt(self) -> Failure:
        """Why the current attempt ended: the watch's own hang kill; else a rank killed by a signal, as
        torchrun saw it first (a killed rank writes nothing, and the survivors' error records blame their
        lost peer); else the earliest error record; else the exit code torchrun reports."""
        self.observe()
        if self.hang is not None:
            return self.hang
        errors = self._error_records()
        error_step = next((d.get("step") for _, _, d in errors if isinstance(d.get("step"), int)), None)
        step = max((s for s in (self.furthest, error_step) if s is not None), default=None)
        first = next((m for line in self._log_since_attempt() if (m := FAILED_LINE.search(line))), None)
        if first is not None and int(first.group(1)) < 0:
            name = signal_name(int(first.group(1))) or f"signal {-int(first.group(1))}"
            rank = self._global_rank(int(first.group(2)))
            where = f" at step {step}" if step is not None else ""
            return Failure(
                "rank_killed", rank, f"rank {rank} was killed by {name}{where}", step, f"killed:{name}:{rank}"
            )
        if errors:
            _, rank, data = errors[0]
            lost = PEER_LOST.search(str(data.get("message") or ""))
            if lost is not None and self._nnodes() > 1:
                # the rank that died is on another node: that node's own supervisor names it
                peer = f" ({lost.group(1)})" if lost.group(1) else ""
                at = f" at step {step}" if step is not None else ""
                return Failure(
                    "peer_lost",
                    rank,
                    f"rank {rank} lost its connection to a peer on another node{peer}{at}: a rank there died "
                    "or its node was lost (that node's log names it)",
                    step,
                    "peer_lost",
                )
            diagnosis = _from_error_file(data, rank)
            same = f"{data.get('type')}:{data.get('message')}:{rank}"
            return Failure("exception", rank, diagnosis.line, step, same)
        if first is not None:
            rank = self._global_rank(int(first.group(2)))
            line = f"rank {rank} exited with code {first.group(1)}"
            return Failure("rank_failed", rank, line, step, f"exit:{first.group(1)}:{rank}")
        return Failure("unknown", None, "the worker group failed (no rank named in the log)", step, "unknown")

    def _nnodes(self) -> int:
        return int(((read_json(self.run_dir / "launch.json") or {}).get("nodes") or {}).get("nnodes") or 1)

    def rendezvous_timed_out(self) -> str | None:
        """When torchrun's agent stopped because the other nodes did not all (re)join its rendezvous within
        --join-timeout: the line to end the run with, naming the failure that made it wait."""
        if not any(RENDEZVOUS_TIMEOUT in line for line in self._log_since_attempt()):
            return None
        nodes = (read_json(self.run_dir / "launch.json") or {}).get("nodes") or {}
        timeout = float(nodes.get("join_timeout") or 600)
        failure = self.failure_of_attempt()
        return (
            f"a node did not come back within --join-timeout {timeout:g} s: the rendezvous at "
            f"{nodes.get('rdzv_endpoint')} waited for all {nodes.get('nnodes')} nodes after {failure.cause}; "
            "start the lost node again (flashdraft launch --resume RUN on it) or resume every node"
        )

    def _global_rank(self, local_rank: int) -> int:
        launch = read_json(self.run_dir / "launch.json") or {}
        nodes = launch.get("nodes") or {}
        return int(nodes.get("node_rank") or 0) * int(launch.get("nproc_per_node") or 1) + local_rank

    # ------------------------------------------------------------------ restarts
    def check_restart(self) -> str | None:
        """Record a restart when torchrun has started a new attempt. Returns the line to give up with when
        the failure before it repeats the previous one (same cause, same step), else None."""
        numbers = [n for path, n in attempt_dirs(self.run_dir).items() if path not in self.earlier]
        newest = max(numbers, default=0)
        if newest <= self.attempt:
            return None
        failure = self.failure_of_attempt()
        if failure.repeats(self.last_failure):  # not counted as a restart: the watch ends the job now
            return (
                f"the same failure twice in a row at step {failure.step}: {failure.cause}; not restarted again "
                "(a failure that repeats is in the data or the code, not the machine: fix it, then resume)"
            )
        resumed = newest_checkpoint_step(self.run_dir) or 0
        record = {
            "time": time.time(),
            "attempt": newest,
            "of": self.max_restarts,
            "rank": failure.rank,
            "node": self.node,
            "kind": failure.kind,
            "cause": failure.cause,
            "failed_at_step": failure.step,
            "resumed_from_step": resumed,
            "lost_steps": None if failure.step is None else max(0, failure.step - resumed),
        }
        self.restarts.append(record)
        self._set_aside_records(newest)
        self.say(restart_line(record))
        self.last_failure = failure
        self.attempt, self.attempt_started = newest, time.time()
        self.furthest, self.hang, self.dumped_for = None, None, None
        with contextlib.suppress(OSError):
            self.log_offset = (self.run_dir / LOG_NAME).stat().st_size
        return None

    def _set_aside_records(self, attempt: int) -> None:
        """Move the failed attempt's error and final records to restarts/<n>/ (the new attempt has only just
        started: none of them is its own), so that a later diagnosis reads only the later attempts'."""
        for path in [*self.run_dir.glob("rank*/error.json"), *self.run_dir.glob("rank*/final.json")]:
            dest = self.run_dir / "restarts" / str(attempt) / path.parent.name
            with contextlib.suppress(OSError):
                dest.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest / path.name)

    # ------------------------------------------------------------------ hangs
    def check_stall(self, workers: list[psutil.Process]) -> str | None:
        """When the current attempt has not beaten for --stall-seconds (counted from its start, so that a
        restarted attempt is not judged by the beats of the one before): ask its ranks for their stacks,
        once per stall; with a restart left, kill them after the stacks so that torchrun restarts the
        group. Returns "killed", "dumped" or None."""
        beats = self.observe()
        times = [b["time"] for b in beats.values() if isinstance(b.get("time"), int | float)]
        newest = max([*times, self.attempt_started])
        if time.time() - newest <= self.stall_seconds or newest == self.dumped_for:
            return None
        # Start-up and the compiling first step are long and beat little (a large target loads for
        # minutes): only an attempt that has trained a step and then stopped beating counts as hung.
        training = self.furthest is not None and all(
            b.get("phase") not in ("starting", "loading", "compiling") for b in beats.values()
        )
        self.dumped_for = newest
        beaten = {b.get("pid"): r for r, b in beats.items()}
        # only processes that beat: they registered the SIGUSR1 handler first (it would end any other)
        ranks = [p for p in workers if p.pid in beaten]
        stopped = [beaten[p.pid] for p in ranks if _status(p) == psutil.STATUS_STOPPED]
        oldest = min(beats.items(), key=lambda item: item[1].get("time", 0))[0] if beats else None
        rank = stopped[0] if stopped else oldest
        self.say(
            f"no heartbeat for {time.time() - newest:.0f} s (--stall-seconds {self.stall_seconds:.0f}): asked "
            f"{len(ranks)} training process(es) for their Python stacks (SIGUSR1); they follow in this log"
        )
        for process in ranks:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                process.send_signal(signal.SIGUSR1)
        if len(self.restarts) >= self.max_restarts or not training:
            return "dumped"  # the run stays stalled for a person (status says so), as without restarts
        time.sleep(STACK_DUMP_GRACE_S)  # the stacks are written by the ranks' own signal handlers
        what = f"rank {rank} is stopped (SIGSTOP)" if stopped else f"the oldest heartbeat is rank {rank}'s"
        self.hang = Failure(
            "hang",
            rank,
            f"hung: no heartbeat for {time.time() - newest:.0f} s at step {self.furthest} ({what}); "
            "its stacks are in the log",
            self.furthest,
            f"hang:{rank}",
        )
        self.say(f"killing the hung ranks so that torchrun restarts them: {self.hang.cause}")
        for process in workers:  # SIGKILL ends a stopped process too
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                process.send_signal(signal.SIGKILL)
        return "killed"


def _status(process: psutil.Process) -> str | None:
    try:
        return process.status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def restart_line(record: dict[str, Any]) -> str:
    """One restart, as the supervisor's log and `status` say it."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["time"]))
    lost = "" if record.get("lost_steps") is None else f", {record['lost_steps']} step(s) of work lost"
    return (
        f"restart {record['attempt']}/{record['of']} at {when} on {record.get('node')}: {record['cause']}; "
        f"resumed from step {record['resumed_from_step']}{lost}"
    )
