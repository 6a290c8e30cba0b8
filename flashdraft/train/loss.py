"""Weighted cross-entropy through the frozen LM head without a [tokens x vocab] blow-up.

Only rows with non-zero weight reach the head. Rows are processed in fixed-size chunks; each chunk's
logits live only inside the chunk, and the gradient w.r.t. the hidden rows is computed in the same
pass (the loss is a scalar, so the backward is a rescale). The head's weight is frozen: no weight
gradient is ever formed. With a 152k vocabulary and 8k block positions, full fp32 logits would be
~5 GB; a 1024-row chunk holds ~0.6 GB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def chunk_loss_and_grad(
    hidden: Tensor, weight: Tensor, labels: Tensor, row_weights: Tensor, multiplier: float
):
    """Σ w·CE, argmax correctness and d(Σ w·CE)/d hidden for one chunk (compiled on GPU)."""
    logits = F.linear(hidden, weight).float()
    if multiplier != 1.0:
        logits = logits * multiplier
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, labels[:, None])[:, 0]
    loss_sum = ((lse - target_logit) * row_weights).sum()
    correct = logits.argmax(dim=-1) == labels
    probs = torch.exp(logits - lse[:, None])
    probs = probs - F.one_hot(labels, probs.shape[-1]).to(probs.dtype)
    grad_logits = (probs * (row_weights * multiplier)[:, None]).to(hidden.dtype)
    return loss_sum, correct, grad_logits @ weight


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk, multiplier, chunk_fn):
        rows = hidden.shape[0]
        total = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.empty(rows, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            loss_sum, ok, g = chunk_fn(
                hidden[start:end], weight, labels[start:end], row_weights[start:end], multiplier
            )
            total = total + loss_sum
            correct[start:end] = ok
            grad[start:end] = g
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None


class WeightedHeadLoss:
    """Σ w·CE over the selected rows through a frozen head. `compile=True` (on GPU) compiles the chunk
    function once, fullgraph: the loss owns its kernels, as the drafter's layers are compiled by
    `distributed/parallelize.py` and the optimizer's update by `train/optim.py`."""

    def __init__(self, chunk: int = 1024, multiplier: float = 1.0, *, compile: bool = False):
        self.chunk = chunk
        self.multiplier = multiplier
        self.chunk_fn: Callable = (
            torch.compile(chunk_loss_and_grad, fullgraph=True) if compile else chunk_loss_and_grad
        )

    def __call__(
        self, hidden: Tensor, head_weight: Tensor, labels: Tensor, row_weights: Tensor
    ) -> tuple[Tensor, Tensor]:
        """hidden [T, H] rows with non-zero weight; returns (Σ w·CE as fp32 scalar, correct [T] bool)."""
        rows = hidden.shape[0]
        if rows == 0:
            return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
        # No padding to whole chunks (it cost ~6% of the head's FLOPs): full chunks run the graph compiled
        # for `chunk` rows, and the remainder one dynamic-shape graph compiled once.
        total, correct = _FusedLinearCrossEntropy.apply(
            hidden, head_weight, labels, row_weights.float(), self.chunk, self.multiplier, self.chunk_fn
        )
        return total, correct[:rows]
