"""AdamW with global-norm clipping folded into the fused CUDA kernel.

`clip_grad_norm_` rescales every gradient in place (one extra read and write of all gradients, ~8 GB
for a 1B-parameter fp32 drafter) before AdamW reads them again. The fused AdamW kernel already divides
gradients by `grad_scale` (the hook GradScaler uses), so on CUDA we pass max(1, norm / max_norm) there
instead: the same update, one pass fewer. Elsewhere the standard clip runs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def make_adamw(params, *, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=device.type == "cuda")


def clip_and_step(optimizer: torch.optim.AdamW, params: list[Tensor], max_norm: float) -> Tensor:
    """Clip gradients to `max_norm` (global L2 norm), step, and return the pre-clip norm (a tensor: no sync)."""
    fused = bool(optimizer.defaults.get("fused"))
    if not fused:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    optimizer.grad_scale = torch.clamp(norm / max_norm, min=1.0).float()  # read by the fused kernel
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None
    return norm
