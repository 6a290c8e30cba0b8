"""Drafter commands: `eval` (real speculative decoding against plain decoding) and `export` (the layout
vLLM, SGLang or z-lab's code loads). Both take a drafter directory or a training run's directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from flashdraft.cli.flags import (
    add_threads_flag,
    check_target,
    device_is_well_formed,
    flags_from,
    settings_from,
    start_models,
    threads_of,
)
from flashdraft.config import FORCE_HELP, EvalSettings, check_eval_settings
from flashdraft.errors import FlashdraftError
from flashdraft.model.locate import find_drafter

DRAFTER_HELP = (
    "drafter directory (config.json + model.safetensors), or a training run's directory: its best/, "
    "else its newest checkpoints/step-N/drafter/"
)


def _fp32_only(text: str) -> str:
    if text != "fp32":
        raise argparse.ArgumentTypeError(
            f"the only value is fp32 (rerun diverged prompts in fp32), got {text!r}"
        )
    return text


def _drafter(path: str, label: str) -> Path:
    drafter, why = find_drafter(path, label)
    if why is not None:
        print(f"{label} {path}: using {why}", flush=True)
    return drafter


def cmd_eval(args: argparse.Namespace) -> int:
    settings = settings_from(args, EvalSettings, check_lossless=args.check_lossless)
    check_eval_settings(settings)  # the flags first, then the paths
    if not device_is_well_formed(args.device):  # infer/evaluate.py's wording
        raise FlashdraftError(f"--device {args.device}: not a device (use auto, cpu, cuda or cuda:N)")
    check_target(args.target)
    drafter = _drafter(args.drafter, "--drafter")
    if not Path(args.prompts).exists():  # data/sources.py's wording, before torch loads
        raise FlashdraftError(f"{args.prompts}: no such file")
    start_models(threads_of(args), args.device, "flashdraft.infer.evaluate")
    from flashdraft.infer.evaluate import run_eval

    run_eval(
        args.target,
        str(drafter),
        args.prompts,
        settings,
        device=args.device,
        out=args.out,
        plot_path=args.plot,
        force=args.force,
        threads=threads_of(args),
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.to == "vllm" and args.target is None:  # the wording of model/export.py, said before torch loads
        raise FlashdraftError(
            "--to vllm needs --target: the speculators layout records the verifier (its path or hub id) "
            "and its architecture"
        )
    drafter = _drafter(args.drafter, "DRAFTER")
    from flashdraft.progress import phase

    with phase("loading torch and transformers"):
        from flashdraft.hf_startup import prepare_transformers

        prepare_transformers()
        from flashdraft.model.export import export_drafter

    with phase(f"exporting {drafter} for {args.to} to {args.out}"):
        command = export_drafter(
            drafter,
            args.to,
            args.out,
            target=args.target,
            force=args.force,
            allow_sliding_window=args.allow_sliding_window,
        )
    print(f"wrote the {args.to} export of {drafter} to {args.out}; serve it with:\n  {command}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="speculative decoding: τ, per-position acceptance, speedup, losslessness",
        description="Decode --prompts with the target alone and with the drafter through the same loop: "
        "τ (tokens per target step), per-position acceptance, speedup, and whether outputs are identical.",
    )
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--drafter", required=True, help=DRAFTER_HELP)
    p.add_argument(
        "--prompts", required=True, help="JSONL of messages / conversations / prompt / input_ids records"
    )
    flags_from(p, EvalSettings)
    p.add_argument(
        "--check-lossless",
        nargs="?",
        const=True,
        default=False,
        type=_fp32_only,
        metavar="fp32",
        help=EvalSettings.__dataclass_fields__["check_lossless"].metadata["help"],
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--out", default=None, help="write the report as JSON (a file path)")
    p.add_argument(
        "--plot", default=None, help="write a PNG of per-position acceptance and the length histogram"
    )
    p.add_argument(
        "--force", action="store_true", help="overwrite --out / --plot files flashdraft did not write"
    )
    add_threads_flag(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write a drafter in the layout vLLM, SGLang or z-lab's code loads")
    p.add_argument("drafter", metavar="DRAFTER", help=DRAFTER_HELP)
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
