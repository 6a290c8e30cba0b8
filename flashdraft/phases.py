"""Seconds per named phase of a command, for the summaries users read when a start-up or a run is slow
(`prepare`'s manifest and summary, `train`'s start-up line)."""

from __future__ import annotations

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
            # create_time is wall-clock (epoch) seconds, at the kernel's tick resolution (10 ms)
            elapsed = max(0.0, time.time() - psutil.Process().create_time())
            self.seconds["start-up"] = round(elapsed, 3)

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def summary(self) -> str:
        return ", ".join(f"{name} {value:.1f} s" for name, value in self.seconds.items())
