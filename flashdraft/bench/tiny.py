"""Small randomly initialised targets built locally (no machine here reaches a model hub).

Used by `flashdraft quickstart`, the tests and the benchmarks: each writes a real Hugging Face model
directory (config.json + safetensors, optionally a tokenizer) that loads with AutoModelForCausalLM.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

TARGET_KINDS = ("qwen3", "llama", "qwen3_5", "gemma3")


def tiny_config(
    kind: str = "qwen3", *, vocab_size: int = 320, hidden_size: int = 64, num_layers: int = 6, **overrides
) -> PretrainedConfig:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if kind == "qwen3":
        return Qwen3Config(rope_theta=1e6, **common)
    if kind == "llama":
        return LlamaConfig(rope_theta=5e5, **common)
    if kind == "qwen3_5":
        # Hybrid Gated DeltaNet + attention text model inside the multimodal wrapper (Qwen3.5/3.6 family).
        from transformers import Qwen3_5Config

        layer_types = [
            "full_attention" if (i + 1) % 3 == 0 else "linear_attention" for i in range(num_layers)
        ]
        text = dict(
            common,
            layer_types=layer_types,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=hidden_size // 4,
            linear_value_head_dim=hidden_size // 4,
        )
        return Qwen3_5Config(text_config=text)
    if kind == "gemma3":
        # Gemma 3's text model (docs/real-target.md, "Gemma 3"): sliding-window layers with a full one every
        # third (the real 270M: every sixth, window 512), one RoPE per layer type, a √H-scaled embedding,
        # pre- and post-norms around each sub-layer, a tied head.
        from transformers import Gemma3TextConfig

        pattern = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]
        gemma = dict(common, tie_word_embeddings=True, layer_types=pattern, sliding_window=8)
        gemma["query_pre_attn_scalar"] = gemma["head_dim"]
        gemma.update(overrides)
        return Gemma3TextConfig(**gemma)
    raise ValueError(f"unknown tiny target kind {kind!r}; expected one of {TARGET_KINDS}")


def build_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if getattr(config, "model_type", "") == "qwen3_5":
        from transformers import Qwen3_5ForConditionalGeneration

        return Qwen3_5ForConditionalGeneration(config)
    return AutoModelForCausalLM.from_config(config)


def save_tiny_target(
    out: str | Path, kind: str = "qwen3", *, seed: int = 0, tokenizer=None, **config_kwargs
) -> Path:
    """Write a tiny random target to `out` (fp32 safetensors); returns the directory."""
    out = Path(out)
    model = build_model(tiny_config(kind, **config_kwargs), seed=seed)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
