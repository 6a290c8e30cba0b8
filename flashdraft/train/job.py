"""`flashdraft train` as a job: crash capture and a final record on every exit path it controls.

faulthandler dumps all threads' stacks on fatal signals and on SIGUSR1 (the supervisor's request when the
job stalls); an exception in any thread ends the process (instead of leaving a half-dead run); uncaught
exceptions are written to error.json, and final.json records the outcome and the count of skipped
non-finite steps (docs/run-files.md, docs/training-safety.md). Output is flushed line by line.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import traceback

from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.run_protocol import RESTART_COUNT_ENV, RUN_DIR_ENV, Heartbeat, global_rank


def _install_thread_hook(heartbeat: Heartbeat) -> None:
    def hook(args: threading.ExceptHookArgs) -> None:
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        print(
            f"uncaught exception in thread {args.thread.name if args.thread else '?'}:\n{text}",
            file=sys.stderr,
            flush=True,
        )
        heartbeat.error(args.exc_value, text)
        heartbeat.final("failed", reason=f"exception in thread: {args.exc_type.__name__}: {args.exc_value}")
        os._exit(1)

    threading.excepthook = hook


def _skipped(heartbeat: Heartbeat) -> dict[str, int]:
    """The trainer's count of skipped non-finite steps so far, as its heartbeat last reported it."""
    count = heartbeat.state.get("skipped_steps")
    return {} if count is None else {"skipped_steps": count}


def run_job(path: str | None, overrides: list[str]) -> dict:
    heartbeat = Heartbeat(os.environ.get(RUN_DIR_ENV), rank=global_rank())
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # The supervisor asks a stalled job for its stacks with SIGUSR1 (docs/run-files.md, "Stalls"): written
    # by faulthandler from the signal handler itself, so also when the main thread holds the GIL.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    _install_thread_hook(heartbeat)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    # torchrun's restart of the worker group (launch --max-restarts): this attempt's number, in every beat
    attempt = int(os.environ.get(RESTART_COUNT_ENV) or 0)
    heartbeat.state["attempt"] = attempt
    heartbeat.beat("starting", force=True)
    try:
        config = load_config(path, overrides)
        if attempt > 0 and config.train.resume != "auto":
            # a restarted attempt continues from the newest complete checkpoint, whatever the first asked
            print(
                f"restart {attempt}: train.resume={config.train.resume} -> auto (the newest complete checkpoint)",
                flush=True,
            )
            config.train.resume = "auto"
        if config.train.compile and config.distributed.mode != "split":
            # every rank of a colocated run compiles the drafter: start the compile workers before the
            # trainer's imports (seconds), which their own start-up then overlaps; a split run's target
            # ranks compile nothing, so there the trainer starts them once a rank knows its role
            from flashdraft.distributed.compile_workers import start_compile_workers
            from flashdraft.distributed.topology import resolve_device

            if resolve_device(config.train.device).type == "cuda":
                start_compile_workers()
        from flashdraft.train.trainer import train

        result = train(config, heartbeat=heartbeat)
    except FlashdraftError as exc:
        heartbeat.error(exc, "")
        heartbeat.final("failed", reason=str(exc), **_skipped(heartbeat))
        raise
    except BaseException as exc:
        heartbeat.error(exc, traceback.format_exc())
        heartbeat.final("failed", reason=f"{type(exc).__name__}: {exc}", **_skipped(heartbeat))
        raise
    heartbeat.final(result["outcome"], step=result["steps"], skipped_steps=result["skipped_steps"])
    return result
