"""The target's compiled decoder layers (distributed/parallelize.py::compile_target) give the features the
eager forward gives, compile one graph for every length, and still stop after the last feature layer."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from flashdraft.distributed.parallelize import compile_decoder_layers, compile_target, target_compile_refusal
from flashdraft.model.target import TargetModel


def test_the_target_compiles_only_on_a_gpu_and_never_a_hybrid(target_dirs):
    qwen3 = TargetModel.load(target_dirs["qwen3"], [1, 4])
    assert target_compile_refusal(qwen3) is None
    assert not compile_target(qwen3)  # on the CPU: eager
    assert "forward" not in vars(qwen3.layers[0])
    hybrid = TargetModel.load(target_dirs["qwen3_5"], [1, 4])
    assert "linear-attention" in target_compile_refusal(hybrid)


@pytest.mark.slow
def test_compiled_layers_give_the_eager_features_in_fp32_and_stop_early(qwen3_target):
    torch._dynamo.reset()
    counters.clear()
    target = TargetModel.load(qwen3_target, [1, 3])
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 300, (2, length), generator=g) for length in (256, 512)]
    eager = [target.features(ids) for ids in batches]
    compile_decoder_layers(target)
    ran_late = []
    hooks = [layer.register_forward_pre_hook(lambda *_: ran_late.append(1)) for layer in target.layers[4:]]
    hooks.append(
        target.model.get_output_embeddings().register_forward_pre_hook(lambda *_: ran_late.append(1))
    )
    compiled = [target.features(ids) for ids in batches]
    for handle in hooks:
        handle.remove()
    for got, want in zip(compiled, eager, strict=True):
        # not bit for bit: inductor fuses the norms' reductions, which round in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not ran_late  # layers after the last feature layer and the LM head never ran
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # every layer, both lengths
    torch._dynamo.reset()
