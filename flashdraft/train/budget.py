"""Training time under `train.max_minutes` (docs/quality-benchmark.md, "What GPU minutes counts").

The budget counts the wall-clock time of optimizer steps, and leaves out evaluation, checkpoint writes
and the steps that compiled: a step during which torch.compile built a new graph (the first steps, and a
recompile for a new sequence length) is compile time, reported apart. On the H200 four concurrent
1.5-minute runs of the quality benchmark spent almost all of their budget compiling (5 steps each), so
a budget that counts compiling measures the compiler, not the drafter's training; a real run of hours
pays the same compile once and never notices.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable


def compiled_graph_count() -> int:
    """How many graphs torch.compile has built in this process so far (0 before any compile)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without dynamo compiles nothing
        return 0
    return int(counters["stats"]["unique_graphs"])


class TrainingClock:
    """Per step: `start()`, then `compiling()` as often as needed, then `stop()`, which books the step's
    seconds as training or as compile time. `train_seconds` is what the budget and the schedule read."""

    def __init__(
        self,
        train_seconds: float = 0.0,
        compile_seconds: float = 0.0,
        graphs: Callable[[], int] = compiled_graph_count,
    ):
        self.train_seconds, self.compile_seconds = train_seconds, compile_seconds
        self.recent: deque[float] = deque(maxlen=64)  # training steps only: the schedule's typical step
        self._graphs = graphs
        self._started = 0.0
        self._graphs_at_start = 0

    def start(self) -> None:
        self._started = time.perf_counter()
        self._graphs_at_start = self._graphs()

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def compiling(self) -> bool:
        """Whether torch.compile built a graph since `start()`."""
        return self._graphs() != self._graphs_at_start

    def stop(self) -> float:
        """Book this step; returns its seconds."""
        seconds = self.elapsed()
        if self.compiling():
            self.compile_seconds += seconds
        else:
            self.train_seconds += seconds
            self.recent.append(seconds)
        return seconds

    def would_exceed(self, budget_seconds: float) -> bool:
        """Whether this step, if it counts, reaches the budget (a compiling step never does)."""
        if not budget_seconds or self.compiling():
            return False
        return self.train_seconds + self.elapsed() >= budget_seconds


def budget_schedule_position(
    step: int, total_steps: int, budget_seconds: float, spent_seconds: float, recent_step_seconds: Iterable
) -> int:
    """The step the lr schedule is at under a time budget (train.max_minutes): the cosine runs over the
    steps expected to fit, the steps done plus the budget left over a typical (median) recent step.
    A stall (a slow step that still counts) must not move the schedule either: on the H200 a schedule on
    spent time alone had decayed the lr before the drafter learned anything (docs/quality-benchmark.md)."""
    recent = list(recent_step_seconds)
    if not recent:
        return step
    left = max(budget_seconds - spent_seconds, 0.0)
    expected = step + left / max(statistics.median(recent), 1e-9)
    return min(total_steps, max(step, int(step / max(expected, 1.0) * total_steps)))
