"""How many CPU threads a command runs its model with.

torch's default intra-op count is every core of the host, whatever the process may use; on a small,
shared machine those threads spin against each other (issue 29 measured 12.9 tokens/s with one thread
and 0.9 with two on a 2-core host whose other core was busy). So the count comes from the cores this
process may run on, and `--threads N` overrides it. No torch import at module import.
"""

from __future__ import annotations

import os

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def available_cpus() -> int:
    """The cores in this process's affinity mask, at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def configure_threads(requested: int | None, device: str) -> int:
    """Set torch's intra-op thread count for a command running its model on `device` (and the same in
    OMP_NUM_THREADS / MKL_NUM_THREADS for its child processes); returns it. `requested` (`--threads N`)
    overrides the choice; on a GPU the count is left to torch unless requested."""
    if requested is not None and requested < 1:
        from flashdraft.errors import FlashdraftError

        raise FlashdraftError(f"--threads {requested}: expected a whole number of at least 1")
    import torch

    if requested is None and not str(device).startswith("cpu"):
        return torch.get_num_threads()
    threads = requested if requested is not None else available_cpus()
    torch.set_num_threads(threads)
    for name in THREAD_ENV_VARS:
        os.environ[name] = str(threads)
    return threads
