"""A target decoder layer's decoding step with its projections fused (docs/decoding.md, "Fused decoder
steps").

A decoding step of a small model is bound by how many kernels it launches, not by its FLOPs: a Llama-style
layer runs seven GEMMs (q, k, v, o, gate, up, down), and transformers' attention on a static cache copies
every key and value once per query group (`repeat_kv`) before SDPA. `fused_decoder_step` computes the same
layer with q/k/v as one GEMM, gate/up as one GEMM and grouped-query attention that hands the cache to
SDPA as it is: four GEMMs and one attention kernel a layer.

Only layers of the common shape are fused (`fusion_refusal`: Llama, Qwen2, Qwen3, Mistral and their
kin); the family's own RoPE function and norm modules are called, so what differs between the families
stays theirs. `FusedProjections` keeps the fused weights, and the layer's own linear weights become views
of them: fusing costs no memory, and the layer's eager forward reads the very same numbers.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashdraft.model.split_attention import split_attention, split_attention_refusal
from flashdraft.model.target import CACHE_PARAMETERS

_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_ATTENTION_NORMS = {"q_norm", "k_norm"}  # Qwen3: RMSNorm over each head's query and key
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}
# config fields that change attention in ways the fused step does not compute
_ALTERING_CONFIG = ("attn_logit_softcapping", "query_pre_attn_scalar", "use_qk_norm", "partial_rotary_factor")


def grouped_query_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float
) -> Tensor:
    """Attention of `queries` tokens per row through PyTorch's fused SDPA with no key or value repeated:
    query [b, heads, queries, d], key and value [b, kv, cols, d], mask [b, 1, queries, cols] bool (True:
    attend) or the additive mask `grouped_attention_bias` made of one; returns [b, queries, heads, dv].

    Query head h uses KV head h // (heads // kv), as transformers' `repeat_kv` pairs them: the query heads
    of one KV head become that head's query rows (group-major), and each row takes its own token's mask."""
    rows, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    grouped = query.reshape(rows, kv_heads, groups * queries, dim)
    if mask.shape[2] != groups * queries:  # a token's row of the mask for each of its query heads
        mask = _grouped_rows(mask, groups)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(rows, heads, queries, value.shape[-1]).transpose(1, 2)


def _grouped_rows(mask: Tensor, groups: int) -> Tensor:
    """A per-token mask [b, 1, queries, cols] for the grouped query rows (group-major); one query token's
    [b, 1, 1, cols] broadcasts over the groups as it is."""
    rows, _, queries, cols = mask.shape
    if queries == 1:
        return mask
    return mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(rows, 1, groups * queries, cols)


def grouped_attention_bias(mask: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """`mask` [b, 1, queries, cols] bool as the additive mask of `grouped_query_attention`'s rows, made once
    a step for every layer: given the bool mask, each layer's attention converts it (and pads it) again, a
    kernel a layer; given this, none (a contiguous input, aligned where the width is a multiple of 8)."""
    return _grouped_rows(additive_mask(mask, dtype), groups).contiguous()


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True: attend) as the additive one (0 or -inf) in `dtype`; an additive one as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


@dataclass(frozen=True)
class StepKernels:
    """How a fused step computes what it computes, chosen for the device in one place
    (distributed/parallelize.py::step_kernels); off, the step is plain PyTorch (F.linear, SDPA)."""

    # attention through model/split_attention.py's Triton kernels: the cache's columns over many thread
    # blocks, where SDPA walks them in one per KV head (a call it cannot take goes to SDPA)
    split_attention: bool = False


def _plain_linear(module: object) -> bool:
    return type(module) is nn.Linear and module.weight.dtype.is_floating_point


def fusion_refusal(layer: nn.Module) -> str | None:
    """Why `layer` cannot take `fused_decoder_step`, or None: it must be a pre-norm layer with exactly
    attention (plain linear q/k/v/o, optional per-head q/k norms) and a gated MLP (plain linear
    gate/up/down), its family module defining `apply_rotary_pos_emb`."""
    children = {name for name, _ in layer.named_children()}
    if children != _LAYER_CHILDREN:
        return f"its layer holds {sorted(children)}, not {sorted(_LAYER_CHILDREN)}"
    attention, mlp = layer.self_attn, layer.mlp
    attention_children = {name for name, _ in attention.named_children()}
    norms = attention_children - _ATTENTION_CHILDREN
    if not attention_children >= _ATTENTION_CHILDREN or norms not in (set(), _ATTENTION_NORMS):
        return f"its attention holds {sorted(attention_children)}"
    if any(True for _ in attention.parameters(recurse=False)):
        return "its attention has parameters of its own (attention sinks)"
    if {name for name, _ in mlp.named_children()} != _MLP_CHILDREN:
        return f"its MLP holds {sorted(name for name, _ in mlp.named_children())}, not a gated MLP"
    linears = [getattr(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(_plain_linear(linear) for linear in linears):
        return "its projections are not plain floating-point nn.Linear layers (quantized?)"
    config = getattr(attention, "config", None)
    altering = [name for name in _ALTERING_CONFIG if getattr(config, name, None) not in (None, False, 1.0)]
    if altering:
        return f"its config sets {', '.join(altering)}"
    if not hasattr(attention, "scaling") or not hasattr(attention, "head_dim"):
        return "its attention has no `scaling` and `head_dim`"
    if _rotary_function(attention) is None:
        return f"{type(attention).__module__} defines no apply_rotary_pos_emb"
    return None


def _rotary_function(attention: nn.Module) -> Callable | None:
    return getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None)


def _fuse(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One weight (and bias) stacking `linears`' outputs; each linear's own weight becomes a view of it."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None
    if any(linear.bias is not None for linear in linears):  # zeros stand in for a missing one
        bias = torch.cat([_bias_or_zeros(linear) for linear in linears])
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight.data = weight[start:end]
        if linear.bias is not None:
            linear.bias.data = bias[start:end]
        start = end
    return weight, bias


def _bias_or_zeros(linear: nn.Linear) -> Tensor:
    if linear.bias is not None:
        return linear.bias.detach()
    return linear.weight.new_zeros(linear.out_features)


class FusedProjections(nn.Module):
    """A layer's q/k/v weights as one matrix and its gate/up weights as another (buffers: a compiled
    step takes them as graph inputs, so every layer of a kind shares one graph), and the `StepKernels` its
    step computes with. Built from the layer, whose linear weights then view these."""

    def __init__(self, layer: nn.Module, kernels: StepKernels = StepKernels()):
        super().__init__()
        self.kernels = kernels
        attention, mlp = layer.self_attn, layer.mlp
        qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
        self.qkv_splits = [linear.out_features for linear in qkv]
        for name, (weight, bias) in (("qkv", _fuse(qkv)), ("gate_up", _fuse([mlp.gate_proj, mlp.up_proj]))):
            self.register_buffer(f"{name}_weight", weight, persistent=False)
            self.register_buffer(f"{name}_bias", bias, persistent=False)
        self.head_norms = hasattr(attention, "q_norm")
        self.rotary = _rotary_function(attention)


def _attention(
    fused: FusedProjections, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scaling: float
) -> Tensor:
    """[b, queries, heads, dv]: split over the cache's columns where the step's kernels say so and the call
    allows it, else through SDPA (`grouped_query_attention`)."""
    if fused.kernels.split_attention:
        bias = additive_mask(mask, query.dtype)
        if split_attention_refusal(query, keys, bias) is None:
            return split_attention(query, keys, values, bias, scaling)
    return grouped_query_attention(query, keys, values, mask, scaling)


def _attention_block(
    layer: nn.Module,
    fused: FusedProjections,
    hidden_states: Tensor,
    attention_mask: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    cache: object,
) -> Tensor:
    """The layer's input plus its attention's output."""
    attention = layer.self_attn
    x = layer.input_layernorm(hidden_states)
    head_shape = (*x.shape[:-1], -1, attention.head_dim)
    query, key, value = F.linear(x, fused.qkv_weight, fused.qkv_bias).split(fused.qkv_splits, -1)
    query, key, value = query.view(head_shape), key.view(head_shape), value.view(head_shape)
    if fused.head_norms:
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cos, sin = position_embeddings
    query, key = fused.rotary(query, key, cos, sin)
    keys, values = cache.update(key, value)
    out = _attention(fused, query, keys, values, attention_mask, attention.scaling)
    return hidden_states + attention.o_proj(out.reshape(*x.shape[:-1], -1))


def _mlp_block(layer: nn.Module, fused: FusedProjections, hidden: Tensor) -> Tensor:
    """The layer's gated MLP output (before its residual add)."""
    gate, up = F.linear(
        layer.post_attention_layernorm(hidden), fused.gate_up_weight, fused.gate_up_bias
    ).chunk(2, -1)
    return layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)


def fused_decoder_step(
    layer: nn.Module,
    fused: FusedProjections,
    hidden_states: Tensor,
    attention_mask: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    cache: object,
) -> Tensor:
    """The layer's forward for a step through a static cache's layer view (`cache.update(k, v)` writes
    the new keys and returns every attended one), hidden_states [b, queries, hidden], attention_mask
    [b, 1, queries, cols] bool (or `grouped_attention_bias`); returns the layer's output hidden states,
    as its own forward does."""
    hidden = _attention_block(layer, fused, hidden_states, attention_mask, position_embeddings, cache)
    return hidden + _mlp_block(layer, fused, hidden)


def fused_layer_step(
    layer: nn.Module,
    fused: FusedProjections,
    residual: Tensor,
    update: Tensor,
    attention_bias: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    cache: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """`fused_decoder_step` in `FusedStack`'s carried form: the layer's input is `residual + update` (the
    previous layer's output, its last add left to this graph, where it fuses with this layer's norm);
    returns that input (the previous layer's output, a feature), this layer's input plus its attention,
    and its MLP's output, whose sum is this layer's output."""
    hidden_states = residual + update
    hidden = _attention_block(layer, fused, hidden_states, attention_bias, position_embeddings, cache)
    return hidden_states, hidden, _mlp_block(layer, fused, hidden)


def step_difference(reference: Tensor, fused: Tensor, hidden_states: Tensor) -> float:
    """How far a fused step's output is from the layer's own, relative to the layer's contribution (its
    output less its input: the residual stream alone would hide a wrong attention)."""
    contribution = (reference.float() - hidden_states.float()).abs().max().clamp(min=1e-6)
    return float((fused.float() - reference.float()).abs().max() / contribution)


# The `step_difference` a correct fused step stays under in fp32 (`checked_difference`): the two agree to
# rounding there (1e-6 or so), where a wrong step is off by several percent.
STEP_TOLERANCE = 1e-3


class _ScratchCache:
    """One layer's cache for the check: keys and values given, a step's keys written at `columns`
    [rows, queries], and everything attended."""

    def __init__(self, keys: Tensor, values: Tensor, columns: Tensor):
        self.keys, self.values, self.columns = keys, values, columns

    def update(self, key: Tensor, value: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        rows = torch.arange(key.shape[0], device=key.device)[:, None]
        self.keys[rows, :, self.columns] = key.transpose(1, 2)
        self.values[rows, :, self.columns] = value.transpose(1, 2)
        return self.keys, self.values


def checked_difference(layer: nn.Module, kernels: StepKernels = StepKernels()) -> float:
    """`step_difference` of the fused step (computing with `kernels`) against the layer's own forward (its
    cache passed under the name its forward takes one by), both run on an fp32 copy of the layer with
    random inputs of a step's shapes: hidden states, RoPE tables, a cache of random keys attended whole.
    Random, not a real step's: a warm-up step sits at position 0 (RoPE is the identity there) and sees
    one key, which would hide a wrong RoPE or a wrong query-key pairing; fp32, since half-precision
    rounding would hide a fault the size of a whole attention in a small model. The layer itself is left
    as it was."""
    cache_name = next(n for n in CACHE_PARAMETERS if n in inspect.signature(type(layer).forward).parameters)
    routing = layer.__dict__.pop("forward", None)  # a routing object installed on the layer stays out
    try:
        twin = copy.deepcopy(layer).float()
    finally:
        if routing is not None:
            layer.forward = routing
    fused = FusedProjections(twin, kernels)
    attention = twin.self_attn
    device = attention.o_proj.weight.device
    g = torch.Generator(device=device).manual_seed(0)
    kv_heads = attention.k_proj.out_features // attention.head_dim
    hidden_size = attention.o_proj.out_features
    rows, queries, width = 2, 3, 11  # two rows writing a verify block at columns 2.. and at the end

    def random(*shape: int) -> Tensor:
        return torch.randn(shape, generator=g, device=device)

    hidden_states = random(rows, queries, hidden_size)
    rotary = (random(rows, queries, attention.head_dim), random(rows, queries, attention.head_dim))
    mask = torch.ones(rows, 1, queries, width, dtype=torch.bool, device=device)
    keys, values = (
        random(rows, kv_heads, width, attention.head_dim),
        random(rows, kv_heads, width, attention.head_dim),
    )
    columns = torch.arange(queries, device=device) + torch.tensor([[2], [width - queries]], device=device)
    positions = columns.clone()

    def cache() -> _ScratchCache:
        return _ScratchCache(keys.clone(), values.clone(), columns)

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: fp32 rounding only
    try:
        with torch.no_grad():
            reference = type(twin).forward(
                twin,
                hidden_states,
                attention_mask=mask,
                position_ids=positions,
                position_embeddings=rotary,
                use_cache=True,
                **{cache_name: cache()},
            )
            step = fused_decoder_step(twin, fused, hidden_states, mask, rotary, cache())
    finally:
        torch.set_float32_matmul_precision(precision)
    if not isinstance(reference, Tensor):
        raise TypeError(
            f"{type(layer).__name__}.forward returns {type(reference).__name__}, not hidden states"
        )
    return step_difference(reference, step, hidden_states)
