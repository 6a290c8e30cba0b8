"""A dense per-head attention in fp64, the reference of the split attention tests (GPU and interpreted)."""

from __future__ import annotations

import torch


def dense_attention(query, key, value, allowed, scale) -> torch.Tensor:
    """query [b, heads, q, d], key and value [b, kv, cols, d], allowed [b, 1, q, cols] bool; returns
    [b, q, heads, dv] in fp64, query head h reading KV head h // (heads // kv)."""
    groups = query.shape[1] // key.shape[1]
    keys = key.double().repeat_interleave(groups, 1)
    values = value.double().repeat_interleave(groups, 1)
    scores = (query.double() @ keys.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ values).transpose(1, 2)
