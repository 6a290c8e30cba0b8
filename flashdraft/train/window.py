"""The counters of one logging interval: what the trainer adds each step, summed over ranks when logged."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashdraft.distributed.topology import Topology, all_reduce_sum
from flashdraft.train.blocks import summarize_acceptance


@dataclass
class LogWindow:
    """Loss, acceptance statistics and work since the last metric line.

    Losses and statistics stay device tensors while they are added (no sync in the step); `all_reduce`
    turns them into numbers once per window. Σw (`weight`) is global already: the trainer reduces it
    every step to normalise the loss.
    """

    block_size: int
    loss_sum: Tensor | float = 0.0
    weight: float = 0.0
    flops: float = 0.0
    blocks: int = 0
    seconds: float = 0.0
    stats: dict[str, Tensor] | None = field(default=None)

    def add_work(self, blocks: int, flops: float) -> None:
        """A micro-batch's blocks and FLOPs (counted whether or not its step is applied)."""
        self.blocks += blocks
        self.flops += flops

    def add_step(self, loss_sums: list[Tensor], stats: list[dict[str, Tensor]], weight: float) -> None:
        """An applied step: its micro-batches' summed losses and acceptance sums, and its global Σw."""
        for loss_sum, micro_stats in zip(loss_sums, stats, strict=True):
            self.loss_sum = self.loss_sum + loss_sum
            self.stats = (
                micro_stats if self.stats is None else {k: self.stats[k] + v for k, v in micro_stats.items()}
            )
        self.weight += weight

    def _zero_stats(self) -> dict[str, Tensor]:
        zeros = torch.zeros(self.block_size - 1, dtype=torch.float64)
        return {
            "correct_at": zeros,
            "supervised_at": zeros.clone(),
            "accepted_sum": torch.zeros((), dtype=torch.float64),
            "blocks": torch.zeros((), dtype=torch.float64),
        }

    def all_reduce(self, device: torch.device, topo: Topology) -> None:
        """Turn the device sums into numbers and sum the local counters over ranks (one all-reduce)."""
        self.loss_sum = float(self.loss_sum)
        if not topo.distributed:
            return
        if self.stats is None:  # this rank had no samples in the window: it still joins the reduction
            self.stats = self._zero_stats()
        keys = sorted(self.stats)
        flat = [
            self.loss_sum,
            float(self.blocks),
            self.flops,
            *[float(v) for k in keys for v in self.stats[k].flatten()],
        ]
        flat = all_reduce_sum(flat, device, topo)
        self.loss_sum, self.blocks, self.flops = flat[0], int(flat[1]), flat[2]
        stats, i = {}, 3
        for k in keys:
            n = self.stats[k].numel()
            stats[k] = torch.tensor(flat[i : i + n], dtype=torch.float64).view_as(self.stats[k])
            i += n
        self.stats = stats

    def metrics(self) -> dict[str, float]:
        """Loss per unit weight, acceptance, and throughput of the window (after `all_reduce`)."""
        seconds = max(self.seconds, 1e-9)
        return {
            # no applied step in the window (all skipped as non-finite): no loss to report
            "loss": float(self.loss_sum) / max(self.weight, 1e-9) if self.weight > 0 else math.nan,
            **summarize_acceptance(self.stats if self.stats is not None else self._zero_stats()),
            "block_tok_s": self.blocks * self.block_size / seconds,
            "tflops": self.flops / seconds / 1e12,
        }
