"""PhaseClock's start-up phase (flashdraft/phases.py) never books more than the process has lived."""

from __future__ import annotations

import subprocess
import sys
import time


def test_start_up_is_no_longer_than_the_process_has_lived():
    """psutil's create_time can be up to 1 s early (the boot time in whole seconds); a child that reports
    its start-up at once must report less than the parent's own clock around it (plus /proc's 10 ms tick)."""
    code = "from flashdraft.phases import PhaseClock; print(PhaseClock(since_process_start=True).seconds['start-up'])"
    for _ in range(3):
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        lived = time.perf_counter() - started
        assert 0 <= float(out) <= lived + 0.02, (out, lived)
