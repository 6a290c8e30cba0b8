"""Where the cold compile of one drafter layer goes, and what inductor settings change it: the layer the
first training step compiles (flex attention, bf16, Qwen3-8B-shaped drafter, shape (a): 2 rows of 256
anchors x 16, 768 context), each variant in a fresh process with empty compile caches.

    python benchmarks/compile_probe.py [--out FILE] [--variants default,no_pattern_matcher] [--profile]

Per variant: dynamo's compile stages of the forward and backward, the step time of the compiled layer
(forward + backward, median of 20), and with --profile the cProfile functions with the most cumulative
time during the first (compiling) call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

VARIANTS = {
    "default": {},
    "no_pattern_matcher": {"pattern_matcher": False},
    "no_joint_custom_passes": {"joint_graph_constant_folding": False},
}


def child(variant: str, profile: bool) -> dict:
    import cProfile
    import io
    import pstats
    import time

    import torch
    from transformers import Qwen3Config

    from flashdraft.bench.shapes import QWEN3_8B
    from flashdraft.model.attention import flex_mask_mod
    from flashdraft.model.block_mask import dflash_block_mask
    from flashdraft.model.drafter import DFlashDraftModel
    from flashdraft.model.drafter_dir import make_drafter_config
    from flashdraft.train.compile_report import graphs_compiled_since, now

    for key, value in VARIANTS[variant].items():
        setattr(torch._inductor.config, key, value)
    cuda = torch.device("cuda")
    cfg = make_drafter_config(
        Qwen3Config(**QWEN3_8B), num_layers=1, mask_token_id=151669, target_layer_ids=[1]
    )
    with cuda:
        drafter = DFlashDraftModel(cfg)
    drafter.init_weights()
    drafter.to(torch.bfloat16)
    layer = drafter.layers[0]
    layer.compile(fullgraph=True)
    b, n, bs, ctx, hidden = 2, 256, 16, 768, QWEN3_8B["hidden_size"]
    anchors = torch.sort(torch.randint(1, ctx, (b, n), device=cuda), dim=1).values
    keep = torch.ones(b, n, dtype=torch.bool, device=cuda)
    kind = layer.self_attn.kind
    mask = dflash_block_mask(anchors, keep, ctx, bs, kind, flex_mask_mod(anchors, keep, ctx, bs, kind))
    x = torch.randn(b, n * bs, hidden, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    c = torch.randn(b, ctx, hidden, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    ctx_cos, ctx_sin = drafter.rope(torch.arange(ctx, device=cuda)[None].expand(b, -1), x)
    cos, sin = drafter.rope((anchors[:, :, None] + torch.arange(bs, device=cuda)).reshape(b, -1), x)

    def step() -> None:
        out, _ = layer(x, c, ctx_cos, ctx_sin, cos, sin, mask)
        out.float().square().mean().backward()

    since, started = now(), time.perf_counter()
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    step()
    torch.cuda.synchronize()
    if profiler:
        profiler.disable()
    first_s = time.perf_counter() - started
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    result = {
        "variant": variant,
        "first_call_s": round(first_s, 2),
        "step_ms": round(sorted(times)[len(times) // 2], 3),
        "graphs": [g.__dict__ for g in graphs_compiled_since(since)],
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        result["profile"] = text.getvalue().splitlines()[-60:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile", action="store_true", help="cProfile the compiling call of each variant")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.profile)))
        return
    results = []
    for variant in args.variants.split(","):
        caches = tempfile.mkdtemp(prefix="compile-probe-")
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor",
            "TRITON_CACHE_DIR": f"{caches}/triton",
        }
        command = [sys.executable, __file__, "--child", variant] + (["--profile"] if args.profile else [])
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            print(variant, "failed:", done.stderr[-2000:])
            continue
        result = json.loads(lines[-1][7:])
        results.append(result)
        stages = {k: v for g in result["graphs"] for k, v in g["phases"].items() if g["name"] == "forward"}
        print(
            f"{variant:24s} first call {result['first_call_s']:6.2f} s  step {result['step_ms']:7.3f} ms  "
            + "  ".join(f"{k.split('.')[0][0]}.{k.split('.')[1][:14]} {v:.2f}" for k, v in stages.items())
        )
    if args.out:
        from flashdraft.bench.provenance import provenance

        record = provenance("compile-probe", None)
        record.update(benchmark="benchmarks/compile_probe.py", command=" ".join(["python3", *sys.argv]))
        with open(args.out, "w") as f:
            json.dump({**record, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
