"""Training commands: `config` (a starter config for a target), `init` (a new drafter), `train` (in this
process) and `launch` (detached and supervised)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

from flashdraft.cli.flags import (
    THREADS_ENV,
    add_threads_flag,
    check_target,
    flags_from,
    non_negative_int,
    settings_from,
    split_config,
    start_models,
    threads_of,
)
from flashdraft.config import Config, InitSettings, describe, load_config
from flashdraft.errors import FlashdraftError
from flashdraft.run_protocol import RUN_DIR_ENV

RUNS_HELP = "runs directory (default $FLASHDRAFT_RUNS_DIR or ./runs)"


def config_tree_text() -> str:
    """Every config key with its default and help: what `--help-config` prints."""
    lines = ["Config keys (YAML sections, or dotted key=value overrides), with their defaults:", ""]
    section = None
    for key, default, help_text in describe(Config):
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            lines.append(f"{section}:")
        lines.append(f"  {key} = {default}")
        lines += textwrap.wrap(help_text, 100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _check_data_paths(config: Config) -> None:
    for path in [*config.data.train, *config.data.eval]:  # data/tokens.py's wording, before torch loads
        if not Path(path).exists():
            raise FlashdraftError(f"data {path}: no such file or directory")


def _init_shape(settings: InitSettings) -> tuple[int, int | None]:
    """(layer count, how many of them slide) from the flags, refusing contradictions before any import."""
    layer_count = None
    if settings.layer_types is not None:
        if settings.sliding_layers is not None:
            raise FlashdraftError("--layer-types and --sliding-layers both say which layers slide; give one")
        layer_count = len(settings.layer_types.split(","))
        if settings.num_layers is not None and settings.num_layers != layer_count:
            raise FlashdraftError(
                f"--layer-types has {layer_count} entries but --num-layers is {settings.num_layers}"
            )
    num_layers = layer_count or (5 if settings.num_layers is None else settings.num_layers)
    if settings.sliding_layers is not None and settings.sliding_window is None:
        raise FlashdraftError("--sliding-layers needs --sliding-window (the window those layers use)")
    if settings.sliding_layers is not None and settings.sliding_layers > num_layers:
        raise FlashdraftError(
            f"--sliding-layers {settings.sliding_layers} is more than --num-layers {num_layers}"
        )
    return num_layers, settings.sliding_layers


def _init_from(args: argparse.Namespace, settings: InitSettings) -> int:
    """`init --from DRAFTER`: a copy of an existing drafter for --target, or (--arch dflash2) its graft."""
    shape = {
        "--num-layers": settings.num_layers,
        "--layer-types": settings.layer_types,
        "--target-layer-ids": settings.target_layer_ids,
        "--mask-token-id": settings.mask_token_id,
        "--sliding-window": settings.sliding_window,
        "--sliding-layers": settings.sliding_layers,
        "--block-size": None if settings.block_size == InitSettings.block_size else settings.block_size,
    }
    given = [flag for flag, value in shape.items() if value is not None]
    if given:
        raise FlashdraftError(
            f"init --from {args.from_drafter}: {', '.join(given)} describe a new drafter; the one given with "
            "--from fixes its shape (drop them)"
        )
    check_target(args.target)
    from flashdraft.hf_startup import prepare_transformers

    prepare_transformers()
    from flashdraft.model.drafter_dir import init_from_drafter, read_config
    from flashdraft.model.spec import DFlashSpec

    arch = None if settings.arch == InitSettings.arch else settings.arch
    out = init_from_drafter(
        args.target, args.from_drafter, args.out, arch=arch, seed=settings.seed, force=settings.force
    )
    spec = DFlashSpec.from_config(read_config(out))
    how = "grafted onto dflash2 (identity convolutions)" if arch else "copied"
    print(
        f"wrote {spec.arch} drafter {out} from {args.from_drafter} ({how}): block {spec.block_size}, "
        f"target_layer_ids {list(spec.target_layer_ids)}; fine-tune it with model.drafter={out}"
    )
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    settings = settings_from(args, InitSettings)
    if args.from_drafter is not None:
        return _init_from(args, settings)
    num_layers, sliding_layers = _init_shape(settings)
    check_target(args.target)
    from flashdraft.hf_startup import prepare_transformers

    prepare_transformers()
    from flashdraft.model.drafter_dir import init_drafter, read_config
    from flashdraft.model.spec import DEFAULT_SLIDING_WINDOW, DFlashSpec, parse_layer_types

    layer_types = None
    if settings.layer_types is not None:
        layer_types = parse_layer_types(settings.layer_types.split(","), "--layer-types")
    if settings.sliding_window is not None and layer_types is None:
        n_sliding = num_layers - 1 if sliding_layers is None else sliding_layers
        layer_types = ["sliding_attention"] * n_sliding + ["full_attention"] * (num_layers - n_sliding)
    sliding_window = settings.sliding_window
    if sliding_window is None and layer_types is not None and "sliding_attention" in layer_types:
        sliding_window = DEFAULT_SLIDING_WINDOW
    out = init_drafter(
        args.target,
        args.out,
        num_layers=num_layers,
        block_size=settings.block_size,
        target_layer_ids=settings.target_layer_ids,
        mask_token_id=settings.mask_token_id,
        layer_types=layer_types,
        sliding_window=sliding_window,
        arch=settings.arch,
        seed=settings.seed,
        force=settings.force,
    )
    spec = DFlashSpec.from_config(read_config(out))
    print(
        f"wrote {settings.arch} drafter {out}: {num_layers} layers, block {spec.block_size}, "
        f"target_layer_ids {list(spec.target_layer_ids)}, mask_token_id {spec.mask_token_id}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    path, overrides = split_config(args.config, args.overrides)
    # In a launched run (launch checked the config and ran the doctor) the job reports every error itself,
    # in error.json and final.json for status to read: there the checks below are left to it.
    launched = bool(os.environ.get(RUN_DIR_ENV))
    try:
        config = load_config(path, overrides)  # config errors before the heavy stack loads
    except FlashdraftError:
        if not launched:
            raise
        config = None
    if config is not None and not launched:
        if config.model.target:
            check_target(config.model.target)
        _check_data_paths(config)
    start_models(
        threads_of(args), config.train.device if config is not None else "auto", "flashdraft.train.job"
    )
    from flashdraft.train.job import run_job

    run_job(path, overrides)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from flashdraft.progress import phase

    with phase("loading the launcher"):  # its imports alone took 15 s on a busy machine
        from flashdraft.run.launcher import check_nodes, launch

    path, overrides = split_config(args.config, args.overrides)
    nodes = check_nodes(
        args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint, args.join_timeout, args.rdzv_id
    )
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
    threads = threads_of(args)
    if threads is not None:  # the job's `flashdraft train` reads it; OMP_*: any other process it starts
        for name in (THREADS_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(name, str(threads))
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


def cmd_config(args: argparse.Namespace) -> int:
    if args.describe:
        print(config_tree_text())
        return 0
    if args.target is None:
        raise FlashdraftError(
            "config: give --target DIR (the model to draft for), or --describe for every config key"
        )
    check_target(args.target)
    if args.out is not None:
        from flashdraft.outputs import check_output_file

        check_output_file(args.out, "--out", force=args.force, inputs={"--target": args.target})
    from flashdraft.progress import phase

    # transformers and the target's config and tokenizer: tens of seconds on a busy machine
    with phase(f"reading the target {args.target}"):
        from flashdraft.hf_startup import prepare_transformers

        prepare_transformers()
        if args.machine == "auto":
            import torch

            gpu = torch.cuda.is_available()
        else:
            gpu = args.machine == "gpu"
        from flashdraft.train.starter_config import starter_config, write_starter

        name = Path(args.target).name.removesuffix(".gguf") or "target"
        text = starter_config(
            args.target,
            data=args.data or f"data/{name}-shards",
            eval_data=args.eval_data,
            out_dir=args.out_dir or f"runs/{name}",
            gpu=gpu,
            mask_token_id=args.mask_token_id,
        )
    if args.out is None:
        sys.stdout.write(text)
        return 0
    write_starter(text, args.out, force=args.force)
    print(
        f"wrote {args.out}: a starter config for {args.target}, sized for {'a GPU' if gpu else 'the CPU'}; "
        f"check it, then: flashdraft launch {args.out}"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """The commands of the training group: config, init, train, launch."""
    _register_config(sub)
    _register_init(sub)
    _register_train(sub)
    _register_launch(sub)


def _register_config(sub: argparse._SubParsersAction) -> None:
    """`flashdraft config`: a starter config for the user's own target."""
    p = sub.add_parser(
        "config",
        help="write a commented starter config for your own target, sized for this machine",
        description="A starter YAML config for --target: the drafter's shape from the target (its layer "
        "count, its mask token), sizes for this machine's GPU or CPU, every key commented. "
        "--describe lists every config key instead.",
    )
    p.add_argument(
        "--target", default=None, help="local Hugging Face model directory (or .gguf) to draft for"
    )
    p.add_argument("--out", default=None, help="YAML file to write (default: print it)")
    p.add_argument(
        "--data", default=None, help="training shards, made by flashdraft prepare (default data/NAME-shards)"
    )
    p.add_argument(
        "--eval-data", default=None, help="held-out shards: turns on evaluation and the best/ drafter"
    )
    p.add_argument("--out-dir", default=None, help="train.out_dir for `flashdraft train` (default runs/NAME)")
    p.add_argument(
        "--machine",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="size the config for a GPU or the CPU (auto: whether a CUDA GPU is visible here)",
    )
    p.add_argument(
        "--mask-token-id",
        type=non_negative_int,
        default=None,
        help="mask token id (default: from the tokenizer)",
    )
    p.add_argument("--describe", action="store_true", help="print every config key, its default and its help")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=cmd_config)


def _register_init(sub: argparse._SubParsersAction) -> None:
    """`flashdraft init`: a new drafter directory."""
    p = sub.add_parser(
        "init",
        help="create a new drafter directory for a target",
        description="A new, untrained drafter directory for --target (train and launch make one "
        "themselves; init is for choosing its shape by hand or warm-starting).",
    )
    p.add_argument("--target", required=True, help="local Hugging Face model directory of the target")
    p.add_argument("--out", required=True, help="drafter directory to write")
    p.add_argument(
        "--from",
        dest="from_drafter",
        default=None,
        metavar="DRAFTER",
        help="start from this drafter directory (ours or z-lab's) instead of random weights: checked against "
        "--target and copied, or with --arch dflash2 grafted onto DFlash2 (identity convolutions: it starts "
        "as the old drafter); then fine-tune it with model.drafter",
    )
    flags_from(p, InitSettings)
    p.set_defaults(func=cmd_init)


def _register_train(sub: argparse._SubParsersAction) -> None:
    """`flashdraft train`: training in this process."""
    p = sub.add_parser(
        "train",
        help="train a drafter in this process: flashdraft train CONFIG [key=value ...]",
        description="Train a drafter in this process (flashdraft launch runs the same detached).",
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    add_threads_flag(p)
    p.set_defaults(func=cmd_train)


def _register_launch(sub: argparse._SubParsersAction) -> None:
    """`flashdraft launch`: a detached, supervised run."""
    p = sub.add_parser(
        "launch", help="start a detached, supervised training run; returns once it is up or has failed"
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    p.add_argument("--runs-dir", default=None, help=RUNS_HELP)
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
        type=non_negative_int,
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
        "--join-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long the nodes wait for each other at start and for a lost node to come back before "
        "the run stops (multi-node runs; default 600)",
    )
    p.add_argument(
        "--rdzv-id",
        default=None,
        help="the rendezvous name, the same on every node (multi-node runs; default flashdraft)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN",
        help="continue a stopped, failed, killed or lost run in its own directory (its config, "
        "train.resume=auto, its log); key=value overrides still apply",
    )
    p.add_argument("--json", action="store_true")
    add_threads_flag(p)
    p.set_defaults(func=cmd_launch)
