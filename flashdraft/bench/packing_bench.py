"""`flashdraft bench train --data SHARDS`: the training step on real shards, packing on and off (docs/packing.md).

For each mode the batches come from the trainer's own pieces (sampler, collation, `Objective.blocks`), and
the step's work is counted twice: what it executes (every row slot and block slot, padding included) and
what is useful (real tokens, real blocks: train/flops.py). `--waste-only` stops at the counts, which need
no model (CPU, seconds). Otherwise `--steps` real steps run (target forward, drafter forward and backward,
AdamW) on a local target directory (`--target-dir`, e.g. a test's tiny model on the CPU) or on a random
target of a real shape (`--target`, CUDA only), and samples/s, real tokens/s and MFU counting only useful
FLOPs are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from flashdraft.bench.provenance import provenance
from flashdraft.bench.shapes import MASK_TOKEN_IDS, TARGETS, build_random_target, target_config
from flashdraft.data.packing import PackedEpochSampler
from flashdraft.data.shards import write_shards
from flashdraft.data.tokens import EpochSampler, TokenDataset, collate, collate_packed, load_token_dataset
from flashdraft.distributed.parallelize import parallelize
from flashdraft.durable import atomic_write_json
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config, resolve_mask_token_id
from flashdraft.model.spec import build_target_layer_ids, default_gamma, layer_kinds
from flashdraft.model.target import TargetModel, load_target_config
from flashdraft.train.blocks import blocks_for
from flashdraft.train.flops import peak_tflops, step_flops
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from flashdraft.train.optim import make_optimizer

COUNTS = ("samples", "tokens", "token_slots", "blocks", "block_slots", "useful_flops", "executed_flops")


def lognormal_samples(
    count: int, median: int, sigma: float, max_length: int, vocab: int, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Lengths log-normal around `median` tokens (at least 64, at most `max_length`), a prompt of a quarter
    and a supervised answer (the prompt share `flashdraft bench data` uses)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), sigma, size=count).astype(np.int64), 64, max_length)
    for length in lengths.tolist():
        mask = np.ones(length, dtype=np.uint8)
        mask[: length // 4] = 0
        yield rng.integers(0, vocab, size=length, dtype=np.uint32), mask


class Mode:
    """One way of drawing batches: unpacked samples or packed rows, as the trainer draws them."""

    def __init__(self, data: TokenDataset, packed: bool, batch_size: int, seed: int, pad_multiple: int):
        self.data, self.packed, self.seed, self.pad_multiple = data, packed, seed, pad_multiple
        if packed:
            self.sampler = PackedEpochSampler(data.lengths(), batch_size, seed, data.max_length)
        else:
            self.sampler = EpochSampler(len(data), batch_size, seed)

    def batches(self) -> Iterator:
        while True:
            epoch, items = self.sampler.next_batch()
            build = collate_packed if self.packed else collate
            yield build(self.data, epoch, items, self.seed, self.pad_multiple)


def count_work(batch, blocks, drafter_config, kinds, vocab: int) -> dict[str, float]:
    """What one micro-batch executes and what of it is useful. Executed: every block slot a real block and
    every row slot a context token (the same formula, padding included; the head only runs on supervised
    rows either way)."""
    b, s = batch.input_ids.shape
    loss_rows = int((blocks.weights > 0).sum())
    useful = step_flops(drafter_config, kinds, blocks, int(batch.lengths.sum()), loss_rows, vocab)
    every_slot = dataclasses.replace(blocks, keep=torch.ones_like(blocks.keep))
    executed = step_flops(drafter_config, kinds, every_slot, b * s, loss_rows, vocab)
    return {
        "samples": len(batch.seeds),
        "tokens": int(batch.lengths.sum()),
        "token_slots": b * s,
        "blocks": int(blocks.keep.sum()),
        "block_slots": blocks.keep.numel(),
        "useful_flops": useful.total,
        "executed_flops": executed.total,
    }


def shares(totals: dict[str, float]) -> dict[str, float]:
    return {
        "samples": int(totals["samples"]),
        "mean_samples_per_row": round(totals["samples"] / max(totals["rows"], 1), 2),
        "row_padding": round(1 - totals["tokens"] / totals["token_slots"], 4),
        "block_padding": round(1 - totals["blocks"] / totals["block_slots"], 4),
        "useful_flop_share": round(totals["useful_flops"] / totals["executed_flops"], 4),
        "useful_tflop_per_sample": round(totals["useful_flops"] / totals["samples"] / 1e12, 4),
        "executed_tflop_per_sample": round(totals["executed_flops"] / totals["samples"] / 1e12, 4),
    }


def measure_waste(mode: Mode, objective_blocks, drafter_config, kinds, vocab: int, batches: int) -> dict:
    totals = dict.fromkeys((*COUNTS, "rows"), 0.0)
    source = mode.batches()
    limit = batches or -(-mode.sampler.items(0) // mode.sampler.batch_size)  # 0: one whole epoch
    for _ in range(limit):
        batch = next(source)
        for key, value in count_work(batch, objective_blocks(batch), drafter_config, kinds, vocab).items():
            totals[key] += value
        totals["rows"] += batch.input_ids.shape[0]
    return {"batches": limit, **shares(totals)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(mode: Mode, objective: Objective, optimizer, drafter_config, steps: int, warmup: int) -> dict:
    """Real steps: host preparation, target forward, drafter forward + backward + AdamW, each timed."""
    device = objective.target.device
    kinds = objective.drafter.layer_kinds()
    totals = dict.fromkeys((*COUNTS, "rows", "host_s", "target_s", "drafter_s"), 0.0)
    source = mode.batches()
    started = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            warmup_s = time.perf_counter() - started
        t0 = time.perf_counter()
        cpu_batch = next(source)
        cpu_blocks = objective.blocks(cpu_batch)
        batch, blocks = cpu_batch.to(device), cpu_blocks.to(device)
        t1 = time.perf_counter()
        features = objective.target.features(batch.input_ids, position_ids=batch.position_ids)
        sync(device)
        t2 = time.perf_counter()
        out = objective(batch, blocks, features=features)
        (out.loss_sum / out.weight_sum).backward()
        optimizer.clip_and_step(1.0)
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        if i >= warmup:
            work = count_work(cpu_batch, cpu_blocks, drafter_config, kinds, objective.target.vocab_size)
            for key, value in work.items():
                totals[key] += value
            totals["rows"] += cpu_batch.input_ids.shape[0]
            totals["host_s"] += t1 - t0
            totals["target_s"] += t2 - t1
            totals["drafter_s"] += t3 - t2
    step_s = totals["target_s"] + totals["drafter_s"]  # the trainer prepares the host side during the step
    useful_tflops = totals["useful_flops"] / totals["drafter_s"] / 1e12
    peak = peak_tflops(device)
    return {
        "steps": steps,
        "warmup_s": round(warmup_s, 1),
        "samples_per_s": round(totals["samples"] / step_s, 3),
        "tokens_per_s": round(totals["tokens"] / step_s, 1),
        "host_ms_per_step": round(1e3 * totals["host_s"] / steps, 1),
        "target_ms_per_step": round(1e3 * totals["target_s"] / steps, 1),
        "drafter_ms_per_step": round(1e3 * totals["drafter_s"] / steps, 1),
        "useful_drafter_tflops": round(useful_tflops, 4),
        "mfu_useful": round(useful_tflops / peak, 4) if peak else None,
        **shares(totals),
    }


def build_target(args, device: torch.device, layer_ids_count: int = 5) -> tuple[TargetModel | None, object]:
    """The target (None for --waste-only) and its config."""
    if args.target_dir:
        config = load_target_config(args.target_dir)
        layer_ids = build_target_layer_ids(config.num_hidden_layers, layer_ids_count)
        if args.waste_only:
            return None, config
        return TargetModel.load(args.target_dir, layer_ids, device=device), config
    config = target_config(args.target, args.target_layers)
    if args.waste_only:
        return None, config
    if device.type != "cuda":
        raise FlashdraftError(
            "--target (a random target of a real shape) needs a CUDA GPU; use --target-dir on the CPU"
        )
    model = build_random_target(
        args.target, device="cuda", dtype=torch.bfloat16, num_layers=args.target_layers
    )
    layer_ids = build_target_layer_ids(model.config.num_hidden_layers, layer_ids_count)
    return TargetModel(model, layer_ids, name=f"{args.target}-shaped random target"), config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashdraft bench train --data")
    p.add_argument("--data", required=True, help="a shard set (flashdraft prepare)")
    p.add_argument("--packing", choices=("on", "off", "both"), default="both")
    p.add_argument("--anchors", choices=("per_row", "budget"), default="per_row", help="train.anchors")
    p.add_argument("--num-anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--batch-size", type=int, default=4, help="samples per micro-batch, packing off")
    p.add_argument("--packed-batch-size", type=int, default=1, help="packed rows per micro-batch, packing on")
    p.add_argument(
        "--target-dir", default=None, help="a local Hugging Face target (default: a random --target)"
    )
    p.add_argument(
        "--mask-token-id", type=int, default=None, help="with --target-dir (default: its tokenizer's)"
    )
    p.add_argument("--target", choices=sorted(TARGETS), default="qwen3-8b", help="random target shape (CUDA)")
    p.add_argument("--target-layers", type=int, default=None, help="fewer target layers (random target)")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--waste-only", action="store_true", help="count padding and useful FLOPs; run no model")
    p.add_argument(
        "--pad-multiple",
        type=int,
        default=256,
        help="--waste-only: rows padded as compiled GPU training pads them",
    )
    p.add_argument(
        "--waste-batches", type=int, default=0, help="batches counted by --waste-only (0: an epoch)"
    )
    p.add_argument(
        "--make-lognormal",
        type=int,
        default=0,
        metavar="N",
        help="first write N samples with log-normal lengths (median 600, sigma 0.6) to --data, if it is absent",
    )
    p.add_argument("--out", default=None, help="write results JSON here")
    return p


def main(argv: list[str]) -> int:
    options = parser()
    args = options.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1 or args.packed_batch_size < 1:
        options.error("--steps, --batch-size and --packed-batch-size must be at least 1, --warmup at least 0")
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    target, config = build_target(args, device)
    vocab = int(config.vocab_size)
    if args.target_dir:
        mask_token_id = resolve_mask_token_id(
            args.target_dir, config, args.mask_token_id, label="--mask-token-id"
        )
    else:
        mask_token_id = MASK_TOKEN_IDS[args.target]
    if args.make_lognormal and not Path(args.data).exists():  # token ids below the mask token's
        samples = lognormal_samples(args.make_lognormal, 600, 0.6, args.max_length, mask_token_id, args.seed)
        write_shards(Path(args.data), samples, {"tokenizer_name": "synthetic (lognormal lengths)"})
    data = load_token_dataset(
        [args.data], max_length=args.max_length, block_size=args.block_size, vocab_size=vocab
    )
    drafter_config = make_drafter_config(
        config,
        num_layers=args.drafter_layers,
        block_size=args.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=build_target_layer_ids(config.num_hidden_layers, 5),
    )
    gamma, budget = default_gamma(args.block_size), args.anchors == "budget"
    objective, optimizer, pad_multiple = None, None, args.pad_multiple
    if not args.waste_only:
        objective, optimizer, pad_multiple = build_training(args, drafter_config, target, gamma)

    def blocks(batch):
        return blocks_for(batch, args.num_anchors, args.block_size, mask_token_id, gamma, budget)

    results = {}
    for packed in {"on": [True], "off": [False], "both": [False, True]}[args.packing]:
        size = args.packed_batch_size if packed else args.batch_size
        mode = Mode(data, packed, size, args.seed, pad_multiple)
        if args.waste_only:
            kinds = layer_kinds(drafter_config)
            result = measure_waste(mode, blocks, drafter_config, kinds, vocab, args.waste_batches)
        else:
            result = time_steps(mode, objective, optimizer, drafter_config, args.steps, args.warmup)
        results["packing_on" if packed else "packing_off"] = {"batch_size": size, **result}
        print(f"packing {'on' if packed else 'off'} ({args.anchors} anchors): {result}", flush=True)
    report = {
        **provenance("train", argv),
        "data": {
            "path": args.data,
            "samples": len(data),
            "dropped": data.dropped,
            "max_length": args.max_length,
        },
        "target": args.target_dir or args.target,
        "device": str(device),
        "anchors": args.anchors,
        "num_anchors": args.num_anchors,
        "block_size": args.block_size,
        "drafter_layers": args.drafter_layers,
        "results": results,
    }
    if args.out:
        atomic_write_json(args.out, report, indent=2)
    return 0


def build_training(args, drafter_config, target: TargetModel, gamma: float):
    """The drafter, its objective and optimizer, placed and compiled as the trainer does."""
    device = target.device
    with torch.device(device):
        drafter = DFlashDraftModel(drafter_config)
    drafter.init_weights(torch.Generator().manual_seed(args.seed))
    compiled = device.type == "cuda"
    placement = parallelize(
        drafter, device=device, attention="flex" if compiled else "sdpa", compile=compiled
    )
    objective = Objective(
        drafter,
        target,
        num_anchors=args.num_anchors,
        gamma=gamma,
        loss=WeightedHeadLoss(
            chunk=1024, multiplier=drafter.spec.output_multiplier, compile=placement.compiled
        ),
        anchors=args.anchors,
        attention=placement.attention,
        autocast_dtype=placement.autocast_dtype,
    )
    optimizer = make_optimizer(
        list(drafter.parameters()), lr=6e-4, weight_decay=0.0, compile=placement.compiled
    )
    return objective, optimizer, placement.pad_multiple
