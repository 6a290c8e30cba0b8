"""Attention kernels and the DFlash attention masks, in two exact forms.

The rule (docs/dflash.md §1, §3), for a query at block position k of block n
(anchor a_n, absolute position a_n + k):
  * context key at absolute position p: visible iff p < a_n (strictly before the anchor: the anchor's
    own target feature does not exist at inference time);
  * block key of block m: visible iff m == n (bidirectional inside a block, blocks never see each other);
  * sliding-window layers additionally require q_pos - k_pos < window, are causal unless configured
    otherwise, and non-causal ones also require k_pos - q_pos < window (z-lab semantics);
  * padding blocks (keep=False) see only their own block, never the context; their loss weight is zero.

`dense_mask` builds the mask as a boolean tensor for SDPA (CPU, decoding, tests);
`flex_mask_mod` expresses the same rule for flex_attention's BlockMask (GPU training).
`decoding_attention_kernels` picks SDPA kernels for loops whose key length changes every step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashdraft.errors import FlashdraftError

try:  # flex_attention exists from torch 2.5; the GPU path needs it, the CPU path does not.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch>=2.6 is required
    BlockMask, flex_attention = None, None


@dataclass(frozen=True)
class LayerKind:
    """What a drafter layer's attention looks like: full (non-causal) or a sliding window."""

    causal: bool = False
    window: int | None = None

    @property
    def key(self) -> str:
        return f"causal={self.causal},window={self.window}"


def dense_mask(
    anchors: Tensor,
    keep: Tensor,
    ctx_positions: Tensor,
    block_size: int,
    kind: LayerKind,
) -> Tensor:
    """Boolean mask [b, 1, N*B, C + N*B] (True = may attend) for N blocks over C context keys.

    anchors, keep: [b, N]; ctx_positions: [b, C] absolute positions of the context keys.
    """
    b, n = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    q_pos = (anchors[:, :, None] + offsets).reshape(b, n * block_size)  # [b, Q]
    q_block = torch.arange(n, device=anchors.device).repeat_interleave(block_size)  # [Q]
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    q_keep = keep.repeat_interleave(block_size, dim=1)  # [b, Q]

    ctx_ok = (ctx_positions[:, None, :] < q_anchor[:, :, None]) & q_keep[:, :, None]  # [b, Q, C]
    blk_ok = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [b, Q, Q]
    if kind.window is not None or kind.causal:
        ctx_dist = q_pos[:, :, None] - ctx_positions[:, None, :]
        blk_dist = q_pos[:, :, None] - q_pos[:, None, :]
        if kind.causal:
            blk_ok = blk_ok & (blk_dist >= 0)
        if kind.window is not None:
            ctx_ok = ctx_ok & (ctx_dist < kind.window)
            blk_ok = blk_ok & (blk_dist < kind.window) & (-blk_dist < kind.window)
    return torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]


def flex_mask_mod(anchors: Tensor, keep: Tensor, ctx_len: int, block_size: int, kind: LayerKind):
    """The same rule as `dense_mask` as a flex_attention mask_mod; context positions are 0..ctx_len-1."""

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        anchor = anchors[b, blk]
        kv_blk_idx = (kv_idx - ctx_len).clamp(min=0)
        is_ctx = kv_idx < ctx_len
        ctx_ok = is_ctx & (kv_idx < anchor) & keep[b, blk]
        blk_ok = (~is_ctx) & (kv_blk_idx // block_size == blk)
        if kind.window is not None or kind.causal:
            q_pos = anchor + q_idx % block_size
            k_pos = torch.where(is_ctx, kv_idx, anchor + kv_blk_idx % block_size)
            dist = q_pos - k_pos
            if kind.causal:
                blk_ok = blk_ok & (dist >= 0)
            if kind.window is not None:
                ctx_ok = ctx_ok & (dist < kind.window)
                blk_ok = blk_ok & (dist < kind.window) & (-dist < kind.window)
        return ctx_ok | blk_ok

    return mask_mod


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None, scale: float) -> Tensor:
    """q [b, h, q, d]; k, v [b, h_kv, kv, d] (grouped-query). A BlockMask selects flex_attention."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        if not torch.compiler.is_compiling():
            # Eager flex_attention materialises the full score matrix and OOMs on real shapes
            # (docs/processes.md): never let it run silently.
            raise FlashdraftError(
                "flex_attention was called outside torch.compile (it would fall back to dense attention); "
                "compile the drafter with flashdraft.distributed.parallelize.compile_drafter or use attention=sdpa"
            )
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if q.shape[1] != k.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def decoding_attention_kernels() -> AbstractContextManager:
    """SDPA without the cuDNN kernel, for decoding loops (target and drafter alike).

    On the H200 (torch 2.11) SDPA prefers cuDNN attention, which builds an execution plan on the first call
    of every new (query, key) length: 37-141 ms each. A decoding loop meets a new key length at every step:
    with an 8-layer 4096-wide target a speculative step took ~100 ms on unseen lengths against 13.5-19 ms on
    seen ones; without cuDNN it takes 13.6-18.8 ms either way (benchmarks/sdpa_decode_probe.py,
    benchmarks/results/sdpa_decode_probe_h200.json). Flash, memory-efficient and math have no per-shape setup."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
