"""Muon's Newton–Schulz products shared by 2 GPUs over NCCL (flashdraft/train/muon.py, `split_ranks`): each rank
orthogonalises its share, broadcasts the bf16 result on NCCL's stream while it computes its next one, and both
ranks end with the bits one process computes on one GPU. The CPU twin (gloo) is
tests/run/test_ddp_master_weights.py; this one checks the stream ordering a CPU cannot."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdraft.train.muon import make_muon_optimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)"
    ),
]

STEPS = 3
# tall, wide and square matrices of a few sizes, so the owners differ and a tall result is a transposed view
SHAPES = [(1536, 512), (512, 1536), (1024, 1024), (256, 768), (768, 256)]


def _params(device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(*s, device=device).bfloat16().requires_grad_() for s in SHAPES] + [
        torch.randn(64, device=device).bfloat16().requires_grad_()  # the AdamW part
    ]


def _grads(step: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(step)
    return [torch.randn(*p, device=device, generator=g).bfloat16() for p in [*SHAPES, (64,)]]


def _train(params: list[torch.Tensor], split: bool) -> None:
    opt = make_muon_optimizer(
        params, params[:-1], lr=1e-2, muon_lr=2e-2, momentum=0.95, weight_decay=0.01, split_ranks=split
    )
    for step in range(STEPS):
        for p, g in zip(params, _grads(step, params[0].device.type), strict=True):
            p.grad = g.clone()  # the same summed gradients on every rank, as after DDP's all-reduce
        opt.clip_and_step(1.0)
        opt.discard_gradients()
    assert opt.split_ranks == split


def _rank(rank: int, store: str, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    params = _params("cuda")
    _train(params, split=True)
    torch.cuda.synchronize()
    results[rank] = [p.detach().cpu() for p in params]
    dist.destroy_process_group()


def test_two_gpus_share_the_products_and_end_with_one_gpus_bits(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(str(tmp_path / "store"), results), nprocs=2)
    reference = _params("cuda")
    _train(reference, split=False)
    for rank in range(2):
        for got, want in zip(results[rank], reference, strict=True):
            assert torch.equal(got, want.detach().cpu())
    assert not torch.equal(reference[0].detach().cpu(), _params("cuda")[0].detach().cpu())  # it trained
