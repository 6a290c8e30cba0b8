"""`flashdraft bench train`: the drafter training step on a random target of a real model's shape.

Targets: Qwen3-8B (default) or the seeds' hybrid Qwen3.6-27B (`--target qwen3.6-27b`). Shapes: (a) batch
2 x seq 768, 256 anchors; (b) batch 1 x seq 3072, 512 anchors. Block 16, a 5-layer drafter on the default
target layer ids, same process and GPU as the target. Reports the drafter step's achieved TFLOP/s (FLOPs
the work needs, train/flops.py), MFU against the 989 TFLOP/s datasheet peak and the 789 TFLOP/s measured
matmul ceiling (docs/benchmarks.md), target ms, peak memory, and where the drafter step's time goes,
timed with CUDA events around the real objective's own calls.

`--precision bf16 --precision fp8 [--fp8-recipe tensorwise --fp8-recipe rowwise] [--fp8-head]` runs each
drafter precision in turn on the same target and reports each against bf16 (docs/fp8.md); `--fp8-head` adds,
after each FP8 variant, the same with the loss's head GEMMs in FP8 too (train.fp8_head; `--fp8-head only`:
instead of it). `--kernels N` profiles each variant's drafter step and forward apart from the target's. Before
the drafter steps, the target's feature forward is timed eager and then, unless `--no-compile-target` (as the
trainer's train.compile_target, on by default), with its decoder layers compiled, against its GEMM floor; the
drafter steps then run beside the compiled target, as `flashdraft train` does.

`flashdraft bench train --data SHARDS [--packing on|off|both]` times real steps on a real shard set instead,
with and without sequence packing (flashdraft/bench/packing_bench.py, docs/packing.md); it runs on the CPU
with a small local target (`--target-dir`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from flashdraft.bench.kernels import profile_kernels
from flashdraft.bench.provenance import provenance, write_result
from flashdraft.bench.shapes import (
    MASK_TOKEN_IDS,
    TARGETS,
    add_target_shape_arguments,
    build_random_target,
    linear_attention_kernels,
)
from flashdraft.config import OPTIMIZERS, TrainConfig
from flashdraft.data.tokens import TokenBatch
from flashdraft.distributed.compile_workers import start_compile_workers
from flashdraft.distributed.float8 import FP8_RECIPES, PRECISIONS, float8_head
from flashdraft.distributed.parallelize import compile_target, parallelize
from flashdraft.durable import atomic_directory, free_bytes
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config
from flashdraft.model.spec import build_target_layer_ids
from flashdraft.model.target import TargetModel
from flashdraft.run_protocol import read_metrics
from flashdraft.train.flops import step_flops
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.muon import drafter_optimizer
from flashdraft.train.objective import Objective

SHAPES = {
    "a": {"batch": 2, "seq": 768, "anchors": 256},
    "b": {"batch": 1, "seq": 3072, "anchors": 512},
    "tiny": {"batch": 2, "seq": 96, "anchors": 8},  # a CPU check of the bench itself, with --target-dir
}
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


@dataclass
class _DrafterStep:
    """One shape's drafter training step, built as the trainer builds it."""

    config: Any  # the drafter's config
    drafter: DFlashDraftModel
    placement: Any  # distributed/parallelize.py's Placement
    objective: Objective
    optimizer: Any


@dataclass
class _StepTimes:
    """The timed steps after warm-up: each span's median (ms), the FLOPs of each step, the warm-up's
    seconds and the graphs compiled after it."""

    medians: dict[str, float]
    flops: list[Any]
    warmup_s: float
    graphs_compiled_after_warmup: int


def _build_drafter_step(
    target: TargetModel,
    shape: dict,
    *,
    mask_token_id: int,
    num_layers: int,
    compile: bool,
    loss_chunk: int,
    master_weights: bool,
    precision: str,
    fp8_recipe: str,
    fp8_head: bool = False,
    optimizer: str = "adamw",
    fused_ce: bool = False,
) -> _DrafterStep:
    """A fresh drafter (block 16, on the target's layer ids) placed on the GPU, its objective and
    `optimizer` (train.optimizer, built as the trainer builds it, at the default learning rates)."""
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
        precision=precision,
        fp8_recipe=fp8_recipe,
    )
    loss_fn = WeightedHeadLoss(
        chunk=loss_chunk,
        head=float8_head(target.lm_head_weight) if fp8_head else None,
        compile=placement.compiled,
        fused=fused_ce,
    )
    objective = Objective(
        drafter,
        target,
        num_anchors=shape["anchors"],
        gamma=7.0,
        loss=loss_fn,
        attention=placement.attention,
        autocast_dtype=placement.autocast_dtype,
    )
    update = drafter_optimizer(drafter, TrainConfig(optimizer=optimizer), compile=placement.compiled)
    return _DrafterStep(config, drafter, placement, objective, update)


def _time_steps(
    step: _DrafterStep, target: TargetModel, batches: list[TokenBatch], warmup: int, steps: int
) -> _StepTimes:
    """`warmup` untimed steps (compiles), then `steps` steps with the target's forward and the drafter's
    step each timed by CUDA events, and the FLOPs each timed step needs."""
    objective, optimizer = step.objective, step.optimizer
    timer = Timer()
    torch.cuda.reset_peak_memory_stats()
    compile_started = time.perf_counter()
    flops = []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - compile_started
            timer = Timer()
            graphs_after_warmup = counters["stats"]["unique_graphs"]
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
                    step.config,
                    step.drafter.layer_kinds(),
                    cpu_blocks,
                    int(cpu_batch.lengths.sum()),
                    int((cpu_blocks.weights > 0).sum()),
                    target.vocab_size,
                )
            )
    medians = timer.medians()
    compiles_after_warmup = counters["stats"]["unique_graphs"] - graphs_after_warmup
    return _StepTimes(medians, flops, compile_s, compiles_after_warmup)


def _measurements(step: _DrafterStep, shape: dict, timed: _StepTimes, breakdown: dict) -> dict:
    """The shape's numbers: step times, the drafter step's FLOPs and achieved TFLOP/s against the two
    peaks, samples/s end to end, peak memory, warm-up and the time breakdown."""
    times, f = timed.medians, timed.flops[0]
    tflops = f.total / (times["drafter_step_ms"] / 1e3) / 1e12
    samples_per_s = shape["batch"] / ((times["drafter_step_ms"] + times["target_ms"]) / 1e3)
    return {
        "drafter_params_M": round(sum(p.numel() for p in step.drafter.parameters()) / 1e6, 1),
        "target_ms": round(times["target_ms"], 2),
        "drafter_step_ms": round(times["drafter_step_ms"], 2),
        "drafter_tflop_per_step": round(f.total / 1e12, 2),
        "drafter_tflop_breakdown": {
            "linear": round(f.linear / 1e12, 2),
            "lm_head": round(f.head / 1e12, 2),
            "attention": round(f.attention / 1e12, 2),
        },
        "drafter_tflops_achieved": round(tflops, 1),
        "mfu_vs_datasheet_989": round(tflops / DATASHEET_TFLOPS, 3),
        "mfu_vs_measured_789": round(tflops / MEASURED_CEILING_TFLOPS, 3),
        "samples_per_s_end_to_end": round(samples_per_s, 2),
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "warmup_s": round(timed.warmup_s, 1),
        "graphs_compiled_after_warmup": timed.graphs_compiled_after_warmup,
        "breakdown_ms": breakdown,
    }


def run_shape(
    name: str,
    target: TargetModel,
    *,
    mask_token_id: int,
    steps: int,
    warmup: int,
    num_layers: int,
    compile: bool,
    loss_chunk: int = TrainConfig.loss_chunk,
    master_weights: bool = True,
    precision: str = "bf16",
    fp8_recipe: str = "tensorwise",
    fp8_head: bool = False,
    optimizer: str = "adamw",
    kernels: int = 0,
    fused_ce: bool = False,
) -> dict:
    """The drafter training step of shape `name` on `target`: built, warmed up, timed, profiled; with
    `kernels`, also the drafter step's and its forward's `kernels` largest kernels by device time and the
    device time of all their kernels (`step_kernels`, `forward_kernels`)."""
    shape = SHAPES[name]
    torch._dynamo.reset()  # each shape builds its own drafter: start from a clean compile cache
    step = _build_drafter_step(
        target,
        shape,
        mask_token_id=mask_token_id,
        num_layers=num_layers,
        compile=compile,
        loss_chunk=loss_chunk,
        master_weights=master_weights,
        precision=precision,
        fp8_recipe=fp8_recipe,
        fp8_head=fp8_head,
        optimizer=optimizer,
        fused_ce=fused_ce,
    )
    batches = [random_batch(shape, target.vocab_size, seed) for seed in range(4)]
    timed = _time_steps(step, target, batches, warmup, steps)
    cuda_batch = batches[0].to(torch.device("cuda"))
    breakdown = profile_breakdown(step.objective, step.optimizer, cuda_batch)
    step_top, step_kernel_ms = step_kernels(step.objective, step.optimizer, cuda_batch, kernels)
    forward_top, forward_kernel_ms = forward_kernels(step.objective, cuda_batch, kernels)
    return {
        "shape": name,
        **shape,
        "compiled": compile,
        "precision": variant_name(precision, fp8_recipe, fp8_head),
        "optimizer": optimizer,
        "master_weights": master_weights,
        "loss_chunk": loss_chunk,
        "fused_ce": fused_ce,
        "attention": step.placement.attention,
        **_measurements(step, shape, timed, breakdown),
        **(
            {
                "step_kernel_ms": step_kernel_ms,
                "step_kernels": step_top,
                "forward_kernel_ms": forward_kernel_ms,
                "forward_kernels": forward_top,
            }
            if kernels
            else {}
        ),
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


def step_kernels(objective: Objective, optimizer, batch: TokenBatch, count: int) -> tuple[list[dict], float]:
    """The drafter step's (blocks, forward, loss, backward, clip + AdamW; the target's features made before,
    so that its GEMMs do not hide the drafter's) `count` largest kernels by device time, per step over 3
    steps (bench/kernels.py), and all its kernels' milliseconds per step: which GEMMs, attention and casts
    the breakdown's phases are made of, and how much of the step the device is busy. Empty for `count` 0."""
    if count <= 0:
        return [], 0.0
    features = objective.target.features(batch.input_ids)

    def one_step() -> None:
        out = objective(batch, objective.blocks(batch), features=features)
        (out.loss_sum / out.weight_sum).backward()
        optimizer.clip_and_step(1.0)
        optimizer.zero_grad(set_to_none=True)

    return _listed_kernels(one_step, batch.input_ids.device, count)


def forward_kernels(objective: Objective, batch: TokenBatch, count: int) -> tuple[list[dict], float]:
    """The drafter's forward and loss alone (the target's features and the blocks made before, no
    backward): its `count` largest kernels per call over 3 calls and all its kernels' milliseconds per
    call, as `step_kernels`. Empty for `count` 0."""
    if count <= 0:
        return [], 0.0
    blocks, features = objective.blocks(batch), objective.target.features(batch.input_ids)

    def forward() -> None:
        objective(batch, blocks, features=features)

    return _listed_kernels(forward, batch.input_ids.device, count)


def _listed_kernels(run, device: torch.device, count: int) -> tuple[list[dict], float]:
    """`run` profiled over 3 repeats: its `count` largest kernels and all its kernels' ms per repeat."""
    rows, total_us = profile_kernels(run, 3, device)
    return rows[:count], round(total_us / 1000, 2)


def median_ms(fn, repeats: int, device: torch.device | None = None) -> float:
    """Median time of `fn()` over `repeats` calls, after one warm-up call: device time (CUDA events) on a GPU,
    the default; the wall clock for a CPU `device` (the probes' smoke runs)."""
    fn()
    if device is not None and device.type != "cuda":
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)
    timer = Timer()
    for _ in range(repeats):
        with timer.span("call"):
            fn()
    return timer.medians()["call"]


def target_gemm_floor_ms(target: TargetModel, tokens: int, repeats: int = 20) -> float:
    """The target forward's floor: each linear layer of one decoder layer timed alone on `tokens` random
    rows (bf16 cuBLAS), times the layers the forward runs (up to the last feature layer)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    per_layer = 0.0
    for module in target.layers[0].modules():
        if isinstance(module, torch.nn.Linear):
            x = torch.randn(tokens, module.in_features, device="cuda", dtype=target.dtype, generator=g)
            per_layer += median_ms(lambda x=x, w=module.weight: torch.nn.functional.linear(x, w), repeats)
    return per_layer * (max(target.layer_ids) + 1)


def time_target(target: TargetModel, shape_names: list[str], compile_target_layers: bool) -> dict:
    """The target's feature forward per shape: eager (HF's own code), then with its decoder layers compiled
    (distributed/parallelize.py::compile_target), against the GEMM floor; the target stays compiled."""
    batches = {
        name: random_batch(SHAPES[name], target.vocab_size, 0).input_ids.cuda() for name in shape_names
    }
    report: dict = {name: {} for name in shape_names}
    for name, ids in batches.items():
        report[name]["eager_ms"] = round(median_ms(lambda ids=ids: target.features(ids), 10), 2)
        report[name]["gemm_floor_ms"] = round(target_gemm_floor_ms(target, ids.numel()), 2)
    if compile_target_layers:
        started = time.perf_counter()
        compiled = compile_target(target)
        for name, ids in batches.items():
            target.features(ids)
            if name == shape_names[0]:
                torch.cuda.synchronize()
                report["compile_s"] = round(time.perf_counter() - started, 1)
            report[name]["compiled_ms"] = round(median_ms(lambda ids=ids: target.features(ids), 10), 2)
        report["compiled"] = compiled
    for name in shape_names:
        row = report[name]
        best = row.get("compiled_ms", row["eager_ms"])
        row["share_of_floor"] = round(row["gemm_floor_ms"] / best, 3)
    return report


def _add_run_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The step counts, the drafter's depth and the target's shape: one group for both kinds of bench run."""
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--drafter-layers", type=int, default=5)
    add_target_shape_arguments(parser)


def _parser() -> argparse.ArgumentParser:
    """`flashdraft bench train`'s arguments (one GPU)."""
    parser = argparse.ArgumentParser(prog="flashdraft bench train")
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append", help="a, b (default both)")
    _add_run_shape_arguments(parser)
    parser.add_argument(
        "--loss-chunk",
        type=int,
        default=TrainConfig.loss_chunk,
        help="rows per fused LM-head chunk (default: the trainer's train.loss_chunk; results before stop 57 used 1024)",
    )
    parser.add_argument(
        "--fused-ce",
        action="store_true",
        help="the loss's passes between its head GEMMs as train.fused_ce's Triton kernels (every variant)",
    )
    parser.add_argument("--no-compile", action="store_true", help="SDPA + eager (for comparison)")
    parser.add_argument(
        "--no-master-weights",
        action="store_true",
        help="fp32 weights under bf16 autocast instead of bf16 weights + fp32 master weights (for comparison)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        action="append",
        help="drafter GEMM precision, train.precision (repeat to compare; default bf16)",
    )
    parser.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        action="append",
        help="with --precision fp8: train.fp8_recipe (repeat to compare; default tensorwise)",
    )
    parser.add_argument(
        "--fp8-head",
        nargs="?",
        const="also",
        choices=("also", "only"),
        help="after each --precision fp8 variant, the same with train.fp8_head (the loss's head GEMMs in FP8); "
        "--fp8-head only: each fp8 variant with the FP8 head alone (the fastest variant in one short call)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        action="append",
        help="train.optimizer of the step, built as the trainer builds it (repeat to compare; default adamw, what "
        "train.optimizer=auto picks at these widths): "
        "Muon's Newton-Schulz products at this shape's widths (docs/training-loop.md)",
    )
    parser.add_argument(
        "--compile-target",
        action=argparse.BooleanOptionalAction,
        default=TrainConfig.compile_target,
        help="after the eager forward, time the target with its decoder layers compiled and keep them so, "
        "as the trainer's train.compile_target (default on)",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also profile 3 drafter steps of each variant (the target's features made before) and 3 of its "
        "forwards, and record the N largest kernels of each by device time and the device time of all of "
        "them (step_kernels, forward_kernels, step_kernel_ms, forward_kernel_ms in the result: which GEMMs, "
        "attention and casts the breakdown is made of, and how busy the device is)",
    )
    parser.add_argument("--out", default=None, help="write results JSON here")
    return parser


def variant_name(precision: str, fp8_recipe: str, fp8_head: bool) -> str:
    """A result's `precision`: bf16, fp8-tensorwise, fp8-rowwise+head, ..."""
    if precision == "bf16":
        return "bf16"
    return f"fp8-{fp8_recipe}" + ("+head" if fp8_head else "")


def _variants(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """The drafter precisions to run, as (precision, fp8 recipe, fp8 head), each once, in the order given."""
    variants = []
    for precision in dict.fromkeys(args.precision or ["bf16"]):
        if precision != "fp8":
            variants.append((precision, "tensorwise", False))
            continue
        for recipe in dict.fromkeys(args.fp8_recipe or ["tensorwise"]):
            heads = {None: (False,), "also": (False, True), "only": (True,)}[args.fp8_head]
            variants += [(precision, recipe, head) for head in heads]
    return variants


def _against_baselines(result: dict, results: list[dict]) -> None:
    """`vs_bf16` and `vs_adamw`: the result's step time, throughput and memory against the bf16 drafter
    with the same optimizer, and against the AdamW one of the same precision, of the same shape measured in
    this process (where there is one)."""
    same_shape = [b for b in results if b["shape"] == result["shape"]]
    bases = {
        "vs_bf16": [
            b for b in same_shape if b["precision"] == "bf16" and b["optimizer"] == result["optimizer"]
        ],
        "vs_adamw": [
            b for b in same_shape if b["optimizer"] == "adamw" and b["precision"] == result["precision"]
        ],
    }
    for label, found in bases.items():
        if found:
            result[label] = {
                key: round(result[key] / found[0][key], 3)
                for key in ("drafter_step_ms", "samples_per_s_end_to_end", "peak_memory_GiB")
            }


def _print_header() -> None:
    print(
        f"{'shape':5} {'precision':>19} {'target ms':>9} {'drafter ms':>10} {'TFLOP/step':>10} {'TFLOP/s':>8} "
        f"{'MFU989':>7} {'MFU789':>7} {'samp/s':>7} {'peak GiB':>8}",
        flush=True,
    )


def _variant_label(r: dict) -> str:
    """A result's precision, and its optimizer where that is not AdamW."""
    return r["precision"] if r["optimizer"] == "adamw" else f"{r['precision']} {r['optimizer']}"


def _print_result(r: dict) -> None:
    """One variant's row under the header, and its breakdown line."""
    print(
        f"{r['shape']:5} {_variant_label(r):>19} {r['target_ms']:9.1f} {r['drafter_step_ms']:10.1f} "
        f"{r['drafter_tflop_per_step']:10.2f} {r['drafter_tflops_achieved']:8.1f} "
        f"{r['mfu_vs_datasheet_989']:7.3f} {r['mfu_vs_measured_789']:7.3f} "
        f"{r['samples_per_s_end_to_end']:7.2f} {r['peak_memory_GiB']:8.1f}",
        flush=True,
    )
    print(
        f"      breakdown: {r['breakdown_ms']} | warmup {r['warmup_s']} s | graphs after warm-up "
        f"{r['graphs_compiled_after_warmup']} | vs bf16 {r.get('vs_bf16')} | vs adamw {r.get('vs_adamw')}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    if argv and any(a.startswith("--nproc-per-node") for a in argv):  # several GPUs: the real trainer
        return torchrun_bench(argv)
    if argv and "--data" in argv:  # real shards, packing on and off (docs/packing.md)
        from flashdraft.bench.packing_bench import main as bench_data_steps

        return bench_data_steps(argv)
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("flashdraft bench train: needs a CUDA GPU")
        return 2
    if not args.no_compile:
        start_compile_workers()  # as the trainer does: kernels build in parallel from the first compile
    variants = _variants(args)
    optimizers = list(dict.fromkeys(args.optimizer or ["adamw"]))
    shape_names = args.shape or ["a", "b"]
    target = build_target(args.target, args.target_layers)
    report = {
        **provenance("train", argv),
        "target": {
            "kind": args.target,
            "layers": target.config.num_hidden_layers,
            "layer_ids": list(target.layer_ids),
        },
        "linear_attention_kernels": linear_attention_kernels(),
        "target_forward": time_target(target, shape_names, args.compile_target),
        "results": [],
    }
    print("target forward:", report["target_forward"], flush=True)
    _print_header()
    results = report["results"]
    for name in shape_names:
        for optimizer, (precision, recipe, fp8_head) in itertools.product(optimizers, variants):
            r = run_shape(
                name,
                target,
                steps=args.steps,
                warmup=args.warmup,
                num_layers=args.drafter_layers,
                mask_token_id=MASK_TOKEN_IDS[args.target],
                compile=not args.no_compile,
                loss_chunk=args.loss_chunk,
                master_weights=not args.no_master_weights,
                precision=precision,
                fp8_recipe=recipe,
                fp8_head=fp8_head,
                optimizer=optimizer,
                kernels=args.kernels,
                fused_ce=args.fused_ce,
            )
            torch.cuda.empty_cache()
            _against_baselines(r, results)
            results.append(r)
            _print_result(r)
            # after each variant: a run cut short by a time limit keeps what it measured
            write_result(args.out, report)
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


def _torchrun_parser() -> argparse.ArgumentParser:
    """`flashdraft bench train --nproc-per-node N`'s arguments."""
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
    _add_run_shape_arguments(parser)
    parser.add_argument("--workdir", default="bench-train-work", help="the saved random target and the runs")
    parser.add_argument(
        "--target-dir", default=None, help="a local target instead of a random one of --target's shape"
    )
    parser.add_argument(
        "--mask-token-id", type=int, default=None, help="with --target-dir: the drafter's mask id"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="checkpoint every K steps and report the step time of a checkpointing step against a plain "
        "one, and the background write's own seconds and bytes (docs/distributed.md)",
    )
    parser.add_argument("--out", default=None, help="write results JSON here")
    return parser


def _check_torchrun_args(args: argparse.Namespace) -> None:
    """What the parser cannot check: --checkpoint-every and --target-parallel against the topology."""
    if args.checkpoint_every < 0:
        raise FlashdraftError(f"--checkpoint-every must be 0 (off) or more, got {args.checkpoint_every}")
    if args.target_parallel < 1 or args.nproc_per_node % args.target_parallel:
        raise FlashdraftError(
            f"--target-parallel {args.target_parallel} must divide --nproc-per-node {args.nproc_per_node}"
        )
    if args.target_parallel > 1 and args.mode != "colocated":
        raise FlashdraftError(
            "--target-parallel above 1 needs --mode colocated (split + tensor parallel: not yet)"
        )


def _bench_target(args: argparse.Namespace, work: Path) -> tuple[Path, int]:
    """The target directory the run trains on and its vocabulary size: --target-dir, or a random target of
    --target's shape saved once under `work`."""
    if args.target_dir is not None:
        target_dir = Path(args.target_dir)
        return target_dir, json.loads((target_dir / "config.json").read_text())["vocab_size"]
    target_dir = work / f"target-{args.target}-{args.target_layers or 'all'}"
    if not (target_dir / "config.json").is_file():  # built once: a random target of the real shape
        save_random_target(target_dir, args.target, args.target_layers)
    return target_dir, TARGETS[args.target]["vocab_size"]


def _write_random_samples(path: Path, shape: dict, count: int, vocab: int) -> None:
    """`count` random token samples of the shape's length, a short prompt each, as a JSONL data file."""
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for _ in range(count):
            ids = torch.randint(0, max(vocab - 300, vocab // 2), (shape["seq"],), generator=g).tolist()
            prompt = min(64, shape["seq"] // 4)
            f.write(
                json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (shape["seq"] - prompt)})
                + "\n"
            )


def _trainer_overrides(
    args: argparse.Namespace, target_dir: Path, data: Path, run: Path, steps: int
) -> dict[str, object]:
    """The `flashdraft train` config overrides of the benchmarked run."""
    shape = SHAPES[args.shape]
    mask_token_id = args.mask_token_id if args.mask_token_id is not None else MASK_TOKEN_IDS[args.target]
    return {
        "model.target": target_dir,
        "model.num_layers": args.drafter_layers,
        "model.block_size": 16,
        "model.mask_token_id": mask_token_id,
        "data.train": f"[{data}]",
        "data.max_length": shape["seq"],
        "train.out_dir": run,
        "train.resume": "never",
        "train.batch_size": shape["batch"],
        "train.num_anchors": shape["anchors"],
        "train.max_steps": steps,
        "train.log_every": 1,
        "train.save_every": args.checkpoint_every or 10**9,
        "train.keep_last": 1,
        "distributed.mode": args.mode,
        "distributed.target_ranks": args.target_ranks,
        "distributed.data_parallel": args.data_parallel,
        "distributed.bucket_mb": args.bucket_mb,
        "distributed.target_parallel": args.target_parallel,
    }


def _start_trainer(nproc_per_node: int, overrides: dict[str, object]) -> subprocess.Popen:
    """`flashdraft train` under torchrun (standalone), its command printed, its output piped."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
    ]
    cmd += ["-m", "flashdraft", "train", *(f"{k}={v}" for k, v in overrides.items())]
    print(" ".join(map(str, cmd)), flush=True)
    return subprocess.Popen(
        cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _checkpoint_intervals(
    intervals: dict[int, float], every: int, steps: int
) -> tuple[dict[int, float], list[float]]:
    """The measured step intervals split into plain ones (by step) and those that hold a save: a save
    follows its step's metrics row, so it lands in the interval up to the next row."""
    saving = {s + 1 for s in range(every, steps, every)}
    return (
        {s: v for s, v in intervals.items() if s not in saving},
        [v for s, v in intervals.items() if s in saving],
    )


def _torchrun_result(
    argv: list[str], args: argparse.Namespace, rows: list[dict], intervals: dict[int, float], trainers: int
) -> dict:
    """The run's numbers: the median step's seconds, samples/s (per GPU too), the drafter's TFLOP/s and, for
    a split topology, each side's waiting share and the balanced split the trainer reported."""
    shape = SHAPES[args.shape]
    step_s = statistics.median(list(intervals.values()))
    samples_per_s = shape["batch"] * trainers / step_s
    return {
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


def _balance(result: dict, rows: list[dict], warmup: int) -> None:
    """A split run's balance report, from its measured steps: each side's median waiting share and the
    last balanced split (nothing for a colocated run)."""
    measured = [r for r in rows if r["step"] > warmup and "balance/target_waiting_share" in r]
    if measured:
        for side in ("target", "drafter"):
            result[f"{side}_waiting_share"] = statistics.median(
                r[f"balance/{side}_waiting_share"] for r in measured
            )
        splits = [r["balance/balanced_split"] for r in measured if r.get("balance/balanced_split")]
        result["balanced_split"] = splits[-1] if splits else None


def torchrun_bench(argv: list[str]) -> int:
    """`flashdraft bench train --nproc-per-node N [--mode colocated|split] ...`: the real trainer under torchrun
    (docs/distributed.md) on a random target of a real model's shape saved once to --workdir and random
    token data of the chosen shape; reports samples/s per GPU and, for a split topology, each side's
    busy and waiting shares (the trainer's balance report)."""
    args = _torchrun_parser().parse_args(argv)
    _check_torchrun_args(args)
    shape = SHAPES[args.shape]
    work = Path(args.workdir)
    target_dir, vocab = _bench_target(args, work)
    trainers = args.nproc_per_node - (args.target_ranks if args.mode == "split" else 0)
    steps = args.steps + args.warmup
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"data-{args.shape}.jsonl"
    _write_random_samples(data, shape, steps * shape["batch"] * trainers, vocab)  # one epoch: what it draws
    run = work / f"run-{args.mode}-{args.nproc_per_node}-{args.data_parallel}-tp{args.target_parallel}"
    overrides = _trainer_overrides(args, target_dir, data, run, steps)
    if run.exists():
        shutil.rmtree(run)
    proc = _start_trainer(args.nproc_per_node, overrides)
    output = echo_lines(proc)  # the run's lines, shown as they come and kept for the checkpoint report
    # The numbers are taken, and the result written, as soon as the last step's metrics are in: the run's
    # final checkpoint (tens of GB for a big drafter's optimizer state) can outlast a caller's time limit.
    rows, code = last_step_rows(proc, run / "metrics.jsonl", steps)
    if rows is None:
        print(f"flashdraft bench train: the run failed (exit {code}) before its last step")
        return code or 1
    intervals = {
        b["step"]: b["time"] - a["time"] for a, b in itertools.pairwise(rows) if b["step"] > args.warmup
    }
    checkpoint = None
    if args.checkpoint_every:
        intervals, saving_intervals = _checkpoint_intervals(intervals, args.checkpoint_every, steps)
        code = proc.wait()  # every background write's own line, the last one's too
        checkpoint = checkpoint_report(output.lines(), intervals, saving_intervals, args.checkpoint_every)
    result = _torchrun_result(argv, args, rows, intervals, trainers)
    if checkpoint is not None:
        result["checkpoint"] = checkpoint
    _balance(result, rows, args.warmup)
    print(json.dumps(result, indent=1))
    write_result(args.out, result)
    code = proc.wait()
    if code != 0:
        print(f"flashdraft bench train: the run failed after its last step (exit {code}); the result stands")
    return code


class _Lines:
    def __init__(self, thread, lines: list[str]):
        self.thread, self._lines = thread, lines

    def lines(self) -> list[str]:
        self.thread.join(timeout=10)
        return list(self._lines)


def echo_lines(proc) -> _Lines:
    """Print the run's output as it comes (a thread) and keep its lines."""
    import sys
    import threading

    kept: list[str] = []

    def pump():
        for raw in proc.stdout:
            line = raw.decode("utf-8", errors="replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            kept.append(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return _Lines(thread, kept)


# train/checkpoint.py's WrittenCheckpoint.line
WRITTEN_LINE = re.compile(
    r"checkpoint step (\d+): ([\d.]+) MB written in ([\d.]+) s in the background "
    r"\(the step paid ([\d.]+) s for the copy\)"
)


def checkpoint_report(
    lines: list[str], plain: dict[int, float], saving: list[float], every: int
) -> dict[str, object]:
    """A checkpointing step against a plain one, and what the background writes took."""
    writes = [
        {"step": int(m[1]), "bytes": int(float(m[2]) * 1e6), "write_s": float(m[3]), "copy_s": float(m[4])}
        for line in lines
        if (m := WRITTEN_LINE.search(line))
    ]
    if not saving or not writes:
        raise FlashdraftError(
            f"bench train --checkpoint-every {every}: no checkpointing step was measured "
            f"({len(saving)} step(s), {len(writes)} write line(s)); give more --steps than {every}"
        )
    plain_s, saving_s = statistics.median(plain.values()), statistics.median(saving)
    return {
        "every": every,
        "plain_step_seconds_median": round(plain_s, 4),
        "checkpoint_step_seconds_median": round(saving_s, 4),
        "checkpoint_step_extra_seconds": round(saving_s - plain_s, 4),
        "checkpoint_steps_measured": len(saving),
        "copy_seconds_median": statistics.median(w["copy_s"] for w in writes),
        "write_seconds_median": statistics.median(w["write_s"] for w in writes),
        "bytes": writes[-1]["bytes"],
        "writes": writes,
    }


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
