"""train.precision=fp8 on the CPU: the refusals, and what torchao's conversion keeps (the weights, the
state dict, the saved drafter directory). The casts run here through torchao's emulation (high-precision
GEMMs on float8-rounded operands); the real FP8 GEMMs are checked on the GPU (tests/gpu/test_fp8.py)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from flashdraft.config import load_config
from flashdraft.distributed.float8 import Float8Head, convert_to_float8, fits_float8, float8_head
from flashdraft.distributed.parallelize import parallelize
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import fused_linear
from flashdraft.model.drafter_dir import load_drafter, save_drafter
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective

from ..train.helpers import tiny_pair, token_batch


def _float8_linear():
    return pytest.importorskip("torchao.float8.float8_linear").Float8Linear


def test_fp8_is_refused_on_the_cpu_naming_the_field(qwen3_target):
    drafter, _ = tiny_pair(qwen3_target)
    with pytest.raises(FlashdraftError, match=r"train\.precision=fp8 needs a CUDA GPU") as caught:
        parallelize(drafter, device=torch.device("cpu"), precision="fp8")
    assert "\n" not in str(caught.value)


def test_a_missing_torchao_is_one_line_with_the_install_command(qwen3_target, monkeypatch):
    drafter, _ = tiny_pair(qwen3_target)
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(FlashdraftError, match=r"pip install 'flashdraft\[fp8\]'") as caught:
        convert_to_float8(drafter, "tensorwise")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.precision=fp16", r"train\.precision must be bf16 or fp8"),
        ("train.fp8_recipe=blockwise", r"train\.fp8_recipe must be tensorwise or rowwise"),
        ("train.dtype=fp32", r"train\.precision=fp8 .* not fp32"),
    ],
)
def test_the_config_refuses_bad_precision_settings(override, message):
    overrides = ["model.target=/nowhere", override]
    if override.startswith("train.dtype"):
        overrides.append("train.precision=fp8")
    with pytest.raises(FlashdraftError, match=message):
        load_config(None, overrides)


def test_the_filter_keeps_only_gemm_friendly_linears():
    assert fits_float8(torch.nn.Linear(64, 32))
    assert not fits_float8(torch.nn.Linear(64, 24))  # DFlash2's kernel projections can be this small
    assert not fits_float8(torch.nn.Linear(40, 32))
    assert not fits_float8(torch.nn.LayerNorm(64))


def test_conversion_keeps_the_parameters_the_state_dict_and_the_saved_directory(qwen3_target, tmp_path):
    float8_linear = _float8_linear()
    drafter, _ = tiny_pair(qwen3_target)
    before = {name: p for name, p in drafter.named_parameters()}
    keys = list(drafter.state_dict())
    converted = convert_to_float8(drafter, "rowwise", emulate=True)
    linears = [n for n, m in drafter.named_modules() if isinstance(m, float8_linear)]
    assert converted == linears and len(linears) == 7 * len(drafter.layers) + 1  # q k v o gate up down, fc
    # the same Parameter objects, not copies: the optimizer's master weights and the checkpoints see them
    after = dict(drafter.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert list(drafter.state_dict()) == keys
    save_drafter(drafter, tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert "float8" not in json.dumps(config).lower() and config["dtype"] == "bfloat16"
    loaded = load_drafter(tmp_path / "drafter")  # a plain drafter directory: no float8 module in it
    assert not any(isinstance(m, float8_linear) for m in loaded.modules())
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, drafter.state_dict()[name].to(torch.bfloat16).float())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_fused_projections_take_the_fp8_gemm(qwen3_target, recipe):
    """fused_linear over converted layers casts to float8 like the layers themselves do: for one layer it is
    that layer's own forward, bit for bit; for q/k/v it is near the bf16 GEMM, but not equal to it."""
    _float8_linear()
    drafter, _ = tiny_pair(qwen3_target)
    convert_to_float8(drafter, recipe, emulate=True)
    attn = drafter.layers[0].self_attn
    x = torch.randn(2, 32, attn.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fused_linear(x, (attn.o_proj,)), attn.o_proj(x))
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    with torch.no_grad():
        got = fused_linear(x, projections)
        want = F.linear(x, torch.cat([p.weight for p in projections]))
    error = float((got - want).norm() / want.norm())
    assert 1e-4 < error < 0.1, error  # e4m3 keeps 3 mantissa bits: a few percent, never exact


@pytest.mark.parametrize("layers", ["qkv", "o"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_weight_and_input_casts_are_torchaos_own_bit_for_bit_and_made_once(
    qwen3_target, recipe, layers, monkeypatch
):
    """Tensorwise, flashdraft casts the weight (q/k/v: their concatenation, its amax the largest of each
    weight's own; o: the layer's own call) and the input once each, for the forward and the backward's
    GEMMs: output and every gradient are torchao's, bit for bit, and torchao casts only the output's
    gradient itself. Rowwise every cast is left to torchao."""
    from torchao.float8 import float8_linear as torchao_linear

    _float8_linear()
    drafter, _ = tiny_pair(qwen3_target)
    convert_to_float8(drafter, recipe, emulate=True)
    attn = drafter.layers[0].self_attn
    projections = (attn.q_proj, attn.k_proj, attn.v_proj) if layers == "qkv" else (attn.o_proj,)
    x = torch.randn(2, 32, projections[0].in_features, generator=torch.Generator().manual_seed(1))
    cast, roles = torchao_linear.hp_tensor_to_float8_dynamic, []
    monkeypatch.setattr(
        torchao_linear,
        "hp_tensor_to_float8_dynamic",
        lambda *args, **kwargs: roles.append(kwargs["gemm_input_role"].name) or cast(*args, **kwargs),
    )

    def run(fused: bool) -> list[torch.Tensor]:
        roles.clear()
        inputs = x.clone().requires_grad_()
        layer = projections[0]
        if fused:
            out = fused_linear(inputs, projections) if len(projections) > 1 else layer(inputs)
        else:  # torchao's matmul on the concatenation, as before the cast moved here
            weight = torch.cat([p.weight for p in projections])
            out = torchao_linear.matmul_with_hp_or_float8_args.apply(
                inputs, weight.t(), layer.linear_mm_config, layer.config
            )
        out.square().sum().backward()
        grads = [inputs.grad, *(p.weight.grad for p in projections)]
        for p in projections:
            p.weight.grad = None
        return [out.detach(), *grads]

    fused, reference = run(True), run(False)
    torchao_roles = list(roles)
    fused = run(True)
    for got, want in zip(fused, reference, strict=True):
        assert torch.equal(got, want)
    # torchao's path: the forward's casts and the backward's
    assert sorted(torchao_roles) == ["GRAD_OUTPUT"] * 2 + ["INPUT"] * 2 + ["WEIGHT"] * 2
    assert sorted(roles) == (["GRAD_OUTPUT"] * 2 if recipe == "tensorwise" else sorted(torchao_roles))


def test_an_fp8_objective_step_is_near_the_plain_one(qwen3_target):
    """Loss and gradients of one step with every drafter GEMM on float8-rounded operands (emulated) against
    the same drafter in fp32: the loss within 1%, each gradient within FP8 noise (and not exact)."""
    _float8_linear()
    results = []
    for fp8 in (False, True):
        drafter, target = tiny_pair(qwen3_target)
        if fp8:
            convert_to_float8(drafter, "tensorwise", emulate=True)
        objective = Objective(
            drafter, target, num_anchors=8, gamma=3.0, loss=WeightedHeadLoss(chunk=64), attention="sdpa"
        )
        out = objective(token_batch([200, 130], prompt_lengths=[10, 20], seq_len=256))
        loss = out.loss_sum / out.weight_sum
        loss.backward()
        results.append((float(loss.detach()), {n: p.grad for n, p in drafter.named_parameters()}))
    (plain_loss, plain_grads), (fp8_loss, fp8_grads) = results
    assert abs(fp8_loss - plain_loss) < 0.01 * plain_loss
    for name, grad in plain_grads.items():
        error = float((fp8_grads[name] - grad).norm() / grad.norm())
        assert 0 < error < 0.35, (name, error)


# --- train.fp8_head: the loss's two GEMMs through the frozen head, casts emulated (fp32 GEMMs) ---


def _head_case(rows: int = 70, hidden: int = 32, vocab: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, hidden, generator=g),  # the drafter's rows
        torch.randn(vocab, hidden, generator=g) * 0.5,  # the frozen head
        torch.randint(0, vocab, (rows,), generator=g),
        torch.randn(rows, hidden, generator=g),  # the teacher's rows (kl, lk)
    )


@pytest.mark.parametrize("kind", ["ce", "kl", "lk"])
def test_fp8_head_rows_are_near_the_plain_head(kind):
    """The chunk's summed loss within 1% of the plain head's (each row within 3% on average: e4m3 keeps 3
    mantissa bits, and a 32-wide row averages few products), the rows' gradient within FP8 noise and not
    exact (an e5m2 gradient: a few percent; measured 5-7% here)."""
    hidden, head, labels, teacher = _head_case()
    plain = WeightedHeadLoss(chunk=32, loss=kind).rows(hidden, head, labels, teacher)
    fp8 = WeightedHeadLoss(chunk=32, loss=kind, head=Float8Head(emulate=True)).rows(
        hidden, head, labels, teacher
    )
    total_error = float((fp8.loss.sum() - plain.loss.sum()).abs() / plain.loss.sum())
    assert total_error < 0.01, total_error
    row_error = float((fp8.loss - plain.loss).abs().sum() / plain.loss.abs().sum())
    assert 1e-4 < row_error < 0.03, row_error
    grad_error = float((fp8.grad - plain.grad).norm() / plain.grad.norm())
    assert 1e-4 < grad_error < 0.08, grad_error


def test_fp8_heads_gradient_cast_with_the_known_amax_is_the_read_amaxs():
    """Cross-entropy hands the FP8 head the gradient's amax (train/loss.py::ce_grad_amax) instead of a pass
    over the gradient: the rows' gradient matches the head that reads the amax itself to float rounding
    (the same e5m2 bytes, the scale equal to its last bits)."""
    hidden, head, labels, _ = _head_case(rows=96)
    gemm = Float8Head(emulate=True)

    class AmaxRead:  # the same head, ignoring the known amax
        operands, logits = gemm.operands, gemm.logits

        def input_grad(self, grad_logits, weight, operands, dtype, grad_amax=None):
            return gemm.input_grad(grad_logits, weight, operands, dtype)

    known = WeightedHeadLoss(chunk=32, head=gemm).rows(hidden, head, labels)
    read = WeightedHeadLoss(chunk=32, head=AmaxRead()).rows(hidden, head, labels)
    torch.testing.assert_close(known.grad, read.grad, rtol=1e-5, atol=0)
    assert torch.equal(known.loss, read.loss)


def test_fp8_head_is_cast_once_and_again_only_after_it_changes():
    hidden, head, labels, _ = _head_case()
    gemm = Float8Head(emulate=True)
    loss = WeightedHeadLoss(chunk=32, head=gemm)
    first = loss.rows(hidden, head, labels)
    loss.rows(hidden[:40], head, labels[:40])
    assert gemm.casts == 1
    head.mul_(2)  # an in-place change bumps the tensor's version: the FP8 copy is stale
    again = loss.rows(hidden, head, labels)
    assert gemm.casts == 2
    assert not torch.equal(first.loss, again.loss)


def test_fp8_head_cast_in_slices_is_the_whole_cast_bit_for_bit():
    _, head, _, _ = _head_case(vocab=208)
    whole = Float8Head(emulate=True)._cast(head)
    sliced = Float8Head(emulate=True, slice_bytes=4 * head.shape[1] * 48)._cast(
        head
    )  # 5 slices, the last short
    (head8, head8_t, inverse), (sliced8, sliced8_t, sliced_inverse) = whole, sliced
    assert head8.dtype == sliced8.dtype == torch.float8_e4m3fn
    assert torch.equal(head8.view(torch.uint8), sliced8.view(torch.uint8))
    assert torch.equal(head8_t.view(torch.uint8), sliced8_t.view(torch.uint8))
    assert torch.equal(inverse, sliced_inverse)
    assert torch.equal(head8.t().contiguous().view(torch.uint8), head8_t.view(torch.uint8))


@pytest.mark.parametrize("kind", ["ce", "lk"])
def test_the_compiled_chunk_function_with_the_fp8_head_is_one_graph(kind):
    """Dynamo's own graph count through its eager backend, full chunks and the remainder: one graph, no
    break (fullgraph), and the same rows as the uncompiled FP8 head."""
    from torch._dynamo.utils import counters

    from flashdraft.train.loss import chunk_rows

    torch._dynamo.reset()
    counters.clear()
    compiled = WeightedHeadLoss(chunk=32, loss=kind, head=Float8Head(emulate=True), compile=True)
    compiled.chunk_fn = torch.compile(chunk_rows, fullgraph=True, backend="eager")
    eager = WeightedHeadLoss(chunk=32, loss=kind, head=Float8Head(emulate=True))
    for rows in (90, 45, 32):
        hidden, head, labels, teacher = _head_case(rows=rows, seed=rows)
        got, want = compiled.rows(hidden, head, labels, teacher), eager.rows(hidden, head, labels, teacher)
        torch.testing.assert_close(got.loss, want.loss)
        torch.testing.assert_close(got.grad, want.grad)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_fp8_head_refusals_name_the_field():
    with pytest.raises(FlashdraftError, match=r"train\.fp8_head needs train\.precision=fp8"):
        load_config(None, ["model.target=/nowhere", "train.fp8_head=true"])
    with pytest.raises(FlashdraftError, match=r"train\.fp8_head needs .* multiples of 16") as caught:
        float8_head(torch.zeros(100, 32))
    assert "\n" not in str(caught.value) and "train.fp8_head=false" in str(caught.value)


def test_the_fp8_casts_compile_into_one_graph(qwen3_target):
    """The casts made in `_float8_gemm`, for q/k/v's concatenation and through a converted layer's own call
    (the MLP's down projection), trace whole (fullgraph) and give the eager output and input gradient."""
    _float8_linear()
    torch._dynamo.reset()
    drafter, _ = tiny_pair(qwen3_target)
    convert_to_float8(drafter, "tensorwise", emulate=True)
    layer = drafter.layers[0]
    attn = layer.self_attn
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(2, 32, attn.q_proj.in_features, generator=torch.Generator().manual_seed(1))

    def qkv_and_mlp(inputs: torch.Tensor) -> torch.Tensor:
        return fused_linear(inputs, projections).sum() + layer.mlp(inputs).square().sum()

    compiled = torch.compile(qkv_and_mlp, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, qkv_and_mlp):
        inputs = x.clone().requires_grad_()
        out = fn(inputs)
        out.backward()
        results.append((out.detach(), inputs.grad))
    torch.testing.assert_close(results[0], results[1])
