"""The drafter's loss through the frozen LM head without a [tokens x vocab] blow-up (docs/drafters.md §1).

Three per-position losses (`train.loss`):
  * ce: cross-entropy to the data token (the paper's);
  * kl: KL(p || q) to the target's own distribution p at the position (self-distillation);
  * lk: the LK loss, λ·KL(p || q) + (1 - λ)·TV(p, q) with λ = exp(-η·α) and α = Σ min(p, q) the
    position's expected acceptance (held constant in the gradient).
q is the drafter's distribution. Position weights (`train.position_weight`) multiply the per-row losses:
the paper's exp(-(k-1)/γ) decay, or D-PACE (`dpace_weights`).

Only rows with non-zero weight reach the head. Rows are processed in fixed-size chunks; each chunk's
logits (and the target's logits, for kl/lk) live only inside the chunk, and the gradient of each row's
loss w.r.t. its hidden row is computed in the same pass. Row weights come after the pass: the gradient
is linear in them, so D-PACE's weights, which need every row's probability first, cost no second pass.
With a 152k vocabulary and 8k block positions, full fp32 logits would be ~5 GB; a 1024-row chunk holds
~0.6 GB (twice that for kl/lk).

The chunk's two GEMMs through the head (the logits, and the gradient back to the hidden rows) go through a
`HeadGemm`: `PlainHead` in the head's own dtype, or `distributed/float8.py::Float8Head` on FP8 tensor
cores (`train.fp8_head`, docs/fp8.md). The teacher's logits (kl/lk) always use the head as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

LOSSES = ("ce", "kl", "lk")
POSITION_WEIGHTS = ("decay", "dpace")


@dataclass
class HeadRows:
    """What the head pass yields per row, before row weights are applied."""

    loss: Tensor  # [n] fp32 per-row loss
    label_prob: Tensor  # [n] fp32 q(label): D-PACE's confidence
    correct: Tensor  # [n] bool argmax == label
    grad: Tensor  # [n, H] d loss_row / d hidden_row (hidden's dtype)
    topk_values: Tensor  # [n, k] fp32 the k largest logits (k = 0 without a selector)
    topk_ids: Tensor  # [n, k] their token ids


class HeadGemm(Protocol):
    """The chunk function's two products with the frozen head `weight` [V, H]. `operands` are tensors made
    from the head once, outside the compiled function (an FP8 copy, its scale), passed in by `rows`."""

    def operands(self, weight: Tensor) -> tuple[Tensor, ...]:
        """What `logits` and `input_grad` read besides the head itself (cached while the head is unchanged)."""
        ...

    def logits(self, rows: Tensor, weight: Tensor, operands: tuple[Tensor, ...]) -> Tensor:
        """rows [n, H] @ weight.T -> [n, V]."""
        ...

    def input_grad(
        self,
        grad_logits: Tensor,
        weight: Tensor,
        operands: tuple[Tensor, ...],
        dtype: torch.dtype,
        grad_amax: Tensor | None = None,
    ) -> Tensor:
        """grad_logits [n, V] (fp32) @ weight -> [n, H] in `dtype`. `grad_amax`, when the caller knows it
        without reading grad_logits (cross-entropy: `ce_grad_amax`), is grad_logits' largest magnitude, for a
        head that scales the gradient by it."""
        ...

    def gradient_format(self, weight: Tensor, grad_amax: Tensor) -> tuple[torch.dtype, Tensor]:
        """The dtype and the one-element fp32 scale in which `train.fused_ce`'s kernel writes the logits'
        gradient for `scaled_input_grad`, given its largest magnitude."""
        ...

    def scaled_input_grad(
        self,
        grad_logits: Tensor,
        scale: Tensor,
        weight: Tensor,
        operands: tuple[Tensor, ...],
        dtype: torch.dtype,
    ) -> Tensor:
        """grad_logits [n, V], written times `scale` in `gradient_format`'s dtype, @ weight -> [n, H] in
        `dtype`."""
        ...


class PlainHead:
    """Both GEMMs in the head's own dtype (bf16 on a GPU, fp32 on the CPU)."""

    def operands(self, weight: Tensor) -> tuple[Tensor, ...]:
        return ()

    def logits(self, rows: Tensor, weight: Tensor, operands: tuple[Tensor, ...]) -> Tensor:
        return F.linear(rows, weight)

    def input_grad(
        self,
        grad_logits: Tensor,
        weight: Tensor,
        operands: tuple[Tensor, ...],
        dtype: torch.dtype,
        grad_amax: Tensor | None = None,
    ) -> Tensor:
        return grad_logits.to(dtype) @ weight

    def gradient_format(self, weight: Tensor, grad_amax: Tensor) -> tuple[torch.dtype, Tensor]:
        return weight.dtype, torch.ones(1, dtype=torch.float32, device=weight.device)

    def scaled_input_grad(
        self,
        grad_logits: Tensor,
        scale: Tensor,
        weight: Tensor,
        operands: tuple[Tensor, ...],
        dtype: torch.dtype,
    ) -> Tensor:
        return (grad_logits @ weight).to(dtype)  # written at scale 1


PLAIN_HEAD = PlainHead()


def ce_grad_amax(label_log_q: Tensor, multiplier: float) -> Tensor:
    """The largest |q - onehot(label)| over a chunk, times |multiplier|, from each row's q(label) instead of
    a pass over the [n, V] gradient. A row's entries are q_label - 1 at the label and q_j elsewhere, and the
    other q_j sum to 1 - q_label, so none exceeds it: the row's largest magnitude is 1 - q_label. In floats,
    up to the rounding of Σq (a scale's last bits; the FP8 cast clamps)."""
    return (1 - label_log_q.exp()).amax() * abs(multiplier)


def chunk_rows(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: Tensor | None,
    multiplier: float,
    loss: str,
    lk_eta: float,
    top_k: int,
    gemm: HeadGemm = PLAIN_HEAD,
    gemm_operands: tuple[Tensor, ...] = (),
):
    """Per-row loss, q(label), argmax correctness, unit-weight gradient and top-k of one chunk
    (compiled on GPU). `teacher` holds the target's final hidden rows that predict the same tokens."""
    logits = gemm.logits(hidden, weight, gemm_operands).float()
    if multiplier != 1.0:
        logits = logits * multiplier
    log_q = torch.log_softmax(logits, dim=-1)
    q = log_q.exp()
    label_log_q = log_q.gather(-1, labels[:, None])[:, 0]
    grad_amax = None
    if loss == "ce":
        row_loss = -label_log_q
        grad_logits = q - F.one_hot(labels, q.shape[-1]).to(q.dtype)
        # known from per-row values: an FP8 head then casts the gradient in one pass over the logits
        grad_amax = ce_grad_amax(label_log_q, multiplier)
    else:
        log_p = torch.log_softmax(F.linear(teacher, weight).float(), dim=-1)
        p = log_p.exp()
        kl = (p * (log_p - log_q)).sum(-1)
        grad_kl = q - p
        if loss == "kl":
            row_loss, grad_logits = kl, grad_kl
        else:
            # TV = 1 - Σ min(p, q); where q < p the min is q, so dTV/dz_j = q_j (Σ_{q<p} q - [q_j < p_j]).
            below = (q < p).to(q.dtype)
            acceptance = torch.minimum(p, q).sum(-1)
            lam = torch.exp(-lk_eta * acceptance)
            grad_tv = q * ((below * q).sum(-1, keepdim=True) - below)
            row_loss = lam * kl + (1 - lam) * (1 - acceptance)
            grad_logits = lam[:, None] * grad_kl + (1 - lam)[:, None] * grad_tv
    grad = gemm.input_grad(grad_logits * multiplier, weight, gemm_operands, hidden.dtype, grad_amax)
    correct = logits.argmax(dim=-1) == labels
    if top_k > 0:
        topk_values, topk_ids = logits.topk(top_k, dim=-1, sorted=False)
    else:
        topk_values, topk_ids = logits.new_zeros(logits.shape[0], 0), labels.new_zeros(labels.shape[0], 0)
    return row_loss, label_log_q.exp(), correct, grad, topk_values, topk_ids


def fused_ce_rows(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    multiplier: float,
    gemm: HeadGemm = PLAIN_HEAD,
    gemm_operands: tuple[Tensor, ...] = (),
):
    """`chunk_rows` for cross-entropy without the selector's top-k (`train.fused_ce`): the head's two GEMMs
    as there, the passes between them as two Triton kernels (train/loss_kernels.py), the gradient written
    once in the dtype and scale the head's second GEMM reads."""
    from flashdraft.train import loss_kernels

    logits = gemm.logits(hidden, weight, gemm_operands)
    lse, label_logit, argmax = loss_kernels.row_stats(logits, labels, multiplier)
    label_log_q = label_logit - lse
    dtype, scale = gemm.gradient_format(weight, ce_grad_amax(label_log_q, multiplier))
    grad_logits = loss_kernels.softmax_grad(logits, labels, lse, multiplier, scale, dtype)
    grad = gemm.scaled_input_grad(grad_logits, scale, weight, gemm_operands, hidden.dtype)
    no_topk = labels.new_zeros(labels.shape[0], 0)
    return -label_log_q, label_log_q.exp(), argmax == labels, grad, no_topk.float(), no_topk


class _WeightedRowSum(torch.autograd.Function):
    """Σ w·loss_row, whose gradient w.r.t. hidden row r is w_r · grad_r (both precomputed)."""

    @staticmethod
    def forward(ctx, hidden, row_weights, row_loss, row_grad):
        ctx.save_for_backward(row_weights, row_grad)
        return (row_loss * row_weights).sum()

    @staticmethod
    def backward(ctx, grad_total):
        row_weights, row_grad = ctx.saved_tensors
        scale = (row_weights * grad_total).to(row_grad.dtype)
        return row_grad * scale[:, None], None, None, None


def weighted_sum(hidden: Tensor, rows: HeadRows, row_weights: Tensor) -> Tensor:
    """Σ w·loss over the rows (fp32 scalar), differentiable w.r.t. `hidden` (the rows `rows` came from)."""
    return _WeightedRowSum.apply(hidden, row_weights.detach().float(), rows.loss, rows.grad)


def dpace_weights(confidence: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE position weights [blocks, B] (docs/drafters.md §1), detached.

    With s_k = (1 - alpha)·q_k(label) + alpha the smoothed chance that position k is accepted, a
    position's weight is the expected number of accepted positions it unlocks: Σ_{j >= k} Π_{i <= j} s_i.
    Unsupervised positions count as certain in the products and add nothing to the sums."""
    with torch.no_grad():
        smooth = torch.where(valid, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(confidence))
        prefix = torch.cumprod(smooth, dim=-1) * valid
        suffix = prefix.flip(-1).cumsum(-1).flip(-1)
        return suffix * valid


def selector_weight(step: int, alpha: float, warmup_steps: int, ramp_steps: int) -> float:
    """The DFlash2 selector loss's factor at optimizer step `step` (docs/drafters.md §3): 0 for the first
    `warmup_steps`, then rising linearly to `alpha` over `ramp_steps` (at once when 0)."""
    if alpha == 0.0 or step < warmup_steps:
        return 0.0
    if ramp_steps <= 0:
        return alpha
    return alpha * min(1.0, (step - warmup_steps + 1) / ramp_steps)


class WeightedHeadLoss:
    """Per-row losses through a frozen head, in chunks. `compile=True` (on GPU) compiles the chunk
    function once, fullgraph: the loss owns its kernels, as the drafter's layers are compiled by
    `distributed/parallelize.py` and the optimizer's update by `train/optim.py`.

    `loss` is 'ce', 'kl' or 'lk' (kl and lk need the target's final hidden rows, `teacher`); `top_k` > 0
    also returns each row's top-k logits (the DFlash2 selector's candidates); `head` does the two GEMMs
    through the head (default `PlainHead`)."""

    def __init__(
        self,
        chunk: int = 1024,
        multiplier: float = 1.0,
        *,
        loss: str = "ce",
        lk_eta: float = 3.0,
        top_k: int = 0,
        head: HeadGemm | None = None,
        compile: bool = False,
        fused: bool = False,
    ):
        if loss not in LOSSES:
            raise ValueError(f"loss={loss!r}; expected one of {LOSSES}")
        if fused and loss != "ce":
            raise ValueError(f"fused kernels compute cross-entropy only, not loss={loss!r}")
        self.fused = fused
        self.chunk = chunk
        self.multiplier = multiplier
        self.loss = loss
        self.lk_eta = lk_eta
        self.top_k = top_k
        self.head: HeadGemm = PLAIN_HEAD if head is None else head
        self.compiled = compile
        self.chunk_fn: Callable = torch.compile(chunk_rows, fullgraph=True) if compile else chunk_rows

    @property
    def needs_teacher(self) -> bool:
        return self.loss != "ce"

    @torch.no_grad()
    def rows(
        self, hidden: Tensor, head_weight: Tensor, labels: Tensor, teacher: Tensor | None = None
    ) -> HeadRows:
        """hidden [n, H] rows with non-zero weight; teacher [n, H] for kl/lk."""
        if self.needs_teacher and teacher is None:
            raise ValueError(f"loss={self.loss!r} needs the target's final hidden rows")
        if self.fused and self.top_k:
            raise ValueError("fused kernels compute no top-k (the DFlash2 selector's candidates)")
        n = hidden.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        prob = torch.empty(n, dtype=torch.float32, device=hidden.device)
        correct = torch.empty(n, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden)
        topk_values = torch.empty(n, self.top_k, dtype=torch.float32, device=hidden.device)
        topk_ids = torch.empty(n, self.top_k, dtype=torch.long, device=hidden.device)
        gemm_operands = self.head.operands(head_weight)
        # No padding to whole chunks (it cost ~6% of the head's FLOPs). Compiled, full chunks and the
        # remainder run one graph, dynamic in its rows only: a static graph for full chunks and a dynamic one
        # for the remainder would both compile in the first step, which a user waits for (on the CPU's
        # inductor the remainder's own compile took 4.3 s; run by the one graph, 0.6 s). The row count only
        # bounds the kernels' outer loop; the hidden and vocabulary sizes stay static (all dimensions
        # dynamic would also tie a hidden size equal to the chunk to the row count, and recompile).
        for start in range(0, n, self.chunk):
            end = min(start + self.chunk, n)
            chunk_hidden, chunk_labels = hidden[start:end].detach(), labels[start:end]
            chunk_teacher = None if teacher is None else teacher[start:end].to(head_weight.dtype)
            if self.fused:
                out = fused_ce_rows(
                    chunk_hidden, head_weight, chunk_labels, self.multiplier, self.head, gemm_operands
                )
            else:
                if self.compiled:
                    for tensor in (chunk_hidden, chunk_labels, chunk_teacher):
                        if tensor is not None:
                            torch._dynamo.maybe_mark_dynamic(tensor, 0)
                out = self.chunk_fn(
                    chunk_hidden,
                    head_weight,
                    chunk_labels,
                    chunk_teacher,
                    self.multiplier,
                    self.loss,
                    self.lk_eta,
                    self.top_k,
                    self.head,
                    gemm_operands,
                )
            for buffer, value in zip((loss, prob, correct, grad, topk_values, topk_ids), out, strict=True):
                buffer[start:end] = value
        return HeadRows(loss, prob, correct, grad, topk_values, topk_ids)

    def __call__(
        self,
        hidden: Tensor,
        head_weight: Tensor,
        labels: Tensor,
        row_weights: Tensor,
        teacher: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """hidden [T, H] rows with non-zero weight; returns (Σ w·loss as fp32 scalar, correct [T] bool)."""
        if hidden.shape[0] == 0:
            return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
        rows = self.rows(hidden, head_weight, labels, teacher)
        return weighted_sum(hidden, rows, row_weights), rows.correct
