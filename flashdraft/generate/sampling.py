"""Token choice for every decoding loop: one logit filter, greedy and sampled picks, and the exact
speculative acceptance rules (docs/dflash.md §5).

`filter_logits` is the one temperature/top-k/top-p rule; `sampling_probs` (the eager speculative loop's
distributions) and `seeded_token` (regeneration's batch-independent draw) both go through it.

Greedy: the longest prefix where draft[i] equals the target's argmax at i-1, plus the target's token
at the first mismatch (the bonus). Sampling: standard speculative rejection sampling against the
drafter's per-position proposal distribution q (one-hot for argmax proposals): accept x_i while
u·q(x_i) < p(x_i); at the first rejection sample from norm(max(p - q, 0)); if all are accepted sample
the bonus from p. Every emitted token is then distributed as the target alone would sample it.
`rejection_rows` is that rule for many rows at once with the randomness given (the fast engine's, and the
eager loop's with one row); every sampled token is a `race` (argmax of p / Exp(1) draws).

`counter_uniform` / `seeded_token`: the regeneration engines' draw, from a counter-based hash of
(row seed, step, token id) rather than a shared random stream, so an answer never depends on its batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from flashdraft.config import Sampling
from flashdraft.errors import FlashdraftError

_MASK32 = 0xFFFFFFFF


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise FlashdraftError(
            f"sampling: need temperature >= 0, 0 < top_p <= 1, top_k >= 0 (got {temperature}, {top_p}, {top_k})"
        )


def filter_logits(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """fp32 scores after temperature, top-k and top-p (nucleus) filtering: every filtered-out token's score
    is -inf. Top-k keeps ties with the k-th score; top-p keeps the smallest set of most likely tokens whose
    mass reaches `top_p` (always the top token). [..., V]"""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # keeps the token that crosses top_p
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return scores


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Probabilities after `filter_logits`, in fp32. [..., V]"""
    return torch.softmax(filter_logits(logits, temperature, top_p, top_k), dim=-1)


def exponential_noise(shape: tuple[int, ...], generator: torch.Generator | None, device) -> Tensor:
    """Exp(1) draws in fp32 from `generator`: the randomness of one `race` per leading index."""
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)


def race(probs: Tensor, noise: Tensor) -> Tensor:
    """The token argmax(p / E) of each distribution [..., V] for Exp(1) draws E of the same shape: token i
    wins with probability p_i / Σp (E_i / p_i is exponential with rate p_i; the smallest is chosen). The
    draw torch.multinomial makes for one sample, without its host-side check, so a CUDA graph holds it."""
    return (probs / noise).argmax(-1)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per distribution [..., V], drawn from `generator` (`race` over fresh Exp(1) draws)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return race(flat, exponential_noise(tuple(flat.shape), generator, flat.device)).view(probs.shape[:-1])


def greedy_accept(draft: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """draft [n] proposed tokens for block positions 1..n; target_logits [n+1, V] at positions 0..n.
    Returns (accepted count, bonus token)."""
    posterior = target_logits.argmax(dim=-1)
    accepted = int((draft == posterior[:-1]).int().cumprod(dim=0).sum())
    return accepted, int(posterior[accepted])


def rejection_accept(
    draft: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """draft [n]; draft_probs [n, V] (q per position); target_probs [n+1, V] (p per position). Draws as
    z-lab's loop draws (n uniforms, then one multinomial draw), so a DFlash2 drafter's sampled decode,
    which the fast engine does not run, matches z-lab's token for token."""
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


def rejection_rows(
    drafts: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    lengths: Tensor,
    uniforms: Tensor,
    noise: Tensor,
) -> tuple[Tensor, Tensor]:
    """The rejection rule for rows at once, on the device with no host sync (a CUDA graph holds it), the
    randomness given: drafts [R, n], draft_probs q [R, n, V], target_probs p [R, n+1, V]; row r proposes only
    its first `lengths[r]` drafts (≤ n: a block cut at the token limit); uniforms [R, n]; noise [R, V]
    (Exp(1) draws for the row's one sampled token). Returns (accepted [R], token [R]): draft i is accepted
    while u_i·q_i(x_i) < p_i(x_i); the token after the accepted prefix comes from norm(max(p - q, 0)) at the
    first rejection (p where that is all zero), or from p after the last proposed draft."""
    n = drafts.shape[1]
    p = target_probs[:, :n].gather(-1, drafts[..., None])[..., 0]
    q = draft_probs.gather(-1, drafts[..., None])[..., 0]
    proposed = torch.arange(n, device=drafts.device)[None, :] < lengths[:, None]
    accepted = ((uniforms * q < p) & proposed).long().cumprod(-1).sum(-1)
    at = accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])
    p_at = target_probs.gather(1, at)[:, 0]
    q_at = draft_probs.gather(1, at.clamp(max=max(n - 1, 0)))[:, 0] if n else torch.zeros_like(p_at)
    residual = (p_at - q_at).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    rejected = (accepted < lengths)[:, None]
    distribution = torch.where(rejected & (total > 0), residual / total, p_at)
    return accepted, race(distribution, noise)


def one_hot_probs(tokens: Tensor, vocab: int) -> Tensor:
    return F.one_hot(tokens, vocab).float()


def counter_uniform(
    seeds: torch.Tensor, step: int | torch.Tensor, vocab: int, device: torch.device
) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1) that depend only on (row seed, step, token id): a 32-bit integer
    hash (every product stays below 2**63, so it is exact in int64 on any device). `step` is one int for
    every row, or a [rows] tensor (a device tensor keeps a CUDA graph valid from step to step)."""
    token = torch.arange(vocab, device=device, dtype=torch.int64)
    if isinstance(step, torch.Tensor):
        step = step.to(device=device, dtype=torch.int64).reshape(-1, 1)
    x = (seeds.to(device)[:, None] * 0x9E37 + step * 0x3C6EF + token[None, :] * 0x1B873593) & _MASK32
    for _ in range(3):
        x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = (x >> 16) ^ x
    return ((x >> 8).to(torch.float64) + 0.5) / float(1 << 24)


def seeded_choice(scores: torch.Tensor, seeds: torch.Tensor, step: int, s: Sampling) -> torch.Tensor:
    """Scores that keep only the `seeded_token` of each row (0; every other logit -inf)."""
    choice = seeded_token(scores, seeds, step, s)[:, None]
    out = torch.full_like(scores, -math.inf)
    return out.scatter(-1, choice, 0.0)


def seeded_token(
    scores: torch.Tensor, seeds: torch.Tensor, step: int | torch.Tensor, s: Sampling
) -> torch.Tensor:
    """[rows] the token each row samples at `step` from its temperature/top-k/top-p filtered distribution:
    the Gumbel-max trick with the row's own counter-based noise (no shared random stream)."""
    logits = filter_logits(scores, s.temperature, s.top_p, s.top_k)
    uniform = counter_uniform(seeds, step, logits.shape[-1], logits.device)
    gumbel = -torch.log(-torch.log(uniform)).to(logits.dtype)
    return (logits.log_softmax(-1) + gumbel).argmax(-1)
