"""The DFlash drafter in plain single-device PyTorch (docs/dflash.md §1).

A stack of Qwen3-style decoder layers whose queries come only from the block tokens, while keys and
values are [fused target context ; block] ("KV injection", docs/dflash.md §1). The drafter owns no embedding and no
LM head: callers embed the block with the target's embedding and decode with the target's head.
Parallelism, compilation and sharding are applied from outside (flashdraft/distributed/parallelize.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from flashdraft.model.attention import BlockMask, LayerKind, attend
from flashdraft.model.spec import DFlashSpec, layer_kinds

Masks = dict[str, "Tensor | BlockMask"]
"""Attention masks keyed by LayerKind.key; one per distinct layer kind, shared by its layers."""


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as Qwen3 does (bitwise-compatible with transformers)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, h, n, d]; cos/sin [b, n, d] (neox-style rotation, as vLLM/SGLang assume, docs/dflash.md §1)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def fused_linear(x: Tensor, linears: Sequence[nn.Linear]) -> Tensor:
    """One GEMM for several linear layers over the same input (a wider N runs closer to the matmul
    ceiling); each layer keeps its own weight, so checkpoint names and gradients are unchanged. Layers
    converted for FP8 training carry the GEMM to use as their `fused_gemm` method (distributed/float8.py),
    which takes the weights apart."""
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    fp8_gemm = getattr(linears[0], "fused_gemm", None)
    if fp8_gemm is not None:  # the weights apart: it casts their concatenation from each one's amax
        return fp8_gemm(x, [linear.weight for linear in linears], bias)
    return F.linear(x, torch.cat([linear.weight for linear in linears]), bias)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = fused_linear(x, (self.gate_proj, self.up_proj)).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DrafterAttention(nn.Module):
    def __init__(self, config: Qwen3Config, kind: LayerKind):
        super().__init__()
        self.kind = kind
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _heads(self, x: Tensor, n_heads: int) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, n_heads, self.head_dim)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """K (normed, rotated) and V [b, h_kv, n, d] of rows `x`; used for context and block rows alike."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: Tensor,
        ctx_k: Tensor,
        ctx_v: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | BlockMask | None,
    ) -> Tensor:
        b, n, _ = x.shape
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))  # q, k and v of the block rows
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(self.q_norm(self._heads(q, self.num_heads)).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(self._heads(k, self.num_kv_heads)).transpose(1, 2), cos, sin)
        v = self._heads(v, self.num_kv_heads).transpose(1, 2)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        out = attend(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class DrafterLayer(nn.Module):
    def __init__(self, config: Qwen3Config, kind: LayerKind):
        super().__init__()
        self.self_attn = DrafterAttention(config, kind)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # DFlash2 sets these to GroupedDynamicCausalConv (flashdraft/model/dflash2.py); DFlash leaves them None.
        self.attention_conv: nn.Module | None = None
        self.mlp_conv: nn.Module | None = None

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        ctx_cos: Tensor,
        ctx_sin: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | BlockMask | None,
        past: tuple[Tensor, Tensor] | None = None,
        block_len: int | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Returns the block's new hidden state and this layer's context K/V (past + new rows).
        `block_len`: the length of each block in `x` (the DFlash2 convolutions stay inside a block)."""
        ctx_k, ctx_v = self.self_attn.key_value(ctx, ctx_cos, ctx_sin)
        if past is not None:
            ctx_k = torch.cat([past[0], ctx_k], dim=2)
            ctx_v = torch.cat([past[1], ctx_v], dim=2)
        return self.block(x, ctx_k, ctx_v, cos, sin, mask, block_len), (ctx_k, ctx_v)

    def block(
        self,
        x: Tensor,
        ctx_k: Tensor,
        ctx_v: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | BlockMask | None,
        block_len: int | None,
    ) -> Tensor:
        """The block rows' new hidden state, attending to the context K/V [b, h_kv, C, d] and to the block."""
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x + self.self_attn(h, ctx_k, ctx_v, cos, sin, mask)
        else:
            h, kernel = self.attention_conv.prepare(h, block_len)
            x = x + self.attention_conv.finish(
                self.self_attn(h, ctx_k, ctx_v, cos, sin, mask), kernel, block_len
            )
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            x = x + self.mlp(h)
        else:
            h, kernel = self.mlp_conv.prepare(h, block_len)
            x = x + self.mlp_conv.finish(self.mlp(h), kernel, block_len)
        return x


@dataclass
class DraftCache:
    """Per-layer K/V of the injected context only; block K/V are never stored (docs/dflash.md §5)."""

    kv: list[tuple[Tensor, Tensor]] | None = None

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2]


class DFlashDraftModel(nn.Module):
    """Tensor names match z-lab's released checkpoints: layers.*, fc, hidden_norm, norm (docs/dflash.md §2)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.spec = DFlashSpec.from_config(config)
        kinds = layer_kinds(config)
        self.layers = nn.ModuleList(DrafterLayer(config, kind) for kind in kinds)
        n_feat = len(self.spec.target_layer_ids)
        self.fc = nn.Linear(n_feat * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # no weights; honours rope_parameters

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def mask_token_id(self) -> int:
        return self.spec.mask_token_id

    def layer_kinds(self) -> list[LayerKind]:
        return [layer.self_attn.kind for layer in self.layers]

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Qwen3-style init: normal(0, initializer_range) linears, unit norms. A CPU generator gives the
        same weights whether the drafter already sits on a GPU or not."""
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    if generator is not None and generator.device != module.weight.device:
                        # drawn where the generator lives: one seed, one init, on any device
                        drawn = torch.empty(module.weight.shape, device=generator.device)
                        module.weight.copy_(drawn.normal_(0.0, std, generator=generator))
                    else:
                        module.weight.normal_(0.0, std, generator=generator)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def rope(self, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.rotary_emb(like, positions)
        return cos.to(like.dtype), sin.to(like.dtype)

    def forward(
        self,
        noise_embedding: Tensor,
        target_hidden: Tensor,
        ctx_positions: Tensor,
        block_positions: Tensor,
        masks: Masks | None,
        cache: DraftCache | None = None,
        block_len: int | None = None,
    ) -> Tensor:
        """noise_embedding [b, Q, H] (embedded blocks); target_hidden [b, C, n_feat*H] (raw concatenated
        target features of the new context rows); positions are absolute. Returns normed hidden [b, Q, H].

        With `cache`, the new context rows are appended to it and the block attends to all cached rows.
        `masks` maps LayerKind.key to a mask; None means every block query sees every key (decoding a
        single block with full-attention layers only). `block_len` is the length of each block in the
        query rows (default: the drafter's block size, or all rows as one shorter block; only DFlash2's
        convolutions depend on it).
        """
        rows = noise_embedding.shape[1]
        if block_len is None:
            block_len = self.block_size if rows % self.block_size == 0 else rows
        if rows % block_len:
            raise ValueError(f"{rows} block rows are not whole blocks of {block_len}")
        ctx = self.hidden_norm(self.fc(target_hidden))
        ctx_cos, ctx_sin = self.rope(ctx_positions, noise_embedding)
        cos, sin = self.rope(block_positions, noise_embedding)
        x = noise_embedding
        new_kv = []
        for i, layer in enumerate(self.layers):
            mask = None if masks is None else masks[layer.self_attn.kind.key]
            past = cache.kv[i] if cache is not None and cache.kv is not None else None
            x, kv = layer(x, ctx, ctx_cos, ctx_sin, cos, sin, mask, past, block_len)
            new_kv.append(kv)
        if cache is not None:
            cache.kv = new_kv
        return self.norm(x)

    def forward_cached(
        self,
        noise_embedding: Tensor,
        block_positions: Tensor,
        masks: Masks,
        context: Sequence[tuple[Tensor, Tensor]],
        block_len: int,
    ) -> Tensor:
        """`forward` for a decoding engine that keeps the context K/V itself (`context_key_values`): per
        layer, buffers [b, h_kv, W, d] of which the block sees the first C columns, C being what each mask
        [b, 1, Q, C + Q] gives the context. No new context rows; returns the normed hidden [b, Q, H]."""
        cos, sin = self.rope(block_positions, noise_embedding)
        x = noise_embedding
        for layer, (keys, values) in zip(self.layers, context, strict=True):
            mask = masks[layer.self_attn.kind.key]
            seen = mask.shape[-1] - x.shape[1]
            x = layer.block(x, keys[:, :, :seen], values[:, :, :seen], cos, sin, mask, block_len)
        return self.norm(x)

    def context_key_values(self, target_hidden: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's context K/V [b, h_kv, C, d] of target features [b, C, n_feat*H] at absolute
        `positions` [b, C]: what `forward` computes for its context rows (fc, hidden_norm, RoPE, the
        layer's `key_value`), for a decoding engine that keeps them in a cache of its own."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rope(positions, ctx)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def compute_logits(self, hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        logits = F.linear(hidden, lm_head_weight)
        multiplier = self.spec.output_multiplier
        return logits * multiplier if multiplier != 1.0 else logits
