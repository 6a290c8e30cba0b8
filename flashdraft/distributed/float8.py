"""FP8 compute for the drafter's linear layers, through torchao's float8 training (docs/fp8.md).

`train.precision=fp8` swaps each of the drafter's `nn.Linear` layers whose two dimensions are multiples of
16 (what the FP8 GEMM needs) for torchao's `Float8Linear`: the same module with the same `weight` (and
`bias`) parameters, whose forward casts its input and weight to float8 e4m3 with dynamic scales (one per
tensor, `tensorwise`, or one per row, `rowwise`) and multiplies them on the FP8 tensor cores; its backward
does the same for both gradient GEMMs. The weights stay bf16 parameters, so the optimizer's fp32 master
weights, gradient clipping and checkpoints see the drafter they always see, and the state dict keeps its
keys. The drafter's fused projections (q/k/v, gate/up: model/drafter.py::fused_linear) take the converted
layer's GEMM from its `fused_gemm` attribute, set here.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor, nn

from flashdraft.errors import FlashdraftError

PRECISIONS = ("bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")
INSTALL_HINT = "pip install 'flashdraft[fp8]'"
GEMM_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of each weight to be multiples of 16


def check_float8_device(device: torch.device) -> None:
    """Refuse FP8 training where there are no FP8 tensor cores (the CPU, a GPU below compute capability
    8.9: Ada and Hopper have them)."""
    if device.type != "cuda":
        raise FlashdraftError(
            f"train.precision=fp8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); this run "
            f"is on {device.type}: use train.precision=bf16"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise FlashdraftError(
            f"train.precision=fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use train.precision=bf16"
        )


def _torchao_float8():
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    except ImportError as exc:
        raise FlashdraftError(
            f"train.precision=fp8 needs torchao, which is not importable here ({exc}): {INSTALL_HINT}"
        ) from None
    return float8, Float8Linear, matmul_with_hp_or_float8_args


def fits_float8(module: nn.Module, _name: str = "") -> bool:
    """torchao's module filter: a linear layer whose dimensions the FP8 GEMM takes. Others (DFlash2's small
    kernel projections) stay bf16."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % GEMM_MULTIPLE == 0
        and module.out_features % GEMM_MULTIPLE == 0
    )


def float8_config(recipe: str, *, pad_inner_dim: bool = True, emulate: bool = False):
    """torchao's config for `recipe`. The inner dimension of the weight-gradient GEMM is the token count,
    which must be a multiple of 16 too: `pad_inner_dim` pads it where it may not be (blocks of 10 or 8
    rows, unpadded context lengths), at the cost of copies. `emulate` computes the same casts with
    high-precision GEMMs (tests on the CPU)."""
    if recipe not in FP8_RECIPES:
        raise FlashdraftError(f"train.fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {recipe!r}")
    float8, _, _ = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, pad_inner_dim=pad_inner_dim, emulate=emulate)


def _float8_gemm(x: Tensor, weight: Tensor, bias: Tensor | None, *, layer: nn.Module, apply) -> Tensor:
    """F.linear(x, weight, bias) through torchao's FP8 matmul, with `layer`'s casts (Float8Linear.forward
    for a weight that is not the layer's own: the concatenation of several layers' weights)."""
    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_gpu_dtype())
    out = apply(x, weight.t(), layer.linear_mm_config, layer.config)
    return out if bias is None else out + bias.to(out.dtype)


def convert_to_float8(
    drafter: nn.Module, recipe: str, *, pad_inner_dim: bool = True, emulate: bool = False
) -> list[str]:
    """Swap the drafter's fitting linear layers for torchao's Float8Linear in place (before torch.compile);
    returns the names of the converted layers. `pad_inner_dim`: see `float8_config`."""
    float8, float8_linear, matmul = _torchao_float8()
    config = float8_config(recipe, pad_inner_dim=pad_inner_dim, emulate=emulate)
    converted: list[str] = []

    def wanted(module: nn.Module, name: str) -> bool:
        if fits_float8(module, name):
            converted.append(name)
            return True
        return False

    float8.convert_to_float8_training(drafter, module_filter_fn=wanted, config=config)
    for module in drafter.modules():
        if isinstance(module, float8_linear):
            module.fused_gemm = functools.partial(_float8_gemm, layer=module, apply=matmul.apply)
    return converted
