"""The fused decoding step of a target decoder layer (model/fused_decoder.py, docs/decoding.md, "Fused
decoder steps"): in fp32 it computes what the layer's own forward computes through the static cache, for
Llama (grouped-query attention), Qwen2 (biased q/k/v) and Qwen3 (per-head q/k norms), one query token
and a block of them; fusing leaves the layer's weights as views of the fused ones; layers of another
shape are refused with the reason. The grouped attention is checked against a dense per-head loop."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from flashdraft.generate.kv_cache import LayerKV
from flashdraft.model import fused_decoder
from flashdraft.model.fused_decoder import (
    STEP_TOLERANCE,
    FusedProjections,
    StepKernels,
    additive_mask,
    checked_difference,
    fused_decoder_step,
    fusion_refusal,
    grouped_attention_bias,
    grouped_query_attention,
    step_difference,
)
from flashdraft.model.split_attention import split_attention_refusal
from flashdraft.model.target import CACHE_PARAMETERS

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(head_dim=8, **SHAPE)),
    "llama, k biased alone": (LlamaForCausalLM, LlamaConfig(**SHAPE)),  # one biased projection of three
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model_class, config = FAMILIES[family]
    model = model_class(config).eval()
    if "biased alone" in family:
        for layer in model.model.layers:
            plain = layer.self_attn.k_proj
            layer.self_attn.k_proj = torch.nn.Linear(plain.in_features, plain.out_features, bias=True)
    with torch.no_grad():  # biases and norms away from their initial zeros and ones
        for name, param in model.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def _cache_name(layer: torch.nn.Module) -> str:
    """The name this transformers version's decoder layer takes its cache by."""
    return next(n for n in CACHE_PARAMETERS if n in inspect.signature(type(layer).forward).parameters)


def _view(config, rows: int, width: int, columns: torch.Tensor, seed: int) -> LayerKV:
    """A layer's cache view with random keys and values already in it, the step's keys going to `columns`."""
    g = torch.Generator().manual_seed(seed)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (rows, config.num_key_value_heads, width, head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return LayerKV(keys, values, torch.arange(rows)[:, None], columns, torch.empty(width, dtype=torch.bool))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("queries", [1, 3])
def test_the_fused_step_computes_the_layers_own_forward(family, queries):
    model = _model(family)
    layer = model.model.layers[1]
    rows, width = 2, 12
    starts = torch.tensor([[4], [7]])
    positions = starts + torch.arange(queries)  # [rows, queries]
    columns = torch.arange(width)
    mask = (columns[None, None, None, :] <= positions[:, None, :, None]).expand(rows, 1, queries, width)
    hidden = torch.randn(rows, queries, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
    rotary = model.model.rotary_emb(hidden, positions)
    cache_name = _cache_name(layer)
    own_view = _view(model.config, rows, width, positions, seed=2)
    with torch.no_grad():
        own = type(layer).forward(
            layer, hidden, attention_mask=mask, position_embeddings=rotary, **{cache_name: own_view}
        )
        weights = {name: p.clone() for name, p in layer.named_parameters()}
        assert fusion_refusal(layer) is None
        fused = FusedProjections(layer)
        fused_view = _view(model.config, rows, width, positions, seed=2)
        out = fused_decoder_step(layer, fused, hidden, mask, rotary, fused_view)
    torch.testing.assert_close(out, own, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_view.keys, own_view.keys, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_view.values, own_view.values, rtol=1e-6, atol=1e-6)
    assert step_difference(own, out, hidden) < STEP_TOLERANCE / 100
    # the layer's own weights are the fused ones' rows now, with the values they had
    storage = fused.qkv_weight.untyped_storage().data_ptr()
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == storage
    assert (
        layer.mlp.up_proj.weight.untyped_storage().data_ptr()
        == fused.gate_up_weight.untyped_storage().data_ptr()
    )
    for name, param in layer.named_parameters():
        assert torch.equal(param, weights[name]), name


def test_layers_of_another_shape_are_refused_with_the_reason():
    gemma = Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=8)).eval()
    assert "pre_feedforward_layernorm" in fusion_refusal(gemma.model.layers[0])
    llama = _model("llama")
    layer = llama.model.layers[0]
    layer.self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    assert "sinks" in fusion_refusal(layer)
    del layer.self_attn.sinks
    layer.mlp.up_proj = torch.nn.Identity()
    assert "nn.Linear" in fusion_refusal(layer)


@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("form", ["bool", "additive, a row a token", "additive, a row a head"])
def test_grouped_query_attention_is_per_head_attention(queries, form):
    g = torch.Generator().manual_seed(5)
    rows, heads, kv_heads, cols, dim = 3, 6, 2, 10, 8
    query = torch.randn(rows, heads, queries, dim, generator=g)
    key, value = (
        torch.randn(rows, kv_heads, cols, dim, generator=g),
        torch.randn(rows, kv_heads, cols, dim, generator=g),
    )
    mask = torch.rand(rows, 1, queries, cols, generator=g) < 0.6
    mask[..., 0] = True
    given = mask if form == "bool" else additive_mask(mask, torch.float32)
    if form.endswith("a head"):  # as the fused stack's prologue makes it for SDPA
        given = grouped_attention_bias(mask, heads // kv_heads, torch.float32)
    out = grouped_query_attention(query, key, value, given, 0.3)
    assert out.shape == (rows, queries, heads, dim)
    for r in range(rows):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = 0.3 * query[r, h] @ key[r, kv].T  # [queries, cols]
            scores = scores.masked_fill(~mask[r, 0], float("-inf"))
            expected = torch.softmax(scores, -1) @ value[r, kv]
            torch.testing.assert_close(out[r, :, h], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_check_passes_every_family_in_bf16_and_leaves_the_layer_as_it_was(family):
    model = _model(family).to(torch.bfloat16)
    layer = model.model.layers[0]
    before = [p.clone() for p in layer.parameters()]
    assert checked_difference(layer) < STEP_TOLERANCE / 100
    assert all(
        torch.equal(a, b) and b.dtype == torch.bfloat16
        for a, b in zip(before, layer.parameters(), strict=True)
    )


def test_the_check_sees_a_wrong_rope(monkeypatch):
    layer = _model("llama").model.layers[0]
    monkeypatch.setattr(fused_decoder, "_rotary_function", lambda attention: lambda q, k, cos, sin: (q, k))
    assert checked_difference(layer) > 20 * STEP_TOLERANCE


def test_split_attention_off_a_cuda_device_is_sdpa():
    """Split attention takes CUDA tensors alone: elsewhere a step asked for it computes through SDPA, and
    the refusal says why."""
    model = _model("llama")
    layer, config = model.model.layers[1], model.config
    rows, queries, width = 2, 3, 12
    positions = torch.tensor([[4], [7]]) + torch.arange(queries)
    mask = torch.arange(width)[None, None, None, :] <= positions[:, None, :, None]
    hidden = torch.randn(rows, queries, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
    rotary = model.model.rotary_emb(hidden, positions)
    query = torch.zeros(rows, 4, queries, 8)
    refusal = split_attention_refusal(query, torch.zeros(rows, 2, width, 8), additive_mask(mask, query.dtype))
    assert refusal is not None and ("Triton" in refusal or "CUDA" in refusal)
    with torch.no_grad():
        steps = [
            fused_decoder_step(layer, FusedProjections(layer, kernels), hidden, mask, rotary, view)
            for kernels, view in (
                (StepKernels(), _view(config, rows, width, positions, 2)),
                (StepKernels(split_attention=True), _view(config, rows, width, positions, 2)),
            )
        ]
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-6, atol=1e-6)
