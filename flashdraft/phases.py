"""Seconds per named phase of a command, for the summaries users read when a start-up or a run is slow
(`prepare`'s manifest and summary, `train`'s start-up line)."""

from __future__ import annotations

import time


class PhaseClock:
    """`mark(name)` books the time since the previous mark (or the clock's creation) to `name`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def summary(self) -> str:
        return ", ".join(f"{name} {value:.1f} s" for name, value in self.seconds.items())
