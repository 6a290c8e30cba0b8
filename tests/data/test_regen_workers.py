"""Parallel in-process regeneration: worker processes, journal parts, a worker that dies, the flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft.cli import main
from flashdraft.config import Sampling
from flashdraft.data.local_regen import LocalJob, run_workers
from flashdraft.data.regenerate import journal_part, read_journal
from flashdraft.devices import resolve_devices
from flashdraft.errors import FlashdraftError

CONVS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi there"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"}]},
    {
        "messages": [
            {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "why"},
            {"role": "assistant", "content": "because"},
        ]
    },
    {"messages": [{"role": "user", "content": "thanks"}, {"role": "assistant", "content": "sure"}]},
    {"messages": [{"role": "user", "content": "hi there ok"}, {"role": "assistant", "content": "ok"}]},
]


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _journal(path: Path) -> dict:
    return {key: (r.messages, r.finish_reasons, r.token_ids) for key, r in read_journal(path).items()}


@pytest.mark.slow
def test_two_cpu_workers_journal_exactly_what_one_worker_does(tmp_path, target):
    data = _write(tmp_path / "in.jsonl", CONVS)
    journals = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
        # every answer of the random target runs to the limit, so nothing is kept (exit 2): the journal is
        # what is compared
        main([*args, "--max-new-tokens", "4", "--device", "cpu", "--workers", str(workers)])
        journals.append(_journal(out / "regenerated.jsonl"))
        assert not list(out.glob("regenerated.jsonl.part-*"))  # the parts were folded into the journal
    assert len(journals[0]) == len(CONVS)
    assert journals[0] == journals[1]


def _worker_that_fails_on_rank_1(rank, device, job, items, journal, errors):
    """Journals its first item to its part like a real worker, then rank 1 fails."""
    record = {"key": items[0][0], "messages": items[0][1], "finish_reasons": ["stop"]}
    with journal_part(journal, rank).open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    if rank == 1:
        errors.put((rank, "CUDA error: out of memory"))
        raise SystemExit(1)


def _worker_that_is_killed(rank, device, job, items, journal, errors):
    import os
    import signal

    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # spawned processes import torch
def test_a_failed_worker_fails_with_its_rank_and_finished_work_stays_journaled(tmp_path):
    items = [(f"k{i}", [{"role": "user", "content": str(i)}]) for i in range(4)]
    journal = tmp_path / "regenerated.jsonl"
    job = LocalJob("unused", Sampling(), None, "hf")
    with pytest.raises(
        FlashdraftError, match=r"worker 1 \(cpu\) failed: CUDA error: out of memory; .*resume"
    ):
        run_workers(items, job, ["cpu", "cpu"], journal, worker=_worker_that_fails_on_rank_1)
    assert not list(tmp_path.glob("*.part-*"))
    kept = read_journal(journal)
    assert "k1" in kept  # what the failed worker finished before failing is in the journal itself


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_is_named(tmp_path):
    items = [(f"k{i}", [{"role": "user", "content": str(i)}]) for i in range(2)]
    job = LocalJob("unused", Sampling(), None, "hf")
    with pytest.raises(FlashdraftError, match=r"worker 0 \(cpu\) failed: exit code -9"):
        run_workers(items, job, ["cpu", "cpu"], tmp_path / "regenerated.jsonl", worker=_worker_that_is_killed)


def test_read_journal_merges_parts_and_ignores_torn_lines(tmp_path):
    journal = tmp_path / "regenerated.jsonl"
    line = {"messages": [], "finish_reasons": ["stop"]}
    journal.write_text(json.dumps({"key": "a", **line}) + "\n")
    journal_part(journal, 0).write_text(json.dumps({"key": "b", **line}) + "\n" + '{"key": "c", "mess')
    journal_part(journal, 1).write_text(json.dumps({"key": "c", **line, "token_ids": [[5, 6]]}) + "\n")
    done = read_journal(journal)
    assert sorted(done) == ["a", "b", "c"]
    assert done["c"].token_ids == [[5, 6]]


def test_device_flags_are_checked_before_work(tmp_path, target, capsys):
    data = _write(tmp_path / "in.jsonl", CONVS)
    base = ["prepare", str(data), "--target", str(target), "--out", str(tmp_path / "o"), "--regenerate"]
    assert main([*base, "--device", "tpu"]) == 2
    assert "--device 'tpu': expected auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    assert main([*base, "--device", "auto", "--workers", "2"]) == 2
    assert "--workers 2: only with --device cpu" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_resolve_devices():
    assert resolve_devices("cpu", 3) == ["cpu"] * 3
    import torch

    if not torch.cuda.is_available():
        assert resolve_devices("auto", 1) == ["cpu"]
        with pytest.raises(FlashdraftError, match="--device cuda: no CUDA GPU"):
            resolve_devices("cuda", 1)
        with pytest.raises(FlashdraftError, match="--device cuda:1: this machine has 0"):
            resolve_devices("cuda:1", 1)
