"""The training batches of each optimizer step, prepared on the host ahead of use.

The next step's micro-batches are read, collated, given their anchors and blocks and queued to the device
while the GPU still runs this step's kernels (the order of samples is the same as without it). Anchors,
blocks and every count come from the CPU batch, so the step itself never waits for the device. A split
topology's drafter rank draws `max_in_flight` steps ahead instead: each drawn micro-batch posts the receive
of its features (distributed/roles.py).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.data.tokens import TokenBatch
from flashdraft.distributed.roles import StepHooks
from flashdraft.distributed.split import micro_share
from flashdraft.distributed.topology import Topology
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.train.blocks import BlockBatch
from flashdraft.train.flops import step_flops
from flashdraft.train.inputs import TrainingData
from flashdraft.train.objective import Objective


@dataclass
class MicroBatch:
    batch: TokenBatch  # on the device
    blocks: BlockBatch  # on the device
    weight: float  # its share of the step's loss normaliser Σw (0 for padding)
    # (blocks, FLOPs) of its work; None for padding: a rank left without samples at an epoch's end runs
    # one sample at weight zero, since DDP and FSDP need every rank in every backward
    work: tuple[int, float] | None

    @property
    def padding(self) -> bool:
        return self.work is None


@dataclass
class DrawnStep:
    micro: list[MicroBatch]
    sampler_state: dict[
        str, Any
    ]  # the sampler's position after drawing this step (what its checkpoint keeps)


class StepPrefetcher:
    """Draws optimizer steps' micro-batches in order, from step `first_step` on, at most `total_steps`."""

    def __init__(
        self,
        data: TrainingData,
        objective: Objective,
        drafter: DFlashDraftModel,
        *,
        topo: Topology,
        device: torch.device,
        grad_accum: int,
        seed: int,
        pad_multiple: int,
        vocab_size: int,
        first_step: int,
        hooks: StepHooks,
    ):
        self.data, self.objective, self.drafter = data, objective, drafter
        self.topo, self.device, self.hooks = topo, device, hooks
        self.grad_accum, self.seed, self.pad_multiple, self.vocab_size = (
            grad_accum,
            seed,
            pad_multiple,
            vocab_size,
        )
        self.pending: collections.deque[DrawnStep] = collections.deque()
        self.next_index = first_step

    def draw_ahead(self, count: int) -> None:
        """Draw until `count` steps are pending (or every step of the run is drawn)."""
        while len(self.pending) < count and self.next_index < self.data.total_steps:
            self.pending.append(self._draw(self.next_index))
            self.next_index += 1

    def next_step(self) -> DrawnStep:
        """The next step's micro-batches (the hooks' steps ahead drawn first)."""
        self.draw_ahead(self.hooks.steps_ahead)
        return self.pending.popleft()

    def _draw(self, index: int) -> DrawnStep:
        sampler = self.data.sampler
        micro = []
        for m in range(self.grad_accum):
            epoch, indices = sampler.next_batch()
            mine, padding = micro_share(indices, self.topo.rank, self.topo.world_size)
            batch = self.data.collate(self.data.train, epoch, mine, self.seed, self.pad_multiple)
            self.hooks.drawn(index, m, tuple(batch.input_ids.shape))
            blocks = self.objective.blocks(batch)
            if padding:
                micro.append(MicroBatch(batch.to(self.device), blocks.to(self.device), 0.0, None))
                continue
            flops = step_flops(
                self.drafter.config,
                self.drafter.layer_kinds(),
                blocks,
                int(batch.lengths.sum()),
                len(blocks.rows),
                self.vocab_size,
            ).total
            work = (int(blocks.keep.sum()), flops)
            weight = float(self.objective.normalizer(blocks.weights))
            micro.append(MicroBatch(batch.to(self.device), blocks.to(self.device), weight, work))
        return DrawnStep(micro, sampler.state_dict())
