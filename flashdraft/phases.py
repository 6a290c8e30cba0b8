"""Seconds per named phase of a command, for the summaries users read when a start-up or a run is slow
(`prepare`'s manifest and summary, `train`'s start-up line)."""

from __future__ import annotations

import os
import time

import psutil


class PhaseClock:
    """`mark(name)` books the time since the previous mark (or the clock's creation) to `name`.

    With `since_process_start`, the first phase, `start-up`, is the time from the process's creation to
    the clock's: the interpreter's start and the imports (torch and transformers take seconds), which a
    command's own phases would otherwise leave unexplained."""

    def __init__(self, since_process_start: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()
        if since_process_start:
            self.seconds["start-up"] = round(max(0.0, seconds_since_process_start()), 3)

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def summary(self) -> str:
        return ", ".join(f"{name} {value:.1f} s" for name, value in self.seconds.items())


def seconds_since_process_start() -> float:
    """Seconds since this process was created. On Linux from /proc (its start tick against the uptime,
    both at 10 ms): psutil's create_time adds the boot time, which /proc/stat gives in whole seconds, so
    it can be up to 1 s early and book more start-up than the process has lived."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - psutil.Process().create_time()
