"""Held-out validation during training: teacher-forced simulated acceptance on `data.eval` (fixed anchors,
so the numbers compare across steps). Real speculative decoding is `flashdraft eval` (infer/evaluate.py);
this pass only picks the best checkpoint and shows the trend.

A pass can take minutes on a large eval set: it says how far it is (a line every few seconds), keeps the
heartbeat beating, and gives way to a stop request after the batch in flight (docs/training-safety.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from flashdraft.data.tokens import TokenDataset, iterate_batches
from flashdraft.train.blocks import summarize_acceptance
from flashdraft.train.objective import Objective

# Seconds between two progress lines of one pass (the heartbeat beats every batch, throttled by itself).
PROGRESS_EVERY_S = 5.0


def batch_count(data: TokenDataset, batch_size: int) -> int:
    return math.ceil(len(data) / batch_size)


@torch.no_grad()
def held_out_acceptance(
    objective: Objective,
    data: TokenDataset,
    batch_size: int,
    seed: int,
    pad_multiple: int,
    device: torch.device,
    *,
    after_batch: Callable[[int, int], bool] | None = None,
) -> dict[str, float] | None:
    """Loss and simulated acceptance over every sample of `data`. `after_batch(done, total)` is called after
    each batch; when it returns True the pass is abandoned and None is returned (a stop request)."""
    objective.drafter.eval()
    total = batch_count(data, batch_size)
    loss_sum, weight_sum, stats = 0.0, 0.0, None
    try:
        for done, batch in enumerate(iterate_batches(data, batch_size, seed, pad_multiple), start=1):
            out = objective(batch.to(device), objective.blocks(batch).to(device))
            loss_sum += float(out.loss_sum)
            weight_sum += float(out.weight_sum)
            stats = out.stats if stats is None else {k: stats[k] + v for k, v in out.stats.items()}
            if after_batch is not None and after_batch(done, total):
                return None
    finally:
        objective.drafter.train()
    return {"loss": loss_sum / max(weight_sum, 1e-9), **summarize_acceptance(stats)}


class PassProgress:
    """Progress lines of one validation pass: one every PROGRESS_EVERY_S (a pass quicker than that says
    nothing but its result)."""

    def __init__(self, step: int, say: Callable[[str], None]):
        self.step, self.say = step, say
        self.started = self.last_line = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last_line >= PROGRESS_EVERY_S:
            self.last_line = now
            self.say(f"step {self.step}: evaluating, batch {done}/{total} ({now - self.started:.0f} s)")
