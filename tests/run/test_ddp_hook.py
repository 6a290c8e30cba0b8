"""The DDP communication hook's reduction (flashdraft/distributed/parallelize.py, docs/distributed.md): a bf16
bucket of two ranks is summed in place and gives exactly the fp32 sum rounded once; with three ranks a bf16
sum would round twice, so the hook widens to fp32 and still gives the fp32 sum rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdraft.distributed import parallelize

pytestmark = pytest.mark.slow


class _Bucket:  # what the hook reads of DDP's GradBucket
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self.tensor


def _rank(rank: int, world: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    # magnitudes over 12 decades: additions that round, and some that lose the smaller operand entirely
    grads = (torch.randn(50_000, generator=g) * torch.logspace(-6, 6, 50_000)).bfloat16()
    gathered = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(gathered, grads)
    exact_then_rounded = sum(t.float() for t in gathered).bfloat16()
    plain_bf16 = grads.clone()
    dist.all_reduce(plain_bf16)
    bucket, sent = _Bucket(grads.clone()), []
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        sent.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    parallelize.dist.all_reduce = recording_all_reduce
    hooked = parallelize._sum_gradients(None, bucket).wait()
    parallelize.dist.all_reduce = all_reduce
    results[rank] = (
        torch.equal(hooked, exact_then_rounded),
        hooked.data_ptr() == bucket.tensor.data_ptr(),
        torch.equal(plain_bf16, exact_then_rounded),
        sent,
    )
    dist.destroy_process_group()


def _run(world: int, tmp_path) -> list[tuple]:
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(world, str(tmp_path / f"store{world}"), results), nprocs=world)
    return [results[r] for r in range(world)]


def test_two_ranks_sum_bf16_buckets_in_place_exactly_as_fp32_would(tmp_path):
    for hooked_exact, in_place, plain_exact, sent in _run(2, tmp_path):
        assert hooked_exact and in_place
        assert sent == [torch.bfloat16]  # half the bytes of an fp32 reduction
        assert plain_exact  # why two ranks need no widening: one addition, one rounding


def test_three_ranks_widen_to_fp32_where_a_bf16_sum_would_round_twice(tmp_path):
    for hooked_exact, in_place, plain_exact, sent in _run(3, tmp_path):
        assert hooked_exact and in_place  # the fp32 result is written back into the bucket
        assert sent == [torch.float32]
        assert not plain_exact  # the double rounding the widening avoids
