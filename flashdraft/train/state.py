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
    best_by: str = "simulated_tau"  # train.best_by: which held-out metric picked best/
    best: float | None = None  # that metric's value at the evaluation best/ holds; None: none yet
    best_step: int | None = None  # the step best/ holds (None: none yet, or a checkpoint from before it)
    evals_since_best: int = 0  # evaluations in a row since, none of which improved best/
    skipped: int = 0  # non-finite steps skipped in all
    bad_in_a_row: int = 0  # of them, the latest unbroken run (not saved: a checkpoint follows a good step)
    sampler: dict[str, Any] | None = None
    clock: TrainingClock = field(default_factory=TrainingClock)

    @property
    def epoch(self) -> int | None:
        return None if self.sampler is None else self.sampler["epoch"]

    def improves(self, value: float | None) -> bool:
        """Whether an evaluation whose best_by metric is `value` replaces best/: a strict improvement
        (higher τ, lower loss); a missing or non-finite value never does."""
        if value is None or not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value < self.best if self.best_by == "loss" else value > self.best

    def record_evaluation(self, value: float | None) -> bool:
        """Book one evaluation whose best_by metric is `value`; returns whether it replaces best/. One with
        no finite value (a real τ that was not measured) neither improves nor counts against best/."""
        if self.improves(value):
            self.best, self.best_step, self.evals_since_best = value, self.step, 0
            return True
        if value is not None and math.isfinite(value):
            self.evals_since_best += 1
        return False

    def choose_best_by(self, best_by: str) -> str | None:
        """Continue with this run's train.best_by; a resumed best by another metric is forgotten (best/
        is chosen anew from the next evaluation), and the line that says so is returned."""
        if best_by == self.best_by:
            return None
        was, self.best_by, self.best = self.best_by, best_by, None
        self.best_step, self.evals_since_best = None, 0
        return f"resume: train.best_by {was} -> {best_by}: best/ is chosen anew from the next evaluation"

    def state_dict(self) -> dict[str, Any]:
        simulated = self.best_by == "simulated_tau" and self.best is not None
        return {
            "step": self.step,
            "sampler": self.sampler,
            # best_tau: the key of checkpoints before train.best_by (the best simulated τ, -inf for none)
            "best_tau": self.best if simulated else -math.inf,
            "best_by": self.best_by,
            "best_value": self.best,
            "best_step": self.best_step,
            "evals_since_best": self.evals_since_best,
            "skipped_steps": self.skipped,
            "train_seconds": self.clock.train_seconds,
            "compile_seconds": self.clock.compile_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.skipped = state["step"], state["skipped_steps"]
        if "best_by" in state:
            self.best_by, self.best = state["best_by"], state["best_value"]
        else:  # a checkpoint from before train.best_by: best/ was chosen by simulated τ
            old = float(state["best_tau"])
            self.best_by, self.best = "simulated_tau", old if math.isfinite(old) else None
        # checkpoints from before these keys: the step unknown, the streak starts anew
        self.best_step, self.evals_since_best = state.get("best_step"), state.get("evals_since_best", 0)
        self.sampler = state["sampler"]
        # Checkpoints from before the time budget existed carry no clock: they start from zero.
        self.clock = TrainingClock(
            float(state.get("train_seconds", 0.0)), float(state.get("compile_seconds", 0.0))
        )
