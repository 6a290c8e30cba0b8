"""`flashdraft` with a fault patched in, for the trainer tests that need a separate process (a SIGKILL,
or several ranks under torchrun). Production code carries no fault hooks.

    python -m tests.train.inject FAULT [FAULT ...] -- train [key=value ...]

Faults: `kill-after-log@N` (SIGKILL once the metrics of step N are logged), `inf-loss@N:R` (the loss of step N on rank R reads inf while its
gradients stay finite: only an agreement across ranks makes every rank skip that step).
"""

from __future__ import annotations

import os
import signal
import sys

import torch


def _at(spec: str) -> tuple[int, int | None]:
    step, _, rank = spec.partition(":")
    return int(step), (int(rank) if rank else None)


def install(fault: str) -> None:
    from flashdraft.train import metrics
    from flashdraft.train.objective import Objective

    what, _, where = fault.partition("@")
    step, rank = _at(where)
    if what == "kill-after-log":
        real_log = metrics.MetricsLogger.log

        def log_then_kill(self, at, values, kind="train"):
            real_log(self, at, values, kind)
            if at == step and kind == "train":
                os.kill(os.getpid(), signal.SIGKILL)

        metrics.MetricsLogger.log = log_then_kill
    elif what == "inf-loss":
        real_call = Objective.__call__
        calls = {"n": 0}  # one objective call per optimizer step (grad_accum 1)

        def call(self, *args, **kwargs):
            out = real_call(self, *args, **kwargs)
            calls["n"] += 1
            if calls["n"] == step and (rank is None or rank == int(os.environ.get("RANK", "0"))):
                out.loss_sum = out.loss_sum + torch.tensor(float("inf"))  # d/dx (x + c) = 1: finite grads
            return out

        Objective.__call__ = call
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def main(argv: list[str]) -> int:
    split = argv.index("--")
    for fault in argv[:split]:
        install(fault)
    from flashdraft.cli import main as flashdraft_main

    return flashdraft_main(argv[split + 1 :])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
