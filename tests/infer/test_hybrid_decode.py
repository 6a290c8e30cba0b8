"""Exact speculative decoding on targets whose cache is not a plain KV cache: a Qwen3.5-style hybrid
(Gated DeltaNet linear attention + full attention) and a Qwen3 with sliding-window layers, run past its
window. The targets are sharpened so that the next token depends on the whole context: an unsharpened
random target would look lossless whatever happened to its cache."""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.errors import FlashdraftError
from flashdraft.generate.speculative import generate
from flashdraft.model import target as target_module
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config
from flashdraft.model.target import DecodingCache, TargetModel
from flashdraft.model.tiny import build_model, tiny_config

VOCAB = 64
MASK = VOCAB - 1
BLOCK = 6
pytestmark = pytest.mark.usefixtures("one_thread")


def _sharpened_target(kind: str, seed: int = 0, **overrides) -> TargetModel:
    model = build_model(
        tiny_config(kind, vocab_size=VOCAB, hidden_size=32, num_layers=4, **overrides), seed=seed
    )
    with torch.no_grad():  # larger projections: attention and recurrences weigh the whole context
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(4.0)
    return TargetModel(model, [1, 2])


@pytest.fixture(scope="module")
def hybrid() -> TargetModel:
    target = _sharpened_target("qwen3_5")
    assert {"linear_attention", "full_attention"} <= set(target.config.layer_types)
    return target


@pytest.fixture(scope="module")
def sliding() -> TargetModel:
    # layers 0-1 full attention, 2-3 sliding over 8 positions; prompts + generations reach ~50
    target = _sharpened_target("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert target.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    return target


class NoisyOracleDrafter(DFlashDraftModel):
    """A real drafter whose proposals are replaced by a known continuation, each token corrupted with
    probability `error`: acceptance lengths then cover 0..B-1, so every rollback length is exercised
    (an untrained drafter is rejected at the first token nearly always)."""

    def __init__(self, config, continuation: list[int], error: float, seed: int):
        super().__init__(config)
        self.init_weights(torch.Generator().manual_seed(seed))
        self.continuation, self.error, self.rng = continuation, error, random.Random(seed)

    def forward(
        self,
        noise_embedding,
        target_hidden,
        ctx_positions,
        block_positions,
        masks,
        cache=None,
        block_len=None,
    ):
        self.block_start = int(block_positions[0, 0])
        return super().forward(noise_embedding, target_hidden, ctx_positions, block_positions, masks, cache)

    def compute_logits(self, hidden, lm_head_weight):
        logits = super().compute_logits(hidden, lm_head_weight)
        proposal = torch.full_like(logits, -30.0)
        for row in range(logits.shape[0]):
            position = self.block_start + 1 + row
            token = self.continuation[position] if position < len(self.continuation) else 0
            if self.rng.random() < self.error:
                token = self.rng.randrange(VOCAB - 1)
            proposal[row, token] = 0.0
        return proposal


def _drafter(target: TargetModel, continuation: list[int] | None = None, seed: int = 0) -> DFlashDraftModel:
    config = make_drafter_config(
        target.config, num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=[1, 2]
    )
    if continuation is None:
        drafter = DFlashDraftModel(config)
        drafter.init_weights(torch.Generator().manual_seed(seed))
        return drafter
    return NoisyOracleDrafter(config, continuation, error=0.25, seed=seed)


def _prompts(n: int, low: int, high: int, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, MASK, (1, int(torch.randint(low, high, (1,), generator=g))), generator=g)
        for _ in range(n)
    ]


def _uncached_greedy_mismatches(target: TargetModel, prompt: torch.Tensor, tokens: list[int]) -> list[int]:
    """Generated positions where a token is not the argmax of one uncached forward over the sequence."""
    sequence = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        argmax = target.model(sequence, use_cache=False).logits[0, prompt.shape[1] - 1 : -1].argmax(-1)
    return [i for i, (a, b) in enumerate(zip(argmax.tolist(), tokens, strict=True)) if a != b]


def _check_exact_greedy(target: TargetModel, prompts: list[torch.Tensor], new_tokens: int) -> list[int]:
    lengths = []
    for i, prompt in enumerate(prompts):
        plain = generate(target, None, prompt, new_tokens).tokens
        assert _uncached_greedy_mismatches(target, prompt, plain) == [], f"prompt {i}: plain loop"
        continuation = prompt[0].tolist() + plain
        for drafter in (_drafter(target, continuation, seed=i), _drafter(target, seed=i)):
            spec = generate(target, drafter, prompt, new_tokens)
            assert spec.tokens == plain, f"prompt {i}: speculative != plain greedy"
            lengths += spec.accepted
    return lengths


@pytest.mark.slow
def test_hybrid_speculative_greedy_equals_plain_greedy_and_uncached_forward(hybrid):
    lengths = _check_exact_greedy(hybrid, _prompts(4, 5, 16), 36)
    # every rollback length happened: nothing accepted, partly accepted, the whole block accepted
    assert {1, 2, 3, BLOCK} <= set(lengths), sorted(set(lengths))


@pytest.mark.slow
def test_sliding_window_speculative_greedy_is_exact_past_the_window(sliding):
    prompts = _prompts(4, 5, 16, seed=4)
    lengths = _check_exact_greedy(sliding, prompts, 36)  # every sequence passes the 8-position window
    assert {1, 2, 3, BLOCK} <= set(lengths), sorted(set(lengths))


def test_hybrid_cache_restores_recurrent_state_exactly(hybrid):
    """After a verify of 6 positions of which 2 are kept, every recurrent and conv state equals the state
    of a cache that only ever saw the kept positions."""
    prompt = torch.tensor([[5, 9, 2, 40, 17, 3, 8]])
    block = torch.tensor([[11, 12, 13, 14, 15, 16]])

    def run(blocks: list[torch.Tensor], keep: int) -> DecodingCache:
        cache = DecodingCache(hybrid)
        hybrid.forward_cached(prompt, torch.arange(7)[None], cache, logits_to_keep=1)
        cache.keep(7)
        for ids in blocks:
            hybrid.forward_cached(ids, torch.arange(7, 7 + ids.shape[1])[None], cache)
            cache.keep(min(keep, ids.shape[1]))
        return cache

    rolled, fresh = run([block], keep=2), run([block[:, :2]], keep=2)
    recurrent = [i for i, t in enumerate(hybrid.config.layer_types) if t == "linear_attention"]
    assert recurrent and rolled.has_recurrent_layers
    for i in recurrent:
        a, b = rolled.cache.layers[i], fresh.cache.layers[i]
        assert torch.allclose(a.recurrent_states[0], b.recurrent_states[0], atol=1e-5)
        # fp32 rounding only: a forward over 6 positions and one over 2 differ by ~2e-6 in later layers' inputs
        assert torch.allclose(a.conv_states[0], b.conv_states[0], atol=1e-5)
    assert rolled.cache.get_seq_length() == fresh.cache.get_seq_length() == 9


@pytest.mark.slow
def test_hybrid_sampled_speculative_decoding_follows_the_target_distribution():
    """As tests/infer/test_decode.py does for Qwen3, on the hybrid target: 2,000 seeded runs at T=1 over a
    24-token vocabulary; in most runs the 3rd generated token comes after a rejection that rolled the
    recurrent state back, and its marginal must match the target's (TV < 0.06; sampling noise is about
    0.03; without the rollback it is about 0.34)."""
    vocab = 24
    model = build_model(tiny_config("qwen3_5", vocab_size=vocab, hidden_size=32, num_layers=3), seed=3)
    with torch.no_grad():  # sharp enough that a wrong recurrent state moves the 3rd token's TV to ~0.3
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(8.0)
        model.get_output_embeddings().weight.mul_(3.0)
    target = TargetModel(model, [0, 1])
    config = make_drafter_config(
        target.config, num_layers=1, block_size=4, mask_token_id=vocab - 1, target_layer_ids=[0, 1]
    )
    drafter = DFlashDraftModel(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    drafter.fc.weight.data.mul_(20)  # confident and mostly wrong: rejections are frequent
    prompt = torch.tensor([[3, 7, 11, 2, 19]])

    with torch.no_grad():
        p1 = torch.softmax(target.model(prompt).logits[0, -1], -1)
        seqs = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2_given = torch.softmax(target.model(seqs).logits[:, -1], -1)
        seqs3 = torch.cat([seqs.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab)[:, None]], 1)
        p3_given = torch.softmax(target.model(seqs3).logits[:, -1], -1).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2_given
    exact2, exact3 = joint12.sum(0), (joint12[:, :, None] * p3_given).sum((0, 1))

    g = torch.Generator().manual_seed(1)
    seconds, thirds, rejected_first = [], [], 0
    for _ in range(2000):
        out = generate(target, drafter, prompt, 3, temperature=1.0, generator=g)
        seconds.append(out.tokens[1])
        thirds.append(out.tokens[2])
        rejected_first += out.accepted[0] == 1
    emp2 = torch.bincount(torch.tensor(seconds), minlength=vocab) / 2000
    emp3 = torch.bincount(torch.tensor(thirds), minlength=vocab) / 2000
    assert 0.5 * (emp2 - exact2).abs().sum() < 0.06
    assert 0.5 * (emp3 - exact3).abs().sum() < 0.06
    assert rejected_first > 200  # the 3rd token often came after a rollback


def test_targets_whose_cache_cannot_be_rolled_back_are_refused_with_the_reason(hybrid, monkeypatch):
    monkeypatch.setattr(target_module, "CACHE_PARAMETERS", ("no_such_parameter",))
    with pytest.raises(FlashdraftError, match=r"layer 0 keeps a recurrent .* cannot tell which"):
        generate(hybrid, _drafter(hybrid), torch.tensor([[1, 2, 3]]), 4)
