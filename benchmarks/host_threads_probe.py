"""How many host threads the trainer's per-step CPU tensor work wants (anchors and blocks of one batch).

On the H200 machine a profile of `flashdraft train` on a 135M target showed that work at ~10 ms a step,
10x its time on a 2-core laptop-class CPU: this times it at several `torch.set_num_threads` values.
Usage: python benchmarks/host_threads_probe.py
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from flashdraft.data.tokens import TokenBatch
from flashdraft.train.blocks import blocks_for


def main() -> None:
    cpu_max = "/sys/fs/cgroup/cpu.max"
    quota = Path(cpu_max).read_text().strip() if os.path.exists(cpu_max) else "n/a"
    print(
        f"os.cpu_count {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}, "
        f"torch threads {torch.get_num_threads()}, cgroup cpu.max {quota}"
    )
    b, s = 16, 1400
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49000, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, :100] = 0
    batch = TokenBatch(ids, mask, torch.randint(400, s, (b,), generator=g), list(range(b)))
    for threads in sorted({torch.get_num_threads(), 1, 2, 4, 8}):
        torch.set_num_threads(threads)
        times = []
        for _ in range(20):
            started = time.perf_counter()
            blocks_for(batch, 256, 16, 3, 7.0)
            times.append((time.perf_counter() - started) * 1e3)
        print(f"threads {threads:3d}: blocks_for {statistics.median(times[5:]):.2f} ms (median of 15)")


if __name__ == "__main__":
    main()
