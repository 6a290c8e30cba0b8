"""Grouped-query attention of a decoding step split over the cache's columns, in two Triton kernels
(docs/decoding.md, "Split attention").

A step attends few query tokens (1 plain, a block when verifying) to a cache of hundreds of columns.
PyTorch's fused SDPA kernels give each (row, head, 64 query rows) one thread block that walks every
column in turn: with the query heads of a KV head stacked as its rows, a batch-1 step of a 3-KV-head
model runs on 3 of the H200's 132 SMs, and its time grows with the width. Here the columns are split
into chunks of 64, one thread block per (row, KV head, chunk) computing a partial softmax (its running
max, its sum and its weighted values), and a second kernel combines the chunks, as flash-decoding does.
The output is written in the [rows, queries, heads, dv] layout the output projection reads, with no
copy.

CUDA tensors only (`split_attention_refusal` says why a call cannot take it); the fused layer step
calls `grouped_query_attention` otherwise, which computes the same attention through SDPA.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships no Triton: the step keeps SDPA
    triton = None

_BLOCK_N = 64  # columns a thread block's loop takes at a time, and a chunk's columns up to _COMBINE_VALUES
_MAX_ROWS = 128  # grouped query rows (query heads per KV head × queries) one block holds
_COMBINE_VALUES = 8192  # the chunks' partial values (chunks × head dim) one combine program reads at once

# The order of every sum is fixed by the head dimension alone, never by the call, so that a row attending
# the same keys gets the same bits whether it decodes alone (plain, 1 query) or in a verify block, and
# whatever the attended width (plain and speculative decoding reach a position at different widths):
# - a block holds 64 grouped query rows whenever 64 suffice (128 past that), so that a row's dots and
#   reductions run in one layout;
# - chunks are 64 columns from column 0 (doubled only where the width would need more chunks than the
#   combine reads, past 8,192 columns at head dim 64), so a wider cache adds only chunks masked whole,
#   whose partials are exact zeros;
# - the combine reduces over a fixed count of chunks (the unused ones zeros).
# Widths should be aligned: Triton compiles a kernel variant per integer argument's 16-divisibility (the
# width, the mask's strides), and a bf16 call at width 200 differed by an ulp from one at 448; not
# specializing them cost 22 of 95 us a batch-1 step (measured on the H200). The engine's widths are all
# 64-column bucket multiples, its buffers' too (docs/decoding.md, "The order rule").
# Measured before this rule (334f092), a chunk size picked from the width left one of 164 batch-16
# greedy outputs past the lossless check's tie rule (docs/decoding.md, "Split attention").


def split_attention_refusal(query: Tensor, key: Tensor, mask: Tensor) -> str | None:
    """Why `split_attention` cannot compute this call, or None (query [b, heads, q, d], key
    [b, kv, cols, d], mask [b, 1, q, cols] additive)."""
    if triton is None:
        return "this torch has no Triton"
    if not query.is_cuda:
        return "its tensors are not on a CUDA device"
    if mask.dtype == torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return "its mask is not a [b, 1, queries, cols] additive mask"
    if query.shape[1] // key.shape[1] * query.shape[2] > _MAX_ROWS:
        return f"its grouped query rows exceed {_MAX_ROWS}"
    if query.shape[-1] > 256:
        return "its head dimension exceeds 256"
    return None


def _padded(n: int) -> int:
    """A head dimension as a block's: a power of 2, at least 16 (tl.dot's least; the padding is zeros)."""
    return max(16, 1 << max(0, n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _partial_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, acc_ptr, max_ptr, sum_ptr,
        q_sr, q_sh, q_sq, q_sd,
        k_sr, k_sh, k_sc, k_sd,
        v_sr, v_sh, v_sc, v_sd,
        b_sr, b_sq, b_sc,
        kv_heads, queries, width, chunk, splits, scale,
        GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        row_kv = tl.program_id(0)
        split = tl.program_id(1)
        row = row_kv // kv_heads
        kv = row_kv % kv_heads
        # grouped query row m: query token m // GROUPS of query head kv * GROUPS + m % GROUPS
        m = tl.arange(0, BLOCK_M)
        token = m // GROUPS
        head = kv * GROUPS + m % GROUPS
        m_valid = m < GROUPS * queries
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        q = tl.load(
            q_ptr + row * q_sr + head[:, None] * q_sh + token[:, None] * q_sq + d[None, :] * q_sd,
            mask=m_valid[:, None] & (d[None, :] < D),
            other=0.0,
        )
        start = split * chunk
        end = tl.minimum(start + chunk, width)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
        for c0 in range(start, end, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            c_valid = c < end
            k = tl.load(
                k_ptr + row * k_sr + kv * k_sh + c[None, :] * k_sc + d[:, None] * k_sd,
                mask=c_valid[None, :] & (d[:, None] < D),
                other=0.0,
            )
            scores = tl.dot(q, k, input_precision=PRECISION) * scale
            bias = tl.load(
                bias_ptr + row * b_sr + token[:, None] * b_sq + c[None, :] * b_sc,
                mask=m_valid[:, None] & c_valid[None, :],
                other=float("-inf"),
            )
            scores = scores + bias.to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a chunk masked whole adds 0
            probs = tl.exp(scores - safe_max[:, None])
            decay = tl.exp(running_max - safe_max)
            running_sum = running_sum * decay + tl.sum(probs, 1)
            v = tl.load(
                v_ptr + row * v_sr + kv * v_sh + c[:, None] * v_sc + dv[None, :] * v_sd,
                mask=c_valid[:, None] & (dv[None, :] < DV),
                other=0.0,
            )
            acc = acc * decay[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
            running_max = new_max
        part = row_kv * splits + split
        tl.store(max_ptr + part * BLOCK_M + m, running_max)
        tl.store(sum_ptr + part * BLOCK_M + m, running_sum)
        tl.store(acc_ptr + (part * BLOCK_M + m[:, None]) * DV_PAD + dv[None, :], acc)

    @triton.jit
    def _combine_kernel(
        acc_ptr, max_ptr, sum_ptr, out_ptr,
        o_sr, o_sq, o_sh, o_sd,
        kv_heads, queries, splits,
        GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):  # fmt: skip
        # one program a grouped query row: every chunk's partial read at once, not chunk after chunk
        program = tl.program_id(0)
        row_kv = program // (GROUPS * queries)
        m = program % (GROUPS * queries)
        row = row_kv // kv_heads
        head = (row_kv % kv_heads) * GROUPS + m % GROUPS
        chunk = tl.arange(0, SPLITS_PAD)
        chunk_valid = chunk < splits
        part = row_kv * splits + chunk
        chunk_max = tl.load(max_ptr + part * BLOCK_M + m, mask=chunk_valid, other=float("-inf"))
        total_max = tl.max(chunk_max, 0)
        weight = tl.exp(chunk_max - tl.where(total_max == float("-inf"), 0.0, total_max))
        total_sum = tl.sum(tl.load(sum_ptr + part * BLOCK_M + m, mask=chunk_valid, other=0.0) * weight, 0)
        dv = tl.arange(0, DV_PAD)
        acc = tl.load(
            acc_ptr + (part[:, None] * BLOCK_M + m) * DV_PAD + dv[None, :],
            mask=chunk_valid[:, None],
            other=0.0,
        )
        out = tl.sum(acc * weight[:, None], 0) / total_sum
        tl.store(
            out_ptr + row * o_sr + (m // GROUPS) * o_sq + head * o_sh + dv * o_sd,
            out.to(out_ptr.dtype.element_ty),
            mask=dv < DV,
        )


def _split_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float) -> Tensor:
    rows, heads, queries, dim = query.shape
    kv_heads, width, dim_v = key.shape[1], key.shape[2], value.shape[-1]
    groups = heads // kv_heads
    block_m = 64 if groups * queries <= 64 else _MAX_ROWS
    dv_pad = _padded(dim_v)
    most_chunks = _COMBINE_VALUES // dv_pad
    chunk = _BLOCK_N
    while math.ceil(width / chunk) > most_chunks:
        chunk *= 2
    splits = math.ceil(width / chunk)
    parts = rows * kv_heads * splits
    device = query.device
    acc = torch.empty(parts * block_m * dv_pad, dtype=torch.float32, device=device)
    running_max = torch.empty(parts * block_m, dtype=torch.float32, device=device)
    running_sum = torch.empty(parts * block_m, dtype=torch.float32, device=device)
    out = torch.empty(rows, queries, heads, dim_v, dtype=query.dtype, device=device)
    # fp32 stays fp32 (no TF32: the checks compare in it); "tf32", Triton's default, leaves bf16 as it is
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _partial_kernel[(rows * kv_heads, splits)](
        query, key, value, mask, acc, running_max, running_sum,
        *query.stride(), *key.stride(), *value.stride(),
        mask.stride(0), mask.stride(2), mask.stride(3),
        kv_heads, queries, width, chunk, splits, scaling,
        GROUPS=groups, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, D=dim, DV=dim_v,
        D_PAD=_padded(dim), DV_PAD=dv_pad, PRECISION=precision,
    )  # fmt: skip
    _combine_kernel[(rows * kv_heads * groups * queries,)](
        acc, running_max, running_sum, out, *out.stride(), kv_heads, queries, splits,
        GROUPS=groups, BLOCK_M=block_m, DV=dim_v, DV_PAD=dv_pad, SPLITS_PAD=most_chunks,
    )  # fmt: skip
    return out


@torch.library.custom_op("flashdraft::split_attention", mutates_args=())
def split_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """Attention of query [b, heads, q, d] to key and value [b, kv, cols, d] with the additive mask
    [b, 1, q, cols], query head h reading KV head h // (heads // kv); returns [b, q, heads, dv]: what
    `grouped_query_attention` returns, with the cache's columns split over thread blocks. An op of its
    own, so that a compiled step calls the two kernels as they are."""
    return _split_attention(query, key, value, mask, scaling)


@split_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float) -> Tensor:
    rows, heads, queries, _ = query.shape
    return query.new_empty(rows, queries, heads, value.shape[-1])
