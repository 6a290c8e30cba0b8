"""Token sampling and the exact speculative acceptance rules (docs/dflash.md §5).

Greedy: the longest prefix where draft[i] equals the target's argmax at i-1, plus the target's token
at the first mismatch (the bonus). Sampling: standard speculative rejection sampling against the
drafter's per-position proposal distribution q (one-hot for argmax proposals): accept x_i while
u·q(x_i) < p(x_i); at the first rejection sample from norm(max(p - q, 0)); if all are accepted sample
the bonus from p. Every emitted token is then distributed as the target alone would sample it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flashdraft.errors import FlashdraftError


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise FlashdraftError(
            f"sampling: need temperature >= 0, 0 < top_p <= 1, top_k >= 0 (got {temperature}, {top_p}, {top_k})"
        )


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus) filtering, in fp32. [..., V]"""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p  # always keeps the top token
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def greedy_accept(draft: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """draft [n] proposed tokens for block positions 1..n; target_logits [n+1, V] at positions 0..n.
    Returns (accepted count, bonus token)."""
    posterior = target_logits.argmax(dim=-1)
    accepted = int((draft == posterior[:-1]).int().cumprod(dim=0).sum())
    return accepted, int(posterior[accepted])


def rejection_accept(
    draft: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """draft [n]; draft_probs [n, V] (q per position); target_probs [n+1, V] (p per position)."""
    n = draft.shape[0]
    p = target_probs[:n].gather(-1, draft[:, None])[:, 0]
    q = draft_probs.gather(-1, draft[:, None])[:, 0]
    u = torch.rand(n, generator=generator, device=draft.device)
    accepted = int((u * q < p).int().cumprod(dim=0).sum())
    if accepted == n:
        return n, int(sample(target_probs[n], generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp(min=0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[accepted]
    return accepted, int(sample(residual, generator))


def one_hot_probs(tokens: Tensor, vocab: int) -> Tensor:
    return F.one_hot(tokens, vocab).float()
