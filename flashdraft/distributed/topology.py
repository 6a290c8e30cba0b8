"""Process topology for data-parallel training: one process per GPU under torchrun (multi-node is
torchrun's job). Each process holds the target and a drafter replica on its own GPU; gradients are
summed across processes after the local backward, so N processes with batch b train exactly like one
process with batch N·b (docs/processes.md: processes, never threads).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashdraft import devices
from flashdraft.errors import FlashdraftError
from flashdraft.run_protocol import NODE_RANK_ENV, global_rank


def resolve_device(name: str) -> torch.device:
    """`train.device`: auto (a GPU when there is one), cpu, cuda or cuda:N (flashdraft.devices)."""
    return devices.resolve_device(name, "train.device")


@dataclass(frozen=True)
class Topology:
    """The ranks that train the drafter together: all of them (colocated), or the drafter ranks of a split
    topology, then with their own process group and `rank` counted among them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: dist.ProcessGroup | None = None  # None: the whole world

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_topology(device_name: str, timeout_minutes: float = 30.0) -> tuple[Topology, torch.device]:
    """Read torchrun's environment; a single process needs no process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Topology(), resolve_device(device_name)
    topo = Topology(global_rank(), world, int(os.environ.get("LOCAL_RANK", "0")))
    use_cuda = device_name != "cpu" and torch.cuda.is_available()
    if device_name.startswith("cuda") and not torch.cuda.is_available():
        raise FlashdraftError(f"train.device={device_name}: no CUDA GPU is visible to rank {topo.rank}")
    if use_cuda:
        if topo.local_rank >= torch.cuda.device_count():
            raise FlashdraftError(
                f"rank {topo.rank}: local rank {topo.local_rank} but only {torch.cuda.device_count()} GPUs visible"
            )
        device = torch.device("cuda", topo.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=timeout,
            **({"device_id": device} if use_cuda else {}),
            **(_node_ranked_store(topo, timeout) or _restart_store(topo, timeout)),
        )
    return topo, device


def _node_ranked_store(topo: Topology, timeout: datetime.timedelta) -> dict:
    """A multi-node launch counts ranks from its --node-rank (run_protocol.global_rank), not from
    torchrun's order of the nodes, so that rank 0, which writes the checkpoints, stays on node 0 across
    restarts. The store is the one torchrun's RANK 0 hosts, fresh each attempt (the launcher turns
    off the agent's shared store: TORCH_DISABLE_SHARE_RDZV_TCP_STORE, docs/distributed.md); on a torch
    that still hands out the agent's store, this attempt's keys get a prefix of their own."""
    if NODE_RANK_ENV not in os.environ:
        return {}
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store: dist.Store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        topo.world_size,
        is_master=not shared and os.environ.get("RANK") == "0",
        timeout=timeout,
    )
    if shared:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        store = dist.PrefixStore(f"flashdraft/attempt-{attempt}/", store)
    # two nodes launched with the same --node-rank would wait for each other until the timeout
    if store.add(f"flashdraft/rank-taken/{topo.rank}", 1) > 1:
        raise FlashdraftError(
            f"rank {topo.rank} is taken twice: two nodes were launched with --node-rank "
            f"{os.environ[NODE_RANK_ENV]}; give each node its own, 0 .. nnodes-1"
        )
    return {"store": store, "rank": topo.rank, "world_size": topo.world_size}


def _restart_store(topo: Topology, timeout: datetime.timedelta) -> dict:
    """After torchrun restarts the group (launch --max-restarts), the agent's store still holds the
    previous attempt's keys, and a rank that starts first reads its peers' old addresses from them (gloo
    then hangs connecting to dead ports): each restarted attempt takes keys of its own."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        topo.world_size,
        is_master=False,
        timeout=timeout,
    )
    store = dist.PrefixStore(f"flashdraft/attempt-{attempt}/", agent_store)
    return {"store": store, "rank": topo.rank, "world_size": topo.world_size}


def local_world_size() -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def all_reduce_sum(values: list[float], device: torch.device, topo: Topology) -> list[float]:
    if not topo.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=topo.group)
    return tensor.tolist()


def sum_gradients(grads: list[torch.Tensor], topo: Topology) -> None:
    """Sum gradients over ranks in place (the loss is already normalised by the global Σw)."""
    if not topo.distributed:
        return
    for grad in grads:
        dist.all_reduce(grad, group=topo.group)


def any_rank(flag: bool, device: torch.device, topo: Topology) -> bool:
    """True if the flag is set on any rank: ranks must agree before leaving the loop together."""
    if not topo.distributed:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=topo.group)
    return bool(tensor.item())


def barrier(topo: Topology) -> None:
    """Every process of the world (target ranks too), not only the topology's group."""
    if dist.is_initialized():
        dist.barrier()


def shutdown(topo: Topology) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def any_rank_flags(flags: list[torch.Tensor | bool], device: torch.device, topo: Topology) -> list[bool]:
    """Each flag, true if set on any rank, in one all-reduce; device-tensor flags are read with one host
    sync in all (a flag computed on the device, e.g. a finiteness check, is not read on its own)."""
    tensor = torch.stack([torch.as_tensor(f, device=device).reshape(()).float() for f in flags])
    if topo.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=topo.group)
    return [v > 0 for v in tensor.tolist()]
