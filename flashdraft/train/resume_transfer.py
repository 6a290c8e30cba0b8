"""Every rank resumes from the main rank's checkpoint, also on a node that does not have it.

Rank 0 (on node 0: run_protocol.global_rank) writes the checkpoints into its own `train.out_dir`. The ranks
of other nodes look in theirs: without a shared filesystem they find none, and after a restart a rank that
resumed elsewhere would train another trajectory. So at start every rank says which checkpoint it found;
rank 0's choice is the run's; a rank that found another (or none) receives rank 0's checkpoint files over
a gloo group, writes them into a scratch directory of its own `train.out_dir`, and loads them through the
same verified path as a local checkpoint (`verify_checkpoint`: `weights_only=True`, nothing unpickled
beyond tensors and plain values), then removes the copy (docs/distributed.md, "Several nodes").
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from flashdraft.train.checkpoint import ResumePoint, verify_checkpoint

# Bytes per broadcast: a checkpoint of the 1.05B drafter with fp32 masters and moments is ~15 GB.
CHUNK_BYTES = 64 * 2**20
RECEIVED_DIR = "received-checkpoint"


def share_resume_point(
    point: ResumePoint | None, out_dir: Path, log: Callable[[str], None] = print
) -> ResumePoint | None:
    """The resume point of rank 0, on every rank (a collective of the whole world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return point
    mine = None if point is None else [int(point.state["step"]), point.path.name]
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    chosen, rank = found[0], dist.get_rank()
    lacking = [r for r, theirs in enumerate(found) if theirs != chosen]
    if not lacking:
        return point
    if chosen is None:  # rank 0 starts afresh: so does every rank
        log(f"resume: rank 0 found no checkpoint; rank(s) {lacking} start afresh with it")
        return None
    log(
        f"resume: rank(s) {lacking} do not have rank 0's checkpoint {chosen[1]} (another node's run "
        "directory): sending it from rank 0"
    )
    # every rank creates the group (a collective); only rank 0 and the ranks lacking it take part
    group = dist.new_group(ranks=[0, *lacking], backend="gloo")
    if rank == 0:
        _send(point.path, group)
    elif rank in lacking:
        received = _receive(out_dir / RECEIVED_DIR, group)
        try:
            point = verify_checkpoint(received)
        finally:
            shutil.rmtree(received.parent, ignore_errors=True)
    if rank == 0 or rank in lacking:
        dist.destroy_process_group(group)
    return point


def _send(checkpoint: Path, group: dist.ProcessGroup) -> None:
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    manifest = [[checkpoint.name, [(str(p.relative_to(checkpoint)), p.stat().st_size) for p in files]]]
    dist.broadcast_object_list(manifest, src=0, group=group)
    for path in files:
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                dist.broadcast(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), src=0, group=group)


def _receive(scratch: Path, group: dist.ProcessGroup) -> Path:
    manifest: list = [None]
    dist.broadcast_object_list(manifest, src=0, group=group)
    name, files = manifest[0]
    shutil.rmtree(scratch, ignore_errors=True)  # a copy left by an attempt that died while receiving
    root = scratch / name
    for relative, size in files:
        path = root / relative
        if root.resolve() not in path.resolve().parents:
            raise ValueError(f"rank 0 sent a checkpoint file outside its directory: {relative}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as handle:
            for start in range(0, size, CHUNK_BYTES):
                chunk = torch.empty(min(CHUNK_BYTES, size - start), dtype=torch.uint8)
                dist.broadcast(chunk, src=0, group=group)
                handle.write(chunk.numpy().tobytes())
    return root
