"""A decoding step's attention and GEMMs on their own, on a GPU: microseconds a call replayed from a CUDA
graph for PyTorch's SDPA on the grouped query rows (the fused layer step's attention before split
attention) and `split_attention`'s two Triton kernels, each one's largest error against an fp32
reference beside it; and the SmolLM2 layer GEMMs at 1 and 8 rows through cuBLAS and through a compiled
reduction (tried for one-token steps and left out: docs/decoding.md, "Split attention").

    python benchmarks/split_attention_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from flashdraft.model.fused_decoder import grouped_attention_bias, grouped_query_attention
from flashdraft.model.split_attention import split_attention


def replay_us(fn, calls: int = 20, replays: int = 30) -> float:
    """Microseconds a call of `fn` takes, `calls` of them captured in one CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(1000 * start.elapsed_time(end) / (replays * calls), 2)


def reference(q, k, v, allowed, scale):
    groups = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(groups, 1)
    vv = v.float().repeat_interleave(groups, 1)
    scores = (q.float() @ kk.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(1, 2)  # [b, q, heads, d]


def attention_rows(device: str) -> list[dict]:
    results = []
    shapes = [(1, 9, 3, 64, 1), (1, 9, 3, 64, 8), (16, 9, 3, 64, 1), (16, 9, 3, 64, 8), (1, 32, 8, 128, 16)]
    for rows, heads, kv, dim, queries in shapes:
        for width in (128, 512, 2048):
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(rows, heads, queries, dim, device=device, generator=g, dtype=torch.bfloat16)
            k = torch.randn(rows, kv, width, dim, device=device, generator=g, dtype=torch.bfloat16)
            v = torch.randn(rows, kv, width, dim, device=device, generator=g, dtype=torch.bfloat16)
            ends = torch.randint(width // 2, width - queries, (rows, 1), device=device, generator=g)
            positions = ends + torch.arange(queries, device=device)
            allowed = (torch.arange(width, device=device) <= positions[..., None])[:, None]  # [b,1,q,w]
            additive = torch.zeros(allowed.shape, device=device, dtype=torch.bfloat16).masked_fill(
                ~allowed, float("-inf")
            )
            grouped = grouped_attention_bias(allowed, heads // kv, torch.bfloat16)
            scale = dim**-0.5
            truth = reference(q, k, v, allowed, scale)
            row = {"rows": rows, "heads": heads, "kv": kv, "dim": dim, "queries": queries, "width": width}

            calls = {
                "sdpa": functools.partial(grouped_query_attention, q, k, v, grouped, scale),
                "split": functools.partial(split_attention, q, k, v, additive, scale),
            }
            for name, fn in calls.items():
                row[f"{name}_us"] = replay_us(fn)
                row[f"{name}_err"] = round(float((fn().float() - truth).abs().max()), 4)
            results.append(row)
            print(json.dumps(row), flush=True)
    # fp32: the split kernel in IEEE fp32 against the reference
    q, k, v = (t.float() for t in (q, k, v))
    err = float(
        (split_attention(q, k, v, additive.float(), scale) - reference(q, k, v, allowed, scale)).abs().max()
    )
    results.append({"fp32_split_err": err})
    print("fp32 split error", err)
    return results


def gemm_rows(device: str) -> list[dict]:
    reduce = torch.compile(
        lambda x, w: (x[:, None, :].float() * w.float()).sum(-1).to(x.dtype), dynamic=False
    )
    results = []
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        for m in (1, 8):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            row = {"m": m, "n": n, "k": k}
            row["cublas_us"] = replay_us(functools.partial(F.linear, x, w))
            row["reduction_us"] = replay_us(functools.partial(reduce, x, w))
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda"
    report = {
        "attention": attention_rows(device),
        "gemm": gemm_rows(device),
        "device": torch.cuda.get_device_name(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
