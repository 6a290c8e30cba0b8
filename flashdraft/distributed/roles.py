"""What a training rank does in its topology (docs/distributed.md): which copy of the target it loads, and
what the topology adds to each of its optimizer steps.

`StepHooks` is the colocated topology's answer, nothing at all; `SplitDrafterHooks` is a split topology's
drafter rank: the features of its micro-batches are received ahead from its target rank (posted as each
micro-batch is drawn, taken as it trains), and after each step it joins the control exchange that carries
a stop decided by either side and both sides' clocks (the balance report). The trainer calls the hooks
unconditionally, so its loop has no branch per topology.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flashdraft.distributed.split import Control, FeatureReceiver, SideClock, SplitRoles, balance
from flashdraft.distributed.target_parallel import load_group_target
from flashdraft.model.target import TargetModel, default_dtype


def load_rank_target(
    path: str, layer_ids: list[int], device: torch.device, target_parallel: int, roles: SplitRoles | None
) -> TargetModel:
    """The target as this rank needs it: sharded over its group (`distributed.target_parallel` > 1), whole
    on its device (colocated, or a split topology's target rank), or, on a split topology's drafter rank,
    only the embedding and the LM head on its device (the features come from a target rank)."""
    if target_parallel > 1:
        return load_group_target(path, layer_ids, device, target_parallel)
    if roles is None or roles.is_target:
        return TargetModel.load(path, layer_ids, device=device)
    target = TargetModel.load(path, layer_ids, dtype=default_dtype(device))
    target.embed_weight = target.embed_weight.to(device)
    target.lm_head_weight = target.lm_head_weight.to(device)
    return target


class StepHooks:
    """What a topology adds to a training step; this one (colocated ranks) adds nothing."""

    # Steps drawn before a step trains (the split topology posts its receives this far ahead).
    steps_ahead: int = 1
    # Whether the next step's batches are drawn while this step's kernels run (else all are drawn ahead).
    draw_during_step: bool = True

    def drawn(self, step_index: int, micro_index: int, batch_shape: tuple[int, ...]) -> None:
        """A micro-batch of step `step_index` was drawn on the host."""

    def features(self) -> Tensor | None:
        """The target features of the micro-batch about to train (None: the objective runs the target)."""
        return None

    def trained(self, samples: int) -> None:
        """A micro-batch of `samples` real samples (not padding) was trained."""

    def step_started(self) -> None:
        """Before the step draws its batches."""

    def step_finished(self, seconds: float, stop: bool, step: int) -> bool:
        """After step `step` (`seconds` long) and this side's `stop` decision: whether the other side asks
        to stop."""
        return False

    def window_report(self) -> dict[str, Any]:
        """The topology's report over the logging window that ends now (empty: none)."""
        return {}

    def close(self) -> None:
        """The loop ended (a stop may leave work of steps not trained in flight)."""


class SplitDrafterHooks(StepHooks):
    """A drafter rank of a split topology (distributed/split.py carries the messages)."""

    draw_during_step = False

    def __init__(
        self,
        roles: SplitRoles,
        device: torch.device,
        timeout_s: float,
        max_in_flight: int,
        feature_width: int,
        feature_dtype: torch.dtype,
    ):
        self.roles, self.device = roles, device
        self.steps_ahead = max_in_flight
        self.feature_width, self.feature_dtype = feature_width, feature_dtype
        self.clock = SideClock()
        self.receiver = FeatureReceiver(roles.source_of(roles.rank), timeout_s, self.clock)
        self.control = Control(roles, device, timeout_s)
        self.totals: dict[str, float] | None = None
        self._totals_reported: dict[str, float] | None = None
        self._waited_before = 0.0

    def drawn(self, step_index: int, micro_index: int, batch_shape: tuple[int, ...]) -> None:
        header = [step_index, micro_index, *batch_shape, self.feature_width]
        self.receiver.post(header, self.feature_dtype, self.device)

    def features(self) -> Tensor:
        return self.receiver.take()

    def trained(self, samples: int) -> None:
        self.clock.samples += samples

    def step_started(self) -> None:
        self._waited_before = self.clock.waiting

    def step_finished(self, seconds: float, stop: bool, step: int) -> bool:
        # busy: the step's time less what it spent waiting for features
        self.clock.busy += seconds - (self.clock.waiting - self._waited_before)
        self.totals = self.control.exchange(stop, self.clock, step)
        return self.totals["stop"] > 0

    def window_report(self) -> dict[str, Any]:
        report = balance(
            self.totals, self._totals_reported, len(self.roles.target_ranks), len(self.roles.drafter_ranks)
        )
        self._totals_reported = self.totals
        return report

    def close(self) -> None:
        self.receiver.drain()  # features received ahead for steps not trained: take and drop them
