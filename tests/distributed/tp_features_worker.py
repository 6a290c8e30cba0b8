"""Run under torchrun (gloo, CPU) by test_target_parallel.py: each rank loads the target sharded over the
group and saves its features of its own batch (`inputs` below, also used by the test for the reference)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flashdraft.cli import exit_without_teardown
from flashdraft.distributed.target_parallel import load_group_target
from tests.group_holders import group_holders

LAYER_IDS = [0, 2, 5]


def inputs(rank: int) -> dict[str, torch.Tensor | None]:
    """Ranks pass batches of different rows and lengths; rank 1's rows are packed (positions restart)."""
    g = torch.Generator().manual_seed(rank)
    if rank == 0:
        return {"input_ids": torch.randint(0, 300, (2, 13), generator=g), "position_ids": None}
    positions = torch.cat([torch.arange(4), torch.arange(5)]).unsqueeze(0)
    return {"input_ids": torch.randint(0, 300, (1, 9), generator=g), "position_ids": positions}


def _held(target, group: dist.ProcessGroup) -> dict:
    """Who holds the group (gc's view) and how many groups the target's meshes still register."""
    return {"holders": group_holders(group), "registered": sum(map(len, target.mesh_registries()))}


def main(path: str, out: str, group_size: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target = load_group_target(path, LAYER_IDS, torch.device("cpu"), group_size, dtype=torch.float32)
    features = target.features(**inputs(rank))
    sharded = [n for n, p in target.model.named_parameters() if isinstance(p, DTensor)]
    group = target.group
    held_before = _held(target, group)
    target.close()  # as the trainer does before destroy_process_group (docs/distributed.md, "Shutting down")
    held_after = _held(target, group)
    del group
    record = {
        "features": features,
        "plain": type(features) is torch.Tensor,
        "sharded": sharded,
        "local_numel": sum(p.to_local().numel() for p in target.model.parameters() if isinstance(p, DTensor)),
        "full_numel": sum(p.numel() for p in target.model.parameters() if isinstance(p, DTensor)),
        "embed_plain": type(target.embed_weight) is torch.nn.Parameter,
        "head_plain": type(target.lm_head_weight) is torch.nn.Parameter,
        "held_before": held_before,
        "held_after": held_after,
    }
    torch.save(record, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
    # torch's functional collectives (DTensor's) keep references to a group they ran on that outlive
    # destroy_process_group, so it would be freed during interpreter exit, where a rank can abort: the
    # worker ends as `flashdraft train` does (docs/distributed.md, "Shutting down").
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
