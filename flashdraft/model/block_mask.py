"""The DFlash BlockMask built from the rule's intervals, with plain tensor ops and no compile.

flex_attention skips the 128 x 128 tiles of the score matrix that a BlockMask marks empty, runs the
mask_mod only inside partly visible tiles, and skips it in fully visible ones. torch's
`create_block_mask` finds those tiles by evaluating the mask_mod on every (query, key) pair; eagerly
that materialises the dense mask, so training compiled it, and that compile cost the first step 11.1 s
on the H200 (docs/shards.md, "The first step").

The DFlash rule (flashdraft/model/attention.py) needs no such search: every query row sees at most two
intervals of keys, one of context and one inside its own block. The number of visible pairs of a tile
is then the sum over its rows of the intervals' overlaps with the tile's keys, which is exactly what
`create_block_mask` counts, and a tile is full when that sum is its size, partial when it is between.
`tests/model/test_block_mask.py` checks the result equal to `create_block_mask`'s, tile for tile.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flashdraft.model.attention import LayerKind

TILE = 128  # flex_attention's default sparse block size, for queries and keys alike


def _row_intervals(
    anchors: Tensor,
    keep: Tensor,
    doc_starts: Tensor | None,
    ctx_len: int,
    block_size: int,
    kind: LayerKind,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query row [b, Q]: the visible context keys [ctx_lo, ctx_hi) and block keys [blk_lo, blk_hi),
    as key indices (context keys 0..ctx_len-1, block n's keys ctx_len + n*block_size + j)."""
    b, n = anchors.shape
    device = anchors.device
    offset = torch.arange(block_size, device=device)  # k: the query's position in its block
    anchor = anchors[:, :, None].expand(b, n, block_size)
    q_pos = anchor + offset  # the query's absolute position

    # context: kv < anchor, only for kept blocks; from the sample's start (packing's document rule);
    # a window keeps q_pos - kv < window, i.e. kv >= q_pos - window + 1
    ctx_hi = torch.where(keep[:, :, None], anchor.clamp(0, ctx_len), 0)
    ctx_lo = torch.zeros_like(ctx_hi)
    if doc_starts is not None:
        ctx_lo = doc_starts[:, :, None].expand(b, n, block_size).clamp(0, ctx_len)
    if kind.window is not None:
        ctx_lo = torch.maximum(ctx_lo, q_pos - kind.window + 1)

    # own block: key j of block n, distance k - j; causal keeps j <= k, a window |k - j| < window
    first = ctx_len + torch.arange(n, device=device)[None, :, None] * block_size  # [1, n, 1]
    blk_lo = torch.zeros_like(offset)
    blk_hi = torch.full_like(offset, block_size)
    if kind.causal:
        blk_hi = torch.minimum(blk_hi, offset + 1)
    if kind.window is not None:
        blk_lo = torch.maximum(blk_lo, offset - kind.window + 1)
        blk_hi = torch.minimum(blk_hi, offset + kind.window)
    blk_lo = (first + blk_lo).expand(b, n, block_size)
    blk_hi = (first + blk_hi).expand(b, n, block_size)
    return tuple(t.reshape(b, n * block_size) for t in (ctx_lo, ctx_hi, blk_lo, blk_hi))


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """A [b, 1, q_tiles, kv_tiles] tile map as flex's (count, indices): the marked tiles first, in order."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, indices


def dflash_block_mask(
    anchors: Tensor,
    keep: Tensor,
    ctx_len: int,
    block_size: int,
    kind: LayerKind,
    mask_mod,
    doc_starts: Tensor | None = None,
) -> BlockMask:
    """The H=1 BlockMask of `mask_mod` (the DFlash rule for these anchors, `flex_mask_mod`, with the
    document rule when `doc_starts` is given) over N*block_size queries and ctx_len + N*block_size keys,
    equal to `create_block_mask(mask_mod, b, 1, Q, KV)`; no host sync, no compile."""
    b, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    q_tiles, kv_tiles = -(-q_len // TILE), -(-kv_len // TILE)
    pad = q_tiles * TILE - q_len  # padded query rows see nothing
    ctx_lo, ctx_hi, blk_lo, blk_hi = (
        torch.nn.functional.pad(bound, (0, pad))
        for bound in _row_intervals(anchors, keep, doc_starts, ctx_len, block_size, kind)
    )
    tile_lo = torch.arange(kv_tiles, device=anchors.device) * TILE
    tile_hi = (tile_lo + TILE).clamp(max=kv_len)  # padded keys are never visible

    def overlap(lo: Tensor, hi: Tensor) -> Tensor:  # [b, Q] intervals against every tile: [b, Q, kv_tiles]
        return (torch.minimum(hi[..., None], tile_hi) - torch.maximum(lo[..., None], tile_lo)).clamp(min=0)

    visible = overlap(ctx_lo, ctx_hi) + overlap(blk_lo, blk_hi)
    per_tile = visible.view(b, 1, q_tiles, TILE, kv_tiles).sum(dim=3)  # [b, 1, q_tiles, kv_tiles]
    full = per_tile == TILE * TILE
    partial = (per_tile > 0) & ~full
    kv_count, kv_indices = _ordered(partial)
    full_count, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_count,
        kv_indices,
        full_count,
        full_indices,
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )
