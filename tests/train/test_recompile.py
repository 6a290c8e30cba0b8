"""A compiled drafter compiles once for every context length (issue 28: on the H200 a batch of another
padded length recompiled the layers in step 2). On the CPU, inductor compiles the same graphs; flex
attention has no CPU backward, so its check runs forward only, and the training path (with backward)
runs on the dense mask."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from flashdraft.distributed import parallelize
from flashdraft.distributed.parallelize import CheckpointedDrafterLayer, compile_drafter
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from tests.dynamo_graphs import compiled_graphs

from .helpers import tiny_pair, token_batch

pytestmark = pytest.mark.usefixtures("fresh_compile_cache")

LENGTHS = (256, 512, 768, 256)  # padded lengths as the compiled trainer pads them (multiples of 256)
# A compiled drafter's graphs in training: one its layers share, one of the context projection (fc), one
# its two norms outside the layers share (compile_drafter)
DRAFTER_GRAPHS = 3


def _compiled_objective(target_dir: str, attention: str, checkpointed: bool = False) -> Objective:
    drafter, target = tiny_pair(target_dir, block_size=4)
    if checkpointed:
        for layer in drafter.layers:
            layer.__class__ = CheckpointedDrafterLayer
    compile_drafter(drafter)
    return Objective(
        drafter, target, num_anchors=8, gamma=3.0, loss=WeightedHeadLoss(chunk=64), attention=attention
    )


def _batch(length: int, seed: int):
    return token_batch([length - 10, length - 50], prompt_lengths=[4, 4], seq_len=length, seed=seed)


@pytest.mark.slow
def test_flex_layers_compile_once_for_every_context_length(qwen3_target):
    objective = _compiled_objective(qwen3_target, "flex")
    with torch.no_grad():  # evaluation: the modules around the layers stay eager (compile_drafter)
        for seed, length in enumerate(LENGTHS):
            objective(_batch(length, seed))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_training_step_of_another_length_compiles_nothing(qwen3_target, checkpointed):
    """Also with train.activation_checkpointing: a checkpointed layer's forward taking `*args` named its
    inputs L['args'][i], which the context's dynamic sources do not name, and compiled again at step 2."""
    objective = _compiled_objective(qwen3_target, "sdpa", checkpointed)
    for seed, length in enumerate(LENGTHS):
        out = objective(_batch(length, seed))
        (out.loss_sum / out.weight_sum).backward()
        if seed == 0:
            first = counters["stats"]["unique_graphs"]
    assert first == DRAFTER_GRAPHS and counters["stats"]["unique_graphs"] == DRAFTER_GRAPHS, dict(
        counters["stats"]
    )


def _step_gradients(objective: Objective) -> tuple[float, list[torch.Tensor]]:
    out = objective(_batch(256, 0))
    loss = out.loss_sum / out.weight_sum
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in objective.drafter.parameters()]


def _three_layer_objective(
    target_dir: str,
    *,
    checkpointed: bool = False,
    fp8: bool = False,
    per_layer_value: bool = False,
    compile: bool,
):
    """A 3-layer drafter as parallelize prepares it: FP8-converted (casts emulated on the CPU) and/or each
    layer checkpointed, then, with `compile`, compiled per layer. `per_layer_value`: each layer's attention
    scale differs a little, a value torch.compile guards on, so that each layer compiles its own graph."""
    from flashdraft.distributed.float8 import convert_to_float8

    drafter, target = tiny_pair(target_dir, block_size=4, num_layers=3)
    if fp8:
        convert_to_float8(drafter, "tensorwise", emulate=True)
    if checkpointed:
        for layer in drafter.layers:
            layer.__class__ = CheckpointedDrafterLayer
    if per_layer_value:
        for index, layer in enumerate(drafter.layers):
            layer.self_attn.scale *= 1 + 1e-3 * index
    if compile:
        compile_drafter(drafter)
    return Objective(
        drafter, target, num_anchors=8, gamma=3.0, loss=WeightedHeadLoss(chunk=64), attention="sdpa"
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["checkpointed", "fp8"])
def test_every_drafter_layer_shares_one_compiled_graph(qwen3_target, variant):
    """train.activation_checkpointing and train.precision=fp8 change each layer (its class, its linears)
    before the compile. Both once did it with a function stored on each layer instance, which torch.compile
    guards by identity: one graph per layer (a 5-layer FP8 drafter compiled its layer five times in the
    first step), and a checkpointed layer found no frame to compile at all. One graph for all layers now,
    with the eager step's loss and gradients."""
    kind = {variant: True}
    if variant == "fp8":
        pytest.importorskip("torchao.float8")
    loss, grads = _step_gradients(_three_layer_objective(qwen3_target, compile=False, **kind))
    if variant == "checkpointed":  # recomputing the activations changes nothing of the step
        plain_loss, plain_grads = _step_gradients(_three_layer_objective(qwen3_target, compile=False))
        assert loss == plain_loss
        for got, want in zip(grads, plain_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()
    counters.clear()
    compiled_loss, compiled_grads = _step_gradients(
        _three_layer_objective(qwen3_target, compile=True, **kind)
    )
    assert counters["stats"]["unique_graphs"] == DRAFTER_GRAPHS, dict(counters["stats"])
    assert abs(compiled_loss - loss) < 1e-4 * loss
    if variant != "fp8":
        for got, want in zip(compiled_grads, grads, strict=True):
            assert float((got - want).norm() / want.norm()) < 1e-4
        return
    # inductor's fused reductions round in another order, and under FP8 a value that crosses a rounding
    # boundary of the float8 grid moves by a whole step (an eighth of its binade): the compiled FP8 step
    # differs from the eager one by about 5% as a whole (13% in the worst tensor, a norm's), and is held
    # to the eager FP8 step's accuracy against the unconverted drafter's gradients (both ~9.6% there)
    _, reference = _step_gradients(_three_layer_objective(qwen3_target, compile=False))
    assert _whole_error(compiled_grads, grads) < 0.1
    assert _whole_error(compiled_grads, reference) <= 1.1 * _whole_error(grads, reference) + 0.01


def _whole_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The relative L2 distance of two sets of gradients taken as one vector."""
    squares = sum(float((g - w).norm() ** 2) for g, w in zip(got, want, strict=True))
    return (squares / sum(float(w.norm() ** 2) for w in want)) ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("per_layer_value", [False, True])
def test_the_trainer_warns_where_each_layer_compiles_its_own_graph(qwen3_target, per_layer_value):
    """The check the trainer runs after each compiling step (Trainer.report_compiles): silent where the
    layers share their graph, a warning naming the count where a value stored on each layer made
    torch.compile build one graph per layer (stop 63's FP8 layers did, unnoticed, for a slower warm-up)."""
    from flashdraft.model.drafter import DrafterLayer
    from flashdraft.train import compile_report

    torch._dynamo.reset()
    objective = _three_layer_objective(qwen3_target, per_layer_value=per_layer_value, compile=True)
    since = compile_report.now()
    _step_gradients(objective)
    graphs = compile_report.graphs_compiled_since(since)
    layers = objective.drafter.layers
    assert sum(g.code == compile_report.code_of(DrafterLayer.forward) for g in graphs) == (
        3 if per_layer_value else 1
    )
    warning = compile_report.repeated_layer_graphs(graphs, type(layers[0]).forward, len(layers), kinds=1)
    if per_layer_value:
        assert warning is not None and "3 layers compiled 3 graphs of DrafterLayer.forward" in warning
    else:
        assert warning is None


@pytest.mark.slow
def test_the_projection_and_norms_around_the_layers_compile_once_each_and_change_nothing(qwen3_target):
    """compile_drafter routes `fc` and the two norms outside the layers through compiled code in training
    (they were eager kernel chains, FP8's casts among them): the same loss and gradients as the eager
    drafter, one graph for the projection and one the two norms share, for every padded length, and the
    modules' own calls (hooks included) unchanged. Without a gradient they run their eager forward."""
    torch._dynamo.reset()
    loss, grads = _step_gradients(_three_layer_objective(qwen3_target, compile=False))
    torch._dynamo.reset()
    objective = _three_layer_objective(qwen3_target, compile=True)
    drafter = objective.drafter
    seen = []
    drafter.norm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    compiled_loss, compiled_grads = _step_gradients(objective)
    assert abs(compiled_loss - loss) < 1e-4 * loss
    for got, want in zip(compiled_grads, grads, strict=True):
        assert float((got - want).norm() / want.norm()) < 1e-4
    for seed, length in enumerate(LENGTHS[1:]):
        out = objective(_batch(length, seed))
        (out.loss_sum / out.weight_sum).backward()
    assert len(seen) == len(LENGTHS)  # the hook ran on each call: the module call itself is not replaced
    assert compiled_graphs(parallelize._run_context_projection) == 1
    assert compiled_graphs(parallelize._run_drafter_norm) == 1
    with torch.no_grad():
        objective(_batch(LENGTHS[0], 0))
    assert compiled_graphs(parallelize._run_context_projection) == 1  # nothing compiled for evaluation
