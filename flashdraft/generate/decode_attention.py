"""Decode attention for the static engine that reads each cached key and value once (docs/regeneration.md,
"Decode attention").

With a boolean mask, transformers' SDPA path copies every layer's K and V once per query group before a
1-token step on 5.17 (`repeat_kv`), and SDPA with an arbitrary mask may fall to its math kernel. A decode
step with a 1-token query needs neither: the query heads that share a KV head are stacked as the rows of
one small matrix, so `q @ K^T` and `probs @ V` run against the cache buffers as they are.

Two ways to compute it, each registered with transformers' `AttentionInterface` under its own name
(`KERNELS`): `grouped` runs the two matmuls and an fp32 softmax itself; `grouped-fused` hands the same
grouped query ([b, kv, groups, d], the groups as query rows) to PyTorch's fused
`scaled_dot_product_attention`. Both read K and V once; which is faster depends on the device and is
measured by `flashdraft bench regen --step-time`. `use_decode_attention(model, kernel)` switches a model
to one for a block and restores every config after. Anything but a plain 1-token query with a broadcast
boolean mask goes to transformers' own SDPA function unchanged. A `row_groups` keyword (passed through
the model's forward by the static engine) has each group of rows read only its own columns
(`by_row_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from flashdraft.model.fused_decoder import grouped_query_attention

# kernel -> registered implementation name; transformers reads any name containing "flash" as a
# flash-attention kernel to load, and one containing "sdpa" as its own SDPA: the names avoid both
KERNELS = {"grouped": "grouped_decode", "grouped-fused": "grouped_decode_fused"}

# keyword arguments some attention layers pass that change the computation (logit soft-capping, position
# biases, attention sinks): with any of them set, the call goes to SDPA as it would without us
_ALTERING_KWARGS = ("softcap", "position_bias", "s_aux", "sinks")


def grouped_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of one query token per row: query [b, heads, 1, d], key [b, kv, cols, d], value
    [b, kv, cols, dv], mask [b, 1, 1, cols] bool (True: attend); returns [b, 1, heads, dv].

    Query head h uses KV head h // (heads // kv), as transformers' `repeat_kv` pairs them. Scores and the
    softmax are fp32; every shape follows the inputs' shapes only (CUDA-graph capturable: no host sync).
    A row whose mask is all False gets NaN, as SDPA's math kernel gives; the static engine never makes one
    (a row always sees its own new column)."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # [b, kv, groups, d]
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float()  # [b, kv, groups, cols], a new tensor
    # in place: the scores are a fresh tensor, so no extra pass; mask [b, 1, 1, cols] broadcasts
    scores.mul_(scaling).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [b, kv, groups, dv]
    return out.reshape(rows, 1, heads, value.shape[-1])


# `grouped_decode_attention` through PyTorch's fused SDPA: the query heads of one KV head become that head's
# query rows and the [b, 1, 1, cols] mask broadcasts over them, so no K or V is repeated (the compiled
# engine's attention too)
fused_grouped_decode_attention = grouped_query_attention


def by_row_groups(
    attend: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    groups: tuple[tuple[int, int, int], ...],
) -> torch.Tensor:
    """`attend` per row group (rows [r0, r1) read columns [c0, cols) only), the groups' outputs stacked.

    The static engine left-pads every prompt to the batch's longest, so a short prompt's row holds masked
    padding columns that every decode step would read again. With rows sorted longest first, a group's
    columns before c0 are padding for all of its rows: they add exact zeros to the softmax's sums and
    to `probs @ V`, so leaving them out reads less and computes the same attention."""
    parts = [
        attend(query[r0:r1], key[r0:r1, :, c0:], value[r0:r1, :, c0:], mask[r0:r1, :, :, c0:], scaling)
        for r0, r1, c0 in groups
    ]
    return torch.cat(parts, dim=0)


def _decode_call(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs: dict
) -> bool:
    """Whether this call is a plain decode step that the grouped kernels compute exactly."""
    return (
        query.shape[2] == 1
        and dropout == 0.0
        and attention_mask is not None
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and attention_mask.shape[2] == 1
        and query.shape[1] % key.shape[1] == 0
        and not any(kwargs.get(name) is not None for name in _ALTERING_KWARGS)
    )


def _attention_function(kernel: str, name: str) -> Callable:
    """transformers' attention-function signature around one decode kernel: query [b, heads, q_len, d],
    key and value [b, kv, cols, d]; returns ([b, q_len, heads, d], None). Prefill and anything unusual go
    to exactly what the `sdpa` implementation would do."""

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        groups = kwargs.pop("row_groups", None)
        if not _decode_call(query, key, attention_mask, dropout, kwargs):
            return ALL_ATTENTION_FUNCTIONS["sdpa"](
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        # the kernel is looked up when called, as a module-level call would be (a test watches it run)
        attend = globals()[kernel]
        if not groups:
            return attend(query, key, value, attention_mask, scale), None
        return by_row_groups(attend, query, key, value, attention_mask, scale, groups), None

    forward.__name__ = forward.__qualname__ = name
    return forward


decode_attention_forward = _attention_function("grouped_decode_attention", "decode_attention_forward")
fused_decode_attention_forward = _attention_function(
    "fused_grouped_decode_attention", "fused_decode_attention_forward"
)
_FORWARDS = {"grouped": decode_attention_forward, "grouped-fused": fused_decode_attention_forward}


def register(kernel: str = "grouped") -> str:
    """Make `kernel`'s implementation name valid for transformers (idempotent) and return it; masks are
    built as for SDPA (the static engine passes ready 4-D masks, which transformers uses as they are)."""
    name = KERNELS[kernel]
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _FORWARDS[kernel])
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


def _configs(model: torch.nn.Module) -> list[PretrainedConfig]:
    """Every config the model's modules read `_attn_implementation` from, sub-configs included."""
    found: dict[int, PretrainedConfig] = {}
    pending = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while pending:
        config = pending.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        for name in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, name, None)
            if isinstance(sub, PretrainedConfig):
                pending.append(sub)
    return list(found.values())


@contextmanager
def use_decode_attention(model: torch.nn.Module, kernel: str = "grouped") -> Iterator[bool]:
    """Run the block with `model` on `kernel` (a key of `KERNELS`); yields whether the switch took (a model that
    cannot change its attention implementation only gets a transformers warning). Afterwards, also after
    an error, every config of the model holds exactly the implementation it held before, so a model shared
    with other code comes back unchanged. The switch goes through `set_attn_implementation`
    (transformers' own checks); the restore writes the saved values back without a second round of checks."""
    configs = _configs(model)
    before = [config._attn_implementation_internal for config in configs]
    try:
        name = register(kernel)
        model.set_attn_implementation(name)
        yield all(config._attn_implementation_internal == name for config in configs)
    finally:
        for config, implementation in zip(configs, before, strict=True):
            config._attn_implementation_internal = implementation
