"""Which objects hold a process group: the invariant behind a safe exit (docs/distributed.md, "Shutting
down") is that after the trainer lets go, nothing outside torch's own registry does."""

from __future__ import annotations

import gc

import torch.distributed as dist

IGNORED = ("_World", "module")  # torch's registry of groups, and module globals


def group_holders(group: dist.ProcessGroup) -> list[str]:
    """The types of the objects that hold `group` as an attribute, or in a dict one of their attributes
    holds (a DeviceMesh's registry of its groups), torch's own registry aside."""
    owners: dict[int, object] = {}
    frontier: list[object] = [group]
    for _ in range(2):  # the group itself, then the dicts that hold it and are no instance's __dict__
        dicts = []
        for held in frontier:
            for referrer in gc.get_referrers(held):
                if isinstance(referrer, dict):
                    instances = [
                        o for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer
                    ]
                    owners.update((id(o), o) for o in instances)
                    if not instances:
                        dicts.append(referrer)
                elif hasattr(
                    referrer, "__dict__"
                ):  # an instance whose attributes live inline (Python >= 3.11)
                    owners[id(referrer)] = referrer
        frontier = dicts
    return sorted(type(o).__name__ for o in owners.values() if type(o).__name__ not in IGNORED)
