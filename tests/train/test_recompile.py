"""A compiled drafter compiles once for every context length (issue 28: on the H200 a batch of another
padded length recompiled the layers in step 2). On the CPU, inductor compiles the same graphs; flex
attention has no CPU backward, so its check runs forward only, and the training path (with backward)
runs on the dense mask."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from flashdraft.distributed.parallelize import compile_drafter
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective

from .helpers import tiny_pair, token_batch

pytestmark = pytest.mark.usefixtures("fresh_compile_cache")

LENGTHS = (256, 512, 768, 256)  # padded lengths as the compiled trainer pads them (multiples of 256)


def _compiled_objective(target_dir: str, attention: str) -> Objective:
    drafter, target = tiny_pair(target_dir, block_size=4)
    compile_drafter(drafter)
    return Objective(
        drafter, target, num_anchors=8, gamma=3.0, loss=WeightedHeadLoss(chunk=64), attention=attention
    )


def _batch(length: int, seed: int):
    return token_batch([length - 10, length - 50], prompt_lengths=[4, 4], seq_len=length, seed=seed)


@pytest.mark.slow
def test_flex_layers_compile_once_for_every_context_length(qwen3_target):
    objective = _compiled_objective(qwen3_target, "flex")
    with torch.no_grad():
        for seed, length in enumerate(LENGTHS):
            objective(_batch(length, seed))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.slow
def test_a_training_step_of_another_length_compiles_nothing(qwen3_target):
    objective = _compiled_objective(qwen3_target, "sdpa")
    for seed, length in enumerate(LENGTHS):
        out = objective(_batch(length, seed))
        (out.loss_sum / out.weight_sum).backward()
        if seed == 0:
            first = counters["stats"]["unique_graphs"]
    assert first == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
