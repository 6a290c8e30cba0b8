"""The operators one decode step of the fast engine runs for a SmolLM2-135M-shaped target (random weights,
profiled on the CPU): what a CUDA graph of the step replays as kernels on a GPU, where a step of a small
target costs about the number of its kernels times their launch-bound few microseconds (docs/decoding.md,
"Where a step's time goes").

    python benchmarks/decode_step_ops.py [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from flashdraft.generate.fast import FastEngine
from flashdraft.model.attention import decoding_attention_kernels
from flashdraft.model.target import TargetModel

# SmolLM2-135M-Instruct's shape (its config.json): 30 layers, hidden 576, 9 heads over 3 K/V heads
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
)
# no kernel on a GPU: views, allocations, dtype no-ops
NOT_KERNELS = {
    "aten::view", "aten::as_strided", "aten::slice", "aten::select", "aten::unsqueeze", "aten::expand",
    "aten::transpose", "aten::t", "aten::reshape", "aten::_unsafe_view", "aten::alias", "aten::empty",
    "aten::empty_strided", "aten::detach", "aten::squeeze", "aten::permute", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::_reshape_alias", "aten::empty_like", "aten::result_type",
    "aten::split", "aten::chunk", "aten::narrow", "aten::contiguous", "aten::unbind", "aten::to",
}  # fmt: skip


def count_step_ops() -> dict:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).eval()
    target = TargetModel(model, [1, 15, 28])
    engine = FastEngine(target, None, 8)
    prompt = torch.randint(0, SMOLLM2["vocab_size"], (1, 40))
    engine.generate([prompt])  # allocates the buffers
    with torch.inference_mode(), decoding_attention_kernels():
        engine._admit(0, prompt, 0)
        visible = engine._visible(prompt.shape[1] + 1 + engine.block)
        engine._step(visible)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine._step(visible)
    ops = [e for e in prof.events() if e.name.startswith("aten::")]

    def computes(event) -> bool:  # it, or an operator it calls, is a kernel
        return event.name.startswith("aten::") and (
            event.name not in NOT_KERNELS or any(computes(c) for c in event.cpu_children)
        )

    # a kernel: a computing operator that calls no computing operator (a matmul's mm, a cast's copy_)
    kernels = collections.Counter(
        e.name for e in ops if e.name not in NOT_KERNELS and not any(computes(c) for c in e.cpu_children)
    )
    layers = SMOLLM2["num_hidden_layers"]
    return {
        "target_shape": SMOLLM2,
        "kernels_per_step": sum(kernels.values()),
        "kernels_per_layer": round(sum(kernels.values()) / layers, 1),
        "gemms_per_step": sum(1 for e in ops if e.name == "aten::mm"),
        "attention_calls_per_step": sum(1 for e in ops if e.name == "aten::scaled_dot_product_attention"),
        "by_operator": dict(kernels.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the counts as JSON here")
    args = parser.parse_args()
    result = count_step_ops()
    print({k: v for k, v in result.items() if k not in ("by_operator", "target_shape")})
    print(result["by_operator"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
