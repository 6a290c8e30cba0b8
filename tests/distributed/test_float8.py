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
from flashdraft.distributed.float8 import convert_to_float8, fits_float8
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
