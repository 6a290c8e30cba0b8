"""A target rank of the split topology (docs/distributed.md): it draws the same global micro-batches as the
drafter ranks, runs the frozen target on each drafter's share and sends the features (flashdraft/distributed/
split.py carries them); it trains nothing and writes nothing but its heartbeat.

Before producing step s it joins the control exchange of step s - max_in_flight, so it runs at most
max_in_flight steps ahead of the drafters; a stop decided by either side ends both after the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from flashdraft.config import Config
from flashdraft.data.tokens import EpochSampler, TokenDataset, collate
from flashdraft.distributed.split import Control, FeatureSender, SideClock, SplitRoles, micro_share
from flashdraft.distributed.topology import Topology, barrier, shutdown
from flashdraft.model.target import TargetModel
from flashdraft.run_protocol import Heartbeat


def serve_features(
    config: Config,
    roles: SplitRoles,
    target: TargetModel,
    data: TokenDataset,
    sampler: EpochSampler,
    resume_state: dict[str, Any] | None,
    total_steps: int,
    pad_multiple: int,
    heartbeat: Heartbeat,
    stop_requested: Callable[[], bool],
) -> dict[str, Any]:
    t = config.train
    timeout_s = config.distributed.timeout_minutes * 60
    depth = config.distributed.max_in_flight
    device = target.device
    step = 0
    if resume_state is not None:  # the same position as the drafters, from the same checkpoint
        sampler.load_state_dict(resume_state["sampler"])
        step = resume_state["step"]
    first = step
    clock = SideClock()
    sender = FeatureSender(roles, depth * t.grad_accum, timeout_s, clock)
    control = Control(roles, device, timeout_s)
    served = roles.served_by(roles.rank)
    drafters = len(roles.drafter_ranks)
    heartbeat.beat("training", force=True, step=step, total_steps=total_steps, role="target")
    outcome, exchanged = "finished", first

    def exchange() -> bool:
        nonlocal exchanged
        exchanged += 1
        return control.exchange(stop_requested(), clock, exchanged)["stop"] > 0

    while step < total_steps:
        if step - first >= depth and exchange():
            outcome = "stopped"
            break
        for m in range(t.grad_accum):
            epoch, indices = sampler.next_batch()
            for drafter in served:
                started = time.perf_counter()
                mine, padding = micro_share(indices, roles.drafter_ranks.index(drafter), drafters)
                batch = collate(data, epoch, mine, t.seed, pad_multiple)
                features = target.features(batch.input_ids.to(device))
                if device.type == "cuda":  # busy time is the target's compute, not the wait that follows
                    torch.cuda.synchronize(device)
                clock.busy += time.perf_counter() - started
                clock.samples += 0 if padding else len(mine)
                sender.send(drafter, [step, m, *batch.input_ids.shape, features.shape[-1]], features)
        step += 1
        heartbeat.beat("training", step=step, total_steps=total_steps, role="target")
    if outcome == "finished":
        while exchanged < total_steps:  # the drafters join one exchange per step they train
            if exchange():
                outcome = "stopped"
                break
    sender.drain()
    world = Topology(roles.rank, len(roles.target_ranks) + drafters)
    barrier(world)
    shutdown(world)
    return {
        "steps": step,
        "out_dir": t.out_dir,
        "best_by": t.best_by,
        "best": None,
        "outcome": outcome,
        "skipped_steps": 0,
    }
