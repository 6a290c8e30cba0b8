"""The `flashdraft` command: builds the parser from the command groups' modules, then runs one command.

Groups: data.py (convert, prepare, inspect, convert-shards), train.py (config, init, train, launch),
run.py (status, logs, stop, doctor), eval.py (eval, export), bench.py (quickstart, bench); flags.py makes
flags from the settings dataclasses of flashdraft/config.py. Nothing outside this package imports it,
and nothing here imports torch or transformers before a command's arguments and paths are checked.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable

from flashdraft.cli import bench, data, run, train
from flashdraft.cli import eval as evaluation
from flashdraft.cli.flags import THREADS_HELP, close_flag_hint, positive_int, split_config
from flashdraft.errors import FlashdraftError

__all__ = ["build_parser", "main"]

_split_config = split_config  # the name tests/test_cli.py imports

DESCRIPTION = """\
Train a DFlash drafter for a Hugging Face causal LM, so that speculative decoding (vLLM, SGLang or
z-lab's code) runs it faster with identical outputs. First time: `flashdraft quickstart` runs the whole
path on a tiny local model in about two minutes on a CPU."""

EPILOG = """\
the usual order, for your own model (README.md walks through it):
  flashdraft convert MODEL.gguf --out DIR     only for a GGUF (llama.cpp) model
  flashdraft prepare CHATS.jsonl --target DIR --out SHARDS --regenerate
  flashdraft config --target DIR --data SHARDS --out my.yaml
  flashdraft launch my.yaml                   then: status, logs RUN -f, stop RUN
  flashdraft eval --target DIR --drafter RUN_DIR --prompts HELD_OUT.jsonl
  flashdraft export RUN_DIR --to vllm --target DIR --out DIR

A run's drafter is in RUN_DIR/best/ (best held-out τ) and RUN_DIR/checkpoints/step-N/drafter/.
`flashdraft COMMAND --help` gives a command's flags; `flashdraft --help-config` every config key."""


class _HelpConfig(argparse.Action):
    """`flashdraft --help-config`: the documented config tree, then exit (as --help does)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(train.config_tree_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashdraft",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--help-config", action=_HelpConfig, help="print every config key, its default and its help"
    )
    parser.add_argument(
        "--threads", dest="global_threads", type=positive_int, default=None, metavar="N", help=THREADS_HELP
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    bench.register_quickstart(sub)
    data.register(sub)
    train.register(sub)
    run.register(sub)
    evaluation.register(sub)
    bench.register(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`launch cfg.yaml --env A=1 train.lr=1e-4`): argparse leaves them over.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        hint = close_flag_hint(extra[0], _command_parser(parser, args.command))
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if args.global_threads is not None and not (
        hasattr(args, "threads") or getattr(args, "takes_threads", 0)
    ):
        parser.error(f"argument --threads: `flashdraft {args.command}` runs no model")
    args.command_line = "flashdraft " + " ".join(sys.argv[1:] if argv is None else argv)
    # from the command line this call is the whole process, so its start-up is this command's to report
    args.own_process = argv is None
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
    except FlashdraftError as exc:
        print(f"flashdraft: error: {exc}", file=sys.stderr)
        code = 2
    if args.own_process and args.command in QUICK_EXIT:
        exit_without_teardown(code)
    return code


# Commands whose process ends without the interpreter's teardown once their work is done and written:
# unloading torch and transformers took 6-17 s on the busy 2-core machine (0.4 s without it), a silent
# wait after the last line (docs/newcomer-walk.md). `train` returns after its checkpoint writer finished and
# its process group was destroyed; skipping the teardown also keeps a gloo group that torch still holds (its
# functional collectives keep references) from being freed during interpreter exit, where a rank can abort
# (docs/distributed.md, "Shutting down"). Not `quickstart` and `bench`: they run a trainer in-process.
QUICK_EXIT = frozenset(
    {"convert", "prepare", "config", "init", "inspect", "eval", "export", "doctor", "launch", "train"}
)


def exit_without_teardown(code: int) -> None:
    """Flush, run the atexit handlers (multiprocessing's, weakref finalizers: temporary directories), then
    end the process at once, skipping the module teardown; does nothing while a non-daemon thread still
    runs (normal exit waits for it)."""
    import atexit
    import os
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
