"""The interval-built DFlash BlockMask against torch's create_block_mask (which evaluates the mask_mod on
every query-key pair), tile for tile, over the rule's variants: kept and padding blocks, windows, causal
blocks, packing's document rule, lengths that are and are not multiples of the 128-wide tile."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flashdraft.model.attention import LayerKind, flex_mask_mod
from flashdraft.model.block_mask import dflash_block_mask
from flashdraft.train.blocks import _within_document

FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _case(seed: int, b: int, n: int, ctx_len: int, packed: bool):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randint(1, ctx_len, (b, n), generator=g).sort(dim=1).values
    keep = torch.rand(b, n, generator=g) > 0.2
    doc_starts = None
    if packed:  # each block's sample starts somewhere at or before its anchor
        doc_starts = (anchors * torch.rand(b, n, generator=g)).long()
    return anchors, keep, doc_starts


@pytest.mark.parametrize(
    "kind", [LayerKind(), LayerKind(causal=True), LayerKind(window=40), LayerKind(causal=True, window=7)]
)
@pytest.mark.parametrize(
    "b,n,block_size,ctx_len,packed",
    [
        (2, 16, 16, 256, False),  # both lengths multiples of the tile
        (3, 9, 16, 300, False),  # neither
        (2, 20, 8, 520, True),  # packed rows
        (1, 5, 4, 1000, True),  # blocks much smaller than a tile, a long context
    ],
)
def test_equals_create_block_mask_tile_for_tile(kind, b, n, block_size, ctx_len, packed):
    anchors, keep, doc_starts = _case(b * 1000 + n, b, n, ctx_len, packed)
    mod = flex_mask_mod(anchors, keep, ctx_len, block_size, kind)
    if doc_starts is not None:
        mod = _within_document(mod, doc_starts, ctx_len, block_size)
    q_len = n * block_size
    expected = create_block_mask(mod, b, 1, q_len, ctx_len + q_len, device="cpu")
    got = dflash_block_mask(anchors, keep, ctx_len, block_size, kind, mod, doc_starts)

    assert got.seq_lengths == expected.seq_lengths and got.BLOCK_SIZE == expected.BLOCK_SIZE
    for field in FIELDS:
        mine, theirs = getattr(got, field), getattr(expected, field)
        assert mine.dtype == theirs.dtype, field
        assert torch.equal(mine, theirs), field
    assert got.mask_mod is mod


def test_a_long_context_has_full_and_partial_tiles():
    """The case the interval count exists for: most context tiles are fully visible (the mask_mod is
    skipped there), the block diagonal is partial, the rest is empty."""
    anchors = torch.arange(2000, 4000, 250)[None]  # 8 blocks of 16: one 128-row query tile
    keep = torch.ones(1, 8, dtype=torch.bool)
    mod = flex_mask_mod(anchors, keep, 4096, 16, LayerKind())
    got = dflash_block_mask(anchors, keep, 4096, 16, LayerKind(), mod)
    # every row sees the 15 tiles before 1920 (< the first anchor, 2000); the tiles up to the last
    # anchor, 3750, and the tile of the blocks' own keys are partial; the rest is empty
    assert got.full_kv_num_blocks.tolist() == [[[15]]]
    assert got.kv_num_blocks.tolist() == [[[30 - 15 + 1]]]
