"""The run directory's files: the only interface between a job and its supervision.

    <run_dir>/launch.json        written once by `launch`: command, environment, git commit, host, boot id
    <run_dir>/config.yaml        the resolved training config
    <run_dir>/train.log          opened by `launch` before anything else runs; supervisor and job append
    <run_dir>/status.json        written by the supervisor: state, pids, exit code or signal, diagnosis
    <run_dir>/rank<N>/heartbeat.json   written by the trainer: phase, step, loss, τ, throughput, memory
    <run_dir>/rank<N>/error.json       written by the trainer on an uncaught exception (torchrun style)
    <run_dir>/rank<N>/final.json       written by the trainer on every exit path it controls

Every write is atomic (temporary file + rename): a reader sees the old or the new content, never half.
This module imports nothing else from flashdraft, so the trainer and `flashdraft status` share only the
file formats: a broken trainer can still be diagnosed (../shared/reference/architecture-sketch.md).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "FLASHDRAFT_RUN_DIR"
RUN_ID_ENV = "FLASHDRAFT_RUN_ID"
FAULT_ENV = "FLASHDRAFT_FAULT"

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


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as handle:
        json.dump(data, handle, indent=1, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_json(path: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def rank_dir(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}"


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
            write_json(self.dir / "heartbeat.json", self.state)
            self.last_write = now

    def final(self, outcome: str, **fields: Any) -> None:
        if self.dir is None:
            return
        self.beat(phase="finished" if outcome == "finished" else self.state.get("phase"), force=True)
        write_json(
            self.dir / "final.json", {"outcome": outcome, "time": time.time(), "pid": os.getpid(), **fields}
        )

    def error(self, exc: BaseException, traceback_text: str) -> None:
        if self.dir is None:
            return
        write_json(
            self.dir / "error.json",
            {
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback_text,
                "time": time.time(),
                "pid": os.getpid(),
                "phase": self.state.get("phase"),
                "step": self.state.get("step"),
            },
        )
