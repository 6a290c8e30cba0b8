"""`flashdraft bench train`: the drafter training step on a random target of a real model's shape.

Targets: Qwen3-8B (default) or the seeds' hybrid Qwen3.6-27B (`--target qwen3.6-27b`). Shapes: (a) batch
2 x seq 768, 256 anchors; (b) batch 1 x seq 3072, 512 anchors. Block 16, a 5-layer drafter on the default
target layer ids, same process and GPU as the target. Reports the drafter step's achieved TFLOP/s (FLOPs
the work needs, train/flops.py), MFU against the 989 TFLOP/s datasheet peak and the 789 TFLOP/s measured
matmul ceiling (docs/benchmarks.md), target ms, peak memory, and where the drafter step's time goes,
timed with CUDA events around the real objective's own calls.

`flashdraft bench train --data SHARDS [--packing on|off|both]` times real steps on a real shard set instead,
with and without sequence packing (flashdraft/bench/packing_bench.py, docs/packing.md); it runs on the CPU
with a small local target (`--target-dir`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from flashdraft.bench.provenance import provenance
from flashdraft.bench.shapes import MASK_TOKEN_IDS, TARGETS, build_random_target, linear_attention_kernels
from flashdraft.data.tokens import TokenBatch
from flashdraft.distributed.parallelize import Placement, parallelize
from flashdraft.durable import atomic_directory, atomic_write_json, free_bytes
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config
from flashdraft.model.spec import build_target_layer_ids
from flashdraft.model.target import TargetModel
from flashdraft.run_protocol import read_metrics
from flashdraft.train.flops import StepFlops, step_flops
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from flashdraft.train.optim import make_optimizer

SHAPES = {"a": {"batch": 2, "seq": 768, "anchors": 256}, "b": {"batch": 1, "seq": 3072, "anchors": 512}}
DATASHEET_TFLOPS, MEASURED_CEILING_TFLOPS = 989.0, 789.0


def build_target(kind: str, num_layers: int | None = None) -> TargetModel:
    model = build_random_target(kind, device="cuda", dtype=torch.bfloat16, num_layers=num_layers)
    layer_ids = build_target_layer_ids(model.config.num_hidden_layers, 5)
    return TargetModel(model, layer_ids, name=f"{kind}-shaped random target")


def random_batch(shape: dict, vocab: int, seed: int) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    b, s = shape["batch"], shape["seq"]
    ids = torch.randint(0, vocab - 300, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, :64] = 0  # a short prompt, the rest supervised
    return TokenBatch(
        ids, mask, torch.full((b,), s), [seed * 10 + i for i in range(b)]
    )  # on the CPU; moved per step


class Timer:
    def __init__(self):
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    def span(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.start = torch.cuda.Event(enable_timing=True)
                self.end = torch.cuda.Event(enable_timing=True)
                self.start.record()

            def __exit__(self, *exc):
                self.end.record()
                timer.events.setdefault(name, []).append((self.start, self.end))

        return _Span()

    def medians(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {k: statistics.median(s.elapsed_time(e) for s, e in v) for k, v in self.events.items()}


def run_shape(
    name: str,
    target: TargetModel,
    *,
    mask_token_id: int,
    steps: int,
    warmup: int,
    num_layers: int,
    compile: bool,
    loss_chunk: int = 1024,
    master_weights: bool = True,
) -> dict:
    """One shape's drafter step, timed: `warmup` steps (compiling), then `steps` measured ones; returns the
    shape's record (times, FLOPs, MFU, memory, the per-phase breakdown)."""
    shape = SHAPES[name]
    torch._dynamo.reset()  # each shape builds its own drafter: start from a clean compile cache
    config, drafter, placement, objective, optimizer = build_step(
        target, shape, mask_token_id, num_layers, compile, loss_chunk, master_weights
    )
    batches = [random_batch(shape, target.vocab_size, seed) for seed in range(4)]
    timer = Timer()
    torch.cuda.reset_peak_memory_stats()
    compile_started = time.perf_counter()
    flops = []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - compile_started
            timer = Timer()
        cpu_batch = batches[i % len(batches)]
        cpu_blocks = objective.blocks(cpu_batch)
        batch, blocks = cpu_batch.to(torch.device("cuda")), cpu_blocks.to(torch.device("cuda"))
        with timer.span("target_ms"):
            features = target.features(batch.input_ids)
        with timer.span("drafter_step_ms"):
            out = objective(batch, blocks, features=features)
            (out.loss_sum / out.weight_sum).backward()
            optimizer.clip_and_step(1.0)
            optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            flops.append(
                step_flops(
                    config,
                    drafter.layer_kinds(),
                    cpu_blocks,
                    int(cpu_batch.lengths.sum()),
                    int((cpu_blocks.weights > 0).sum()),
                    target.vocab_size,
                )
            )
    times = timer.medians()
    breakdown = profile_breakdown(objective, optimizer, batches[0].to(torch.device("cuda")))
    return shape_record(
        name, compile, master_weights, loss_chunk, placement, drafter, times, flops[0], compile_s, breakdown
    )


def build_step(
    target: TargetModel,
    shape: dict,
    mask_token_id: int,
    num_layers: int,
    compile: bool,
    loss_chunk: int,
    master_weights: bool,
) -> tuple[object, DFlashDraftModel, Placement, Objective, object]:
    """The drafter of one shape placed the way the trainer places it, its objective and optimizer:
    (drafter config, drafter, placement, objective, optimizer)."""
    config = make_drafter_config(
        target.config,
        num_layers=num_layers,
        block_size=16,
        mask_token_id=mask_token_id,
        target_layer_ids=target.layer_ids,
    )
    with torch.device("cuda"):
        drafter = DFlashDraftModel(config)
    drafter.init_weights()
    placement = parallelize(
        drafter,
        device=torch.device("cuda"),
        attention="flex" if compile else "sdpa",
        compile=compile,
        master_weights=master_weights,
    )
    loss_fn = WeightedHeadLoss(chunk=loss_chunk, compile=placement.compiled)
    objective = Objective(
        drafter,
        target,
        num_anchors=shape["anchors"],
        gamma=7.0,
        loss=loss_fn,
        attention=placement.attention,
        autocast_dtype=placement.autocast_dtype,
    )
    optimizer = make_optimizer(
        list(drafter.parameters()), lr=6e-4, weight_decay=0.0, compile=placement.compiled
    )
    return config, drafter, placement, objective, optimizer


def shape_record(
    name: str,
    compile: bool,
    master_weights: bool,
    loss_chunk: int,
    placement: Placement,
    drafter: DFlashDraftModel,
    times: dict[str, float],
    flops: StepFlops,
    compile_s: float,
    breakdown: dict,
) -> dict:
    """One shape's result: median milliseconds, FLOPs per step (`flops`, the first measured step's), achieved
    TFLOP/s and MFU, end-to-end samples/s, peak memory, the warm-up (compile) time, the breakdown."""
    shape = SHAPES[name]
    tflops = flops.total / (times["drafter_step_ms"] / 1e3) / 1e12
    samples_per_s = shape["batch"] / ((times["drafter_step_ms"] + times["target_ms"]) / 1e3)
    return {
        "shape": name,
        **shape,
        "compiled": compile,
        "master_weights": master_weights,
        "loss_chunk": loss_chunk,
        "attention": placement.attention,
        "drafter_params_M": round(sum(p.numel() for p in drafter.parameters()) / 1e6, 1),
        "target_ms": round(times["target_ms"], 2),
        "drafter_step_ms": round(times["drafter_step_ms"], 2),
        "drafter_tflop_per_step": round(flops.total / 1e12, 2),
        "drafter_tflop_breakdown": {
            "linear": round(flops.linear / 1e12, 2),
            "lm_head": round(flops.head / 1e12, 2),
            "attention": round(flops.attention / 1e12, 2),
        },
        "drafter_tflops_achieved": round(tflops, 1),
        "mfu_vs_datasheet_989": round(tflops / DATASHEET_TFLOPS, 3),
        "mfu_vs_measured_789": round(tflops / MEASURED_CEILING_TFLOPS, 3),
        "samples_per_s_end_to_end": round(samples_per_s, 2),
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "warmup_s": round(compile_s, 1),
        "breakdown_ms": breakdown,
    }


@contextlib.contextmanager
def timed_phases(objective: Objective, timer: Timer):
    """Time the real objective's phases with CUDA events around its own calls (no copy of its code):
    the block mask builder, the drafter forward (module hooks) and the head loss's rows."""
    spans: dict[str, object] = {}

    def start(name: str):
        spans[name] = timer.span(name)
        spans[name].__enter__()

    def stop(name: str):
        spans.pop(name).__exit__(None, None, None)

    def wrap(name: str, fn):
        def timed(*args, **kwargs):
            start(name)
            try:
                return fn(*args, **kwargs)
            finally:
                stop(name)

        return timed

    handles = [
        objective.drafter.register_forward_pre_hook(lambda *_: start("drafter_forward")),
        objective.drafter.register_forward_hook(lambda *_: stop("drafter_forward")),
    ]
    # instance attributes shadow the methods the objective calls, and deleting them restores those
    objective.masks = wrap("block_mask", objective.masks)
    objective.loss.rows = wrap("lm_head_loss_fwd_and_grad", objective.loss.rows)
    try:
        yield
    finally:
        del objective.masks, objective.loss.rows
        for handle in handles:
            handle.remove()


def profile_breakdown(objective: Objective, optimizer, batch: TokenBatch) -> dict[str, float]:
    """Where the drafter step's time goes: each phase timed with CUDA events (median of 5)."""
    timer = Timer()
    for _ in range(5):
        blocks = objective.blocks(batch)
        features = objective.target.features(batch.input_ids)
        with timed_phases(objective, timer):
            out = objective(batch, blocks, features=features)
        with timer.span("drafter_backward"):
            (out.loss_sum / out.weight_sum).backward()
        with timer.span("clip_and_adamw"):
            optimizer.clip_and_step(1.0)
            optimizer.zero_grad(set_to_none=True)
    return {k: round(v, 2) for k, v in timer.medians().items()}


def main(argv: list[str] | None = None) -> int:
    if argv and any(a.startswith("--nproc-per-node") for a in argv):  # several GPUs: the real trainer
        return torchrun_bench(argv)
    if argv and "--data" in argv:  # real shards, packing on and off (docs/packing.md)
        from flashdraft.bench.packing_bench import main as bench_data_steps

        return bench_data_steps(argv)
    parser = argparse.ArgumentParser(prog="flashdraft bench train")
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append", help="a, b (default both)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument(
        "--target", choices=sorted(TARGETS), default="qwen3-8b", help="target shape (random weights)"
    )
    parser.add_argument(
        "--target-layers", type=int, default=None, help="fewer target layers (default: the model's)"
    )
    parser.add_argument("--loss-chunk", type=int, default=1024, help="rows per fused LM-head chunk")
    parser.add_argument("--no-compile", action="store_true", help="SDPA + eager (for comparison)")
    parser.add_argument(
        "--no-master-weights",
        action="store_true",
        help="fp32 weights under bf16 autocast instead of bf16 weights + fp32 master weights (for comparison)",
    )
    parser.add_argument("--out", default=None, help="write results JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashdraft bench train: needs a CUDA GPU")
        return 2
    target = build_target(args.target, args.target_layers)
    results = []
    for name in args.shape or ["a", "b"]:
        results.append(
            run_shape(
                name,
                target,
                steps=args.steps,
                warmup=args.warmup,
                num_layers=args.drafter_layers,
                mask_token_id=MASK_TOKEN_IDS[args.target],
                compile=not args.no_compile,
                loss_chunk=args.loss_chunk,
                master_weights=not args.no_master_weights,
            )
        )
        torch.cuda.empty_cache()
    report = {
        **provenance("train", argv),
        "target": {
            "kind": args.target,
            "layers": target.config.num_hidden_layers,
            "layer_ids": list(target.layer_ids),
        },
        "linear_attention_kernels": linear_attention_kernels(),
        "results": results,
    }
    header = f"{'shape':5} {'target ms':>9} {'drafter ms':>10} {'TFLOP/step':>10} {'TFLOP/s':>8} {'MFU989':>7} {'MFU789':>7} {'samp/s':>7} {'peak GiB':>8}"
    print(header)
    for r in results:
        print(
            f"{r['shape']:5} {r['target_ms']:9.1f} {r['drafter_step_ms']:10.1f} {r['drafter_tflop_per_step']:10.2f} "
            f"{r['drafter_tflops_achieved']:8.1f} {r['mfu_vs_datasheet_989']:7.3f} {r['mfu_vs_measured_789']:7.3f} "
            f"{r['samples_per_s_end_to_end']:7.2f} {r['peak_memory_GiB']:8.1f}"
        )
        print("      breakdown:", r["breakdown_ms"], "| warmup", r["warmup_s"], "s")
    if args.out:
        atomic_write_json(args.out, report, indent=2)
    return 0


# --------------------------------------------------------------------------- several GPUs (torchrun)


SAVE_MARGIN_BYTES = 2**30  # config, tokenizer-free index and the file system's own slack


def save_random_target(out, kind: str, num_layers: int | None = None) -> None:
    """Write a random bf16 target of `kind`'s shape to `out` (whole or not at all). Initialised on the GPU
    when there is one: the 27B's 54 GB take many minutes to initialise on the CPU, seconds on cuda:0."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_random_target(kind, device=device, dtype=torch.bfloat16, num_layers=num_layers)
    # Refuse before writing: a 27B target is 54 GB, and a full disk mid-save is a raw safetensors error.
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    free = free_bytes(out)
    if free is not None and free < needed + SAVE_MARGIN_BYTES:
        raise FlashdraftError(
            f"bench train: the random {kind} target needs {needed / 1e9:.1f} GB in {Path(out).parent}, which "
            f"has {free / 1e9:.1f} GB free: free space there or pass --workdir on a larger disk"
        )
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def torchrun_bench(argv: list[str]) -> int:
    """`flashdraft bench train --nproc-per-node N [--mode colocated|split] ...`: the real trainer under torchrun
    (docs/distributed.md) on a random target of a real model's shape saved once to --workdir and random
    token data of the chosen shape; reports samples/s per GPU and, for a split topology, each side's
    busy and waiting shares (the trainer's balance report)."""
    import os
    import subprocess
    import sys

    args = torchrun_parser().parse_args(argv)
    if args.target_parallel < 1 or args.nproc_per_node % args.target_parallel:
        raise FlashdraftError(
            f"--target-parallel {args.target_parallel} must divide --nproc-per-node {args.nproc_per_node}"
        )
    if args.target_parallel > 1 and args.mode != "colocated":
        raise FlashdraftError(
            "--target-parallel above 1 needs --mode colocated (split + tensor parallel: not yet)"
        )
    shape = SHAPES[args.shape]
    work = Path(args.workdir)
    target_dir = work / f"target-{args.target}-{args.target_layers or 'all'}"
    if not (target_dir / "config.json").is_file():  # built once: a random target of the real shape
        save_random_target(target_dir, args.target, args.target_layers)
    trainers = args.nproc_per_node - (args.target_ranks if args.mode == "split" else 0)
    steps = args.steps + args.warmup
    data = work / f"data-{args.shape}.jsonl"
    # exactly the samples the run draws: one epoch
    write_random_samples(
        data, steps * shape["batch"] * trainers, TARGETS[args.target]["vocab_size"], shape["seq"]
    )
    run = work / f"run-{args.mode}-{args.nproc_per_node}-{args.data_parallel}-tp{args.target_parallel}"
    if run.exists():
        import shutil

        shutil.rmtree(run)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc_per_node}",
    ]
    overrides = torchrun_overrides(args, target_dir, data, run, steps)
    cmd += ["-m", "flashdraft", "train", *(f"{k}={v}" for k, v in overrides.items())]
    print(" ".join(map(str, cmd)), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # The numbers are taken, and the result written, as soon as the last step's metrics are in: the run's
    # final checkpoint (tens of GB for a big drafter's optimizer state) can outlast a caller's time limit.
    rows, code = last_step_rows(proc, run / "metrics.jsonl", steps)
    if rows is None:
        print(f"flashdraft bench train: the run failed (exit {code}) before its last step")
        return code or 1
    result = torchrun_result(args, argv, rows, trainers)
    print(json.dumps(result, indent=1))
    if args.out:
        atomic_write_json(args.out, result, indent=2)
    code = proc.wait()
    if code != 0:
        print(f"flashdraft bench train: the run failed after its last step (exit {code}); the result stands")
    return code


def torchrun_parser() -> argparse.ArgumentParser:
    """The flags of `flashdraft bench train --nproc-per-node N`."""
    parser = argparse.ArgumentParser(prog="flashdraft bench train --nproc-per-node N")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--mode", choices=["colocated", "split"], default="colocated")
    parser.add_argument("--target-ranks", type=int, default=1, help="split: target GPUs (per node)")
    parser.add_argument("--data-parallel", choices=["auto", "ddp", "fsdp"], default="auto")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="ddp gradient bucket size (MB)")
    parser.add_argument(
        "--target-parallel",
        type=int,
        default=1,
        help="colocated: ranks that hold one target sharded by tensor parallelism (distributed.target_parallel)",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="a")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument("--target", choices=sorted(TARGETS), default="qwen3-8b")
    parser.add_argument("--target-layers", type=int, default=None)
    parser.add_argument("--workdir", default="bench-train-work", help="the saved random target and the runs")
    parser.add_argument("--out", default=None, help="write results JSON here")
    return parser


def write_random_samples(path: Path, count: int, vocab: int, seq: int) -> None:
    """`count` random samples of `seq` tokens (seeded), a 64-token prompt each and the rest supervised."""
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for _ in range(count):
            ids = torch.randint(0, vocab - 300, (seq,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 64 + [1] * (seq - 64)}) + "\n")


def torchrun_overrides(args: argparse.Namespace, target_dir: Path, data: Path, run: Path, steps: int) -> dict:
    """The training config of the benchmarked run, as `flashdraft train` overrides."""
    shape = SHAPES[args.shape]
    return {
        "model.target": target_dir,
        "model.num_layers": args.drafter_layers,
        "model.block_size": 16,
        "model.mask_token_id": MASK_TOKEN_IDS[args.target],
        "data.train": f"[{data}]",
        "data.max_length": shape["seq"],
        "train.out_dir": run,
        "train.resume": "never",
        "train.batch_size": shape["batch"],
        "train.num_anchors": shape["anchors"],
        "train.max_steps": steps,
        "train.log_every": 1,
        "train.save_every": 10**9,
        "train.keep_last": 1,
        "distributed.mode": args.mode,
        "distributed.target_ranks": args.target_ranks,
        "distributed.data_parallel": args.data_parallel,
        "distributed.bucket_mb": args.bucket_mb,
        "distributed.target_parallel": args.target_parallel,
    }


def torchrun_result(args: argparse.Namespace, argv: list[str], rows: list[dict], trainers: int) -> dict:
    """The result JSON from the run's step rows: median step time and samples/s over the steps after
    --warmup, drafter TFLOP/s, and for a split topology each side's waiting share."""
    import itertools

    shape = SHAPES[args.shape]
    seconds = [b["time"] - a["time"] for a, b in itertools.pairwise(rows) if b["step"] > args.warmup]
    step_s = statistics.median(seconds)
    samples_per_s = shape["batch"] * trainers / step_s
    result = {
        **provenance("train", argv),
        "mode": args.mode,
        "gpus": args.nproc_per_node,
        "target_gpus": args.target_ranks if args.mode == "split" else None,
        "data_parallel": args.data_parallel,
        "bucket_mb": args.bucket_mb,
        "target_parallel": args.target_parallel,
        "shape": {"name": args.shape, **shape},
        "target": args.target,
        "target_layers": args.target_layers,
        "step_seconds_median": round(step_s, 4),
        "samples_per_s": round(samples_per_s, 3),
        "samples_per_s_per_gpu": round(samples_per_s / args.nproc_per_node, 3),
        "tflops_drafter_median": statistics.median(r["tflops"] for r in rows if r["step"] > args.warmup),
    }
    measured = [r for r in rows if r["step"] > args.warmup and "balance/target_waiting_share" in r]
    if measured:
        for side in ("target", "drafter"):
            result[f"{side}_waiting_share"] = statistics.median(
                r[f"balance/{side}_waiting_share"] for r in measured
            )
        splits = [r["balance/balanced_split"] for r in measured if r.get("balance/balanced_split")]
        result["balanced_split"] = splits[-1] if splits else None
    return result


def last_step_rows(
    proc, metrics: Path, steps: int, poll_seconds: float = 1.0
) -> tuple[list[dict] | None, int]:
    """Wait until the run has logged step `steps` (its `train` rows, and None for the exit code if it still
    runs), or until it exits without it (None and its exit code)."""
    while True:
        code = proc.poll()
        rows = read_metrics(metrics, "train")
        if rows and rows[-1]["step"] >= steps:
            return rows, code
        if code is not None:
            return None, code
        time.sleep(poll_seconds)
