"""Fault injection for the supervision tests; it lives with the tests, flashdraft knows nothing of it.

FLASHDRAFT_TEST_FAULT selects one fault:

    kill@N | raise@N | hang@N | oom@N   at the heartbeat of training step N (`:R` for rank R only)
    diskfull@N                          fill the run directory's filesystem as step N's checkpoint begins
    supervisor-dies                     the supervisor exits at start-up, before it reads anything
    kill-after-log@N                    SIGKILL once the metrics of step N are logged
    inf-loss@N[:R]                      the loss of step N (on rank R) reads inf while its gradients stay
                                        finite: only an agreement across ranks makes every rank skip it
    slow-start@S                        the job waits S seconds before it reports its first phase past
                                        start-up (a launcher is still waiting for it meanwhile)

Step faults wrap `flashdraft.run_protocol.Heartbeat.beat`, which the trainer calls with `step=` after
every optimizer step and with phase "checkpointing" before each checkpoint.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

FAULT_ENV = "FLASHDRAFT_TEST_FAULT"
FILLER_NAME = "disk-filler"


def fill_filesystem(directory: str) -> None:
    """Write a file in `directory` until its filesystem has no byte left (a real ENOSPC for what follows)."""
    with open(os.path.join(directory, FILLER_NAME), "wb", buffering=0) as handle:
        for chunk in (2**20, 2**12, 1):
            try:
                while True:
                    handle.write(b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


def _trigger(what: str, step: int) -> None:
    print(f"test fault: {what} at step {step}", file=sys.stderr, flush=True)
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "raise":
        raise RuntimeError(f"injected failure at step {step}")
    if what == "hang":
        while True:
            time.sleep(1)
    if what == "oom":
        import torch

        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 20.00 GiB (injected at step {step}). "
            "GPU 0 has a total capacity of 139.80 GiB"
        )
    raise ValueError(f"{FAULT_ENV}: unknown fault {what!r}")


def _kill_after_log(step_at: int) -> None:
    from flashdraft.train import metrics

    real_log = metrics.MetricsLogger.log

    def log_then_kill(self, at, values, kind="train"):
        real_log(self, at, values, kind)
        if at == step_at and kind == "train":
            os.kill(os.getpid(), signal.SIGKILL)

    metrics.MetricsLogger.log = log_then_kill


def _inf_loss(step_at: int, rank_at: int | None) -> None:
    import torch

    from flashdraft.train.objective import Objective

    real_call = Objective.__call__
    calls = {"n": 0}  # one objective call per optimizer step (grad_accum 1)

    def call(self, *args, **kwargs):
        out = real_call(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == step_at and rank_at in (None, int(os.environ.get("RANK", "0"))):
            out.loss_sum = out.loss_sum + torch.tensor(float("inf"))  # d/dx (x + c) = 1: finite grads
        return out

    Objective.__call__ = call


def _slow_start(seconds: float) -> None:
    from flashdraft.run.launcher import UP_PHASES
    from flashdraft.run_protocol import Heartbeat

    beat, slept = Heartbeat.beat, []

    def slow_beat(self, phase=None, force=False, **fields):
        if phase in UP_PHASES and not slept:
            slept.append(True)
            time.sleep(seconds)
        beat(self, phase, force, **fields)

    Heartbeat.beat = slow_beat


def install() -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec == "supervisor-dies":
        if "flashdraft.run.supervisor" in " ".join(sys.orig_argv):
            print("test fault: the supervisor dies at start-up", file=sys.stderr, flush=True)
            os._exit(3)
        return
    if "@" not in spec:
        return
    what, at = spec.split("@", 1)
    if what == "slow-start":
        _slow_start(float(at))
        return
    at, _, only_rank = at.partition(":")
    step_at, rank_at = int(at), int(only_rank) if only_rank else None
    if what == "kill-after-log":
        _kill_after_log(step_at)
        return
    if what == "inf-loss":
        _inf_loss(step_at, rank_at)
        return

    from flashdraft.run_protocol import Heartbeat

    beat = Heartbeat.beat

    def faulty_beat(self, phase=None, force=False, **fields):
        beat(self, phase, force, **fields)
        if self.state.get("step") != step_at or rank_at not in (None, self.state.get("rank")):
            return
        if what == "diskfull":
            if phase == "checkpointing" and self.dir is not None:
                fill_filesystem(str(self.dir.parent))
        elif "step" in fields:
            beat(
                self, force=True
            )  # the heartbeat file shows the step the fault fired at (beats are throttled)
            _trigger(what, step_at)

    Heartbeat.beat = faulty_beat
