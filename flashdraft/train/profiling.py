"""`train.profile_steps`: torch.profiler around a few optimizer steps of the real training loop.

A user who sees a low MFU wants to know where a step's time goes without writing a harness: the steps
profiled are the loop's own (data, target forward, drafter forward and backward, optimizer, logging). The
profiler starts before step `train.profile_start` + 1 and stops after `train.profile_steps` steps; the
first step after a start includes the profiler's own warm-up, so profile steps past torch.compile's first
graphs. Each rank writes `OUT/profile/rank{R}_steps{A}-{B}.txt` (operators by device time and by host
time) and a Chrome trace beside it (open in Perfetto or chrome://tracing), both renamed into place whole.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashdraft.durable import atomic_write_by, atomic_write_text

TABLE_ROWS = 40


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def device_busy_seconds(trace: dict) -> float:
    """Seconds during which the GPU ran anything (kernels, copies, fills: the union of their intervals),
    from a Chrome trace. Per-operator device times overlap and count annotations; this does not."""
    spans = sorted(
        (event["ts"], event["ts"] + event.get("dur", 0))
        for event in trace.get("traceEvents", [])
        if event.get("ph") == "X" and event.get("cat") in DEVICE_WORK
    )
    busy, end = 0.0, -math.inf
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6  # trace times are in microseconds


class StepProfiler:
    """Profiles optimizer steps start+1 .. start+count of one rank; a no-op when count is 0."""

    def __init__(self, out_dir: Path, start: int, count: int, rank: int, device: torch.device) -> None:
        self.first, self.last = start + 1, start + count  # 1-based step numbers, as the logs count them
        self.enabled = count > 0
        self.rank, self.device = rank, device
        self.directory = out_dir / "profile"
        self._profile: profile | None = None
        self._started = 0.0
        self.report: Path | None = None

    def before_step(self, step: int) -> None:
        """Called with the number of the step about to run (1-based)."""
        if not self.enabled or self._profile is not None or step != self.first:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._profile.__enter__()
        self._started = time.perf_counter()

    def after_step(self, step: int, last: bool = False) -> Path | None:
        """Called after step `step` finished (its kernels waited for); writes the report after the last
        profiled step, or early when training ends first. Returns the report's path when written."""
        if self._profile is None or (step < self.last and not last):
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._started
        self._profile.__exit__(None, None, None)
        prof, self._profile, self.enabled = self._profile, None, False
        steps = step - self.first + 1
        name = f"rank{self.rank}_steps{self.first}-{step}"
        self.directory.mkdir(parents=True, exist_ok=True)
        trace = atomic_write_by(
            self.directory / f"{name}.trace.json", lambda tmp: prof.export_chrome_trace(str(tmp))
        )
        per_step = f"{seconds / steps * 1e3:.1f} ms per step wall"
        if self.device.type == "cuda":
            busy = device_busy_seconds(json.loads(trace.read_text()))
            per_step += (
                f", the GPU busy {busy / steps * 1e3:.1f} ms of it ({busy / seconds:.0%}; idle the rest: "
                "host-bound where that is large)"
            )
        events = prof.key_averages()
        lines = [f"steps {self.first}-{step} on {self.device} (rank {self.rank}): {per_step}", ""]
        if self.device.type == "cuda":
            lines += [
                "by device time",
                events.table(sort_by="self_device_time_total", row_limit=TABLE_ROWS),
                "",
            ]
        lines += ["by host time", events.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)]
        self.report = atomic_write_text(self.directory / f"{name}.txt", "\n".join(lines) + "\n")
        return self.report
