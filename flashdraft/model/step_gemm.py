"""A decoding step's projections at a few rows, in one Triton kernel each, with the RMSNorm before them and
the gate's SiLU or the residual add after them inside it (docs/decoding.md, "Step GEMMs").

A step of a small model multiplies a few token rows (1 plain, a block of 8 verifying, 16 rows of a
batch) by each weight: the time is the weight's read and the kernel's start, and cuBLAS's kernels for
such shapes take 3-4.5 µs on the H200 where the read alone takes under one. Every thread block here
takes a slice of the weight's output columns for all the rows; the norm's statistics are computed by
each block for the few rows it holds (their reads are a few KB), the gate and up halves of a gated MLP
are read side by side so that the block writes SiLU(gate) · up, and the residual is added before the
store. That is three to four kernels fewer a layer than norm, GEMM, activation and add apart.

CUDA tensors only, at most `MAX_ROWS` rows (`step_gemm_refusal`); the fused layer step computes with
PyTorch otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashdraft.model.split_attention import triton

if triton is not None:
    import triton.language as tl

MAX_ROWS = 16  # token rows one thread block holds (tl.dot's least M): more go to cuBLAS
_BLOCK_N = 32  # output columns a block computes
_BLOCK_K = 64  # input columns a block's loop takes at a time
_WARPS, _STAGES = 4, 3


def step_gemm_refusal(x: Tensor, weight: Tensor) -> str | None:
    """Why `step_gemm` cannot compute `x @ weight.T`, or None."""
    if triton is None:
        return "this torch has no Triton"
    if not x.is_cuda:
        return "its tensors are not on a CUDA device"
    if x.shape[:-1].numel() > MAX_ROWS:
        return f"it has more than {MAX_ROWS} rows"
    if weight.stride(-1) != 1:
        return "its weight's rows are not contiguous"
    return None


if triton is not None:

    @triton.jit
    def _step_gemm_kernel(
        x_ptr, w_ptr, bias_ptr, norm_ptr, residual_ptr, out_ptr,
        rows, n_out, k_in, x_sm, w_sn, r_sm, o_sm, eps,
        NORM: tl.constexpr, GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        m = tl.arange(0, BLOCK_M)
        m_valid = m < rows
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = n < n_out
        if NORM:  # RMSNorm's statistic of each row, in fp32, as the norm module computes it
            squares = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, k_in, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(
                    x_ptr + m[:, None] * x_sm + k[None, :], mask=m_valid[:, None] & (k[None, :] < k_in)
                )
                xk = xk.to(tl.float32)
                squares += tl.sum(xk * xk, 1)
            inverse_rms = tl.rsqrt(squares / k_in + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_valid = k < k_in
            xk = tl.load(x_ptr + m[:, None] * x_sm + k[None, :], mask=m_valid[:, None] & k_valid[None, :])
            if NORM:  # normalized in fp32, rounded to the input's dtype, then scaled (Llama's RMSNorm)
                scale = tl.load(norm_ptr + k, mask=k_valid)
                xk = (xk.to(tl.float32) * inverse_rms[:, None]).to(xk.dtype) * scale[None, :]
            w = tl.load(w_ptr + n[None, :] * w_sn + k[:, None], mask=n_valid[None, :] & k_valid[:, None])
            acc += tl.dot(xk, w, input_precision=PRECISION)
            if GATED:  # the up half's rows follow the gate's
                w_up = tl.load(
                    w_ptr + (n[None, :] + n_out) * w_sn + k[:, None], mask=n_valid[None, :] & k_valid[:, None]
                )
                acc_up += tl.dot(xk, w_up, input_precision=PRECISION)
        out_dtype = out_ptr.dtype.element_ty
        if BIAS:
            acc += tl.load(bias_ptr + n, mask=n_valid)[None, :].to(tl.float32)
            if GATED:
                acc_up += tl.load(bias_ptr + n_out + n, mask=n_valid)[None, :].to(tl.float32)
        if GATED:  # SiLU(gate) · up, each rounded as the eager MLP rounds them
            gate = acc.to(out_dtype).to(tl.float32)
            acc = (gate * tl.sigmoid(gate)).to(out_dtype).to(tl.float32) * acc_up.to(out_dtype).to(tl.float32)
        if RESIDUAL:  # the sum of the rounded product and the residual, as `residual + linear(x)`
            residual = tl.load(
                residual_ptr + m[:, None] * r_sm + n[None, :], mask=m_valid[:, None] & n_valid[None, :]
            )
            acc = acc.to(out_dtype).to(tl.float32) + residual.to(tl.float32)
        tl.store(
            out_ptr + m[:, None] * o_sm + n[None, :],
            acc.to(out_dtype),
            mask=m_valid[:, None] & n_valid[None, :],
        )


def _step_gemm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    norm_weight: Tensor | None,
    eps: float,
    gated: bool,
    residual: Tensor | None,
) -> Tensor:
    k_in = x.shape[-1]
    rows = x.shape[:-1].numel()
    flat = x.reshape(rows, k_in)
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    flat_residual = residual.reshape(rows, n_out) if residual is not None else out
    _step_gemm_kernel[(triton.cdiv(n_out, _BLOCK_N),)](
        flat, weight, bias if bias is not None else out, norm_weight if norm_weight is not None else out,
        flat_residual, out,
        rows, n_out, k_in, flat.stride(0), weight.stride(0), flat_residual.stride(0), out.stride(0), eps,
        NORM=norm_weight is not None, GATED=gated, BIAS=bias is not None, RESIDUAL=residual is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=_WARPS, num_stages=_STAGES,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n_out)


@torch.library.custom_op("flashdraft::step_gemm", mutates_args=())
def step_gemm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    norm_weight: Tensor | None,
    eps: float,
    gated: bool,
    residual: Tensor | None,
) -> Tensor:
    """`linear(norm(x), weight, bias)` for x [..., k] of at most `MAX_ROWS` rows, weight [n, k]: the norm
    an RMSNorm with `norm_weight` and `eps` (None: no norm); `gated`: the weight stacks a gated MLP's gate
    and up halves and the result is SiLU(gate) · up [..., n / 2]; `residual` (None: none) is added to the
    result. An op of its own, so that a compiled step calls the kernel as it is."""
    return _step_gemm(x, weight, bias, norm_weight, eps, gated, residual)


@step_gemm.register_fake
def _(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    norm_weight: Tensor | None,
    eps: float,
    gated: bool,
    residual: Tensor | None,
) -> Tensor:
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    return x.new_empty(*x.shape[:-1], n_out)
