"""The DFlash objective bound to a drafter and its target: one forward on a token batch, target features ->
drafter -> weighted head loss (the pieces are in train/blocks.py).

Shared by the trainer, the held-out evaluation and the benchmark, so all three measure the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flashdraft.data.tokens import TokenBatch
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.target import TargetModel
from flashdraft.train.blocks import (
    BlockBatch,
    acceptance_stats,
    blocks_for,
    dense_masks,
    flex_block_masks,
)
from flashdraft.train.loss import WeightedHeadLoss


@dataclass
class StepOutput:
    loss_sum: Tensor  # Σ w·CE (fp32 scalar, differentiable)
    weight_sum: Tensor  # Σ w (a device scalar: reading it is the caller's choice, not a forced sync)
    stats: dict[str, Tensor]  # acceptance sums (see objective.acceptance_stats)


class Objective:
    """Binds a drafter and its target to the DFlash objective with one attention backend."""

    def __init__(
        self,
        drafter: DFlashDraftModel,
        target: TargetModel,
        *,
        num_anchors: int,
        gamma: float,
        loss: WeightedHeadLoss,
        anchors: str = "per_row",
        attention: str = "sdpa",
        create_block_mask: Callable | None = None,
        autocast_dtype: torch.dtype | None = None,
    ):
        if attention == "flex" and create_block_mask is None:
            raise ValueError("flex attention needs the compiled create_block_mask from parallelize")
        if anchors not in ("per_row", "budget"):
            raise ValueError(f"anchors must be per_row or budget, got {anchors!r}")
        self.drafter = drafter
        self.target = target
        self.num_anchors = num_anchors
        self.anchor_budget = anchors == "budget"
        self.gamma = gamma
        self.loss = loss
        self.attention = attention
        self.create_block_mask = create_block_mask
        self.autocast_dtype = autocast_dtype

    def blocks(self, batch: TokenBatch) -> BlockBatch:
        """Anchors and blocks; call it on the CPU batch (then `.to(device)` both) to avoid device syncs."""
        spec = self.drafter.spec
        return blocks_for(
            batch, self.num_anchors, spec.block_size, spec.mask_token_id, self.gamma, self.anchor_budget
        )

    def masks(self, blocks: BlockBatch, ctx_len: int) -> dict:
        kinds = self.drafter.layer_kinds()
        if self.attention == "flex":
            return flex_block_masks(blocks, ctx_len, kinds, self.create_block_mask)
        return dense_masks(blocks, ctx_len, kinds)

    def __call__(
        self, batch: TokenBatch, blocks: BlockBatch | None = None, features: Tensor | None = None
    ) -> StepOutput:
        """`features` may come precomputed (timed separately, or produced by a target on another GPU)."""
        blocks = self.blocks(batch) if blocks is None else blocks
        b, s = batch.input_ids.shape
        if features is None:
            # Packed rows: the position resets keep the target's samples apart (docs/packing.md).
            features = self.target.features(batch.input_ids, position_ids=batch.position_ids)
        noise = self.target.embed(blocks.block_ids)
        if batch.position_ids is not None:
            ctx_positions = batch.position_ids  # RoPE within each sample, as if it were alone
        else:
            ctx_positions = torch.arange(s, device=batch.input_ids.device).expand(b, -1)
        masks = self.masks(blocks, s)
        with torch.autocast(
            noise.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            hidden = self.drafter(noise, features, ctx_positions, blocks.block_positions, masks)
        flat_weights = blocks.weights.flatten()
        rows = flat_weights.nonzero().flatten()
        head = self.target.lm_head_weight
        loss_sum, correct_rows = self.loss(
            hidden.flatten(0, 1).index_select(0, rows).to(head.dtype),
            head,
            blocks.labels.flatten()[rows],
            flat_weights[rows],
        )
        correct = torch.zeros_like(flat_weights, dtype=torch.bool).index_copy_(0, rows, correct_rows)
        return StepOutput(
            loss_sum=loss_sum,
            weight_sum=flat_weights.sum(),
            stats=acceptance_stats(correct.view_as(blocks.weights), blocks.weights, blocks.block_size),
        )
