"""The target's compiled decoder layers (distributed/parallelize.py::compile_target) give the features the
eager forward gives, compile one graph per layer kind (not per layer) for every length, still stop after
the last feature layer, and leave decoding (a call with a cache) eager: in the trainer, under its recompile
limit, none of it recompiles."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch._dynamo.utils import counters

from flashdraft.config import load_config
from flashdraft.distributed import parallelize
from flashdraft.distributed.parallelize import (
    RECOMPILES_PER_LAYER,
    CompiledLayerForward,
    compile_target,
    guard_compile,
    target_compile_refusal,
    target_layer_kinds,
)
from flashdraft.model.target import DecodingCache, TargetModel
from flashdraft.model.tiny import save_tiny_target
from flashdraft.train import build
from flashdraft.train.trainer import train
from tests.bench.test_quality import chain_samples, char_tokenizer, save_chain_target
from tests.dynamo_graphs import compiled_graphs

pytestmark = pytest.mark.usefixtures("fresh_compile_cache", "own_compile_settings")


@pytest.fixture
def own_compile_settings(monkeypatch):
    """compile_target sets dynamo's recompile limit and makes a hit an error (guard_compile), as the
    trainer wants; restored after each test, with the record of what each owner needs."""
    monkeypatch.setattr(parallelize, "_RECOMPILE_BUDGETS", {})
    config = torch._dynamo.config
    with config.patch(
        recompile_limit=config.recompile_limit,
        fail_on_recompile_limit_hit=config.fail_on_recompile_limit_hit,
        suppress_errors=config.suppress_errors,
    ):
        yield


def test_the_target_compiles_only_on_a_gpu_and_never_a_hybrid(target_dirs):
    qwen3 = TargetModel.load(target_dirs["qwen3"], [1, 4])
    assert target_compile_refusal(qwen3) is None
    assert not compile_target(qwen3)  # on the CPU: eager
    assert "forward" not in vars(qwen3.layers[0])
    hybrid = TargetModel.load(target_dirs["qwen3_5"], [1, 4])
    assert "linear-attention" in target_compile_refusal(hybrid)
    assert not compile_target(hybrid, _on_cpu=True)


def _target_graphs() -> int:
    """The graphs compiled for the target's layers (the cache entries of their one compiled function)."""
    return compiled_graphs(parallelize._run_decoder_layer)


def _features_eager_then_compiled(target: TargetModel, lengths: tuple[int, ...], graphs: int) -> None:
    """Features at each length, eager then compiled (the trainer's path, forced on the CPU) with dynamo's
    recompile limit at `graphs` (a hit an error): the same within 1e-5 in fp32."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 300, (2, length), generator=g) for length in lengths]
    eager = [target.features(ids) for ids in batches]
    assert compile_target(target, _on_cpu=True)
    assert torch._dynamo.config.fail_on_recompile_limit_hit
    with torch._dynamo.config.patch(recompile_limit=graphs):
        compiled = [target.features(ids) for ids in batches]
    for got, want in zip(compiled, eager, strict=True):
        # not bit for bit: inductor fuses the norms' reductions, which round in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_every_layer_and_length_share_one_graph_and_stop_early(qwen3_target):
    target = TargetModel.load(qwen3_target, [1, 3])  # layers 0-3 run: four layers, one kind
    ran_late = []
    hooks = [layer.register_forward_pre_hook(lambda *_: ran_late.append(1)) for layer in target.layers[4:]]
    hooks.append(
        target.model.get_output_embeddings().register_forward_pre_hook(lambda *_: ran_late.append(1))
    )
    _features_eager_then_compiled(target, (256, 512), graphs=1)
    for handle in hooks:
        handle.remove()
    assert not ran_late  # layers after the last feature layer and the LM head never ran
    assert target_layer_kinds(target) == 1
    assert _target_graphs() == 1 == counters["stats"]["unique_graphs"], dict(
        counters["stats"]
    )  # 4 layers, 2 lengths


@pytest.mark.slow
def test_sliding_and_full_layers_compile_one_graph_each(tmp_path):
    """Gemma 3: four sliding-window layers and two full ones (tiny.py), one graph per kind."""
    target = TargetModel.load(save_tiny_target(tmp_path / "gemma3", "gemma3", num_layers=6), [1, 5])
    assert target_layer_kinds(target) == 2
    # lengths unlike the tiny model's widths (64, 128): at a length of 64 the sliding layers' mask was
    # specialised to it, one graph more
    _features_eager_then_compiled(target, (96, 160), graphs=2)  # nothing per layer or length
    assert _target_graphs() == 2 == counters["stats"]["unique_graphs"], dict(counters["stats"])


def _decode(target: TargetModel, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """A prompt, then `steps` verifies of 4 tokens, through the eager loop's cache; logits and features."""
    cache = DecodingCache(target)
    g = torch.Generator().manual_seed(1)
    outputs, start, ids = [], 0, prompt
    for _ in range(steps + 1):
        positions = torch.arange(start, start + ids.shape[1])[None]
        outputs.extend(target.forward_cached(ids, positions, cache))
        cache.keep(ids.shape[1])
        start += ids.shape[1]
        ids = torch.randint(0, 300, (1, 4), generator=g)
    return outputs


def test_decoding_through_compiled_layers_stays_eager(qwen3_target):
    """The real τ during training decodes through the target's layers with a cache, whose write reads each
    layer's index: compiled, that was a graph per layer (the trainer's recompile-limit error on the H200)."""
    target = TargetModel.load(qwen3_target, [1, 3])
    prompt = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    eager = _decode(target, prompt, steps=3)
    assert compile_target(target, _on_cpu=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = _decode(target, prompt, steps=3)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same eager code
    assert counters["stats"].get("unique_graphs", 0) == 0, dict(counters["stats"])


def test_the_recompile_limit_counts_the_targets_graphs_beside_the_drafters(tmp_path):
    """compile_target raises the limit to its layer kinds' need and makes a hit an error; the drafter's
    guard keeps whichever need is larger."""
    config = torch._dynamo.config
    config.recompile_limit, config.fail_on_recompile_limit_hit = 1, False
    target = TargetModel.load(save_tiny_target(tmp_path / "gemma3", "gemma3", num_layers=3), [1])
    assert compile_target(target, _on_cpu=True)  # compiles nothing yet: the first call will
    assert config.fail_on_recompile_limit_hit
    assert config.recompile_limit == 2 * RECOMPILES_PER_LAYER  # sliding and full layers
    guard_compile(1)  # a one-layer drafter needs less: the target's need stays
    assert config.recompile_limit == 2 * RECOMPILES_PER_LAYER
    guard_compile(5)
    assert config.recompile_limit == 5 * RECOMPILES_PER_LAYER


def test_a_call_with_a_cache_runs_the_eager_forward_and_one_without_the_compiled(qwen3_target):
    target = TargetModel.load(qwen3_target, [1])
    calls = []
    layer = target.layers[0]
    layer.forward = CompiledLayerForward(
        layer, 0, features=lambda *args, **kwargs: calls.append(args[0]) or args[1]
    )
    features = target.features(torch.arange(5)[None])  # no cache: through `compiled`, with the layer
    assert calls == [layer] and features.shape == (1, 5, target.hidden_size)
    logits, _ = target.forward_cached(torch.arange(5)[None], torch.arange(5)[None], DecodingCache(target))
    assert calls == [layer] and logits.shape[:2] == (1, 5)  # the decode's cached call: eager


@pytest.mark.slow
def test_the_trainer_compiles_the_target_once_and_decodes_real_tau(tmp_path, monkeypatch):
    """The trainer's own path (train.compile_target=true, its recompile limit, real τ at each evaluation)
    with the compile forced on the CPU: no recompile error, one graph for all the target's layers."""
    monkeypatch.setattr(build, "compile_target", functools.partial(compile_target, _on_cpu=True))
    target = save_chain_target(tmp_path / "target")
    data = tmp_path / "train.jsonl"
    data.write_text(chain_samples(char_tokenizer(), 16, 0))
    settings = {
        "model.target": target,
        "model.num_layers": 1,
        "model.block_size": 4,
        "data.train": f"[{data}]",
        "data.eval": f"[{data}]",
        "train.out_dir": tmp_path / "run",
        "train.max_steps": 4,
        "train.num_anchors": 4,
        "train.batch_size": 4,
        "train.eval_every": 2,
        "train.device": "cpu",
        "train.compile_target": "true",
        "train.real_eval_prompts": 2,
        "train.real_eval_new_tokens": 8,
        "train.resume": "never",
    }
    train(load_config(None, [f"{k}={v}" for k, v in settings.items()]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval" and "real_tau" in r] == [2, 4]
    assert _target_graphs() == 1 == counters["stats"]["unique_graphs"], dict(counters["stats"])
