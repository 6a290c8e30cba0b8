"""Why did unseen prompts decode 4x slower than the warm-up prompt on the H200? A probe, one device call.

1. scaled_dot_product_attention, q of 16 against 20 new key lengths, each called twice: the first call's
   cost (any per-shape setup) against the repeat, per allowed kernel set, with and without a mask and GQA.
2. flashdraft's own `generate` on an 8-layer Qwen3-8B-wide random target with a random 5-layer drafter:
   ms per step for a prompt, the same prompt again, and a prompt whose key lengths are all new, with torch's
   default SDPA choice and without cuDNN (the choice `flashdraft.model.attention.decoding_attention_kernels`
   now makes inside `generate`, so its second half shows the fix).

Usage on the device: PYTHONPATH=$PWD python3 benchmarks/sdpa_decode_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNEL_SETS = {
    "default": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def _now() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def _kernels(name: str):
    return sdpa_kernel(KERNEL_SETS[name]) if KERNEL_SETS[name] else contextlib.nullcontext()


def sdpa_first_call_costs() -> list[dict]:
    rows = []
    for name in KERNEL_SETS:
        for masked in (False, True):
            for gqa in (True, False):
                first, repeat, supported = [], [], True
                base = 1000 + 100 * len(rows)  # key lengths no earlier row used
                for k in range(base, base + 20):
                    q = torch.randn(1, 32, 16, 128, device="cuda", dtype=torch.bfloat16)
                    kv = torch.randn(1, 8 if gqa else 32, k, 128, device="cuda", dtype=torch.bfloat16)
                    mask = (
                        torch.ones(1, 1, 16, k, device="cuda", dtype=torch.bool).tril(k - 16)
                        if masked
                        else None
                    )
                    for times in (first, repeat):
                        started = _now()
                        try:
                            with _kernels(name):
                                F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=gqa)
                        except RuntimeError:  # no kernel of this set supports the case
                            supported = False
                            break
                        times.append(_now() - started)
                    if not supported:
                        break
                row = {"kernels": name, "masked": masked, "gqa": gqa, "supported": supported}
                if supported:
                    row |= {
                        "first_call_ms": round(1e3 * sum(first) / len(first), 3),
                        "repeat_ms": round(1e3 * sum(repeat) / len(repeat), 3),
                    }
                rows.append(row)
                print(row, flush=True)
    return rows


def generate_step_times() -> list[dict]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    import flashdraft.generate.speculative as decode
    from flashdraft.bench.shapes import QWEN3_8B
    from flashdraft.model.drafter import DFlashDraftModel
    from flashdraft.model.drafter_dir import make_drafter_config
    from flashdraft.model.target import TargetModel

    config = Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": 8})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    layer_ids = [1, 3, 5, 6, 7]
    target = TargetModel(model, layer_ids, name="probe target")
    with torch.device("cuda"):
        drafter = DFlashDraftModel(
            make_drafter_config(config, mask_token_id=151669, target_layer_ids=layer_ids)
        )
    drafter.init_weights()
    drafter.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, 1000, (1, n), generator=g) for n in (40, 400, 700)}
    rows = []
    for name, new_prompt in (("default", 400), ("no-cudnn", 700)):
        # `generate` itself now excludes cuDNN; "default" swaps that choice out to show what it was before
        choice = decode.decoding_attention_kernels
        decode.decoding_attention_kernels = contextlib.nullcontext if name == "default" else choice
        try:
            for label, length in (
                ("prompt", 40),
                ("same prompt again", 40),
                ("new key lengths", new_prompt),
                ("those again", new_prompt),
            ):
                for mode, draft in (("speculative", drafter), ("plain", None)):
                    gen = decode.generate(target, draft, prompts[length], 96)
                    row = {
                        "kernels": name,
                        "run": label,
                        "mode": mode,
                        "steps": len(gen.accepted),
                        "ms_per_step": round(1e3 * gen.decode_seconds / len(gen.accepted), 2),
                    }
                    rows.append(row)
                    print(row, flush=True)
        finally:
            decode.decoding_attention_kernels = choice
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "sdpa_first_call": sdpa_first_call_costs(),
        "generate": generate_step_times(),
    }
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
