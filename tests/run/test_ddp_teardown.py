"""Two gloo ranks under DDP exit after their last step (docs/distributed.md, "Shutting down").

The race that once hung a run after its final checkpoint is made certain here: rank 0 still has a
collective in flight when it tears down (its peer joins 5 s later, ample for rank 0's teardown on a busy
machine), so its gloo worker thread frees that collective's tensors, and needs the GIL, while the process
group is destroyed. With the trainer's teardown (`DataParallel.close`, then `shutdown`) both ranks exit;
with the reducer left holding the group, rank 0 never does."""

from __future__ import annotations

import gc
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flashdraft.distributed.parallelize import apply_data_parallel
from flashdraft.distributed.topology import Topology, shutdown

pytestmark = pytest.mark.slow


def _rank(rank: int, store: str, close_first: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    parallel = apply_data_parallel(nn.Linear(4, 4), "ddp", torch.device("cpu"), bf16_compute=False)
    parallel.module(torch.randn(3, 4)).sum().backward()
    if rank == 1:
        time.sleep(5.0)
        dist.all_reduce(torch.ones(1))
    else:
        dist.all_reduce(torch.ones(1), async_op=True)  # handle and tensor dropped while it waits for rank 1
    if close_first:
        parallel.close()
    shutdown(Topology(rank, 2))
    del parallel  # the DDP module and, unless closed, its reducer: the group's last owner
    gc.collect()


def _exits(tmp_path, close_first: bool, grace_s: float) -> list[int | None]:
    """Both ranks' exit codes (None: still running), rank 0 given `grace_s` after rank 1 has ended. Rank 1
    ends once the collective completes, so the grace starts where rank 0's teardown can finish, however
    long the two interpreters took to start on a loaded machine."""
    context = multiprocessing.get_context("spawn")
    store = str(tmp_path / f"store-{close_first}")
    ranks = [context.Process(target=_rank, args=(r, store, close_first)) for r in range(2)]
    for process in ranks:
        process.start()
    ranks[1].join(300 if close_first else 60)  # without the fix rank 1 may hang too
    ranks[0].join(grace_s)
    codes = [process.exitcode for process in ranks]
    for process in ranks:
        process.kill()
    return codes


def test_both_ranks_exit_when_the_reducer_is_closed_before_the_group(tmp_path):
    assert _exits(tmp_path, close_first=True, grace_s=60) == [0, 0]


def test_without_closing_the_reducer_the_race_hangs_rank_0(tmp_path):
    """The scenario really is the hang: without the trainer's order rank 0 never exits (torch's behaviour;
    if a torch release frees the group without the GIL from the reducer too, this test says so)."""
    codes = _exits(tmp_path, close_first=False, grace_s=30)  # it exits in seconds when it does
    # Rank 1 is not asserted: on a loaded machine rank 0's stuck teardown can also leave rank 1's
    # collective unanswered (seen in CI on 2 busy cores: both still running). Rank 0 is the claim.
    assert codes[0] is None, codes
