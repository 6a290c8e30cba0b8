"""Speculative decoding with a DFlash drafter, batch size 1 (docs/decoding.md).

Per step: one draft forward over [anchor, MASK x (B-1)] (the draft cache holds only the injected
context K/V; the block's K/V are never stored), one target verify forward over the block, acceptance,
target cache rollback to the accepted prefix (every layer kind: full and sliding attention, recurrent
linear attention; see DecodingCache), and the accepted tokens' target features become the next step's
new context. block_size=1 skips the drafter entirely: plain autoregressive decoding through the same
code, which is the speedup baseline. A DFlash2 drafter proposes through its candidate selector: the argmax
path, or a sampled path whose per-step distributions over the candidates are the q of rejection sampling
(docs/drafters.md §3).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashdraft.generate.sampling import (
    check_sampling,
    exponential_noise,
    greedy_accept,
    one_hot_probs,
    race,
    rejection_accept,
    rejection_rows,
    sample,
    sampling_probs,
)
from flashdraft.model.attention import decoding_attention_kernels, dense_mask
from flashdraft.model.drafter import DFlashDraftModel, DraftCache
from flashdraft.model.target import DecodingCache, TargetModel


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int]  # generated tokens (the first comes from the prefill)
    accepted: list[int] = field(
        default_factory=list
    )  # tokens committed per decode step (accepted drafts + 1)
    decode_seconds: float = 0.0  # decode loop only (prefill excluded, as z-lab's TPOT)
    prefill_seconds: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")


def mean_tau(runs: list[Generation]) -> float:
    """τ of several runs, as z-lab's benchmark defines it and `flashdraft eval` reports it: the mean over
    runs of each run's mean tokens committed per step (accepted drafts + 1); nan when no run took a step.
    Training's real τ (train/real_eval.py) is this too."""
    decoded = [run.tau for run in runs if run.accepted]
    return statistics.mean(decoded) if decoded else float("nan")


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _single_block_masks(
    drafter: DFlashDraftModel, ctx_len: int, start: int, block: int, device
) -> dict | None:
    kinds = drafter.layer_kinds()
    if all(not k.causal and k.window is None for k in kinds):
        return None  # one block over all of its context: nothing to mask
    anchors = torch.tensor([[start]], device=device)
    keep = torch.ones(1, 1, dtype=torch.bool, device=device)
    positions = torch.arange(ctx_len, device=device)[None]
    return {k.key: dense_mask(anchors, keep, positions, block, k) for k in set(kinds)}


@dataclass(frozen=True)
class _Sampler:
    """How one generation chooses tokens: the settings and the generator every random draw comes from."""

    temperature: float
    top_p: float
    top_k: int
    draft_sampling: str
    generator: torch.Generator | None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def pick(self, logits: Tensor) -> int:
        """The token after `logits` [V]: the argmax when greedy, else a draw from the filtered distribution."""
        if self.greedy:
            return int(logits.argmax(-1))
        return int(sample(sampling_probs(logits, self.temperature, self.top_p, self.top_k), self.generator))


def _propose(
    drafter: DFlashDraftModel,
    hidden: Tensor,
    anchor: Tensor,
    target: TargetModel,
    sampler: _Sampler,
    block: int,
) -> tuple[Tensor, Tensor | None]:
    """Draft tokens for block positions 1.. from their hidden states [1, n, H], and the proposal
    distribution q [n, V] they were drawn from (None when greedy: acceptance needs no q). A sampled DFlash
    proposal races Exp(1) draws for all `block` - 1 positions, also when the block was cut shorter at the
    token limit, so the random stream never depends on where a block was cut (the fast engine draws alike)."""
    temperature, generator = sampler.temperature, sampler.generator
    greedy = sampler.greedy
    argmax = greedy or sampler.draft_sampling == "argmax"
    vocab = target.vocab_size
    if getattr(drafter, "candidate_selector", None) is not None:  # DFlash2
        path, candidates, q_rows = drafter.propose(
            hidden, anchor, target.lm_head_weight, 0.0 if argmax else temperature, generator
        )
        drafts = path[0]
        if argmax:
            return drafts, None if greedy else one_hot_probs(drafts, vocab)
        # The selector's distribution over its candidates, as a full-vocabulary q.
        q = torch.zeros(drafts.shape[0], vocab, device=hidden.device).scatter_(-1, candidates[0], q_rows[0])
        return drafts, q
    draft_logits = drafter.compute_logits(hidden[0], target.lm_head_weight)
    if argmax:
        drafts = draft_logits.argmax(-1)
        return drafts, None if greedy else one_hot_probs(drafts, draft_logits.shape[-1])
    draft_probs = sampling_probs(draft_logits, temperature, sampler.top_p, sampler.top_k)
    noise = exponential_noise((block - 1, draft_probs.shape[-1]), generator, draft_probs.device)
    return race(draft_probs, noise[: draft_probs.shape[0]]), draft_probs


def _sampled_accept(
    drafts: Tensor, draft_probs: Tensor, target_probs: Tensor, block: int, generator: torch.Generator | None
) -> tuple[int, int]:
    """The rejection rule (`sampling.rejection_rows`) for this one row: `block` - 1 uniforms and one Exp(1)
    row per step, whatever the cut block's length, as the fast engine draws them."""
    n, device = drafts.shape[0], drafts.device
    uniforms = torch.rand(block - 1, generator=generator, device=device)[:n]
    noise = exponential_noise((1, target_probs.shape[-1]), generator, device)
    lengths = torch.tensor([n], device=device)
    accepted, token = rejection_rows(
        drafts[None], draft_probs[None], target_probs[None], lengths, uniforms[None], noise
    )
    return int(accepted[0]), int(token[0])


@dataclass
class _DecodeState:
    """What the decode loop carries from step to step."""

    output: Tensor  # prompt, committed tokens, then the mask id: [max_len + 1]
    context: Tensor  # target features of committed tokens not yet in the draft cache
    start: int  # index of the last committed token: the next block's anchor
    stopped: bool


def _draft_block(
    drafter: DFlashDraftModel,
    target: TargetModel,
    draft_cache: DraftCache,
    state: _DecodeState,
    block_ids: Tensor,
    sampler: _Sampler,
    block: int,
) -> Tensor | None:
    """One draft forward over the block [anchor, MASK...]: writes the drafts into `block_ids[1:]` and returns
    the proposal distribution q they were drawn from (None when greedy)."""
    start, size, device = state.start, block_ids.shape[0], block_ids.device
    ctx_start = draft_cache.length
    masks = _single_block_masks(drafter, start, start, size, device)
    hidden = drafter(
        target.embed(block_ids[None]),
        state.context,
        torch.arange(ctx_start, start, device=device)[None],
        torch.arange(start, start + size, device=device)[None],
        masks,
        cache=draft_cache,
        block_len=size,
    )
    block_ids[1:], draft_probs = _propose(
        drafter,
        hidden[:, 1:],
        block_ids[:1],
        target,
        sampler,
        block,
    )
    return draft_probs


def _accept(
    drafter: DFlashDraftModel | None,
    logits: Tensor,
    block_ids: Tensor,
    draft_probs: Tensor | None,
    sampler: _Sampler,
    block: int,
) -> tuple[int, int]:
    """How many drafts the target's verify `logits` [size, V] accept, and the bonus token after them."""
    size = block_ids.shape[0]
    if sampler.greedy:
        return greedy_accept(block_ids[1:], logits)
    if size == 1:
        return 0, sampler.pick(logits[-1])
    target_probs = sampling_probs(logits, sampler.temperature, sampler.top_p, sampler.top_k)
    if getattr(drafter, "candidate_selector", None) is not None:  # DFlash2: z-lab's draws
        return rejection_accept(block_ids[1:], draft_probs, target_probs, sampler.generator)
    return _sampled_accept(block_ids[1:], draft_probs, target_probs, block, sampler.generator)


def _commit(
    state: _DecodeState, block_ids: Tensor, accepted: int, bonus: int, max_len: int, stops: set[int]
) -> int:
    """Write the accepted drafts and the bonus after the anchor; how many tokens the step commits (cut at
    the token limit and after a stop token, which ends the generation)."""
    start, output = state.start, state.output
    output[start + 1 : start + accepted + 1] = block_ids[1 : accepted + 1]
    output[start + accepted + 1] = bonus
    produced = min(accepted + 1, max_len - start - 1)
    new = output[start + 1 : start + produced + 1].tolist()
    for i, token in enumerate(new):
        if token in stops:
            produced, state.stopped = i + 1, True
            break
    return produced


def _decode_step(
    target: TargetModel,
    drafter: DFlashDraftModel | None,
    cache: DecodingCache,
    draft_cache: DraftCache,
    state: _DecodeState,
    sampler: _Sampler,
    block: int,
    max_len: int,
    stops: set[int],
) -> int:
    """One speculative step from the anchor at `state.start`: draft, verify, accept, commit, roll the
    target cache back to the committed tokens. Returns the tokens committed (accepted drafts + 1)."""
    start = state.start
    size = min(block, max_len - start)
    block_ids = state.output[start : start + size].clone()
    draft_probs = None
    if size > 1:
        draft_probs = _draft_block(drafter, target, draft_cache, state, block_ids, sampler, block)
    logits, features = target.forward_cached(
        block_ids[None], torch.arange(start, start + size, device=block_ids.device)[None], cache
    )
    accepted, bonus = _accept(drafter, logits[0], block_ids, draft_probs, sampler, block)
    produced = _commit(state, block_ids, accepted, bonus, max_len, stops)
    state.start += produced
    cache.keep(produced)  # anchor + accepted drafts; the bonus token is the next verify's anchor
    state.context = features[:, :produced]  # anchor + accepted drafts: the bonus has no feature yet
    return produced


def _prefill(
    target: TargetModel,
    drafter: DFlashDraftModel | None,
    cache: DecodingCache,
    input_ids: Tensor,
    max_len: int,
    sampler: _Sampler,
) -> tuple[_DecodeState, Generation]:
    """The target's forward over the prompt: its cache, the first token, and the prompt's features as the
    drafter's first context; timed as `prefill_seconds`."""
    device, prompt_len = input_ids.device, input_ids.shape[1]
    mask_id = drafter.mask_token_id if drafter is not None else 0
    output = torch.full((max_len + 1,), mask_id, dtype=torch.long, device=device)
    output[:prompt_len] = input_ids[0]
    started = _sync(device)
    logits, features = target.forward_cached(
        input_ids, torch.arange(prompt_len, device=device)[None], cache, logits_to_keep=1
    )
    cache.keep(prompt_len)
    output[prompt_len] = sampler.pick(logits[0, -1])
    result = Generation(prompt_len=prompt_len, tokens=[], prefill_seconds=_sync(device) - started)
    return _DecodeState(output, features, start=prompt_len, stopped=False), result


@torch.inference_mode()
def generate(
    target: TargetModel,
    drafter: DFlashDraftModel | None,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    block_size: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    draft_sampling: str = "sample",
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` after `input_ids` [1, P]. `draft_sampling` ('sample' or 'argmax')
    chooses how drafts are proposed at temperature > 0; either way the output follows the target."""
    check_sampling(temperature, top_p, top_k)
    cache = DecodingCache(target)  # refuses, with the reason, a target whose cache cannot be rolled back
    with decoding_attention_kernels():  # a new key length every step: see decoding_attention_kernels
        block = 1 if drafter is None else (block_size or drafter.block_size)
        if drafter is not None:
            drafter.eval()
        sampler = _Sampler(temperature, top_p, top_k, draft_sampling, generator)
        device = target.device
        input_ids = input_ids.to(device)
        prompt_len = input_ids.shape[1]
        max_len = prompt_len + max_new_tokens
        stops = set(stop_token_ids or [])
        state, result = _prefill(target, drafter, cache, input_ids, max_len, sampler)
        draft_cache = DraftCache()
        started = _sync(device)
        state.stopped = int(state.output[state.start]) in stops
        while state.start + 1 < max_len and not state.stopped:
            produced = _decode_step(
                target, drafter, cache, draft_cache, state, sampler, block, max_len, stops
            )
            result.accepted.append(produced)
        result.decode_seconds = _sync(device) - started
        result.tokens = state.output[prompt_len : min(state.start + 1, max_len)].tolist()
        return result
