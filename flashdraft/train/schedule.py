"""The learning-rate schedule: linear warm-up, then cosine decay to a floor (docs/dflash.md: 4% warm-up), or
with `train.lr_schedule: wsd` warmup-stable-decay: the peak held, then a linear decay over the last
`train.decay_ratio` of the run (docs/training-loop.md, "The learning-rate schedule").

Under a time budget (`train.max_minutes`) the cosine runs over the steps expected to fit in the budget
rather than over `train.max_steps` (train/budget.py says why and how that position is found).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from flashdraft.config import TrainConfig
from flashdraft.train.budget import budget_schedule_position
from flashdraft.train.state import TrainState


def lr_lambda(
    step: int,
    total: int,
    warmup_ratio: float,
    min_ratio: float,
    schedule: str = "cosine",
    decay_ratio: float = 0.2,
) -> float:
    """Linear warm-up over warmup_ratio of the steps, then cosine decay to min_ratio; or (`wsd`) the peak
    until the last decay_ratio of the steps, then a linear decay. Both reach min_ratio at step `total`, one
    past the last, so no step trains at the floor alone."""
    warmup = max(1, math.ceil(total * warmup_ratio)) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        decay = max(1, math.ceil(total * decay_ratio))
        start = max(warmup, total - decay)  # the decay's first step (still at the peak)
        if step < start:
            return 1.0
        progress = (step - start) / max(1, total - start)
        return min_ratio + (1 - min_ratio) * (1 - min(1.0, progress))
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_scheduler(
    optimizer: torch.optim.Optimizer, t: TrainConfig, total_steps: int, state: TrainState
) -> LambdaLR:
    """The schedule of one run. Under a budget it reads the run's clock through `state` when it is asked
    (the clock a resume restores, not the one of construction). A plain function, not a callable object:
    LambdaLR would write an object's attributes into the checkpoint's scheduler state."""
    budget_seconds = t.max_minutes * 60

    def factor(step: int) -> float:
        position = step
        if budget_seconds:
            clock = state.clock
            position = budget_schedule_position(
                step, total_steps, budget_seconds, clock.train_seconds, clock.recent
            )
        return lr_lambda(position, total_steps, t.warmup_ratio, t.min_lr_ratio, t.lr_schedule, t.decay_ratio)

    return LambdaLR(optimizer, factor)


class TimedSaves:
    """`train.save_every_minutes`: a checkpoint each time that much training time (as the budget counts
    it) has passed; 0 is never. A resumed run continues the cadence from its restored clock."""

    def __init__(self, every_minutes: float, train_seconds: float):
        self.every = every_minutes * 60
        self.next = (math.floor(train_seconds / self.every) + 1) * self.every if self.every else math.inf

    def due(self, train_seconds: float) -> bool:
        """Whether a timed checkpoint is due now (once per interval passed, however many)."""
        due = train_seconds >= self.next
        while self.next <= train_seconds:
            self.next += self.every
        return due
