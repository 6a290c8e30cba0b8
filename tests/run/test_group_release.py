"""Under ddp and fsdp the process group's last reference goes with `destroy_process_group`
(docs/distributed.md, "Shutting down").

DDP's module keeps the group as an attribute and FSDP2 keeps it in each sharded module's mesh info. Held
there, the group outlives `destroy_process_group` and is freed at interpreter exit with the trainer's
objects; a gloo worker thread still letting go of a collective's tensors then needs the GIL that
finalisation no longer grants, and the rank aborts ("terminate called without an active exception": seen
once, in the 3-rank fsdp case of test_distributed_dp.py on a 2-core machine, not in 49 runs after).
`DataParallel.close` drops those references, as it drops DDP's reducer. These tests hold the invariant that
makes the exit safe, on two gloo ranks: before `close` the wrapper holds the group (the negative control),
after it nothing outside torch's own registry does, and both ranks exit 0."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flashdraft.distributed.parallelize import apply_data_parallel
from flashdraft.distributed.topology import Topology, shutdown
from tests.group_holders import group_holders

pytestmark = pytest.mark.slow


class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _rank(rank: int, store: str, out: str, kind: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    parallel = apply_data_parallel(_Layers(), kind, torch.device("cpu"), bf16_compute=False)
    parallel.module(torch.randn(3, 4)).sum().backward()
    dist.barrier()
    before = group_holders(dist.group.WORLD)
    parallel.close()
    after = group_holders(dist.group.WORLD)
    Path(out).write_text(json.dumps({"before": before, "after": after}))
    shutdown(Topology(rank, 2))
    sys.modules[__name__]._kept = parallel  # as the trainer's objects: alive until the process exits


@pytest.mark.parametrize("kind,holder", [("fsdp", "FSDPMeshInfo"), ("ddp", "_DDP")])
def test_data_parallel_lets_go_of_the_group_before_it_is_destroyed(tmp_path, kind, holder):
    context = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    ranks = [
        context.Process(target=_rank, args=(r, str(tmp_path / "store"), str(outs[r]), kind)) for r in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(300)
    codes = [process.exitcode for process in ranks]
    for process in ranks:
        process.kill()
    assert codes == [0, 0]
    for out in outs:
        seen = json.loads(out.read_text())
        assert holder in seen["before"], seen  # the negative control: the wrapper does hold it
        assert seen["after"] == [], seen
