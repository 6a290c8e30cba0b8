"""Cross-entropy's two passes over a chunk's logits as two Triton kernels (`train.fused_ce`, docs/fp8.md).

Inductor compiles `train/loss.py::chunk_rows` into a row reduction (max, log-sum-exp, argmax, the label's
logit) and a pass that writes the gradient q - onehot(label), cast for the head's second GEMM. Measured on
an H100 at 9418e80 they take 2.74 and 3.85 ms a step at shape (a), about 4x what their bytes need at the
memory bandwidth (`benchmarks/head_probe.py`). Here:

- `row_stats`: one program per row walks the vocabulary once, keeping per lane an online maximum and sum of
  exponentials and the first index of the lane's largest logit; the lanes are combined at the end. It
  returns the log-sum-exp, the label's logit and the argmax (the first of ties, as torch.argmax).
- `softmax_grad`: one program per (row, vocabulary slice) writes (q - onehot(label)) * multiplier * scale,
  clamped to the output dtype's range and cast to it: e5m2 for the FP8 head, whose scale comes from
  `loss.py::ce_grad_amax` (no pass over the gradient finds it), or bf16 with scale 1 for the plain head.

Both read the logits in the dtype the head's GEMM wrote them (bf16) and compute in fp32, as the compiled
function does (`logits.float() * multiplier`). CUDA tensors; with TRITON_INTERPRET=1 set before this module
is imported, Triton's interpreter runs them on the CPU (the tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships no Triton: train.fused_ce is refused there
    triton = None

_STATS_BLOCK = 2048  # vocabulary entries a row program reads at a time
_GRAD_BLOCK = 4096  # vocabulary entries per gradient program
_NEG_START = -1.0e30  # the running maximum's start: finite, so exp(start - start) is 1, not nan


def available() -> bool:
    """Whether the kernels can run here (Triton importable)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _row_stats_kernel(
        logits_ptr,
        labels_ptr,
        lse_ptr,
        label_logit_ptr,
        argmax_ptr,
        vocab,
        stride,
        multiplier,
        BLOCK: tl.constexpr,
        NEG_START: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        lanes = tl.arange(0, BLOCK)
        running_max = tl.full([BLOCK], NEG_START, tl.float32)
        running_sum = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_at = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            at = start + lanes
            z = tl.load(base + at, mask=at < vocab, other=float("-inf")).to(tl.float32) * multiplier
            new_max = tl.maximum(running_max, z)
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(z - new_max)
            running_max = new_max
            better = z > best  # strict: a lane keeps the first index of its largest value
            best = tl.where(better, z, best)
            best_at = tl.where(better, at, best_at)
        row_max = tl.max(running_max, axis=0)
        total = tl.sum(running_sum * tl.exp(running_max - row_max), axis=0)
        tl.store(lse_ptr + row, row_max + tl.log(total))
        top = tl.max(best, axis=0)
        tl.store(argmax_ptr + row, tl.min(tl.where(best == top, best_at, vocab), axis=0))
        label = tl.load(labels_ptr + row)
        tl.store(label_logit_ptr + row, tl.load(base + label).to(tl.float32) * multiplier)

    @triton.jit
    def _softmax_grad_kernel(
        logits_ptr,
        labels_ptr,
        lse_ptr,
        out_ptr,
        scale_ptr,
        vocab,
        stride,
        out_stride,
        multiplier,
        largest,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = at < vocab
        z = tl.load(logits_ptr + row.to(tl.int64) * stride + at, mask=inside, other=0.0).to(tl.float32)
        q = tl.exp(z * multiplier - tl.load(lse_ptr + row))
        grad = q - tl.where(at == tl.load(labels_ptr + row), 1.0, 0.0)
        scaled = tl.clamp(grad * (multiplier * tl.load(scale_ptr)), -largest, largest)
        out = out_ptr + row.to(tl.int64) * out_stride + at
        tl.store(out, scaled.to(out_ptr.dtype.element_ty), mask=inside)


def row_stats(logits: Tensor, labels: Tensor, multiplier: float) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp, the label's logit, argmax) per row of `logits` [n, V] times `multiplier`, in fp32
    (argmax int64)."""
    n, vocab = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    label_logit = torch.empty_like(lse)
    argmax = torch.empty(n, dtype=torch.int32, device=logits.device)
    if n:
        _row_stats_kernel[(n,)](
            logits,
            labels,
            lse,
            label_logit,
            argmax,
            vocab,
            logits.stride(0),
            float(multiplier),
            BLOCK=_STATS_BLOCK,
            NEG_START=_NEG_START,
        )
    return lse, label_logit, argmax.long()


def softmax_grad(
    logits: Tensor, labels: Tensor, lse: Tensor, multiplier: float, scale: Tensor, dtype: torch.dtype
) -> Tensor:
    """(softmax(logits * multiplier) - onehot(labels)) * multiplier * scale, clamped to `dtype`'s range, in
    `dtype` [n, V]. `scale` is a one-element fp32 tensor (the FP8 cast's, or 1)."""
    n, vocab = logits.shape
    out = torch.empty(n, vocab, dtype=dtype, device=logits.device)
    if n:
        grid = (n, triton.cdiv(vocab, _GRAD_BLOCK))
        _softmax_grad_kernel[grid](
            logits,
            labels,
            lse,
            out,
            scale,
            vocab,
            logits.stride(0),
            out.stride(0),
            float(multiplier),
            float(torch.finfo(dtype).max),
            BLOCK=_GRAD_BLOCK,
        )
    return out
