"""Split topology (`distributed.mode=split`, docs/distributed.md): inside one torchrun world, target ranks
run the frozen target and send its features to drafter ranks over point-to-point messages (NCCL on GPUs,
gloo on the CPU); drafter ranks train the drafter, data-parallel among themselves in their own process group.

Every message is waited for with a deadline (`distributed.timeout_minutes`): a peer that died fails the
wait when its connection closes, one that hangs fails it at the deadline, and either way the error names
the peer rank and its role. How far the target side may run ahead is bounded by the control exchange (see
`Control`), so memory never grows with a slow side: the fast side waits.
"""

from __future__ import annotations

import collections
import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from flashdraft.distributed.topology import Topology, local_world_size
from flashdraft.errors import FlashdraftError

# The message header sent before each micro-batch's features: who, where, and the shape it promises.
HEADER = ("step", "micro", "batch", "length", "width")


@dataclass(frozen=True)
class SplitRoles:
    """Which global ranks run the target and which train the drafter; drafter d (in drafter order) gets its
    features from target d mod (number of targets)."""

    rank: int
    target_ranks: tuple[int, ...]
    drafter_ranks: tuple[int, ...]

    @property
    def is_target(self) -> bool:
        return self.rank in self.target_ranks

    def source_of(self, drafter_rank: int) -> int:
        return self.target_ranks[self.drafter_ranks.index(drafter_rank) % len(self.target_ranks)]

    def served_by(self, target_rank: int) -> list[int]:
        return [d for d in self.drafter_ranks if self.source_of(d) == target_rank]

    def role(self, rank: int) -> str:
        return "target" if rank in self.target_ranks else "drafter"


def split_roles(
    target_ranks: int | list[int], rank: int, world_size: int, local_world_size: int
) -> SplitRoles:
    """Target ranks from `distributed.target_ranks`, given per node: a count k (the node's last k local
    ranks) or a list of local ranks. Rank 0 must train the drafter: it writes checkpoints, metrics and status."""
    if world_size % local_world_size:
        raise FlashdraftError(
            f"distributed.mode=split: {world_size} ranks are not a whole number of nodes of {local_world_size}"
        )
    if isinstance(target_ranks, int):
        if not 1 <= target_ranks < local_world_size:
            raise FlashdraftError(
                f"distributed.target_ranks={target_ranks}: a count per node must be from 1 to "
                f"{local_world_size - 1} (this node has {local_world_size} ranks; at least one trains the drafter)"
            )
        local = list(range(local_world_size - target_ranks, local_world_size))
    else:
        local = sorted(set(target_ranks))
        bad = [r for r in local if not 0 <= r < local_world_size]
        if not local or bad or len(local) == local_world_size:
            raise FlashdraftError(
                f"distributed.target_ranks={target_ranks}: expected local ranks from 0 to {local_world_size - 1}, "
                "at least one, and not all of them (at least one trains the drafter)"
            )
        if 0 in local:
            raise FlashdraftError(
                f"distributed.target_ranks={target_ranks}: local rank 0 must train the drafter (rank 0 writes the "
                "checkpoints, metrics and status); use later local ranks for the target"
            )
    targets = tuple(
        node * local_world_size + r for node in range(world_size // local_world_size) for r in local
    )
    drafters = tuple(r for r in range(world_size) if r not in targets)
    return SplitRoles(rank, targets, drafters)


def split_topology(target_ranks: int | list[int], world: Topology) -> tuple[SplitRoles, Topology]:
    """This rank's role in a split world, and the topology that trains the drafter: on a drafter rank, the
    drafter ranks with their own process group (every rank takes part in creating it); on a target rank,
    the world unchanged (it trains nothing)."""
    if not world.distributed:
        raise FlashdraftError(
            "distributed.mode=split needs at least 2 processes (flashdraft launch --nproc-per-node N)"
        )
    roles = split_roles(target_ranks, world.rank, world.world_size, local_world_size())
    group = dist.new_group(list(roles.drafter_ranks))
    if roles.is_target:
        return roles, world
    position = roles.drafter_ranks.index(world.rank)
    return roles, Topology(position, len(roles.drafter_ranks), world.local_rank, group)


def micro_share(indices: list[int], position: int, ranks: int) -> tuple[list[int], bool]:
    """The samples of a global micro-batch that drafter `position` (of `ranks`) trains on, and whether they
    are padding: a drafter left without samples at an epoch's end takes the first sample at weight zero, so
    that it still joins every gradient reduction. The target side calls this too: both agree by construction."""
    mine = indices[position::ranks]
    return (mine, False) if mine else (indices[:1], True)


class PeerError(FlashdraftError):
    pass


def wait_for(work: dist.Work, deadline_s: float, what: str) -> float:
    """Wait for a request until it completes or `deadline_s` passes; returns the seconds waited. A failed
    request (the peer's connection closed) or the deadline raise `PeerError` saying `what` and which.
    (On GPUs NCCL's wait orders the streams; its watchdog enforces the process group's timeout.)"""
    started = time.perf_counter()
    try:
        work.wait(datetime.timedelta(seconds=deadline_s))
    except Exception as exc:  # gloo and NCCL raise their own RuntimeError kinds
        waited = time.perf_counter() - started
        if waited >= 0.95 * deadline_s or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise PeerError(
                f"{what}: nothing within {deadline_s:.0f} s (distributed.timeout_minutes): it hangs or died"
            ) from None
        raise PeerError(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0]}; it died") from None
    return time.perf_counter() - started


@dataclass
class SideClock:
    """Busy and waiting seconds of one side, and the samples it handled (the balance report)."""

    busy: float = 0.0
    waiting: float = 0.0
    samples: int = 0


class FeatureSender:
    """Target side: sends each micro-batch's header and features to a drafter rank without waiting, and keeps
    at most `depth` micro-batches in flight per drafter (the oldest is waited for first)."""

    def __init__(self, roles: SplitRoles, depth: int, timeout_s: float, clock: SideClock):
        self.roles, self.depth, self.timeout_s, self.clock = roles, depth, timeout_s, clock
        self.in_flight: dict[int, collections.deque] = collections.defaultdict(collections.deque)

    def send(self, drafter: int, header: list[int], features: Tensor) -> None:
        queue = self.in_flight[drafter]
        while len(queue) >= self.depth:
            self._finish(drafter, queue.popleft())
        head = torch.tensor(header, dtype=torch.int64, device=features.device)
        features = features.contiguous()
        works = [dist.isend(head, drafter), dist.isend(features, drafter)]
        queue.append((header, works, (head, features)))  # the tensors live until their sends complete

    def _finish(self, drafter: int, entry) -> None:
        header, works, _ = entry
        for work in works:
            self.clock.waiting += wait_for(
                work, self.timeout_s, f"rank {drafter} (drafter) did not take step {header[0] + 1}'s features"
            )

    def drain(self) -> None:
        for drafter, queue in self.in_flight.items():
            while queue:
                self._finish(drafter, queue.popleft())


@dataclass
class _Posted:
    header: list[int]
    works: list
    head: Tensor
    features: Tensor


@dataclass
class FeatureReceiver:
    """Drafter side: receives are posted ahead (the shapes come from the drafter's own copy of the batch),
    so the next micro-batches arrive while the current one trains; `take` waits for the oldest."""

    source: int
    timeout_s: float
    clock: SideClock
    posted: collections.deque = field(default_factory=collections.deque)

    def post(self, header: list[int], dtype: torch.dtype, device: torch.device) -> None:
        batch, length, width = header[2:]
        head = torch.empty(len(HEADER), dtype=torch.int64, device=device)
        features = torch.empty(batch, length, width, dtype=dtype, device=device)
        works = [dist.irecv(head, self.source), dist.irecv(features, self.source)]
        self.posted.append(_Posted(header, works, head, features))

    def take(self) -> Tensor:
        entry = self.posted.popleft()
        what = f"rank {self.source} (target) did not send step {entry.header[0] + 1}'s features"
        for work in entry.works:
            self.clock.waiting += wait_for(work, self.timeout_s, what)
        got = entry.head.tolist()
        if got != entry.header:
            raise FlashdraftError(
                f"rank {self.source} (target) sent features for {dict(zip(HEADER, got, strict=True))}, this "
                f"drafter expected {dict(zip(HEADER, entry.header, strict=True))}: the two sides drew different "
                "batches (not the same data or config on every node?)"
            )
        return entry.features

    def drain(self) -> None:
        while self.posted:
            self.take()


class Control:
    """One small all-reduce over the whole world per optimizer step, which both sides join: it carries the
    stop decision and each side's clock. The target side joins the exchange of step s - depth before it
    produces step s's features, so it runs at most `depth` steps ahead of the drafters: a slow drafter side
    makes the target side wait here, never pile up features."""

    FIELDS = (
        "stop",
        "target_busy",
        "target_waiting",
        "target_samples",
        "drafter_busy",
        "drafter_waiting",
        "drafter_samples",
    )

    def __init__(self, roles: SplitRoles, device: torch.device, timeout_s: float):
        self.roles, self.device, self.timeout_s = roles, device, timeout_s

    def exchange(self, stop: bool, clock: SideClock, step: int) -> dict[str, float]:
        values = [0.0] * len(self.FIELDS)
        values[0] = 1.0 if stop else 0.0
        offset = 1 if self.roles.is_target else 4
        values[offset : offset + 3] = [clock.busy, clock.waiting, float(clock.samples)]
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        work = dist.all_reduce(tensor, async_op=True)
        started = time.perf_counter()
        # On a drafter rank the drafters have just agreed on the step's flags among themselves: if this
        # exchange never completes, the missing rank is on the other side, and the message says which.
        other = self.roles.drafter_ranks if self.roles.is_target else self.roles.target_ranks
        side = "drafter" if self.roles.is_target else "target"
        names = f"{side} rank {other[0]}" if len(other) == 1 else f"one of the {side} ranks {list(other)}"
        wait_for(work, self.timeout_s, f"{names} did not join the exchange of step {step}")
        if self.roles.is_target:
            clock.waiting += time.perf_counter() - started
        return dict(zip(self.FIELDS, tensor.tolist(), strict=True))


def balance(totals: dict[str, float], before: dict[str, float] | None, targets: int, drafters: int) -> dict:
    """Each side's samples/s per GPU and busy and waiting shares over the window since `before`, and the
    split of the same number of GPUs that would balance them."""
    before = before or dict.fromkeys(totals, 0.0)
    d = {k: totals[k] - before.get(k, 0.0) for k in totals}
    out: dict = {}
    rates = {}
    for side, gpus in (("target", targets), ("drafter", drafters)):
        busy, waiting, samples = d[f"{side}_busy"], d[f"{side}_waiting"], d[f"{side}_samples"]
        per_rank_time = (busy + waiting) / gpus if gpus else 0.0
        rates[side] = samples / busy if busy > 0 else 0.0  # samples per busy second of one GPU, summed
        out[f"{side}_samples_per_s_per_gpu"] = (
            round(samples / per_rank_time / gpus, 3) if per_rank_time else 0.0
        )
        out[f"{side}_busy_share"] = round(busy / (busy + waiting), 3) if busy + waiting else 0.0
        out[f"{side}_waiting_share"] = round(waiting / (busy + waiting), 3) if busy + waiting else 0.0
    gpus = targets + drafters
    if rates["target"] > 0 and rates["drafter"] > 0:
        # Throughput per GPU when busy is samples / busy-seconds; a side of k GPUs handles k times that.
        # Balanced: t * target rate = (gpus - t) * drafter rate.
        ideal = gpus * rates["drafter"] / (rates["target"] + rates["drafter"])
        best = min(
            range(1, gpus), key=lambda t: max(1 / (t * rates["target"]), 1 / ((gpus - t) * rates["drafter"]))
        )
        out["balanced_split"] = [best, gpus - best]
        out["balanced_target_share"] = round(ideal / gpus, 3)
        waiter = max(("target", "drafter"), key=lambda s: out[f"{s}_waiting_share"])
        out["advice"] = (
            f"{'drafters' if waiter == 'drafter' else 'targets'} wait {out[f'{waiter}_waiting_share']:.0%}: "
            + (
                f"use {best} target + {gpus - best} drafter GPUs"
                if best != targets
                else f"{targets} target + {drafters} drafter GPUs is the best split of {gpus}"
            )
        )
    return out
