"""Run commands: `status`, `logs`, `stop` of launched runs, and `doctor` (preflight checks)."""

from __future__ import annotations

import argparse

from flashdraft.cli.flags import split_config
from flashdraft.config import load_config

RUNS_HELP = "runs directory (default $FLASHDRAFT_RUNS_DIR or ./runs)"


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
    path, overrides = split_config(args.config, args.overrides)
    config = load_config(path, overrides)  # config errors before the checks import torch
    from flashdraft.hf_startup import prepare_transformers

    prepare_transformers()
    from flashdraft.run.doctor import print_checks, run_checks

    return print_checks(run_checks(config, quick=args.quick))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="state, progress and diagnosis of all runs, or of one")
    p.add_argument("run", nargs="?", default=None, help="run name (a unique prefix is enough) or directory")
    p.add_argument("--runs-dir", default=None, help=RUNS_HELP)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="print (or follow) a run's log")
    p.add_argument("run")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--rank", type=int, default=None, help="one rank's log (torchrun runs)")
    p.add_argument("-n", "--lines", type=int, default=100)
    p.add_argument("--runs-dir", default=None, help=RUNS_HELP)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="stop a run gracefully (checkpoint, then exit)")
    p.add_argument("run")
    p.add_argument(
        "--force", action="store_true", help="SIGKILL the job if it has not stopped within --timeout"
    )
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--runs-dir", default=None, help=RUNS_HELP)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("doctor", help="preflight checks for a config, each with its fix")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--quick", action="store_true", help="skip the GPU compile check")
    p.set_defaults(func=cmd_doctor)
