"""`flashdraft bench regen`: in-process regeneration throughput vs plain `model.generate`, same prompts.

A ~1B-parameter Qwen3-shaped target with random weights (built here), prompts of 64..512 random tokens,
256 new tokens each (random weights never emit the end token, so every sample runs to the limit).
Plain = one `model.generate` call per prompt, as a naive script does; the engine = LocalEngine
(length-sorted batches, left padding, static KV cache on GPU).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flashdraft.bench.provenance import provenance
from flashdraft.config import Sampling
from flashdraft.data.regenerate import LocalEngine
from flashdraft.durable import atomic_write_json

ONE_B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashdraft bench regen")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument(
        "--plain-prompts", type=int, default=8, help="prompts timed with plain generate (rate extrapolates)"
    )
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashdraft bench regen: needs a CUDA GPU")
        return 2
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**ONE_B), dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 150000, (int(torch.randint(64, 513, (1,), generator=g)),), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    sampling = Sampling(max_new_tokens=args.new_tokens)
    engine = LocalEngine(model, None, sampling, None, batch_size=args.batch_size)
    engine.generate_ids(prompts[:2])  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = engine.generate_ids(prompts)
    torch.cuda.synchronize()
    engine_s = time.perf_counter() - started
    engine_tokens = sum(len(o) for o in outputs)

    plain_tokens, started = 0, time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts[: args.plain_prompts]:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            plain_tokens += out.shape[1] - ids.shape[1]
    torch.cuda.synchronize()
    plain_s = time.perf_counter() - started
    result = {
        **provenance("regen", argv),
        "target_params_B": round(params / 1e9, 2),
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "batch_size": args.batch_size,
        "engine_tokens_per_s": round(engine_tokens / engine_s, 1),
        "engine_seconds": round(engine_s, 2),
        "plain_generate_tokens_per_s": round(plain_tokens / plain_s, 1),
        "plain_prompts_timed": args.plain_prompts,
        "speedup": round((engine_tokens / engine_s) / (plain_tokens / plain_s), 2),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        atomic_write_json(args.out, result, indent=2)
    return 0
