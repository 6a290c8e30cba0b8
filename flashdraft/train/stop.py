"""A graceful stop: SIGTERM (what `flashdraft stop` and torchrun send) asks the run to stop after the step,
or the held-out evaluation batch, in flight; the trainer then writes a checkpoint and exits cleanly."""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """Set by SIGTERM (installed from the main thread only: signal handlers cannot be set elsewhere)."""

    def __init__(self) -> None:
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, _frame) -> None:
        print(
            f"received {signal.Signals(signum).name}: stopping after the step or evaluation batch in flight, "
            "with a checkpoint",
            flush=True,
        )
        self.requested = True
