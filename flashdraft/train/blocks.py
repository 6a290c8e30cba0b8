"""The DFlash objective's pieces: anchors, blocks, masks, weights and acceptance sums (docs/dflash.md §3).

Per sequence: sample N anchors among supervised positions with room for a block (fresh each epoch);
blocks are [x_anchor, MASK x (B-1)] at positions anchor..anchor+B-1; block position k >= 1 predicts
the token at anchor+k ("same-position" labels, docs/dflash.md §4); weight exp(-(k-1)/γ) times the loss mask;
loss = Σ w·CE / Σ w. Attention follows the rule in flashdraft/model/attention.py.

Packed rows (several samples a row, docs/packing.md) keep every rule per sample: anchors, labels, RoPE
positions and the context a block sees stay inside the block's own sample.

Each alignment trap of docs/dflash.md §4 (labels shifted by one, context visible at kv <= anchor, blocks seeing each
other, padding blocks contributing) has a test in tests/train/test_objective.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flashdraft.data.tokens import TokenBatch, to_device
from flashdraft.model.attention import LayerKind, dense_mask, flex_mask_mod
from flashdraft.model.block_mask import dflash_block_mask


@dataclass
class BlockBatch:
    """N blocks per sequence, flattened to N*B block positions per row."""

    anchors: Tensor  # [b, N] anchor positions (0 for padding blocks)
    keep: Tensor  # [b, N] bool: real block (False: padding, sees nothing of the context, weight 0)
    block_ids: Tensor  # [b, N*B] [x_anchor, MASK, ...]; padding blocks are all MASK
    block_positions: Tensor  # [b, N*B] RoPE positions anchor + k (within the sample in a packed row)
    labels: Tensor  # [b, N*B] token at anchor + k (0 where not supervised)
    weights: Tensor  # [b, N*B] float32 exp(-(k-1)/γ) · loss_mask · keep · (k >= 1)
    # [R] indices into the flattened weights of the positions that carry weight (the LM-head rows),
    # found where the blocks are built (on the host): on the GPU, nonzero() would wait for the device.
    rows: Tensor
    # Packed rows (docs/packing.md): where each block's sample starts in the row. block_positions are then
    # positions within the sample (RoPE sees each sample as if alone) while anchors stay row indices.
    doc_starts: Tensor | None = None  # [b, N]; None: every row is one sample starting at 0

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[1] // self.anchors.shape[1]

    @property
    def context_lengths(self) -> Tensor:
        """[b, N] context tokens each block sees (before its anchor, within its own sample)."""
        return self.anchors if self.doc_starts is None else self.anchors - self.doc_starts

    def to(self, device: torch.device) -> BlockBatch:
        """Through pinned memory on CUDA (`to_device`): a non-blocking copy from pageable memory would
        wait for the GPU's queued work, stalling the step at every batch."""
        fields = (
            "anchors",
            "keep",
            "block_ids",
            "block_positions",
            "labels",
            "weights",
            "rows",
            "doc_starts",
        )
        return BlockBatch(
            *(None if getattr(self, f) is None else to_device(getattr(self, f), device) for f in fields)
        )


def anchor_counts(candidates: list[int], num_anchors: int, rows: int, budget: bool) -> list[int]:
    """Anchors per sample. per_row: up to `num_anchors` each. budget: `num_anchors * rows` for the whole
    micro-batch, shared in proportion to each sample's candidates (largest remainder, ties to the earlier
    sample), never more than a sample's candidates."""
    if not budget:
        return [min(num_anchors, c) for c in candidates]
    total, available = num_anchors * rows, sum(candidates)
    if total >= available:
        return list(candidates)
    shares = [total * c / available for c in candidates]
    counts = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - shares[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def sample_anchors(
    loss_mask: Tensor,
    lengths: Tensor,
    num_anchors: int,
    block_size: int,
    seeds: list[int],
    doc_lengths: list[list[int]] | None = None,
    budget: bool = False,
) -> tuple[Tensor, Tensor]:
    """Anchors per sample, uniformly among its positions p <= sample_end - B with a supervised token; sorted.
    Each sample draws from its own seed, so the choice depends only on (seed, epoch, sample) and how many it
    gets: resume is exact without saving generator state. A packed row (`doc_lengths`) draws per sample,
    inside the sample: an anchor never straddles two samples (docs/packing.md). How many each sample gets:
    `anchor_counts`. The width N is `num_anchors` for one sample a row and per-sample counts (as before),
    else the largest row's total."""
    b = loss_mask.shape[0]
    spans = doc_lengths if doc_lengths is not None else [[int(n)] for n in lengths]
    candidates: list[Tensor] = []
    for row, docs in enumerate(spans):
        start = 0
        for n in docs:
            last = start + n - block_size
            with_room = loss_mask[row, start : max(last + 1, start)]
            candidates.append(with_room.nonzero().flatten().cpu() + start)
            start += n
    counts = anchor_counts([c.numel() for c in candidates], num_anchors, b, budget)
    chosen_per_row: list[list[Tensor]] = [[] for _ in range(b)]
    doc = 0
    for row, docs in enumerate(spans):
        for _ in docs:
            found, count = candidates[doc], counts[doc]
            if count:
                g = torch.Generator().manual_seed(seeds[doc])
                chosen_per_row[row].append(
                    found[torch.randperm(found.numel(), generator=g)[:count]].sort().values
                )
            doc += 1
    totals = [sum(c.numel() for c in row) for row in chosen_per_row]
    width = num_anchors if doc_lengths is None and not budget else max(1, *totals)
    anchors = torch.zeros(b, width, dtype=torch.long)
    keep = torch.zeros(b, width, dtype=torch.bool)
    for row, parts in enumerate(chosen_per_row):
        if parts:
            anchors[row, : totals[row]] = torch.cat(parts)
            keep[row, : totals[row]] = True
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
    position_ids: Tensor | None = None,
) -> BlockBatch:
    """`position_ids` (packed rows): each token's position within its sample; a block position is in range
    while it stays inside the anchor's sample."""
    b, n = anchors.shape
    k = torch.arange(block_size, device=anchors.device)
    positions = anchors[:, :, None] + k  # [b, N, B]
    in_range = positions < lengths[:, None, None]
    gather_at = positions.clamp(max=input_ids.shape[1] - 1).view(b, -1)
    doc_starts, rope_positions = None, positions
    if position_ids is not None:
        within = torch.gather(position_ids, 1, anchors)  # the anchor's position within its sample
        doc_starts = anchors - within
        rope_positions = within[:, :, None] + k
        # Inside the sample the positions count on by one; the next sample restarts at 0.
        in_range = in_range & (
            torch.gather(position_ids, 1, gather_at).view(b, n, block_size) == rope_positions
        )
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
        block_positions=rope_positions.reshape(b, -1),
        labels=torch.where(supervised, labels, 0).view(b, -1),
        weights=weights.view(b, -1),
        doc_starts=doc_starts,
        rows=weights.flatten().nonzero().flatten(),
    )


def blocks_for(
    batch: TokenBatch,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    budget: bool = False,
) -> BlockBatch:
    """Anchors and blocks of a token batch (packed or not): what the objective trains on."""
    anchors, keep = sample_anchors(
        batch.loss_mask, batch.lengths, num_anchors, block_size, batch.seeds, batch.doc_lengths, budget
    )
    return build_blocks(
        batch.input_ids,
        batch.loss_mask,
        batch.lengths,
        anchors,
        keep,
        block_size,
        mask_token_id,
        gamma,
        batch.position_ids,
    )


def dense_masks(blocks: BlockBatch, ctx_len: int, kinds: list[LayerKind]) -> dict[str, Tensor]:
    """One boolean SDPA mask per distinct layer kind (CPU path and tests). Masks are built on row indices
    (anchors and context 0..ctx_len-1); in a packed row a block also sees no context before its own sample's
    start (the document rule, docs/packing.md): with `kv < anchor` that keeps it inside its sample."""
    b = blocks.anchors.shape[0]
    ctx_positions = torch.arange(ctx_len, device=blocks.anchors.device).expand(b, -1)
    masks = {}
    for kind in set(kinds):
        mask = dense_mask(blocks.anchors, blocks.keep, ctx_positions, blocks.block_size, kind)
        if blocks.doc_starts is not None:
            q_start = blocks.doc_starts.repeat_interleave(blocks.block_size, dim=1)  # [b, Q]
            own_doc = ctx_positions[:, None, :] >= q_start[:, :, None]  # [b, Q, C]
            mask[:, 0, :, :ctx_len] &= own_doc
        masks[kind.key] = mask
    return masks


def flex_block_masks(blocks: BlockBatch, ctx_len: int, kinds: list[LayerKind]) -> dict:
    """One BlockMask per distinct layer kind, H=1 (broadcast over heads: H=num_heads OOMs at long
    context), built once per batch from the rule's intervals (flashdraft/model/block_mask.py: no
    compile, no sync) and reused by every layer."""
    masks = {}
    # The mask_mods see the context length as a device scalar, not a Python int: an int in their closure
    # is a constant to torch.compile, and each new padded length would compile the drafter's layers
    # again (distributed/parallelize.py, CONTEXT_DYNAMIC_SOURCES). int32 as flex's kv_idx; a fill, no sync.
    context_length = torch.full((), ctx_len, dtype=torch.int32, device=blocks.anchors.device)
    for kind in set(kinds):
        mod = flex_mask_mod(blocks.anchors, blocks.keep, context_length, blocks.block_size, kind)
        if blocks.doc_starts is not None:
            mod = _within_document(mod, blocks.doc_starts, context_length, blocks.block_size)
        masks[kind.key] = dflash_block_mask(
            blocks.anchors, blocks.keep, ctx_len, blocks.block_size, kind, mod, blocks.doc_starts
        )
    return masks


def _within_document(mask_mod, doc_starts: Tensor, ctx_len: Tensor, block_size: int):
    """The document rule of `dense_masks` added to a flex mask_mod: no context key before the block's sample."""

    def mod(b, h, q_idx, kv_idx):
        in_own_doc = (kv_idx >= ctx_len) | (kv_idx >= doc_starts[b, q_idx // block_size])
        return mask_mod(b, h, q_idx, kv_idx) & in_own_doc

    return mod


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
