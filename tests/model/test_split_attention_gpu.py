"""GPU checks (marker `gpu`) of the split attention kernels (flashdraft/model/split_attention.py): against a
dense per-head reference in fp32 (to fp32 rounding) and in bf16 (no further from the reference than SDPA
is), for one query and a block, one row and several, head dims that are not powers of two or are below
16, widths that leave chunks wholly masked, and the most grouped rows a block holds; compiled whole and
replayed from a CUDA graph, the same numbers; a fused layer step on them is the layer's own forward
(`checked_difference`). Run on the device machine:
`python -m pytest -m gpu tests/model/test_split_attention_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flashdraft.model.fused_decoder import (
    STEP_TOLERANCE,
    StepKernels,
    additive_mask,
    checked_difference,
    grouped_query_attention,
)
from flashdraft.model.split_attention import split_attention, split_attention_refusal
from tests.model.attention_reference import dense_attention

pytestmark = pytest.mark.gpu

# (rows, heads, kv heads, head dim, queries, width)
SHAPES = [
    (1, 9, 3, 64, 1, 100),  # SmolLM2's heads, plain decoding
    (1, 9, 3, 64, 8, 2000),  # a verify block over a wide cache: most chunks end past the positions
    (4, 8, 8, 32, 4, 333),  # no grouping, ragged rows
    (2, 4, 2, 80, 3, 70),  # a head dim that is not a power of two
    (1, 32, 8, 128, 16, 600),  # Qwen3-8B's heads, a block of 16
    (1, 16, 2, 64, 16, 257),  # 128 grouped rows: the most a block holds
    (2, 8, 2, 8, 3, 40),  # a head dim below tl.dot's 16
]


def _inputs(shape: tuple, dtype: torch.dtype, seed: int = 0):
    rows, heads, kv, dim, queries, width = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    query = torch.randn(rows, heads, queries, dim, device="cuda", generator=g).to(dtype)
    key = torch.randn(rows, kv, width, dim, device="cuda", generator=g).to(dtype)
    value = torch.randn(rows, kv, width, dim, device="cuda", generator=g).to(dtype)
    # each row's block at its own place, the columns after it masked; one row also with holes
    starts = torch.randint(0, width - queries, (rows, 1), device="cuda", generator=g)
    positions = starts + torch.arange(queries, device="cuda")
    allowed = (torch.arange(width, device="cuda") <= positions[..., None])[:, None]
    holes = torch.rand(allowed.shape, device="cuda", generator=g) < 0.2
    holes[..., 0] = False
    allowed[0] &= ~holes[0]
    return query, key, value, allowed


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_split_attention_is_attention_in_fp32(shape):
    query, key, value, allowed = _inputs(shape, torch.float32)
    scale = shape[3] ** -0.5
    mask = additive_mask(allowed, torch.float32)
    assert split_attention_refusal(query, key, mask) is None
    out = split_attention(query, key, value, mask, scale)
    assert out.shape == (shape[0], shape[4], shape[1], shape[3]) and out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), dense_attention(query, key, value, allowed, scale), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_split_attention_in_bf16_is_as_close_as_sdpa(shape):
    query, key, value, allowed = _inputs(shape, torch.bfloat16)
    scale = shape[3] ** -0.5
    truth = dense_attention(query, key, value, allowed, scale)
    out = split_attention(query, key, value, additive_mask(allowed, torch.bfloat16), scale)
    sdpa = grouped_query_attention(query, key, value, allowed, scale)
    ours, theirs = ((o.double() - truth).abs().max().item() for o in (out, sdpa))
    assert ours <= max(1.5 * theirs, 1e-2), (ours, theirs)


def test_split_attention_refuses_what_a_block_cannot_hold():
    query, key, _, allowed = _inputs((1, 32, 2, 64, 16, 64), torch.bfloat16)  # 256 grouped rows
    assert "grouped query rows" in split_attention_refusal(query, key, additive_mask(allowed, torch.bfloat16))
    assert "additive" in split_attention_refusal(query, key, allowed)


def test_split_attention_compiled_and_replayed_from_a_graph_is_the_same():
    query, key, value, allowed = _inputs((3, 9, 3, 64, 8, 700), torch.bfloat16)
    mask = additive_mask(allowed, torch.bfloat16)
    eager = split_attention(query, key, value, mask, 0.125)

    def attend(q, k, v, m):
        return split_attention(q * 1.0, k, v, m, 0.125) + 0.0  # ops around it, as a layer step has

    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(query, key, value, mask), eager, rtol=0, atol=0)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    compiled(query, key, value, mask)  # warm
    with torch.cuda.graph(graph):
        out.copy_(compiled(query, key, value, mask))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize(
    "model_class, config",
    [
        (LlamaForCausalLM, LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)),
        (
            Qwen3ForCausalLM,
            Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        ),
    ],
)
def test_a_fused_step_on_the_split_kernels_is_the_layers_own_forward(model_class, config):
    config.update(dict(vocab_size=64, intermediate_size=96, num_hidden_layers=1))
    layer = model_class(config).model.layers[0].cuda()
    assert checked_difference(layer, StepKernels(split_attention=True)) < STEP_TOLERANCE / 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_bits_depend_on_its_keys_alone(dtype):
    """The order rule of split_attention.py: 16 rows (many thread blocks) over a cache widened by masked
    columns give the same bits, and a token decoded alone gets the bits it gets inside a block. Widths
    aligned as the engine's buckets are (see the rule's note on Triton's specialization)."""
    query, key, value, allowed = _inputs((16, 9, 3, 64, 8, 192), dtype)
    narrow = split_attention(query, key, value, additive_mask(allowed, dtype), 0.125)
    wide_key = torch.randn(16, 3, 448, 64, device="cuda").to(dtype)
    wide_value = torch.randn(16, 3, 448, 64, device="cuda").to(dtype)
    wide_key[:, :, :192], wide_value[:, :, :192] = key, value
    wide_allowed = torch.zeros(16, 1, 8, 448, dtype=torch.bool, device="cuda")
    wide_allowed[..., :192] = allowed
    wide = split_attention(query, wide_key, wide_value, additive_mask(wide_allowed, dtype), 0.125)
    assert torch.equal(wide, narrow)
    alone = split_attention(query[:, :, 3:4], key, value, additive_mask(allowed[:, :, 3:4], dtype), 0.125)
    assert torch.equal(alone[:, 0], narrow[:, 3])
