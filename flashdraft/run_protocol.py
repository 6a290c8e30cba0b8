"""The run directory's files: the protocol between a job and its supervision (docs/run-files.md).

    <run_dir>/launch.json        written once by `launch`: command, environment, git commit, host, boot id
    <run_dir>/config.yaml        the resolved training config
    <run_dir>/train.log          opened by `launch` before anything else runs; supervisor and job append
    <run_dir>/status.json        written by the supervisor: state, pids, exit code or signal, diagnosis
    <run_dir>/rank<N>/heartbeat.json   written by the trainer: phase, step, loss, τ, throughput, memory
    <run_dir>/rank<N>/error.json       written by the trainer on an uncaught exception (torchrun style)
    <run_dir>/rank<N>/final.json       written by the trainer on every exit path it controls
    <run_dir>/metrics.jsonl      written by the trainer: a row per logged step, evaluation and compile
                                 report; read back by `eval`'s report, the quickstart and the benchmarks

Both sides import this module and nothing of each other: `run/` never imports `train/`, so a broken
trainer can still be diagnosed. Every write goes through `flashdraft.durable` (atomic, fsynced). A write
that fails (a full disk) is retried, then announced by one `flashdraft: record:` line on stderr, which
is the run log: `status` reads the outcome from that line when the file is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from flashdraft.durable import atomic_write_json

RUN_DIR_ENV = "FLASHDRAFT_RUN_DIR"
RUN_ID_ENV = "FLASHDRAFT_RUN_ID"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun in every worker: 0, then 1, 2, ...
# A multi-node launch's --node-rank, in its job's environment: torchrun's elastic rendezvous numbers the
# nodes in an order of its own (host name, then agent pid), so the ranks are counted from this instead
# (docs/distributed.md, "Several nodes").
NODE_RANK_ENV = "FLASHDRAFT_NODE_RANK"


def global_rank() -> int:
    """This training process's rank: node rank x processes per node + local rank on a multi-node launch,
    torchrun's RANK otherwise (0 for one process)."""
    node_rank = os.environ.get(NODE_RANK_ENV)
    if node_rank is not None and "LOCAL_RANK" in os.environ:
        return int(node_rank) * int(os.environ.get("LOCAL_WORLD_SIZE", "1")) + int(os.environ["LOCAL_RANK"])
    return int(os.environ.get("RANK", "0"))


# Phases a trainer reports; states the supervisor and `status` report.
PHASES = (
    "starting",
    "loading",
    "compiling",
    "training",
    "evaluating",
    "checkpointing",
    "stopping",
    "finished",
)
FINAL_STATES = ("finished", "failed", "stopped", "killed")


# A record that could not be written is announced on stderr with this prefix, then the JSON itself.
RECORD_LINE = "flashdraft: record:"


def default_runs_root() -> Path:
    """Where `flashdraft launch` puts run directories when not told (`--runs-dir`): ./runs, or
    $FLASHDRAFT_RUNS_DIR."""
    return Path(os.environ.get("FLASHDRAFT_RUNS_DIR", "runs")).resolve()


def resume_command(run_dir: str | Path, runs_root: str | Path | None = None) -> str:
    """The one command that continues a launched run in its own directory (`--runs-dir` only when the run
    does not live under the default root)."""
    run_dir = Path(run_dir).resolve()
    root = Path(runs_root).resolve() if runs_root is not None else default_runs_root()
    where = "" if run_dir.parent == root else f" --runs-dir {run_dir.parent}"
    return f"flashdraft launch --resume {run_dir.name}{where}"


def resume_hint(run_dir: str | Path | None = None) -> str:
    """How to continue this training job, said the same way by every message that says it: a launched job
    (it has a run directory, $FLASHDRAFT_RUN_DIR) resumes through `launch --resume`; a plain
    `flashdraft train` resumes by running again with train.resume=auto (the default)."""
    run_dir = run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV)
    if run_dir:
        return f"resume with {resume_command(run_dir)}"
    return "resume with the same flashdraft train command and train.resume=auto (the default)"


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    atomic_write_json(path, data)


def write_record(path: str | Path, data: dict[str, Any], *, attempts: int = 3, delay: float = 0.5) -> bool:
    """Write a protocol file, tolerating a full disk: retry, then print the record as one log line.

    Returns whether the file was written. Never raises for an OS-level failure: the caller is usually
    already on its way out with another error, which must not be masked by this one."""
    for attempt in range(attempts):
        try:
            atomic_write_json(path, data)
            return True
        except OSError as exc:
            error = exc
            if attempt + 1 < attempts:
                time.sleep(delay)
    line = json.dumps({"file": Path(path).name, **data}, default=str)
    with contextlib.suppress(OSError, ValueError):
        print(f"{RECORD_LINE} {line}  (cannot write {path}: {error})", file=sys.stderr, flush=True)
    return False


def records_from_log(lines: list[str], name: str) -> list[dict[str, Any]]:
    """The records of file `name` that a writer could only announce in the log (latest last)."""
    found = []
    for line in lines:
        if not line.startswith(RECORD_LINE):
            continue
        text = line[len(RECORD_LINE) :].strip()
        text = text[: text.rfind("}") + 1]
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(text)
            if isinstance(record, dict) and record.pop("file", None) == name:
                found.append(record)
    return found


def read_json(path: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def rank_dir(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}"


def read_heartbeats(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every rank's last heartbeat, by rank (one being rewritten or unreadable is left out)."""
    beats = {
        int(p.parent.name.removeprefix("rank")): read_json(p)
        for p in sorted(Path(run_dir).glob("rank*/heartbeat.json"))
    }
    return {rank: beat for rank, beat in beats.items() if isinstance(beat, dict)}


def runs_root(runs_dir: str | None = None) -> Path:
    """Where `launch` puts runs: --runs-dir, else $FLASHDRAFT_RUNS_DIR, else ./runs."""
    return Path(runs_dir).resolve() if runs_dir else default_runs_root()


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


class Heartbeat:
    """The trainer's side: phase and progress, throttled to one write a second except on phase changes."""

    def __init__(self, run_dir: str | Path | None, rank: int = 0, min_interval: float = 1.0):
        self.dir = rank_dir(run_dir, rank) if run_dir else None
        self.min_interval = min_interval
        self.last_write = 0.0
        self.state: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "phase": "starting"}

    def beat(self, phase: str | None = None, force: bool = False, **fields: Any) -> None:
        if self.dir is None:
            return
        if phase is not None and phase not in PHASES:  # status maps phases to states: no unknown ones
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        changed = phase is not None and phase != self.state.get("phase")
        if phase is not None:
            self.state["phase"] = phase
        self.state.update(fields)
        now = time.time()
        if force or changed or now - self.last_write >= self.min_interval:
            self.state["time"] = now
            self.last_write = now
            with contextlib.suppress(OSError):  # best effort: the next beat retries; status shows the age
                write_json(self.dir / "heartbeat.json", self.state)

    def final(self, outcome: str, **fields: Any) -> None:
        if self.dir is None:
            return
        self.beat(phase="finished" if outcome == "finished" else self.state.get("phase"), force=True)
        write_record(
            self.dir / "final.json",
            {
                "outcome": outcome,
                "time": time.time(),
                "pid": os.getpid(),
                "rank": self.state.get("rank"),
                **fields,
            },
        )

    def error(self, exc: BaseException, traceback_text: str) -> None:
        if self.dir is None:
            return
        write_record(
            self.dir / "error.json",
            {
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback_text,
                "time": time.time(),
                "pid": os.getpid(),
                "rank": self.state.get("rank"),
                "phase": self.state.get("phase"),
                "step": self.state.get("step"),
            },
        )


def read_metrics(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (only those of `kind`, "train" or "eval", when given), also of one still
    being written or cut short by a crash: a torn line is left out; a missing file has no rows."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and (kind is None or row.get("kind") == kind):
            rows.append(row)
    return rows
