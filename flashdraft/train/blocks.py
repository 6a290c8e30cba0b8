"""The DFlash objective's pieces: anchors, blocks, masks, weights and acceptance sums (docs/dflash.md §3).

Per sequence: sample N anchors among supervised positions with room for a block (fresh each epoch);
blocks are [x_anchor, MASK x (B-1)] at positions anchor..anchor+B-1; block position k >= 1 predicts
the token at anchor+k ("same-position" labels, docs/dflash.md §4); weight exp(-(k-1)/γ) times the loss mask;
loss = Σ w·CE / Σ w. Attention follows the rule in flashdraft/model/attention.py.

Each alignment trap of docs/dflash.md §4 (labels shifted by one, context visible at kv <= anchor, blocks seeing each
other, padding blocks contributing) has a test in tests/train/test_objective.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flashdraft.model.attention import LayerKind, dense_mask, flex_mask_mod


@dataclass
class BlockBatch:
    """N blocks per sequence, flattened to N*B block positions per row."""

    anchors: Tensor  # [b, N] anchor positions (0 for padding blocks)
    keep: Tensor  # [b, N] bool: real block (False: padding, sees nothing of the context, weight 0)
    block_ids: Tensor  # [b, N*B] [x_anchor, MASK, ...]; padding blocks are all MASK
    block_positions: Tensor  # [b, N*B] absolute positions anchor + k
    labels: Tensor  # [b, N*B] token at anchor + k (0 where not supervised)
    weights: Tensor  # [b, N*B] float32 exp(-(k-1)/γ) · loss_mask · keep · (k >= 1)

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[1] // self.anchors.shape[1]

    def to(self, device: torch.device) -> BlockBatch:
        return BlockBatch(
            *(
                getattr(self, f).to(device, non_blocking=True)
                for f in ("anchors", "keep", "block_ids", "block_positions", "labels", "weights")
            )
        )


def sample_anchors(
    loss_mask: Tensor,
    lengths: Tensor,
    num_anchors: int,
    block_size: int,
    seeds: list[int],
) -> tuple[Tensor, Tensor]:
    """Up to `num_anchors` distinct anchors per row, uniformly among positions p <= length - B with a
    supervised token; sorted. Each row draws from its own seed, so the choice depends only on
    (seed, epoch, sample) and resume is exact without saving generator state."""
    b = loss_mask.shape[0]
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    keep = torch.zeros(b, num_anchors, dtype=torch.bool)
    for row in range(b):
        last = int(lengths[row]) - block_size
        candidates = loss_mask[row, : max(last + 1, 0)].nonzero().flatten().cpu()
        if candidates.numel() == 0:
            continue
        g = torch.Generator().manual_seed(seeds[row])
        chosen = candidates[torch.randperm(candidates.numel(), generator=g)[:num_anchors]].sort().values
        anchors[row, : chosen.numel()] = chosen
        keep[row, : chosen.numel()] = True
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def build_blocks(
    input_ids: Tensor,
    loss_mask: Tensor,
    lengths: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> BlockBatch:
    b, n = anchors.shape
    k = torch.arange(block_size, device=anchors.device)
    positions = anchors[:, :, None] + k  # [b, N, B]
    in_range = positions < lengths[:, None, None]
    gather_at = positions.clamp(max=input_ids.shape[1] - 1).view(b, -1)
    labels = torch.gather(input_ids, 1, gather_at).view(b, n, block_size)
    supervised = torch.gather(loss_mask, 1, gather_at).view(b, n, block_size).bool()
    supervised = supervised & in_range & keep[:, :, None] & (k > 0)
    decay = torch.exp(-(k.clamp(min=1) - 1).float() / gamma)
    weights = supervised.float() * decay

    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, :, 0] = torch.where(keep, labels[:, :, 0], mask_token_id)
    return BlockBatch(
        anchors=anchors,
        keep=keep,
        block_ids=block_ids.view(b, -1),
        block_positions=positions.view(b, -1),
        labels=torch.where(supervised, labels, 0).view(b, -1),
        weights=weights.view(b, -1),
    )


def dense_masks(blocks: BlockBatch, ctx_len: int, kinds: list[LayerKind]) -> dict[str, Tensor]:
    """One boolean SDPA mask per distinct layer kind (CPU path and tests)."""
    b = blocks.anchors.shape[0]
    ctx_positions = torch.arange(ctx_len, device=blocks.anchors.device).expand(b, -1)
    return {
        kind.key: dense_mask(blocks.anchors, blocks.keep, ctx_positions, blocks.block_size, kind)
        for kind in set(kinds)
    }


def flex_block_masks(blocks: BlockBatch, ctx_len: int, kinds: list[LayerKind], create_block_mask) -> dict:
    """One BlockMask per distinct layer kind, H=1 (broadcast over heads: H=num_heads OOMs at long
    context), built once per batch and reused by every layer. `create_block_mask` is the compiled
    builder handed in by flashdraft/distributed/parallelize.py."""
    b, n = blocks.anchors.shape
    q_len = n * blocks.block_size
    masks = {}
    for kind in set(kinds):
        mod = flex_mask_mod(blocks.anchors, blocks.keep, ctx_len, blocks.block_size, kind)
        masks[kind.key] = create_block_mask(mod, b, 1, q_len, ctx_len + q_len, device=blocks.anchors.device)
    return masks


def acceptance_stats(correct: Tensor, weights: Tensor, block_size: int) -> dict[str, Tensor]:
    """Per-position accuracy and simulated acceptance from argmax correctness.

    correct, weights: [b, N*B]. acc@k = P(argmax = label | supervised at k). The simulated acceptance
    length of a block is 1 + the number of leading positions k = 1, 2, ... that are supervised and
    correct (what greedy verification would accept on this teacher-forced context); averaged over
    blocks whose position 1 is supervised. Returned as sums so they add across micro-batches and ranks.
    """
    supervised = (weights > 0).view(-1, block_size)
    hit = (correct.view(-1, block_size) & supervised)[:, 1:]
    leading = hit.int().cumprod(dim=1).sum(dim=1)
    counted = supervised[:, 1]
    return {
        "correct_at": hit.sum(0).double(),
        "supervised_at": supervised[:, 1:].sum(0).double(),
        "accepted_sum": (leading * counted).sum().double(),
        "blocks": counted.sum().double(),
    }


def summarize_acceptance(stats: dict[str, Tensor]) -> dict[str, float]:
    acc = (stats["correct_at"] / stats["supervised_at"].clamp(min=1)).tolist()
    out = {f"acc@{k + 1}": a for k, a in enumerate(acc)}
    blocks = float(stats["blocks"])
    out["tau"] = 1.0 + float(stats["accepted_sum"]) / blocks if blocks else math.nan
    return out
