"""How many CPU threads a command runs its model with (docs/cpu.md).

torch's default intra-op count is every core of the host, whatever the process may actually use: on a
2-core machine another job already keeps busy, two threads spin against each other and that job, and
generation falls from ~13 tokens/s to ~1 (docs/cpu.md has the measurements). So the count comes from the
cores this process may really use (its affinity mask and its cgroup's CPU quota), less the cores other
processes are keeping busy right now, and `--threads N` overrides it.

No torch import at module import: `available_cpus` serves the CLI before the heavy stack loads.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _cgroup_quota_cpus(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`), or
    None when there is none. The process's own cgroup is read first, then the mount's root (a container's
    own cgroup is usually mounted as the root)."""
    own: dict[str, str] = {}  # controller ("" for v2) -> path
    try:
        for line in proc_cgroup.read_text().splitlines():
            _id, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path.lstrip("/")
    except (OSError, ValueError):
        pass
    v2_dirs = [root / own[""]] if own.get("") else []
    v1_dirs = [root / "cpu" / own["cpu"]] if own.get("cpu") else []
    for directory in [*v2_dirs, root]:
        try:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else int(quota) / int(period)
    for directory in [*v1_dirs, root / "cpu", root / "cpu,cpuacct"]:
        try:
            quota_us = int((directory / "cpu.cfs_quota_us").read_text())
            period_us = int((directory / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The cores this process may use: its affinity mask, capped by its cgroup's CPU quota (rounded down:
    a thread per partial core would be throttled), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota_cpus(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def _cpu_times(stat_text: str, cpus: set[int] | None) -> tuple[int, int]:
    """(idle, total) jiffies summed over the `cpuN` lines of /proc/stat for the cores in `cpus` (all when
    None). Idle counts iowait too: a core waiting on the disk is free to compute."""
    idle = total = 0
    for line in stat_text.splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or not values:
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        numbers = [int(v) for v in values[:8]]  # guest time is already inside user time
        idle += numbers[3] + (numbers[4] if len(numbers) > 4 else 0)
        total += sum(numbers)
    return idle, total


def idle_between(before: str, after: str, cpus: set[int] | None = None) -> float | None:
    """Cores left idle between two readings of /proc/stat (0.0 to len(cpus)), None if nothing elapsed."""
    idle_0, total_0 = _cpu_times(before, cpus)
    idle_1, total_1 = _cpu_times(after, cpus)
    lines = [ln for ln in after.splitlines() if ln.startswith("cpu") and not ln.startswith("cpu ")]
    count = len(cpus) if cpus is not None else len(lines)
    if total_1 <= total_0:
        return None
    return count * (idle_1 - idle_0) / (total_1 - total_0)


def idle_cpus(sample_s: float = 0.3, stat: Path = Path("/proc/stat")) -> float | None:
    """Cores of this process's affinity mask that nobody used over the next `sample_s` seconds, or None
    where /proc/stat cannot be read."""
    try:
        cpus: set[int] | None = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = None
    try:
        before = stat.read_text()
        time.sleep(sample_s)  # a sampling window, not a wait for something to happen
        after = stat.read_text()
    except OSError:
        return None
    return idle_between(before, after, cpus)


def choose_threads(available: int, idle: float | None) -> int:
    """One thread per core nobody else is using, at least one. A core counts as free only when nearly all
    of it was idle: a thread on a core another process keeps busy costs far more than it gives (docs/cpu.md:
    two threads ran ~60x slower than one on a busy 2-core machine, and only 1.5x faster on an idle one)."""
    if idle is None:
        return available
    return max(1, min(available, math.floor(idle + 0.25)))


def configure_threads(requested: int | None, device: str) -> int:
    """Set the intra-op thread count for a command running its model on `device`, and the same count in
    OMP_NUM_THREADS/MKL_NUM_THREADS for its children; returns it. `requested` (`--threads N`) overrides
    the choice. On a GPU the CPU count is left to torch unless requested."""
    if requested is not None and requested < 1:
        from flashdraft.errors import FlashdraftError

        raise FlashdraftError(f"--threads {requested}: expected a whole number of at least 1")
    import torch

    if requested is None and not str(device).startswith("cpu"):
        return torch.get_num_threads()
    threads = requested if requested is not None else choose_threads(available_cpus(), idle_cpus())
    torch.set_num_threads(threads)
    for name in THREAD_ENV_VARS:
        os.environ[name] = str(threads)
    return threads
