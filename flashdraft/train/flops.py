"""FLOPs the drafter training step needs (not padding): used for TFLOP/s and MFU.

Counted per real block position and real context token; matmuls only (2 FLOPs per multiply-add).
Trainable matmuls cost 3x their forward (forward, input grad, weight grad); the frozen LM head costs
2x (forward, input grad: no weight gradient is formed); attention costs 3.5x its forward (flash-style
backward recomputes the scores: 5 matmuls against the forward's 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from flashdraft.model.attention import LayerKind
from flashdraft.train.blocks import BlockBatch

# Dense bf16 peak by device name (datasheet); MFU is reported against it.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}


@dataclass
class StepFlops:
    linear: float
    head: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.head + self.attention


def visible_pairs(blocks: BlockBatch, kind: LayerKind) -> int:
    """(query, key) pairs a real block position attends to, for one layer kind."""
    b = blocks.block_size
    anchors = blocks.context_lengths[blocks.keep].double()  # context before the anchor, own sample only
    ctx = anchors if kind.window is None else anchors.clamp(max=kind.window)
    block_pairs = b * (b + 1) / 2 if kind.causal else b * b
    return int((ctx * b).sum().item() + block_pairs * anchors.numel())


def step_flops(
    config: PretrainedConfig,
    kinds: list[LayerKind],
    blocks: BlockBatch,
    ctx_tokens: int,
    loss_rows: int,
    vocab_size: int,
) -> StepFlops:
    h = config.hidden_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_dim, kv_dim = config.num_attention_heads * d, config.num_key_value_heads * d
    n_feat = len(config.dflash_config["target_layer_ids"])
    queries = int(blocks.keep.sum()) * blocks.block_size
    per_query = 2 * (h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * config.intermediate_size)
    per_ctx = 2 * (n_feat * h * h) + len(kinds) * 2 * (2 * h * kv_dim)
    linear = 3.0 * (queries * per_query * len(kinds) + ctx_tokens * per_ctx)
    head = 2.0 * (2 * h * vocab_size * loss_rows)
    attention = 3.5 * sum(4 * visible_pairs(blocks, k) * d * config.num_attention_heads for k in kinds)
    return StepFlops(linear, head, attention)


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
