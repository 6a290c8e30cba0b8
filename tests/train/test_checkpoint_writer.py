"""The background checkpoint writer (train/checkpoint.py, CheckpointWriter): `save` returns while the write
runs, with a copy the loop can no longer change; a second save waits for the first; a failed write is
raised in the training thread; the written checkpoint verifies and equals a synchronous one."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.cli import main
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.train import checkpoint
from flashdraft.train.checkpoint import CheckpointWriter, verify_checkpoint

LIMIT_S = 300  # a generous bound on a thread's write of a tiny checkpoint, never a measure of speed


@pytest.fixture()
def drafter(tmp_path, qwen3_target):
    out = tmp_path / "d"
    args = ["init", "--target", qwen3_target, "--out", str(out), "--num-layers", "1", "--block-size", "4"]
    assert main([*args, "--mask-token-id", "300"]) == 0
    return load_drafter(out, dtype=torch.float32)


def _state(step: int) -> dict:
    return {
        "step": step,
        "sampler": {"epoch": 0, "position": step * 2},
        "moments": [torch.full((3,), float(step))],
    }


class _Gate:
    """Holds the writer's thread inside save_checkpoint until released."""

    def __init__(self, monkeypatch):
        self.entered, self.release = threading.Event(), threading.Event()
        real = checkpoint.save_checkpoint

        def gated(*args, **kwargs):
            self.entered.set()
            assert self.release.wait(LIMIT_S)
            return real(*args, **kwargs)

        monkeypatch.setattr(checkpoint, "save_checkpoint", gated)


def test_save_returns_while_the_write_runs_with_a_copy_the_loop_cannot_change(tmp_path, drafter, monkeypatch):
    gate = _Gate(monkeypatch)
    lines: list[str] = []
    writer = CheckpointWriter(say=lines.append)
    state = _state(4)
    writer.save(tmp_path / "run", 4, drafter, state, keep_last=3)
    assert gate.entered.wait(LIMIT_S)
    assert not (tmp_path / "run" / "checkpoints" / "step-00000004").exists()  # still writing, and we go on
    # the loop moves on: the sampler's dict, the moments and the weights change under the writer
    state["sampler"]["position"] = 999
    state["moments"][0].add_(100)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(1.0)
    assert writer.poll() == []  # nothing finished yet
    gate.release.set()
    (done,) = writer.wait()
    assert done.step == 4 and done.write_seconds >= 0 and lines == [done.line()]
    assert "written in" in lines[0] and "in the background" in lines[0]
    point = verify_checkpoint(done.path)
    assert point.state["sampler"]["position"] == 8 and torch.equal(
        point.state["moments"][0], torch.full((3,), 4.0)
    )
    saved = load_file(Path(done.path) / "drafter" / "model.safetensors")
    assert all(torch.equal(saved[k], before[k]) for k in saved)


def test_a_second_save_waits_for_the_first_write(tmp_path, drafter, monkeypatch):
    gate = _Gate(monkeypatch)
    writer = CheckpointWriter(say=lambda _line: None)
    writer.save(tmp_path / "run", 4, drafter, _state(4), keep_last=3)
    assert gate.entered.wait(LIMIT_S)
    second = threading.Thread(target=writer.save, args=(tmp_path / "run", 8, drafter, _state(8), 3))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # blocked behind the first write, which the gate holds
    gate.release.set()
    second.join(LIMIT_S)
    assert not second.is_alive()
    writer.wait()
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000008"]


def test_a_failed_write_is_raised_in_the_training_thread(tmp_path, drafter, monkeypatch):
    def fail(*_args, **_kwargs):
        raise FlashdraftError("checkpoint step 4: disk full writing X")

    monkeypatch.setattr(checkpoint, "save_checkpoint", fail)
    writer = CheckpointWriter(say=lambda _line: None)
    writer.save(tmp_path / "run", 4, drafter, _state(4), keep_last=3)
    with pytest.raises(FlashdraftError, match="disk full"):
        writer.wait()
    assert writer.wait() == []  # raised once


@pytest.mark.gpu
def test_a_cuda_drafter_is_copied_to_pinned_memory_and_written_equal(tmp_path, drafter):
    """On CUDA the copy goes to pinned host buffers (reused by the next save) and the write equals the
    weights at the save, whatever the step does to them afterwards."""
    drafter = drafter.cuda()
    writer = CheckpointWriter(say=lambda _line: None)
    state = {"step": 4, "moments": [torch.ones(1000, device="cuda")]}
    before = {k: v.cpu().clone() for k, v in drafter.state_dict().items()}
    writer.save(tmp_path / "run", 4, drafter, state, keep_last=3)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(1.0)
        state["moments"][0].add_(1.0)
    (done,) = writer.wait()
    assert all(buffer.is_pinned() for buffer in writer._host.values())
    saved = load_file(Path(done.path) / "drafter" / "model.safetensors")
    assert all(torch.equal(saved[k], before[k]) for k in saved)
    point = verify_checkpoint(done.path)
    assert torch.equal(point.state["moments"][0], torch.ones(1000))
    buffers = dict(writer._host)
    writer.save(tmp_path / "run", 8, drafter, state, keep_last=3)
    writer.wait()
    assert all(writer._host[k] is buffers[k] for k in buffers)  # the second save reused them


def test_reserve_lists_the_places_a_save_copies_into(tmp_path, drafter):
    """`reserve` allocates ahead the very buffers the first save would: the same places in the state
    (on the CPU it allocates nothing; the listing is what it would allocate on CUDA)."""
    writer = CheckpointWriter(say=lambda _line: None)
    places: list = []
    writer._to_host(drafter.state_dict(), "weights", into=places)
    writer._to_host(_state(2), "state", into=places)
    writer.reserve(drafter, _state(2))
    assert writer._reserving is None and writer._host == {}  # a CPU state: no pinned buffers to make
    writer.save(tmp_path / "run", 2, drafter, _state(2), keep_last=3)
    writer.wait()
    assert sorted(where for where, _ in places) == sorted(writer._host)


@pytest.mark.gpu
def test_the_first_save_copies_into_the_buffers_reserve_allocated(tmp_path, drafter):
    """On CUDA `reserve` allocates the pinned buffers in a thread; the first save reuses every one of them
    (nothing allocated on the step's path) and writes the state equal."""
    drafter = drafter.cuda()
    writer = CheckpointWriter(say=lambda _line: None)
    state = {"step": 4, "moments": [torch.ones(1000, device="cuda")]}
    writer.reserve(drafter, state)
    writer._reserving.join()
    reserved = dict(writer._host)
    assert len(reserved) == len(drafter.state_dict()) + 1 and all(b.is_pinned() for b in reserved.values())
    writer.save(tmp_path / "run", 4, drafter, state, keep_last=3)
    (done,) = writer.wait()
    assert set(writer._host) == set(reserved) and all(writer._host[k] is reserved[k] for k in reserved)
    assert torch.equal(verify_checkpoint(done.path).state["moments"][0], torch.ones(1000))
