"""Inductor's compile worker processes, started before the first compile needs them.

Until the workers are up, inductor compiles the first step's kernels one by one in the training process;
torch starts them only at the first compile, and each worker's own start (an interpreter importing torch)
takes seconds. Started early, that start-up overlaps the job's imports, the target's load and the data's
opening (the time to the first step: docs/shards.md). Kept apart from `parallelize.py`, whose imports
(the model, transformers) are what the workers' start should overlap.
"""

from __future__ import annotations


def start_compile_workers() -> None:
    """Start the workers now, in the background; calling it again is a no-op. A no-op where torch would
    use no pool (no Triton, one compile thread, or TORCH_WARM_POOL=0)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without it starts the pool itself, at the first compile
        return
    maybe_warm_pool()
