"""`flashdraft bench data`: what `flashdraft train`'s data path costs on a large shard set.

Writes a synthetic set with the real writer (`write_shards`; default 800K samples of ~1250 tokens, about
1B tokens, 5 GB), then, in a fresh process as a rank of `flashdraft train` would, measures: opening the set
(`load_token_dataset`, the call `train` makes), the first epoch permutation, the first batch (its pages
evicted from the page cache first, so read from disk), the sampler's per-call cost and collation, and the
process's peak resident memory. The targets (issue 12): train start to first step <= 30 s, host memory
<= 4 GB a rank. With `--train`, the command itself too: `flashdraft train` on the set (a small random
target with Qwen3's vocabulary unless `--train-target` names one), timed from its start to its first
optimizer step's metrics row, with its peak resident memory and where that time went; the first start
with empty torch compile caches of its own, the second with what the first left in them. Method and
results: docs/shards.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from flashdraft.config import DEFAULT_NUM_LAYERS
from flashdraft.durable import atomic_write_json
from flashdraft.run_protocol import read_metrics

VOCAB = 151_936  # Qwen3's
# bench/shapes.py's TARGETS, named here: importing it imports torch, which the measuring child times
TARGET_SHAPES = ("qwen3-8b", "qwen3.6-27b")


def synthetic_samples(count: int, mean_length: int, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`count` samples, lengths uniform in [mean/4, 7·mean/4], a prompt of a quarter then a supervised answer;
    generated a chunk at a time so the writer, not the generator, is what is measured."""
    rng = np.random.default_rng(seed)
    chunk = 4096
    for start in range(0, count, chunk):
        n = min(chunk, count - start)
        lengths = rng.integers(mean_length // 4, 7 * mean_length // 4 + 1, size=n)
        ids = rng.integers(0, VOCAB, size=int(lengths.sum()), dtype=np.uint32)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i in range(n):
            length = int(lengths[i])
            mask = np.ones(length, dtype=np.uint8)
            mask[: length // 4] = 0
            yield ids[offsets[i] : offsets[i + 1]], mask


def _evict(directory: Path) -> None:
    """Drop the set's pages from the page cache (this set only), so the first batch is read from disk."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rss() -> dict[str, float]:
    """Current resident memory split into anonymous (the process's own) and file-backed (page cache of
    the memory maps, shared and reclaimable), and the peak, in GB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1e6  # kB -> GB
    return {
        "rss_GB": round(fields.get("VmRSS", 0), 3),
        "rss_anon_GB": round(fields.get("RssAnon", 0), 3),
        "rss_file_GB": round(fields.get("RssFile", 0), 3),
        "peak_rss_GB": round(
            max(fields.get("VmHWM", 0), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6), 3
        ),
    }


def measure(directory: Path, batch_size: int, world_size: int, max_length: int, calls: int) -> dict:
    """The data path of one rank (rank 0) of `flashdraft train`, timed; run in a fresh process."""
    started = time.perf_counter()
    import torch

    from flashdraft.data.tokens import EpochSampler, collate, load_token_dataset

    imported = time.perf_counter()  # torch and flashdraft's data modules, as `train` imports them
    _evict(directory)
    data = load_token_dataset([str(directory)], max_length=max_length, block_size=16, vocab_size=VOCAB)
    opened = time.perf_counter()
    sampler = EpochSampler(len(data), batch_size * world_size, seed=0)
    epoch, indices = sampler.next_batch()  # computes the epoch's permutation
    permuted = time.perf_counter()
    batch = collate(data, epoch, indices[0::world_size], 0, 64)  # cold: read from disk
    first_batch = time.perf_counter()
    ready = {
        "import_s": imported - started,
        "open_s": opened - imported,
        "first_permutation_s": permuted - opened,
        "first_batch_s": first_batch - permuted,
        "to_first_batch_s": first_batch - started,
    }
    t0 = time.perf_counter()
    for _ in range(calls):
        epoch, indices = sampler.next_batch()
    sampler_call = (time.perf_counter() - t0) / calls
    t0, collated = time.perf_counter(), 0
    for _ in range(min(calls, 200)):
        epoch, indices = sampler.next_batch()
        collated += int(collate(data, epoch, indices[0::world_size], 0, 64).lengths.sum())
    collate_call = (time.perf_counter() - t0) / min(calls, 200)
    t0 = time.perf_counter()
    torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    old_call = time.perf_counter() - t0  # what every call cost before the permutation was cached
    return {
        **{k: round(v, 4) for k, v in ready.items()},
        "sampler_call_ms": round(sampler_call * 1e3, 4),
        "sampler_call_before_caching_ms": round(old_call * 1e3, 2),
        "collate_call_ms": round(collate_call * 1e3, 3),
        "collated_tokens_per_s": round(collated / (collate_call * min(calls, 200)), 0),
        "first_batch_shape": list(batch.input_ids.shape),
        "samples_usable": len(data),
        **_rss(),
    }


def _peak_rss_gb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in GB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 0.0


SET_UP = re.compile(r"set up in ([0-9.]+) s")
COMPILED = re.compile(r"step \d+: \d+ graph\(s\) compiled")  # the trainer's per-step compile report


# What the measurement itself needs: a --train-override of these would time another thing, or nothing.
BENCH_KEYS = (
    "model.target",
    "data.train",
    "train.max_steps",
    "train.log_every",
    "train.out_dir",
    "train.resume",
)


def _train_overrides(pairs: list[str]) -> dict[str, str]:
    """--train-override KEY=VALUE pairs, applied over the bench's own settings; `flashdraft train` checks
    the keys and values themselves."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"flashdraft bench data: --train-override {pair!r}: expected KEY=VALUE")
        if key in BENCH_KEYS:
            raise SystemExit(
                f"flashdraft bench data: --train-override {key}: the bench sets it to time the first step "
                f"(it sets {', '.join(BENCH_KEYS)})"
            )
        overrides[key] = value
    return overrides


def _random_target(root: Path, args: argparse.Namespace) -> Path:
    """The target `flashdraft train` loads: Qwen3's vocabulary (the set's ids) with small layers, where the
    data path dominates; or, with --train-target-shape, a random bf16 target of that model's shape
    (--target-layers of it), where the compiles and kernels of the real widths do."""
    if args.train_target_shape:
        from flashdraft.bench.train_bench import save_random_target

        layers = args.target_layers or "all"
        target = root / f"target-{args.train_target_shape}-{layers}-layers"
        if not (target / "config.json").is_file():
            save_random_target(target, args.train_target_shape, args.target_layers)
        return target
    from flashdraft.model.tiny import save_tiny_target

    # enough layers for the drafter's default feature layers (1 to L-3, one per drafter layer)
    layers = max(2, args.drafter_layers + 3)
    target = root / f"target-{layers}-layers"
    if not (target / "config.json").is_file():
        save_tiny_target(target, vocab_size=VOCAB, hidden_size=64, num_layers=layers)
    return target


def time_train(
    shards: Path,
    root: Path,
    target: str | None,
    args: argparse.Namespace,
    compile_cache: Path,
    extra_overrides: dict[str, str],
) -> dict:
    """`flashdraft train` on the set, as a user runs it (one process, default device): seconds from the
    command's start to its first optimizer step's metrics row, its peak resident memory, its start-up line,
    and where the time before the first step went: `before_set_up_s` (the interpreter, the imports, CUDA's
    start), `set_up_s` (the command's own set-up, from that line) and `first_step_s` (the first step, with
    the compiles it waited for, graph by graph under `compiled`). torch's compile caches are
    `compile_cache` (inductor's and Triton's). `extra_overrides` (--train-override) go over the bench's own."""
    if target is None:
        target = str(_random_target(root, args))
    run = root / "run"
    shutil.rmtree(run, ignore_errors=True)
    overrides = {
        "model.target": target,
        "model.num_layers": args.drafter_layers,
        "model.mask_token_id": VOCAB - 1,
        "data.train": f"[{shards}]",
        "data.max_length": args.max_length,
        "train.batch_size": args.batch_size,
        # few anchors and small head chunks: the step's compute is not what is measured (on the CPU a
        # default step through a 152k-vocabulary head takes minutes and ~11 GB of logits chunks)
        "train.num_anchors": 16,
        "train.loss_chunk": 256,
        "train.max_steps": 2,
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.out_dir": run,
        "train.resume": "never",
    }
    overrides.update(extra_overrides)
    command = [sys.executable, "-m", "flashdraft", "train", *(f"{k}={v}" for k, v in overrides.items())]
    caches = {
        "TORCHINDUCTOR_CACHE_DIR": str(compile_cache),
        "TRITON_CACHE_DIR": str(compile_cache / "triton"),
    }
    _evict(shards)
    started = time.perf_counter()
    # The child's output goes to a file: a pipe read only at the end would fill and stall a chatty run.
    log = root / "train.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, text=True, env={**os.environ, **caches}
        )
        metrics, first_step, peak = run / "metrics.jsonl", None, 0.0
        while process.poll() is None:
            peak = max(peak, _peak_rss_gb(process.pid))
            if first_step is None and read_metrics(metrics, "train"):
                first_step = time.perf_counter() - started
            time.sleep(0.05)
    output = log.read_text()
    if process.returncode != 0:
        raise SystemExit(
            f"flashdraft bench data: flashdraft train failed (exit {process.returncode}):\n{output[-3000:]}"
        )
    if first_step is None:  # the run ended between two polls
        first_step = time.perf_counter() - started
    head = [line for line in output.splitlines() if line.startswith("training ")][:1]
    set_up = SET_UP.search(head[0]) if head else None
    row = read_metrics(metrics, "train")[0]  # step 1: a compiling step is booked as compile time
    step_s = 60 * (row["compile_minutes"] + row["train_minutes"])
    parts = {"set_up_s": float(set_up.group(1)) if set_up else None, "first_step_s": round(step_s, 2)}
    if set_up:
        parts["before_set_up_s"] = round(first_step - parts["set_up_s"] - step_s, 2)
    return {
        "command": "flashdraft train " + " ".join(f"{k}={v}" for k, v in overrides.items()),
        "to_first_step_s": round(first_step, 2),
        **parts,
        "peak_rss_GB": round(peak, 3),
        "log_head": head,
        "compiled": [line for line in output.splitlines() if COMPILED.match(line)],
        # each graph's compile stages (dynamo, AOT autograd, inductor, code generation, Triton), per step
        "compile_stages": [row["graphs"] for row in read_metrics(metrics, "compile")],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashdraft bench data")
    parser.add_argument("--samples", type=int, default=800_000)
    parser.add_argument("--mean-length", type=int, default=1250, help="mean tokens a sample")
    parser.add_argument("--dir", default=None, help="where to write the set (default: a temporary dir)")
    parser.add_argument("--keep", action="store_true", help="keep the set afterwards (and reuse it if there)")
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank batch")
    parser.add_argument("--world-size", type=int, default=8, help="ranks the global batch is split over")
    parser.add_argument("--max-length", type=int, default=3072)
    parser.add_argument("--calls", type=int, default=2000, help="sampler calls timed")
    parser.add_argument("--train", action="store_true", help="also time `flashdraft train` on the set")
    parser.add_argument(
        "--train-target", default=None, help="with --train: the target (default: a small random one)"
    )
    parser.add_argument(
        "--drafter-layers",
        type=int,
        default=DEFAULT_NUM_LAYERS,
        help=f"with --train: the drafter's layers (default {DEFAULT_NUM_LAYERS}, a new drafter's default)",
    )
    parser.add_argument(
        "--train-target-shape",
        choices=TARGET_SHAPES,
        default=None,
        help="with --train: a random bf16 target of this model's shape, written under --dir (the widths "
        "the compiles and kernels see; the default is a small random target)",
    )
    parser.add_argument(
        "--target-layers", type=int, default=None, help="with --train-target-shape: fewer target layers"
    )
    parser.add_argument(
        "--train-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --train: one more `flashdraft train` override (repeatable), over the bench's own, "
        "e.g. train.precision=fp8",
    )
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the measuring child process
    args = parser.parse_args(argv)
    if args.train_target and args.train_target_shape:
        parser.error("--train-target and --train-target-shape name two targets: give one")
    if args.target_layers is not None and not args.train_target_shape:
        parser.error("--target-layers cuts the target of --train-target-shape: give that too")
    extra_overrides = _train_overrides(args.train_override)  # refused before the set is written
    if args.measure:
        result = measure(Path(args.measure), args.batch_size, args.world_size, args.max_length, args.calls)
        print(json.dumps(result))
        return 0

    from flashdraft.bench.provenance import provenance
    from flashdraft.data.shards import write_shards

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="flashdraft-bench-data-"))
    root.mkdir(parents=True, exist_ok=True)
    shards = root / "shards"
    need = args.samples * args.mean_length * 5.1
    if not (shards / "manifest.json").is_file():
        free = shutil.disk_usage(root).free
        if free < need * 1.2:
            print(f"flashdraft bench data: {need / 1e9:.1f} GB needed in {root}, {free / 1e9:.1f} GB free")
            return 2
        started = time.perf_counter()
        write_shards(
            shards, synthetic_samples(args.samples, args.mean_length), {"tokenizer_name": "synthetic"}
        )
        write_s = time.perf_counter() - started
    else:
        write_s = None  # reused
    manifest = json.loads((shards / "manifest.json").read_text())
    on_disk = sum(p.stat().st_size for p in shards.iterdir())
    child = subprocess.run(
        [sys.executable, "-m", "flashdraft.bench.data_bench", "--measure", str(shards), *(argv or [])],
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        print(child.stderr[-3000:])
        return 1
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    trained = None
    if args.train:
        # Twice: the first start pays torch.compile with empty caches (a fresh machine, a new torch: its own
        # empty cache directories, whatever ran on this machine before); the second finds its graphs in
        # them, as a user's next launch on that machine does.
        compile_cache = root / "compile-cache"
        shutil.rmtree(compile_cache, ignore_errors=True)
        trained = time_train(shards, root, args.train_target, args, compile_cache, extra_overrides)
        second = time_train(shards, root, args.train_target, args, compile_cache, extra_overrides)
        trained["second_start"] = {k: v for k, v in second.items() if k != "command"}
    result = {
        **provenance("data", argv),
        "set": {
            "samples": manifest["samples"],
            "tokens": manifest["tokens"],
            "shards": len(manifest["shards"]),
            "bytes_on_disk": on_disk,
            "bytes_per_token": round(on_disk / manifest["tokens"], 3),
            "write_s": None if write_s is None else round(write_s, 1),
        },
        "rank": {"batch_size": args.batch_size, "world_size": args.world_size, "max_length": args.max_length},
        "measured": measured,
        "train": trained,
        "targets": {"to_first_batch_s": 30, "to_first_step_s": 30, "peak_rss_GB": 4},
        "meets_targets": measured["to_first_batch_s"] <= 30
        and measured["peak_rss_GB"] <= 4
        and (trained is None or (trained["to_first_step_s"] <= 30 and trained["peak_rss_GB"] <= 4)),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        atomic_write_json(args.out, result)
    if not args.keep and not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    elif not args.keep:
        shutil.rmtree(shards, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
