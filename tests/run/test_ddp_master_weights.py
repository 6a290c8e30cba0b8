"""DDP with the master-weight optimizer (flashdraft/train/optim.py): the optimizer re-points the
parameters into its flat weight buffer after DDP has wrapped the model, and DDP's bucket-view gradients
(summed by the two-rank bf16 hook) still reach the update. Each rank ends with the weights one process
computes from the two ranks' gradients summed. The same with Muon for the weight matrices beside AdamW
(train.optimizer=muon, flashdraft/train/muon.py), and with Muon's Newton–Schulz products shared by the ranks
(`split_ranks`: each rank orthogonalises its share and broadcasts it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdraft.distributed.parallelize import apply_data_parallel
from flashdraft.train import muon as muon_module
from flashdraft.train.muon import make_muon_optimizer
from flashdraft.train.optim import MasterWeightAdamW

pytestmark = pytest.mark.slow

STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8)).bfloat16()


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if kind == "adamw":
        return MasterWeightAdamW(params, lr=1e-2)
    matrices = [p for p in params if p.ndim == 2]
    return make_muon_optimizer(
        params,
        matrices,
        lr=1e-2,
        muon_lr=1e-2,
        momentum=0.95,
        weight_decay=0.0,
        split_ranks=kind == "muon-split",
    )


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 24, generator=torch.Generator().manual_seed(100 * step + rank)).bfloat16()


def _rank(rank: int, store: str, kind: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    orthogonalised = []  # the shapes this rank ran Newton–Schulz on
    plain = muon_module.newton_schulz

    def counted(matrix, *args):
        orthogonalised.append(tuple(matrix.shape))
        return plain(matrix, *args)

    muon_module.newton_schulz = counted
    model = _model()
    parallel = apply_data_parallel(model, "ddp", torch.device("cpu"), bf16_compute=True)
    opt = _optimizer(model, kind)  # built after DDP, as the trainer does
    for step in range(STEPS):
        parallel.module(_inputs(rank, step)).float().square().sum().backward()
        opt.clip_and_step(1.0)
        opt.discard_gradients()
    results[rank] = [p.detach().clone() for p in model.parameters()]
    results[f"orthogonalised {rank}"] = orthogonalised
    parallel.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["adamw", "muon", "muon-split"])
def test_ddp_gradients_reach_the_flat_master_weight_update(tmp_path, kind):
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(str(tmp_path / "store"), kind, results), nprocs=2)
    model = _model()
    params = list(model.parameters())
    opt = _optimizer(model, kind)
    for step in range(STEPS):
        per_rank = []
        for rank in range(2):
            model(_inputs(rank, step)).float().square().sum().backward()
            per_rank.append([p.grad.float() for p in params])
            model.zero_grad(set_to_none=True)
        for p, a, b in zip(params, *per_rank, strict=True):
            p.grad = (a + b).bfloat16()  # the two-rank hook: one addition, rounded once
        opt.clip_and_step(1.0)
        opt.discard_gradients()
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(results[rank], params, strict=True))
    assert not torch.equal(params[0], _model()[0].weight)  # it trained
    shapes = [(40, 24), (8, 40)]  # the two matrices, each step
    if kind == "muon":  # each rank orthogonalised both
        assert all(results[f"orthogonalised {rank}"] == shapes * STEPS for rank in range(2))
    if kind == "muon-split":  # one each: the larger (cost 40 x 24 x 24) on rank 0, the other on rank 1
        assert results["orthogonalised 0"] == [(40, 24)] * STEPS
        assert results["orthogonalised 1"] == [(8, 40)] * STEPS
