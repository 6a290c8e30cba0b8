"""GPU-only (marker `gpu`, and torchao for the FP8 ones): train.precision=fp8 converts the drafter, trains
compiled with no recompile after warm-up and tracks the bf16 loss; the target's compiled decoder layers give
the eager features. Run on the device machine: `python -m pytest -m gpu tests/gpu/test_fp8.py -q`."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from flashdraft.data.tokens import TokenBatch
from flashdraft.distributed.float8 import Float8Head, float8_head
from flashdraft.distributed.parallelize import compile_target, parallelize
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from flashdraft.train.optim import make_optimizer

from ..train.helpers import tiny_pair

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_compile_cache")]
CUDA = torch.device("cuda")
STEPS = 20


def _bf16_target_on_gpu(target):
    target.model.to(CUDA, torch.bfloat16)
    target.embed_weight = target.model.get_input_embeddings().weight
    target.lm_head_weight = target.model.get_output_embeddings().weight
    return target


def counting_batch(step: int, rows: int = 2, length: int = 256) -> TokenBatch:
    """Rows that count up from a random start (mod 8): a drafter learns them in a few steps, so the loss
    curve falls far enough for two precisions' curves to be told apart."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, 8, (rows, 1), generator=g)
    ids = (starts + torch.arange(length)) % 8
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[:, :8] = 0
    return TokenBatch(ids, mask, torch.full((rows,), length), seeds=[step * 10 + i for i in range(rows)])


def _train(
    target_dir: str,
    precision: str,
    recipe: str = "tensorwise",
    fp8_head: bool = False,
    fused_ce: bool = False,
) -> tuple[list[float], int, object]:
    """STEPS compiled steps (flex attention, bf16 weights with fp32 master weights: the trainer's path);
    returns the losses, the graphs compiled after the first two steps, and the drafter. `fp8_head`: the
    loss's head GEMMs in FP8 too (train.fp8_head); `fused_ce`: its passes between them as
    train.fused_ce's Triton kernels."""
    drafter, target = tiny_pair(target_dir, block_size=4, num_layers=2)
    target = _bf16_target_on_gpu(target)
    with torch.no_grad():  # a head with a trained one's logit scale: the tiny drafter learns in 20 steps
        target.lm_head_weight.mul_(8)
    placement = parallelize(
        drafter, device=CUDA, attention="flex", compile=True, precision=precision, fp8_recipe=recipe
    )
    objective = Objective(
        drafter,
        target,
        num_anchors=16,
        gamma=3.0,
        loss=WeightedHeadLoss(
            chunk=128,
            head=float8_head(target.lm_head_weight) if fp8_head else None,
            compile=True,
            fused=fused_ce,
        ),
        attention="flex",
        autocast_dtype=placement.autocast_dtype,
    )
    optimizer = make_optimizer(list(drafter.parameters()), lr=3e-3, weight_decay=0.0, compile=True)
    losses, warm = [], 0
    for step in range(STEPS):
        if step == 2:
            warm = counters["stats"]["unique_graphs"]
        out = objective(counting_batch(step).to(CUDA))
        loss = out.loss_sum / out.weight_sum
        loss.backward()
        optimizer.clip_and_step(1.0)
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, counters["stats"]["unique_graphs"] - warm, drafter


def _assert_tracks(curve: list[float], reference: list[float], first_gap: float) -> None:
    """`curve` follows `reference`: the same first loss within `first_gap` (same weights, one forward), then
    apart by step noise only (measured on the CPU with emulated FP8 casts: a mean gap of ~2%, at most 9% at
    one late step), and falling below half its start."""
    gaps = [abs(a - b) / b for a, b in zip(curve, reference, strict=True)]
    assert gaps[0] < first_gap, (curve, reference)
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 0.15, (curve, reference)
    assert curve[-1] < 0.5 * curve[0], curve


def test_fp8_converts_trains_compiled_without_recompiles_and_tracks_bf16(qwen3_target):
    from torchao.float8.float8_linear import Float8Linear

    bf16, _, plain = _train(qwen3_target, "bf16")
    assert not any(isinstance(m, Float8Linear) for m in plain.modules())
    assert bf16[-1] < 0.5 * bf16[0], bf16  # the curve falls: the comparison below can tell curves apart
    for recipe, fp8_head in (("tensorwise", False), ("rowwise", False), ("tensorwise", True)):
        torch._dynamo.reset()
        counters.clear()
        fp8, recompiles, drafter = _train(qwen3_target, "fp8", recipe, fp8_head)
        converted = [m for m in drafter.modules() if isinstance(m, Float8Linear)]
        assert len(converted) == 7 * len(drafter.layers) + 1, recipe  # q k v o gate up down per layer, fc
        assert all(p.dtype == torch.bfloat16 for p in drafter.parameters())
        assert list(drafter.state_dict()) == list(plain.state_dict())
        assert recompiles == 0, (recipe, fp8_head, dict(counters["stats"]))
        # (the FP8 head rounds the first step's logits too: its first loss is near, not equal)
        _assert_tracks(fp8, bf16, first_gap=0.02 if fp8_head else 0.01)


@pytest.mark.parametrize(("precision", "fp8_head"), [("bf16", False), ("fp8", True)])
def test_fused_ce_trains_like_the_compiled_loss(qwen3_target, precision, fp8_head):
    """train.fused_ce over whole training steps, not the loss rows alone: the same curve as the compiled
    chunk function's (the kernels' rows equal its rows to bf16 rounding), no graph compiled after warm-up."""
    compiled, _, _ = _train(qwen3_target, precision, fp8_head=fp8_head)
    torch._dynamo.reset()
    counters.clear()
    fused, recompiles, _ = _train(qwen3_target, precision, fp8_head=fp8_head, fused_ce=True)
    assert recompiles == 0, dict(counters["stats"])
    assert compiled[-1] < 0.5 * compiled[0], compiled  # a falling curve, so that a wrong gradient shows
    _assert_tracks(fused, compiled, first_gap=0.01)


def test_fp8_head_gemms_on_the_tensor_cores_match_their_emulation():
    """torch._scaled_mm against the same casts with fp32 GEMMs (what the CPU tests check): equal up to the
    GEMMs' own accumulation order and the bf16 output's rounding, for the logits and the rows' gradient."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    head = torch.randn(4096, 512, generator=g, device=CUDA, dtype=torch.bfloat16) * 0.05
    rows = torch.randn(300, 512, generator=g, device=CUDA, dtype=torch.bfloat16)
    grad_logits = torch.randn(300, 4096, generator=g, device=CUDA) * 1e-3
    real, emulated = Float8Head(), Float8Head(emulate=True)
    for gemm in (real, emulated):
        gemm.out = (
            gemm.logits(rows, head, gemm.operands(head)),
            gemm.input_grad(grad_logits, head, gemm.operands(head), torch.bfloat16),
        )
    for got, want in zip(real.out, emulated.out, strict=True):
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
        error = float((got.float() - want.float()).norm() / want.float().norm())
        assert error < 5e-3, error
    plain = rows.float() @ head.float().t()
    error = float((real.out[0].float() - plain).norm() / plain.norm())
    assert 1e-4 < error < 0.08, error  # FP8 for real: near the bf16 GEMM, not equal to it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_target_layers_give_the_eager_features(qwen3_target, dtype):
    from flashdraft.model.target import TargetModel

    torch.backends.cuda.matmul.allow_tf32 = False
    target = TargetModel.load(qwen3_target, [1, 3], device=CUDA, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 300, (2, length), generator=g).to(CUDA), None) for length in (256, 512, 768)]
    packed = torch.cat([torch.arange(100), torch.arange(156)]).expand(2, -1).to(CUDA)  # two samples a row
    batches.append((batches[0][0], packed))
    eager = [target.features(ids, position_ids=positions) for ids, positions in batches]
    assert compile_target(target)
    compiled = [target.features(ids, position_ids=positions) for ids, positions in batches]
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # fp32; bf16 rounding of a few fused ops
    for got, want in zip(compiled, eager, strict=True):
        error = float((got.float() - want.float()).norm() / want.float().norm())
        assert error < tolerance, error
    # one graph for the three lengths, a second for the packed rows' mask
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
