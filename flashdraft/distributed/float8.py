"""FP8 compute for the drafter's linear layers, through torchao's float8 training (docs/fp8.md).

`train.precision=fp8` swaps each of the drafter's `nn.Linear` layers whose two dimensions are multiples of
16 (what the FP8 GEMM needs) for torchao's `Float8Linear`: the same module with the same `weight` (and
`bias`) parameters, whose forward casts its input and weight to float8 e4m3 with dynamic scales (one per
tensor, `tensorwise`, or one per row, `rowwise`) and multiplies them on the FP8 tensor cores; its backward
does the same for both gradient GEMMs. The weights stay bf16 parameters, so the optimizer's fp32 master
weights, gradient clipping and checkpoints see the drafter they always see, and the state dict keeps its
keys. The drafter's fused projections (q/k/v, gate/up: model/drafter.py::fused_linear) take the converted
layer's GEMM from its `fused_gemm` method (a subclass of Float8Linear, swapped in here).

`train.fp8_head` also runs the loss's two GEMMs through the frozen LM head in FP8 (`Float8Head`, a
`train/loss.py::HeadGemm`): the head is cast to e4m3 once (it does not train), each chunk's rows to e4m3
and the logits' gradient to e5m2, one dynamic scale per tensor, through `torch._scaled_mm` (the call
torchao's float8 GEMMs make; torchao's Float8Linear is built for a trained weight under autograd, which
this head, outside autograd, is not).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from flashdraft.errors import FlashdraftError

PRECISIONS = ("bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")
INSTALL_HINT = "pip install 'flashdraft[fp8]'"
GEMM_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of each weight to be multiples of 16
HEAD_CAST_SLICE_BYTES = 128 << 20  # the head is cast in slices of this many fp32 bytes (see Float8Head)


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


def _float8_gemm(
    x: Tensor,
    weights: list[Tensor],
    bias: Tensor | None,
    *,
    layer: nn.Module,
    matmul: type,
    cast_weight=None,
    cast_input=None,
) -> Tensor:
    """F.linear(x, cat(weights), bias) through torchao's FP8 matmul with `layer`'s casts (Float8Linear.forward,
    also for a weight that is not the layer's own: the concatenation of several layers' weights). Under a
    tensorwise recipe `cast_weight` (`_fused_weight_cast`) and `cast_input` (`_input_cast`) cast the weight and
    the input here, each once for both GEMMs that read it."""
    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_gpu_dtype())
    operand = (weights[0] if len(weights) == 1 else torch.cat(weights)).t()
    if cast_weight is not None:
        operand = cast_weight(weights, operand, layer)
    if cast_input is not None:
        x = cast_input(x, layer)
    # `matmul.apply(...)` called as a method, as torchao's own forward does: dynamo's autograd.Function path
    out = matmul.apply(x, operand, layer.linear_mm_config, layer.config)
    return out if bias is None else out + bias.to(out.dtype)


def _fused_cast_linear(float8_linear: type, matmul: type, cast_weight, cast_input) -> type:
    """torchao's Float8Linear with flashdraft's GEMM path as methods: `fused_gemm` (`_float8_gemm` with
    the conversion's casts, also for the fused projections' concatenated weights) and a `forward` that takes
    it, so that the layer's own call makes its casts once too (torchao's forward casts its input and weight
    again in the backward). `matmul` is torchao's autograd matmul; `cast_weight` (`_fused_weight_cast`) and
    `cast_input` (`_input_cast`) may be None.

    One class a conversion, its functions in the methods' closure, nothing stored on a layer instance:
    torch.compile guards on the identity of a function stored on a module instance, so a `functools.partial`
    per layer (as before) compiled every drafter layer as its own graph, five compiles of the first step
    instead of one; and torch 2.11's dynamo cannot call `matmul.apply` read from an instance attribute
    (stop 64's GPU suite: "GetAttrVariable(AutogradFunctionVariable(), setup_context) has no type")."""

    class FusedCastFloat8Linear(float8_linear):
        def fused_gemm(self, x: Tensor, weights: list[Tensor], bias: Tensor | None) -> Tensor:
            return _float8_gemm(
                x,
                weights,
                bias,
                layer=self,
                matmul=matmul,
                cast_weight=cast_weight,
                cast_input=cast_input,
            )

        def forward(self, x: Tensor) -> Tensor:
            return self.fused_gemm(x, [self.weight], self.bias)

    return FusedCastFloat8Linear


def _tensorwise_dtype(*casts) -> torch.dtype | None:
    """The one float8 dtype that `casts` (torchao's CastConfigs of one operand, one per GEMM that reads it)
    all cast to with one dynamic scale for the whole tensor, as the tensorwise recipe does; None where they
    differ (rowwise scales along a different axis per GEMM)."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    alike = all(c.target_dtype == casts[0].target_dtype for c in casts) and all(
        c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE
        for c in casts
    )
    return casts[0].target_dtype if alike else None


def _input_cast(config):
    """The input's cast for `_float8_gemm`, or None where the recipe does not cast it alike for the forward's
    GEMM and the weight gradient's (`_tensorwise_dtype`).

    torchao saves the bf16 input and, in the backward, takes its amax and casts it again for the weight
    gradient: the same amax, so the same scale and the same float8 bits as the forward's. Cast here, the
    float8 input is what torchao's matmul saves (it uses a float8 argument as it is, and the constructor
    passes the gradient through): the backward reads one byte an element where it read the bf16 input
    twice, and the saved input takes half the memory."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    dtype = _tensorwise_dtype(config.cast_config_input, config.cast_config_input_for_grad_weight)
    if dtype is None:
        return None
    power_of_2 = config.round_scales_to_power_of_2

    def cast_input(x: Tensor, layer: nn.Module) -> Tensor:
        return hp_tensor_to_float8_dynamic(
            x,
            dtype,
            layer.linear_mm_config,
            gemm_input_role=GemmInputRole.INPUT,
            round_scales_to_power_of_2=power_of_2,
        )

    return cast_input


def _fused_weight_cast(config):
    """The cast of a weight or a concatenation of weights for `_float8_gemm`, or None where the recipe does
    not cast the weight alike for both GEMMs that read it (the forward's, the input gradient's:
    `_tensorwise_dtype`).

    torchao would take the amax over a concatenation itself, which compiled to one reduction kernel ~13x
    slower than a read of the weight (0.65 ms a layer on the H200, docs/fp8.md), and cast every weight again
    in the backward. Here the amax is the largest of each weight's own (the same value, so the same scale and
    the same float8 bits), and the cast tensor serves both GEMMs: torchao's matmul uses a float8 argument as
    it is, and its constructor passes the gradient through to the weights."""
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    dtype = _tensorwise_dtype(config.cast_config_weight, config.cast_config_weight_for_grad_input)
    if dtype is None:
        return None
    power_of_2 = config.round_scales_to_power_of_2

    def cast(weights: list[Tensor], weight_t: Tensor, layer: nn.Module) -> Tensor:
        with torch.no_grad():
            scale = amax_to_scale(torch.stack([w.abs().amax() for w in weights]).amax(), dtype, power_of_2)
        return hp_tensor_and_scale_to_float8(
            weight_t, scale, dtype, layer.linear_mm_config, GemmInputRole.WEIGHT
        )

    return cast


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
    fused_cast_linear = _fused_cast_linear(
        float8_linear, matmul, _fused_weight_cast(config), _input_cast(config)
    )  # one class for all layers
    for module in drafter.modules():
        if isinstance(module, float8_linear):
            module.__class__ = fused_cast_linear  # the same module and state; the GEMM path above
    return converted


def _float8_scale(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """The dynamic scale that puts a tensor's amax onto `dtype`'s largest value."""
    return torch.finfo(dtype).max / amax.float().clamp(min=1e-12)


def _scaled_cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    largest = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-largest, largest).to(dtype)


def _to_float8(x: Tensor, dtype: torch.dtype, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`x` cast to `dtype` with one dynamic scale (its amax onto the format's largest value), and the
    inverse scale `torch._scaled_mm` multiplies the product by. `amax`, when known, spares the pass over
    `x` that finds it."""
    scale = _float8_scale(x.abs().amax() if amax is None else amax, dtype)
    return _scaled_cast(x, scale, dtype), scale.reciprocal()


class Float8Head:
    """The loss's two GEMMs through the frozen LM head on FP8 tensor cores (`train.fp8_head`): the logits,
    rows (e4m3) x head (e4m3), and the rows' gradient, the logits' gradient (e5m2, for its range) x head.
    Both outputs are bf16, as the plain head's are. The head is cast once per change of its tensor (it is
    frozen, so once a run), outside the compiled chunk function, into two e4m3 copies: [V, H] and its
    transpose, so each GEMM reads its second operand column-major as `_scaled_mm` needs. `emulate` runs the
    same casts with fp32 GEMMs (the CPU tests)."""

    def __init__(self, *, emulate: bool = False, slice_bytes: int = HEAD_CAST_SLICE_BYTES):
        self.emulate = emulate
        self.slice_bytes = slice_bytes
        self.casts = 0  # how often the head was cast (a test reads it)
        self._key: tuple | None = None
        self._operands: tuple[Tensor, ...] = ()

    @staticmethod
    def check_head(weight: Tensor) -> None:
        """Refuse a head whose dimensions `_scaled_mm` cannot take (each a multiple of 16)."""
        vocab, hidden = weight.shape
        if vocab % GEMM_MULTIPLE or hidden % GEMM_MULTIPLE:
            raise FlashdraftError(
                f"train.fp8_head needs the target's LM head dimensions to be multiples of {GEMM_MULTIPLE} "
                f"(the FP8 GEMM's), got vocabulary {vocab} x hidden {hidden}: set train.fp8_head=false"
            )

    @torch.no_grad()
    def operands(self, weight: Tensor) -> tuple[Tensor, ...]:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device)
        if key != self._key:
            self.check_head(weight)
            self._operands, self._key = self._cast(weight), key
            self.casts += 1
        return self._operands

    def _cast(self, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(head e4m3 [V, H], its transpose e4m3 [H, V], the inverse scale), cast slice by slice: a whole
        fp32 copy of a 152k x 4096 head would add 2.5 GB to the first step's peak."""
        vocab, hidden = weight.shape
        step = max(1, self.slice_bytes // (4 * hidden))
        amax = torch.stack([weight[i : i + step].abs().amax().float() for i in range(0, vocab, step)]).amax()
        dtype = torch.float8_e4m3fn
        scale = _float8_scale(amax, dtype)
        head = torch.empty(vocab, hidden, dtype=dtype, device=weight.device)
        head_t = torch.empty(hidden, vocab, dtype=dtype, device=weight.device)
        for i in range(0, vocab, step):
            part = _scaled_cast(weight[i : i + step], scale, dtype)
            head[i : i + step] = part
            head_t[:, i : i + step] = part.t()
        return head, head_t, scale.reciprocal()

    def _mm(self, a: Tensor, b: Tensor, a_inverse: Tensor, b_inverse: Tensor) -> Tensor:
        if self.emulate:
            return ((a.float() @ b.float()) * (a_inverse * b_inverse)).to(torch.bfloat16)
        return torch._scaled_mm(a, b, scale_a=a_inverse, scale_b=b_inverse, out_dtype=torch.bfloat16)

    def logits(self, rows: Tensor, weight: Tensor, operands: tuple[Tensor, ...]) -> Tensor:
        head, _, head_inverse = operands
        rows8, rows_inverse = _to_float8(rows, torch.float8_e4m3fn)
        return self._mm(rows8, head.t(), rows_inverse, head_inverse)

    def input_grad(
        self,
        grad_logits: Tensor,
        weight: Tensor,
        operands: tuple[Tensor, ...],
        dtype: torch.dtype,
        grad_amax: Tensor | None = None,
    ) -> Tensor:
        amax = grad_logits.abs().amax() if grad_amax is None else grad_amax
        cast_dtype, scale = self.gradient_format(weight, amax)
        grad8 = _scaled_cast(grad_logits, scale, cast_dtype)
        return self.scaled_input_grad(grad8, scale, weight, operands, dtype)

    def gradient_format(self, weight: Tensor, grad_amax: Tensor) -> tuple[torch.dtype, Tensor]:
        """e5m2 (for its range), at the scale that puts `grad_amax` onto e5m2's largest value."""
        return torch.float8_e5m2, _float8_scale(grad_amax, torch.float8_e5m2).reshape(1)

    def scaled_input_grad(
        self,
        grad_logits: Tensor,
        scale: Tensor,
        weight: Tensor,
        operands: tuple[Tensor, ...],
        dtype: torch.dtype,
    ) -> Tensor:
        _, head_t, head_inverse = operands
        return self._mm(grad_logits, head_t.t(), scale.reciprocal().reshape(()), head_inverse).to(dtype)


def float8_head(weight: Tensor) -> Float8Head:
    """The FP8 head GEMMs for the head `weight`, checked now: a head the FP8 GEMM cannot take is refused
    before the first step, not in it."""
    Float8Head.check_head(weight)
    return Float8Head()
