"""The fast engine's step time on a GPU for a SmolLM2-135M-shaped target (random weights, bf16) and the
quickstart's drafter shape (2 layers, block 8), with the step's model code compiled and eager, both
replayed from CUDA graphs: milliseconds a step, plain tokens/s, the kernels one step launches, and the
seconds the warm-up (compile included) and capture took (docs/decoding.md, "Compiled steps").

A random drafter's proposals are rarely accepted, so the speculative rows give the step's cost, not a
speedup: the speedup is `flashdraft eval`'s on a trained drafter.

    python benchmarks/decode_step_time.py [--rows 1 16] [--tokens 256] [--compiled-only] [--kernel-time] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.decode_step_ops import SMOLLM2
from flashdraft.generate.fast import FastEngine
from flashdraft.model.attention import decoding_attention_kernels
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config
from flashdraft.model.target import TargetModel

LAYER_IDS = [1, 15, 28]


def kernels_per_step(engine: FastEngine, prompt: torch.Tensor) -> dict:
    """The CUDA kernels one eager (uncaptured) step launches, by name, on a row just admitted."""
    with torch.inference_mode(), decoding_attention_kernels():
        engine._admit(0, prompt, 0)
        visible = engine._visible(prompt.shape[1] + 1 + engine.block)
        engine._step(visible)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine._step(visible)
            torch.cuda.synchronize()
    names = collections.Counter(
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return {"kernels": sum(names.values()), "top": dict(names.most_common(12))}


def kernel_time_per_step(engine: FastEngine, prompt: torch.Tensor, replays: int = 50) -> dict:
    """Where a replayed step's GPU time goes: each kernel's mean microseconds a step (from torch.profiler
    over `replays` replays of the step's CUDA graph at the row's width), their sum, and the step's wall."""
    with torch.inference_mode():
        engine._admit(0, prompt, 0)
        visible = engine._visible(prompt.shape[1] + 1 + engine.block)
        graph = engine.graphs.get(visible)
        if graph is None:
            return {}
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
            wall = time.perf_counter() - began
    by_name: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name[:90]] += event.device_time / replays
    busy = sum(by_name.values())
    return {
        "kernel_us_per_step": round(busy, 1),
        "wall_us_per_step": round(1e6 * wall / replays, 1),
        "kernel_us": {name: round(us, 1) for name, us in by_name.most_common(16)},
    }


def time_engine(
    target,
    drafter,
    rows: int,
    tokens: int,
    compiled: bool,
    prompts: list[torch.Tensor],
    profile_time: bool = False,
) -> dict:
    engine = FastEngine(target, drafter, tokens, rows=rows, compile=compiled)
    began = time.perf_counter()
    engine.generate(prompts[:1])  # warm-up, compile and capture, as eval's first prompt
    first_call_s = time.perf_counter() - began
    engine.generate(prompts)
    record = engine.describe()
    steps, seconds = record["steps"], record["decode_s"]
    row = {
        "rows": rows,
        "speculative": drafter is not None,
        "compiled": record["compiled"],
        "fused_layers": record["fused_layers"],
        "fused_stack": record["fused_stack"],
        "stack_difference": record["stack_difference"],
        "step_kernels": record["step_kernels"],
        "cuda_graphs": record["cuda_graphs"],
        "ms_per_step": round(1e3 * seconds / steps, 3),
        "steps": steps,
        "first_call_s": round(first_call_s, 2),
        "note": record.get("compile_note") or record.get("cuda_graphs_failed"),
    }
    if drafter is None:
        row["tokens_per_s"] = round(rows * steps / seconds) if rows == 1 else None
    row.update(kernels_per_step(engine, prompts[0]))
    if profile_time:
        row.update(kernel_time_per_step(engine, prompts[0]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--compiled-only", action="store_true", help="skip the eager model code's rows")
    parser.add_argument("--kernel-time", action="store_true", help="each kernel's microseconds a step")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to("cuda", torch.bfloat16).eval()
    target = TargetModel(model, LAYER_IDS)
    config = make_drafter_config(
        target.config,
        num_layers=2,
        block_size=8,
        mask_token_id=SMOLLM2["vocab_size"] - 1,
        target_layer_ids=LAYER_IDS,
    )
    drafter = DFlashDraftModel(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    drafter = drafter.to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, 49000, (1, int(torch.randint(40, 200, (1,), generator=g))), generator=g)
        for _ in range(args.prompts)
    ]
    results = []
    for compiled in (True,) if args.compiled_only else (False, True):
        for rows in args.rows:
            for speculative in (False, True):
                row = time_engine(
                    target,
                    drafter if speculative else None,
                    rows,
                    args.tokens,
                    compiled,
                    prompts,
                    args.kernel_time,
                )
                results.append(row)
                print({k: v for k, v in row.items() if k not in ("top", "kernel_us")}, flush=True)
                for name, us in row.get("kernel_us", {}).items():
                    print(f"    {us:>7} us  {name}")
    print(
        f"{'rows':>4} {'spec':>5} {'compiled':>8} {'fused':>5} {'stack':>5} {'ms/step':>8} {'tok/s':>7} {'kernels':>7} {'first call s':>12}"
    )
    for r in results:
        print(
            f"{r['rows']:>4} {r['speculative']!s:>5} {r['compiled']!s:>8} {r['fused_layers']!s:>5} {r['fused_stack']!s:>5} "
            f"{r['ms_per_step']:>8} "
            f"{r.get('tokens_per_s') or '':>7} {r['kernels']:>7} {r['first_call_s']:>12}"
        )
    if args.out:
        record = {
            "benchmark": "benchmarks/decode_step_time.py",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "target_shape": "SmolLM2-135M (random weights, bf16)",
            "drafter": "2 layers, block 8 (random weights)",
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
