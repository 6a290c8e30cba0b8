"""Compiled steps of the fast engine (distributed/parallelize.py::compile_for_decoding, docs/decoding.md,
"Compiled steps"), on the CPU through inductor's C++ backend: the same tokens and the same acceptance
lengths as the eager loop, every decoder layer of the target through one shared graph, and a compile that
fails falling back to eager model code with the reason in the engine's record. On a GPU the same steps
are captured in CUDA graphs (tests/generate/test_fast_engine_gpu.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from flashdraft.distributed import parallelize
from flashdraft.generate import fast as fast_engine
from flashdraft.generate.fast import FastEngine
from flashdraft.generate.kv_cache import LayerKV
from flashdraft.generate.speculative import generate
from flashdraft.model import fused_decoder, fused_stack
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.model.target import TargetModel
from tests.dynamo_graphs import compiled_graphs
from tests.infer.dflash2_drafter import dflash2_from

NEW = 40


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """Dynamo's graphs are per process: start and leave this module with none, so the counts below are
    this module's and no other test meets its recompile budget used."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def pair(trained):
    drafter = load_drafter(trained["drafter"])
    target = TargetModel.load(trained["target"], drafter.spec.target_layer_ids)
    yield target, drafter
    for layer in target.layers:  # the routes installed on this module's own target copy
        layer.__dict__.pop("forward", None)


@pytest.fixture(scope="module")
def prompts(trained) -> list[torch.Tensor]:
    records = [json.loads(line) for line in (trained["target"].parent / "train.jsonl").open()][:7]
    return [
        torch.tensor([r["input_ids"][: r["loss_mask"].index(1) + 2 + 3 * i]])
        for i, r in enumerate(records)
        if 1 in r["loss_mask"]
    ]


def test_compiled_steps_decode_what_the_eager_loop_decodes_with_one_graph_for_every_layer(pair, prompts):
    target, drafter = pair
    eager = [generate(target, drafter, p, NEW) for p in prompts]
    assert max(max(run.accepted) for run in eager) >= 3  # multi-token acceptances are exercised
    engine = FastEngine(target, drafter, NEW, compile=True, rows=2, bucket=8)
    fast = engine.generate(prompts)
    record = engine.describe()
    assert record["compiled"] and record["fused_layers"] and record["fused_stack"], record
    assert "compile_note" not in record and record["stack_difference"] < 1e-5, record
    assert [run.tokens for run in fast] == [run.tokens for run in eager]
    assert [run.accepted for run in fast] == [run.accepted for run in eager]
    # four decoder layers and several attended widths (bucket 8), yet one graph: widths are dynamic
    assert len(target.layers) == 4 and len(engine.graphs) == 0 and engine.timing["steps"] > 20
    assert compiled_graphs(fused_decoder.fused_layer_step) == 1
    assert compiled_graphs(fused_stack.stack_prologue) == compiled_graphs(fused_stack.stack_epilogue) == 1
    # the layers' own forward, fused or not, is not compiled: the stack's check runs them eagerly
    assert (
        compiled_graphs(parallelize._run_fused_decoding_layer)
        == compiled_graphs(parallelize._run_decoding_layer)
        == 0
    )
    assert compiled_graphs(parallelize._run_drafter) == 1
    assert compiled_graphs(parallelize._run_context_key_values) == 1  # one shape: [rows, block] every step
    # the step's tail
    assert compiled_graphs(fast_engine.greedy_acceptance) == compiled_graphs(fast_engine.settle) == 1
    # the step's own code around the model calls: one graph each, the drafter's inputs at every width
    assert compiled_graphs(fast_engine.draft_inputs) == compiled_graphs(fast_engine.greedy_drafts) == 1
    assert compiled_graphs(fast_engine.write_context) == 1

    plain = FastEngine(target, None, NEW, compile=True, rows=2, bucket=8)
    runs = plain.generate(prompts)
    assert [run.tokens for run in runs] == [generate(target, None, p, NEW).tokens for p in prompts]
    assert compiled_graphs(fused_decoder.fused_layer_step) == 2  # one query a row: a graph of its own
    assert compiled_graphs(fast_engine.settle) == 2


def test_a_dflash2_drafter_compiled_walks_its_candidates_in_one_graph_and_decodes_what_the_eager_loop_does(
    pair, prompts
):
    """DFlash2's candidate walk (CandidateSelector.select at temperature 0) compiled whole with the step's
    other functions: the same tokens and acceptance lengths as the eager loop, one graph for every step."""
    target, drafter = pair
    dflash2 = dflash2_from(drafter, target)
    eager = [generate(target, dflash2, p, NEW) for p in prompts]
    assert max(max(run.accepted) for run in eager) >= 3
    engine = FastEngine(target, dflash2, NEW, compile=True, rows=2, bucket=8)
    fast = engine.generate(prompts)
    assert engine.describe()["compiled"] and engine.timing["steps"] > 20
    assert [run.tokens for run in fast] == [run.tokens for run in eager]
    assert [run.accepted for run in fast] == [run.accepted for run in eager]
    assert compiled_graphs(fast_engine.candidate_walk) == 1


def test_a_fused_step_that_differs_from_the_layer_is_refused_and_the_layers_own_forward_decodes(
    trained, prompts, monkeypatch
):
    """A family whose RoPE the fused step would apply wrongly (here: not at all): the check before the
    first fused step sees it, and the compiled steps run the layers' own forward."""
    drafter = load_drafter(trained["drafter"])
    target = TargetModel.load(trained["target"], drafter.spec.target_layer_ids)
    monkeypatch.setattr(fused_decoder, "_rotary_function", lambda attention: lambda q, k, cos, sin: (q, k))
    engine = FastEngine(target, None, NEW, compile=True, rows=2, bucket=8)
    runs = engine.generate(prompts[:3])
    record = engine.describe()
    assert record["compiled"] and not record["fused_layers"]
    assert record["compile_note"].startswith(
        "decoder layers on their own forward: its fused step differed from its own forward by"
    ), record
    assert [run.tokens for run in runs] == [generate(target, None, p, NEW).tokens for p in prompts[:3]]
    assert compiled_graphs(parallelize._run_decoding_layer) >= 1


def test_a_stack_that_differs_from_the_model_forward_is_refused_and_the_model_forward_decodes(
    trained, prompts, monkeypatch
):
    """A model forward that scales its logits where the stack's loop does not (Granite's
    `logits_scaling`, say, had the config check missed it): the check before the first step sees it, and
    the steps go through the model's forward, their layers still fused."""
    drafter = load_drafter(trained["drafter"])
    target = TargetModel.load(trained["target"], drafter.spec.target_layer_ids)
    step = fused_stack.FusedStack.step

    def scaled(self, *args):
        logits, features = step(self, *args)
        return logits * 1.5, features

    monkeypatch.setattr(fused_stack.FusedStack, "step", scaled)
    engine = FastEngine(target, drafter, NEW, compile=True, rows=2, bucket=8)
    runs = engine.generate(prompts[:3])
    record = engine.describe()
    assert record["compiled"] and record["fused_layers"] and not record["fused_stack"]
    assert record["stack_difference"] > fused_stack.STACK_TOLERANCE
    assert record["compile_note"].startswith(
        "step through the model's forward: its fused stack differed from its model forward by"
    ), record
    assert [run.tokens for run in runs] == [generate(target, drafter, p, NEW).tokens for p in prompts[:3]]


def test_a_stack_check_that_cannot_run_refuses_the_stack_alone(trained, prompts, monkeypatch):
    drafter = load_drafter(trained["drafter"])
    target = TargetModel.load(trained["target"], drafter.spec.target_layer_ids)

    def uncopyable(target, layers=2):
        raise RuntimeError("cannot deep-copy this model")

    monkeypatch.setattr(fast_engine, "stack_twin", uncopyable)
    engine = FastEngine(target, None, NEW, compile=True, rows=2, bucket=8)
    runs = engine.generate(prompts[:2])
    record = engine.describe()
    assert record["compiled"] and record["fused_layers"] and not record["fused_stack"], record
    assert "its fused stack could not be checked: RuntimeError: cannot deep-copy" in record["compile_note"]
    assert [run.tokens for run in runs] == [generate(target, None, p, NEW).tokens for p in prompts[:2]]


def test_a_compile_that_fails_leaves_eager_model_code_and_says_why(pair, prompts, monkeypatch):
    target, drafter = pair

    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not build this\nsecond line")

    functions = {name: broken for name in parallelize._decoding_functions()}
    monkeypatch.setattr(parallelize, "_decoding_functions", lambda: functions)
    engine = FastEngine(target, drafter, NEW, compile=True)
    runs = engine.generate(prompts[:2])
    record = engine.describe()
    assert not record["compiled"]
    assert (
        record["compile_note"]
        == "compile failed, eager model code: RuntimeError: inductor could not build this"
    )
    assert [run.tokens for run in runs] == [generate(target, drafter, p, NEW).tokens for p in prompts[:2]]
    assert all(layer.forward.decoding is None for layer in target.layers)  # the routes are back to eager


def test_a_layer_takes_its_own_view_in_a_step_and_the_eager_forward_otherwise():
    class Layer(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return "eager"

    seen = []
    route = parallelize.CompiledLayerForward(
        Layer(), 2, decoding=lambda layer, *args, **kwargs: seen.append(kwargs) or "compiled"
    )

    class Cache:
        def __init__(self, view):
            self.view = view

        def layer_view(self, index):
            return self.view and SimpleNamespace(index=index, keys=self.view, attended=torch.empty(5))

    assert route(None, cache=Cache("keys of 2")) == "compiled"
    assert [(kw["cache"].index, kw["cache"].keys) for kw in seen] == [(2, "keys of 2")]  # its own view
    assert route(None, cache=Cache(None)) == "eager"  # no view (a prefill)
    assert route(None, past_key_values=object()) == "eager"  # a cache without views (the eager loop's)
    assert route(None) == "eager"  # no cache, and no compiled feature extraction
    assert len(seen) == 1


def test_a_layer_view_writes_into_the_cache_it_views():
    keys, values = torch.zeros(2, 1, 10, 3), torch.zeros(2, 1, 10, 3)
    columns = torch.tensor([[4, 5], [7, 8]])  # the second row idle, past the attended width
    view = LayerKV(keys, values, torch.arange(2)[:, None], columns, torch.empty(6))
    new = torch.arange(12.0).reshape(2, 1, 2, 3)
    k, v = view.update(new, -new, 7)
    assert k.shape == v.shape == (2, 1, 6, 3)
    assert torch.equal(keys[0, 0, 4:6], new[0, 0]) and torch.equal(keys[1, 0, 7:9], new[1, 0])
    assert torch.equal(values[1, 0, 7:9], -new[1, 0]) and torch.equal(k, keys[:, :, :6])


@pytest.mark.parametrize("queries", [1, 6, 14, 16, 32, 64])
def test_the_stack_check_fits_its_cache_at_every_block_size(queries):
    width, positions = fast_engine.stack_check_layout(queries)
    assert positions.shape == (2, queries)
    assert positions.min() >= 0 and positions.max() < width  # an index past it aborts a GPU process
    assert positions[1, -1] == width - 2  # the second row attends to a nearly full cache


def test_a_block_of_16_decodes_through_the_checked_fused_stack(pair, prompts):
    """The paper's block size (the default): the stack check ran and passed, the steps went through the
    fused stack; at a3e2a80-c21111c the check's cache (16 columns) was too narrow for it, which the CPU
    caught as an IndexError (the stack refused) and a GPU as a device-side assert (the process lost)."""
    torch._dynamo.reset()  # its own recompile budget: the block of 16 is a new shape for every graph
    target, drafter = pair
    engine = FastEngine(target, drafter, NEW, block_size=16, compile=True, rows=2, bucket=8)
    runs = engine.generate(prompts[:2])
    record = engine.describe()
    assert record["compiled"] and record["fused_stack"] and "compile_note" not in record, record
    assert record["stack_difference"] < 1e-5
    eager = [generate(target, drafter, p, NEW, block_size=16) for p in prompts[:2]]
    assert [run.tokens for run in runs] == [run.tokens for run in eager]
    assert [run.accepted for run in runs] == [run.accepted for run in eager]


def test_a_drafter_compiled_for_training_decodes_what_the_eager_drafter_does(trained, prompts):
    """The trainer's real-τ evaluation decodes with the drafter it trains, whose layers, context projection
    and norms `compile_drafter` compiled (the last three for the training step only): through the eager
    loop, the fast engine on eager model code (the trainer's) and the fast engine's own compiled steps, it
    decodes the tokens the uncompiled drafter does, and decoding compiles none of the three."""
    drafter = load_drafter(trained["drafter"])
    target = TargetModel.load(trained["target"], drafter.spec.target_layer_ids)
    want = [generate(target, drafter, p, NEW) for p in prompts[:3]]
    parallelize.compile_drafter(drafter)
    with torch.no_grad():
        eager_loop = [generate(target, drafter, p, NEW) for p in prompts[:3]]
    trainer_engine = FastEngine(target, drafter, NEW, compile=False, rows=1).generate(prompts[:3])
    compiled_engine = FastEngine(target, drafter, NEW, compile=True, rows=2, bucket=8).generate(prompts[:3])
    for runs in (eager_loop, trainer_engine, compiled_engine):
        assert [run.tokens for run in runs] == [run.tokens for run in want]
        assert [run.accepted for run in runs] == [run.accepted for run in want]
    assert compiled_graphs(parallelize._run_context_projection) == 0
    assert compiled_graphs(parallelize._run_drafter_norm) == 0
