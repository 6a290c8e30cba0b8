"""Where does the drafter's flex_attention backward go? A probe, one device call (issue 32).

At shape (a) the five drafter layers' flex_attention backward took 9.5-10 ms of a 108 ms FP8 step
(benchmarks/results/train_fp8_h200_c21111c.json), while attention is 1 TFLOP of the step's 69: a few
percent of the tensor cores' rate. This times the compiled flex_attention alone, forward and forward +
backward, on the trainer's own BlockMask (train/blocks.py: sorted random anchors, the DFlash rule), with
torch's default kernel choice and with other kernel options (smaller backward tiles, more warps or
stages, WRITE_DQ off, PRESCALE_QK), then with inductor's autotuning of the flex kernels
(mode max-autotune-no-cudagraphs) and the seconds that costs. Each variant is checked against the
default's output and gradients.

Usage on the device: PYTHONPATH=$PWD python3 benchmarks/flex_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from flashdraft.model.attention import LayerKind
from flashdraft.train.blocks import build_blocks, flex_block_masks, sample_anchors

VARIANTS = {
    "default": None,
    "bwd tiles 32/64/64/32": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32},
    "bwd tiles 64/128/128/64 w8": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 64,
        "bwd_num_warps": 8,
    },
    "bwd tiles 64/64/64/64 s3": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 3,
    },
    "fwd tiles 128/64 w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8},
    "WRITE_DQ off": {"WRITE_DQ": False},
    "PRESCALE_QK": {"PRESCALE_QK": True},
}


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def shape_a_mask(batch: int, seq: int, anchors: int, block: int, device: str):
    """The trainer's mask for full-length rows: anchors drawn as train/blocks.py draws them."""
    loss_mask = torch.ones(batch, seq, dtype=torch.long)
    lengths = torch.full((batch,), seq)
    anchor_pos, keep = sample_anchors(loss_mask, lengths, anchors, block, seeds=list(range(batch)))
    ids = torch.randint(0, 1000, (batch, seq))
    blocks = build_blocks(ids, loss_mask, lengths, anchor_pos, keep, block, 0, 7.0).to(torch.device(device))
    kind = LayerKind()
    return flex_block_masks(blocks, seq, [kind])[kind.key]


def time_variant(fn, q, k, v, grad, mask, options, reps: int) -> dict:
    def run(backward: bool):
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
        out = fn(qq, kk, vv, block_mask=mask, enable_gqa=True, kernel_options=options)
        if backward:
            out.backward(grad)
            return out, qq.grad, kk.grad, vv.grad
        return (out,)

    passes = (False, True) if q.is_cuda else (False,)  # flex has no backward on the CPU (a smoke run)
    start = _now()
    run(passes[-1])  # compiles forward and backward
    first = _now() - start
    times = {}
    for backward in passes:
        for _ in range(3):
            run(backward)
        start = _now()
        for _ in range(reps):
            run(backward)
        times["fwd_bwd_ms" if backward else "fwd_ms"] = (_now() - start) / reps * 1e3
    return {
        "first_call_s": round(first, 2),
        **{k: round(t, 3) for k, t in times.items()},
        "outputs": run(passes[-1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=768)
    parser.add_argument("--anchors", type=int, default=256)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = parser.parse_args()

    torch.manual_seed(0)
    mask = shape_a_mask(args.batch, args.seq, args.anchors, args.block, args.device)
    q_len, kv_len = args.anchors * args.block, args.seq + args.anchors * args.block
    q = torch.randn(args.batch, args.heads, q_len, args.head_dim, device=args.device, dtype=torch.bfloat16)
    k, v = (
        torch.randn(
            args.batch, args.kv_heads, kv_len, args.head_dim, device=args.device, dtype=torch.bfloat16
        )
        for _ in range(2)
    )
    # visited tiles (partial + full) x 128 x 128 pairs: the work flex does, whatever the mask keeps inside
    tiles = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    pairs = tiles * 128 * 128 * args.heads
    flop_fwd = 4 * pairs * args.head_dim  # QK^T and PV
    report = {
        "shape": vars(args),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "tiles_visited_per_head": tiles,
        "tile_density": round(tiles / (args.batch * mask.kv_num_blocks.shape[-1] * -(-kv_len // 128)), 3),
        "flop_fwd_G": round(flop_fwd / 1e9, 2),
        "variants": {},
    }
    grad = torch.randn_like(q)  # one output gradient for every variant, so their gradients compare
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    reference = None
    runs = list(VARIANTS.items())
    if args.autotune:
        runs.append(("autotune (max-autotune-no-cudagraphs)", "autotune"))
    for name, options in runs:
        torch._dynamo.reset()
        fn = compiled
        if options == "autotune":
            fn = torch.compile(
                flex_attention, fullgraph=True, dynamic=False, mode="max-autotune-no-cudagraphs"
            )
            options = None
        try:
            row = time_variant(fn, q, k, v, grad, mask, options, args.reps)
        except Exception as error:  # a kernel option this torch does not take: say so, go on
            report["variants"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            print(f"{name:40s} error {type(error).__name__}: {str(error)[:120]}")
            continue
        outputs = row.pop("outputs")
        if reference is None:
            reference = outputs
        row["max_rel_err_vs_default"] = max(
            float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-9))
            for a, b in zip(outputs, reference, strict=True)
        )
        bwd_ms = row.get("fwd_bwd_ms", row["fwd_ms"]) - row["fwd_ms"]
        row["bwd_ms"] = round(bwd_ms, 3)
        row["fwd_tflops"] = round(flop_fwd / row["fwd_ms"] / 1e9, 1)
        row["bwd_tflops"] = round(2.5 * flop_fwd / bwd_ms / 1e9, 1) if bwd_ms > 0 else None
        report["variants"][name] = row
        print(
            f"{name:40s} fwd {row['fwd_ms']:7.3f} ms  bwd {row['bwd_ms']:7.3f} ms  first {row['first_call_s']:6.1f} s"
            f"  err {row['max_rel_err_vs_default']:.2e}"
        )
    print(
        f"tiles visited per head {tiles} (density {report['tile_density']}), forward {report['flop_fwd_G']} GFLOP"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
