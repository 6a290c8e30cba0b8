"""The `flashdraft` command: parses arguments, then calls one function per subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from flashdraft.errors import FlashdraftError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_init(args: argparse.Namespace) -> int:
    from flashdraft.model.checkpoint import init_drafter

    layer_types = None
    if args.sliding_window is not None:
        n_sliding = args.num_layers - 1 if args.sliding_layers is None else args.sliding_layers
        layer_types = ["sliding_attention"] * n_sliding + ["full_attention"] * (args.num_layers - n_sliding)
    out = init_drafter(
        args.target,
        args.out,
        num_layers=args.num_layers,
        block_size=args.block_size,
        target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id,
        layer_types=layer_types,
        sliding_window=args.sliding_window,
        seed=args.seed,
    )
    from flashdraft.model.checkpoint import read_config
    from flashdraft.model.spec import DFlashSpec

    spec = DFlashSpec.from_config(read_config(out))
    print(
        f"wrote drafter {out}: {args.num_layers} layers, block {spec.block_size}, "
        f"target_layer_ids {list(spec.target_layer_ids)}, mask_token_id {spec.mask_token_id}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path:  # no file given: the first word is already an override
        path, overrides = None, [path, *overrides]
    config = load_config(path, overrides)
    train(config)
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from flashdraft.bench.quickstart import quickstart

    quickstart(args.out, steps=args.steps)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from flashdraft.infer.evaluate import EvalSettings, run_eval

    settings = EvalSettings(block_size=args.block_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, thinking=args.thinking, check_lossless=args.check_lossless,
                            max_prompts=args.max_prompts, seed=args.seed)
    run_eval(args.target, args.drafter, args.prompts, settings, device=args.device, out=args.out, plot_path=args.plot)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "train":
        from flashdraft.bench.train_bench import main as bench_train

        return bench_train(args.rest)
    raise FlashdraftError(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("quickstart", help="build a tiny target, train a drafter on it end to end, report")
    p.add_argument("--out", default="runs/quickstart", help="output directory")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser("init", help="create a new drafter directory for a target")
    p.add_argument("--target", required=True, help="local Hugging Face model directory of the target")
    p.add_argument("--out", required=True, help="drafter directory to write")
    p.add_argument("--num-layers", type=int, default=5, help="drafter decoder layers (paper: 5)")
    p.add_argument("--block-size", type=int, default=16, help="block size B (paper: 16 for Qwen3)")
    p.add_argument("--target-layer-ids", type=_int_list, default=None, help="e.g. 1,9,17,25,33 (default: the paper's rule)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask token id (default: from the tokenizer)")
    p.add_argument("--sliding-window", type=int, default=None, help="make the first layers sliding-window layers")
    p.add_argument("--sliding-layers", type=int, default=None, help="how many leading layers slide (default: all but the last)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("train", help="train a drafter: flashdraft train CONFIG [key=value ...]")
    p.add_argument("config", nargs="?", default=None, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="speculative decoding: τ, per-position acceptance, speedup, losslessness")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--drafter", required=True, help="drafter directory")
    p.add_argument("--prompts", required=True, help="JSONL of messages / conversations / prompt / input_ids records")
    p.add_argument("--block-size", type=int, default=None, help="verify block size (default: the drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--thinking", choices=["on", "off"], default=None, help="chat template thinking switch (Qwen3)")
    p.add_argument("--check-lossless", action="store_true", help="also report where greedy outputs diverge")
    p.add_argument("--max-prompts", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="write the report as JSON")
    p.add_argument("--plot", default=None, help="write a PNG of per-position acceptance and the length histogram")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("bench", help="benchmarks: flashdraft bench train [--shape a|b ...]")
    p.add_argument("what", choices=["train"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars are noise in run logs
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except FlashdraftError as exc:
        print(f"flashdraft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
