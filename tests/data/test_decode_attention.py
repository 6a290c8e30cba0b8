"""The static engine's decode attention (flashdraft/generate/decode_attention.py): equal to transformers' SDPA
on random GQA inputs with masks, prefill left to SDPA, the model switched for the engine's call and
restored after (also after an error), and the engine's decode steps really running through it."""

from __future__ import annotations

import json
import types

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import flashdraft.generate.decode_attention as decode_attention
from flashdraft.config import Sampling
from flashdraft.errors import FlashdraftError
from flashdraft.generate.decode_attention import KERNELS, use_decode_attention
from flashdraft.generate.static import StaticEngine
from flashdraft.model.tiny import build_model, tiny_config

FORWARDS = {kernel: decode_attention._FORWARDS[kernel] for kernel in KERNELS}


def _inputs(rows, heads, kv_heads, cols, dim=16, q_len=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, q_len, dim, generator=g)
    # K and V as the engine hands them over: the first `cols` columns of a wider buffer (not contiguous)
    key = torch.randn(rows, kv_heads, cols + 5, dim, generator=g)[:, :, :cols]
    value = torch.randn(rows, kv_heads, cols + 5, dim, generator=g)[:, :, :cols]
    mask = torch.rand(rows, 1, q_len, cols, generator=g) > 0.4
    mask[..., -1] = True  # every query sees at least one key, as in the engine
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    return module, query, key, value, mask


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (4, 1), (4, 4)])
def test_decode_attention_equals_transformers_sdpa_on_random_masked_inputs(kernel, heads, kv_heads):
    module, query, key, value, mask = _inputs(rows=5, heads=heads, kv_heads=kv_heads, cols=37)
    ours, weights = FORWARDS[kernel](module, query, key, value, mask, scaling=0.3)
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=0.3)
    assert weights is None and ours.shape == expected.shape == (5, 1, heads, 16)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    # and the default scale (none given) is transformers' 1/sqrt(head dim)
    default, _ = FORWARDS[kernel](module, query, key, value, mask)
    torch.testing.assert_close(default, ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask)[0])


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_row_groups_read_only_their_columns_and_give_the_same_attention(kernel, monkeypatch):
    """Rows sorted longest prompt first, left-padded: a group's columns before its longest prompt's start
    are masked for all its rows, so reading from there gives the attention over the whole width."""
    module, query, key, value, mask = _inputs(rows=7, heads=9, kv_heads=3, cols=40)
    starts = [0, 0, 6, 6, 12, 20, 31]  # each row's first real column (its left padding before it)
    for row, start in enumerate(starts):
        mask[row, ..., :start] = False
    whole, _ = FORWARDS[kernel](module, query, key, value, mask, scaling=0.3)
    name = {"grouped": "grouped_decode_attention", "grouped-fused": "fused_grouped_decode_attention"}[kernel]
    real, widths = getattr(decode_attention, name), []
    monkeypatch.setattr(
        decode_attention, name, lambda q, k, *a: widths.append((q.shape[0], k.shape[2])) or real(q, k, *a)
    )
    groups = ((0, 2, 0), (2, 4, 6), (4, 7, 12))
    grouped, _ = FORWARDS[kernel](module, query, key, value, mask, scaling=0.3, row_groups=groups)
    assert widths == [(2, 40), (2, 34), (3, 28)]  # each group's rows, from its own first column
    torch.testing.assert_close(grouped, whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_longer_query_goes_to_sdpa_untouched(kernel, monkeypatch):
    """Prefill (and any call that is not a 1-token query with a broadcast bool mask) is SDPA's own."""
    module, query, key, value, mask = _inputs(rows=3, heads=4, kv_heads=2, cols=11, q_len=11)
    ours, _ = FORWARDS[kernel](module, query, key, value, mask, scaling=0.25)
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=0.25)
    assert torch.equal(ours, expected)
    # several queries under one mask row broadcast to all of them: SDPA's as well
    broadcast = mask[:, :, -1:]
    ours, _ = FORWARDS[kernel](module, query, key, value, broadcast, scaling=0.25)
    assert torch.equal(
        ours, ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, broadcast, scaling=0.25)[0]
    )
    # a float (additive) mask on a 1-token query is SDPA's too: the grouped kernels are not called
    monkeypatch.setattr(decode_attention, "grouped_decode_attention", None)
    monkeypatch.setattr(decode_attention, "fused_grouped_decode_attention", None)
    module, query, key, value, mask = _inputs(rows=3, heads=4, kv_heads=2, cols=11)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert torch.equal(
        FORWARDS[kernel](module, query, key, value, additive)[0],
        ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, additive)[0],
    )


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    torch.set_num_threads(1)
    return build_model(tiny_config(request.param, vocab_size=64, hidden_size=32, num_layers=2)).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (4, 9, 2, 6, 7)]


def test_the_switch_is_undone_after_the_block_and_after_an_error(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits
    model.set_attn_implementation("eager")  # whatever the model held comes back, not just sdpa
    try:
        with use_decode_attention(model, "grouped") as switched:
            assert switched and model.config._attn_implementation == KERNELS["grouped"]
            assert model.model.layers[0].self_attn.config._attn_implementation == KERNELS["grouped"]
        assert model.config._attn_implementation == "eager"
        with pytest.raises(RuntimeError, match="inside"), use_decode_attention(model, "grouped-fused"):
            raise RuntimeError("inside")
        assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(model(ids).logits, before)


def test_engine_decode_steps_run_the_grouped_kernel_and_the_model_comes_back(model, prompts, monkeypatch):
    calls = []
    real = decode_attention.grouped_decode_attention
    monkeypatch.setattr(
        decode_attention, "grouped_decode_attention", lambda *a: calls.append(a[1].shape) or real(*a)
    )
    stops = [-7]  # never emitted: every row runs to max_new_tokens
    engine = StaticEngine(model, Sampling(max_new_tokens=6), stops, 0, 2, bucket=4)
    assert model.config._attn_implementation == "sdpa"
    answers = engine.generate_ids(prompts, [0] * len(prompts))
    assert model.config._attn_implementation == "sdpa"
    record = engine.describe()
    # 5 prompts at most 2 rows a batch: 3 batches of 2 rows, 5 decode steps each (the prefill gives token 1)
    assert record["batches"] == 3 and record["rows"] == 2 and record["decode_steps"] == 3 * 5
    assert len(calls) == record["decode_steps"] * 2  # every decode step, every layer; never the prefill
    assert record["decode_attention"].startswith("grouped ")
    assert record["decode_s"] > 0 and record["prefill_s"] > 0 and record["decode_ms_per_step"] > 0
    assert record["capture_s"] >= 0
    # the model's own attention gives the same answers (fp32: exact to the token)
    own = StaticEngine(model, Sampling(max_new_tokens=6), stops, 0, 2, bucket=4, attention="model")
    assert own.generate_ids(prompts, [0] * len(prompts)) == answers
    assert own.describe()["decode_attention"] == "the model's own (asked for)"
    assert len(calls) == 3 * 5 * 2  # not called by the model's own attention


def test_the_model_comes_back_when_generation_fails(model):
    engine = StaticEngine(model, Sampling(max_new_tokens=4), [2], 0)
    with pytest.raises(FlashdraftError, match="an empty prompt"):
        engine.generate_ids([[5, 6], []], [0, 0])
    assert model.config._attn_implementation == "sdpa"


def test_an_unknown_attention_is_refused(model):
    with pytest.raises(FlashdraftError, match=r"^static engine attention 'fast': expected one of"):
        StaticEngine(model, Sampling(), [2], 0, attention="fast")


@pytest.mark.parametrize("attention", ["grouped", "grouped-fused", "model"])
def test_step_seconds_times_a_step_and_leaves_the_model_as_it_was(model, attention):
    engine = StaticEngine(model, Sampling(max_new_tokens=8), [2], 0, 4, attention=attention)
    assert engine.step_seconds(rows=4, columns=24, repeats=2) > 0
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_on_cuda_in_bf16_the_kernels_agree_with_sdpa_and_graphs_equal_eager(kernel, prompts):
    """bf16: both our result and SDPA's are compared with an fp32 computation of the same bf16 inputs;
    ours may be off by at most 2x SDPA's own error plus 1e-2 (bf16 has 8 bits of mantissa)."""
    module, query, key, value, mask = _inputs(rows=64, heads=9, kv_heads=3, cols=448, dim=64)
    exact, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=0.125)
    cuda = [t.cuda().bfloat16() if t.dtype != torch.bool else t.cuda() for t in (query, key, value, mask)]
    ours, _ = FORWARDS[kernel](module, *cuda, scaling=0.125)
    sdpa, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, *cuda, scaling=0.125)
    reference = exact.cuda()
    sdpa_error = (sdpa.float() - reference).abs().max().item()
    assert (ours.float() - reference).abs().max().item() <= 2 * sdpa_error + 1e-2
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=64, hidden_size=96, num_layers=3, num_attention_heads=6)
    model = build_model(config).cuda().bfloat16().eval()
    graphs = StaticEngine(model, Sampling(max_new_tokens=40), [2], 0, cuda_graphs=True, attention=kernel)
    eager = StaticEngine(model, Sampling(max_new_tokens=40), [2], 0, cuda_graphs=False, attention=kernel)
    seeds = list(range(len(prompts)))
    assert graphs.generate_ids(prompts, seeds) == eager.generate_ids(prompts, seeds)
    assert graphs.describe()["cuda_graphs"] is True, graphs.describe()
    assert graphs.describe()["decode_attention"].startswith(f"{kernel} ")


def test_bench_regen_step_time_reports_each_attention_and_refuses_a_bad_size(tmp_path, capsys):
    from flashdraft.bench.regen_bench import engine_timing, main
    from flashdraft.model.tiny import save_tiny_target

    target = save_tiny_target(tmp_path / "t", "llama", vocab_size=64, hidden_size=32, num_layers=1)
    with pytest.raises(FlashdraftError, match=r"^--step-time '8by16': expected ROWSxCOLUMNS"):
        main(["--target", str(target), "--step-time", "8by16"])
    out = tmp_path / "step.json"
    assert main(["--target", str(target), "--step-time", "8x16", "--device", "cpu", "--out", str(out)]) == 0
    step = json.loads(out.read_text())["step_time"]
    assert step["rows"] == 8 and step["columns"] == 16
    assert all(step[f"{a}_ms"] > 0 for a in ("grouped", "grouped-fused", "model"))
    assert "grouped_top_kernels" not in step  # only with --profile
    profiled = tmp_path / "profiled.json"
    argv = [
        "--target",
        str(target),
        "--step-time",
        "8x16",
        "--device",
        "cpu",
        "--profile",
        "--out",
        str(profiled),
    ]
    assert main(argv) == 0
    step = json.loads(profiled.read_text())["step_time"]
    for attention in ("grouped", "grouped-fused", "model"):
        top = step[f"{attention}_top_kernels"]  # on the CPU: aten ops by self time, largest first
        assert top and all(row["us_per_step"] > 0 and row["calls_per_step"] > 0 for row in top)
        assert [row["us_per_step"] for row in top] == sorted(
            (row["us_per_step"] for row in top), reverse=True
        )
        assert any("mm" in row["name"] or "linear" in row["name"] for row in top)  # the layer's matmuls
    # the timing kept from a prepare manifest: static-engine workers only
    regeneration = {"engine_details": [{"engine": "hf"}, {"engine": "static", "rows": 4, "decode_steps": 9}]}
    assert engine_timing(regeneration) == [
        {"rows": 4, "batches": None, "decode_steps": 9, "decode_s": None, "decode_ms_per_step": None}
        | {"prefill_s": None, "capture_s": None, "prefill_chunks": None}
    ]
