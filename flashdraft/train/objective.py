"""The DFlash objective bound to a drafter and its target: one forward on a token batch, target features ->
drafter -> weighted head loss (the pieces are in train/blocks.py; the losses and position weights in
train/loss.py, docs/drafters.md §1; the DFlash2 selector term in docs/drafters.md §3).

Shared by the trainer, the held-out evaluation and the benchmark, so all three measure the same thing.
"""

from __future__ import annotations

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
from flashdraft.train.loss import POSITION_WEIGHTS, WeightedHeadLoss, dpace_weights, weighted_sum


@dataclass
class StepOutput:
    loss_sum: Tensor  # Σ w·loss (+ the selector term; fp32 scalar, differentiable)
    weight_sum: (
        Tensor  # the normalizer, Objective.normalizer (a device scalar: reading it is the caller's choice)
    )
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
        autocast_dtype: torch.dtype | None = None,
        position_weight: str = "decay",
        dpace_alpha: float = 0.5,
    ):
        if position_weight not in POSITION_WEIGHTS:
            raise ValueError(f"position_weight={position_weight!r}; expected one of {POSITION_WEIGHTS}")
        if anchors not in ("per_row", "budget"):
            raise ValueError(f"anchors must be per_row or budget, got {anchors!r}")
        self.drafter = drafter
        self.target = target
        self.num_anchors = num_anchors
        self.anchor_budget = anchors == "budget"
        self.gamma = gamma
        self.loss = loss
        self.attention = attention
        self.autocast_dtype = autocast_dtype
        self.position_weight = position_weight
        self.dpace_alpha = dpace_alpha
        self.selector_weight = 0.0  # DFlash2: the selector term's factor, set per step by the trainer
        self.num_features = len(drafter.spec.target_layer_ids)
        selector = getattr(drafter, "candidate_selector", None)
        if selector is not None:
            loss.top_k = selector.top_k  # the head pass hands the selector its candidates
        if loss.needs_teacher:
            # kl/lk need the target's final hidden state (after its final norm): capture it as one more
            # feature column block after the drafter's own features.
            target.set_layer_ids([*drafter.spec.target_layer_ids, target.num_layers - 1])

    def blocks(self, batch: TokenBatch) -> BlockBatch:
        """Anchors and blocks; call it on the CPU batch (then `.to(device)` both) to avoid device syncs."""
        spec = self.drafter.spec
        return blocks_for(
            batch, self.num_anchors, spec.block_size, spec.mask_token_id, self.gamma, self.anchor_budget
        )

    def normalizer(self, weights: Tensor) -> Tensor:
        """The loss's denominator for block weights [b, N*B], known before the forward (so the trainer
        normalises a step without a device sync): Σ decay weights, or for D-PACE, whose weights come
        from the drafter's own probabilities, the number of supervised positions (docs/drafters.md §1)."""
        if self.position_weight == "dpace":
            return (weights > 0).sum(dtype=torch.float32)
        return weights.sum()

    def masks(self, blocks: BlockBatch, ctx_len: int) -> dict:
        kinds = self.drafter.layer_kinds()
        if self.attention == "flex":
            return flex_block_masks(blocks, ctx_len, kinds)
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
        teacher_features = None
        if self.loss.needs_teacher:
            width = self.num_features * self.target.hidden_size
            features, teacher_features = features[..., :width], features[..., width:]
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
        rows = blocks.rows
        head = self.target.lm_head_weight
        hidden_rows = hidden.flatten(0, 1).index_select(0, rows).to(head.dtype)
        per_row = blocks.weights.shape[1]
        row_batch, row_pos = rows // per_row, blocks.block_positions.flatten()[rows]
        teacher = None
        if teacher_features is not None:
            # The target's logits for the token at position p come from its hidden state at p - 1.
            teacher = teacher_features[row_batch, row_pos - 1]
        head_rows = self.loss.rows(hidden_rows, head, blocks.labels.flatten()[rows], teacher)
        if self.position_weight == "dpace":
            confidence = torch.zeros_like(flat_weights).index_copy_(0, rows, head_rows.label_prob)
            block = blocks.block_size
            valid = (blocks.weights > 0).view(-1, block)
            weights = dpace_weights(confidence.view(-1, block), valid, self.dpace_alpha)
            row_weights = weights.flatten()[rows]
        else:
            row_weights = flat_weights[rows]
        loss_sum = weighted_sum(hidden_rows, head_rows, row_weights)
        selector = getattr(self.drafter, "candidate_selector", None)
        if selector is not None and self.selector_weight > 0:
            predecessors = batch.input_ids[row_batch, row_pos - 1]
            selector_sum = selector.training_loss(
                hidden_rows,
                head_rows.topk_values,
                head_rows.topk_ids,
                predecessors,
                blocks.labels.flatten()[rows],
                row_weights,
            )
            loss_sum = loss_sum + self.selector_weight * selector_sum
        correct_rows = head_rows.correct
        correct = torch.zeros_like(flat_weights, dtype=torch.bool).index_copy_(0, rows, correct_rows)
        return StepOutput(
            loss_sum=loss_sum,
            weight_sum=self.normalizer(blocks.weights),
            stats=acceptance_stats(correct.view_as(blocks.weights), blocks.weights, blocks.block_size),
        )
