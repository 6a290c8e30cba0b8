"""Random targets of real models' shapes, built locally (no machine here reaches a model hub)."""

from __future__ import annotations

import argparse

import torch
from transformers import PretrainedConfig

QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1e6,
    tie_word_embeddings=False,
)
# The seeds' target: Qwen3.6-27B's text model, 64 layers, three Gated-DeltaNet (linear attention) layers
# to each full-attention layer, hidden 5120, vocabulary 248,320.
QWEN3_6_27B = dict(
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_value_heads=48,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)
TARGETS = {"qwen3-8b": QWEN3_8B, "qwen3.6-27b": QWEN3_6_27B}
MASK_TOKEN_IDS = {"qwen3-8b": 151669, "qwen3.6-27b": 248070}


def add_target_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmarks' --target (whose shape the random target takes) and --target-layers."""
    parser.add_argument(
        "--target", choices=sorted(TARGETS), default="qwen3-8b", help="target shape (random weights)"
    )
    parser.add_argument(
        "--target-layers",
        type=int,
        default=None,
        help="fewer target layers (default: the model's; stated in the result)",
    )


def linear_attention_kernels() -> dict[str, bool]:
    """Which fast kernels a hybrid target can use here (transformers falls back to torch without them)."""
    import importlib.util

    return {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}


def target_config(kind: str, num_layers: int | None = None, **overrides) -> PretrainedConfig:
    """The Hugging Face config of a `TARGETS` shape, optionally with fewer layers (stated in results)."""
    from transformers import Qwen3Config

    shape = {**TARGETS[kind], **overrides}
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    if kind == "qwen3.6-27b":
        from transformers import Qwen3_5TextConfig

        n = shape["num_hidden_layers"]
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        return Qwen3_5TextConfig(**shape, layer_types=layer_types)
    return Qwen3Config(**shape)


def build_random_target(
    kind: str, *, device: str, dtype: torch.dtype, num_layers: int | None = None, **overrides
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = target_config(kind, num_layers, **overrides)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
