"""The trainer's progress, one typed object: what the loop advances each step and a checkpoint records
beside the weights, the optimizer and the schedule (train/checkpoint.py writes them; docs/training-safety.md).

The keys of `state_dict` are those of `trainer_state.pt` (STATE_FORMAT 2): checkpoints written before this
module existed load into it unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flashdraft.train.budget import TrainingClock


@dataclass
class TrainState:
    """Progress of one run. `sampler` is the sampler's position after the batches of the last step trained
    (the loader draws ahead: its own position is further on); `clock` books training and compile time."""

    step: int = 0
    best_tau: float = -math.inf  # the best held-out simulated acceptance so far (best/ holds its drafter)
    skipped: int = 0  # non-finite steps skipped in all
    bad_in_a_row: int = 0  # of them, the latest unbroken run (not saved: a checkpoint follows a good step)
    sampler: dict[str, Any] | None = None
    clock: TrainingClock = field(default_factory=TrainingClock)

    @property
    def epoch(self) -> int | None:
        return None if self.sampler is None else self.sampler["epoch"]

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "sampler": self.sampler,
            "best_tau": self.best_tau,
            "skipped_steps": self.skipped,
            "train_seconds": self.clock.train_seconds,
            "compile_seconds": self.clock.compile_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.best_tau, self.skipped = state["step"], state["best_tau"], state["skipped_steps"]
        self.sampler = state["sampler"]
        # Checkpoints from before the time budget existed carry no clock: they start from zero.
        self.clock = TrainingClock(
            float(state.get("train_seconds", 0.0)), float(state.get("compile_seconds", 0.0))
        )
