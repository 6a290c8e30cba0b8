"""The target's decoding step through its fused layers as one loop (model/fused_stack.py, docs/decoding.md,
"Fused stack"): in fp32 its logits and features are those of the model's own forward (transformers' eager
layers through the same static cache), for Llama, Qwen3 and a Qwen2 with sliding-window layers, one query
token and a block; the cache holds the same keys after either; targets whose forward scales what the loop
does not are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from flashdraft.generate.kv_cache import StaticKVCache, step_masks
from flashdraft.model.fused_decoder import FusedProjections, StepKernels
from flashdraft.model.fused_stack import STACK_TOLERANCE, FusedStack, stack_difference, stack_refusal
from flashdraft.model.target import TargetModel

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
WINDOW = 5
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=8, **SHAPE)),
    "qwen2, sliding": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,  # layer 0 full, layers 1.. sliding
            **SHAPE,
        )
    ),
}


def _target(family: str, layer_ids: list[int]) -> TargetModel:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():  # norms away from their initial ones
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return TargetModel(model, layer_ids)


def _cache(target: TargetModel, rows: int, width: int, queries: int, seed: int) -> StaticKVCache:
    """A static cache with layer views, random keys and values already in every column."""
    cache = StaticKVCache(target.model.config, rows, width, torch.float32, "cpu", queries, layer_views=True)
    g = torch.Generator().manual_seed(seed)
    for keys, values in zip(cache.keys, cache.values, strict=True):
        keys.copy_(torch.randn(keys.shape, generator=g))
        values.copy_(torch.randn(values.shape, generator=g))
    return cache


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("split", [False, True], ids=["pytorch", "split attention asked"])
def test_the_stack_computes_the_model_forward(family, queries, split):
    """With split attention asked for (its SDPA fallback off a GPU), the masks come a row a token."""
    target = _target(family, [0, 1, 2])  # the last layer's feature is after the final norm
    if "sliding" in family:
        assert set(target.config.layer_types) == {"full_attention", "sliding_attention"}
    window = WINDOW if "sliding" in family else None
    assert stack_refusal(target) is None
    rows, width = 2, 16
    positions = torch.tensor([[6], [10]]) + torch.arange(queries)
    ids = torch.randint(0, SHAPE["vocab_size"], (rows, queries), generator=torch.Generator().manual_seed(1))
    masks = step_masks(torch.arange(width), positions, window)
    caches = []
    for _ in range(2):
        cache = _cache(target, rows, width, queries, seed=2)
        cache.columns.copy_(positions)
        caches.append(cache)
    with torch.no_grad():
        caches[0].layer_views = False  # transformers' own layers, eager
        reference, features = target._run_with_capture(
            stop_early=False,
            input_ids=ids,
            position_ids=positions,
            attention_mask=masks,
            use_cache=True,
            **{target._cache_kwarg: caches[0]},
        )
        kernels = StepKernels(split_attention=split)
        stack = FusedStack(target, [FusedProjections(layer, kernels) for layer in target.layers])
        assert stack.mask_groups == (
            1 if split else SHAPE["num_attention_heads"] // SHAPE["num_key_value_heads"]
        )
        logits, stacked = stack.step(ids, positions, masks, caches[1])
    torch.testing.assert_close(logits, reference.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stacked, features, rtol=1e-5, atol=1e-5)
    assert stack_difference((reference.logits, features), (logits, stacked)) < STACK_TOLERANCE / 1000
    for ours, theirs in zip(
        caches[1].keys + caches[1].values, caches[0].keys + caches[0].values, strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_a_missing_scale_is_a_difference_past_the_tolerance():
    target = _target("llama", [1])
    reference = (torch.randn(2, 1, 64), torch.randn(2, 1, 32))
    assert stack_difference(reference, reference) == 0
    scaled = (reference[0] * 1.25, reference[1])  # Granite's logits_scaling, say
    assert stack_difference(reference, scaled) > STACK_TOLERANCE
    assert stack_refusal(target) is None


def test_targets_whose_forward_does_more_are_refused_with_the_reason():
    granite = TargetModel(GraniteForCausalLM(GraniteConfig(embedding_multiplier=12.0, **SHAPE)).eval(), [1])
    assert "embedding_multiplier" in stack_refusal(granite)
    llama = _target("llama", [1])
    llama.model.lm_head = torch.nn.Identity()
    assert "LM head" in stack_refusal(llama)
