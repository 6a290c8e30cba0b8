"""The trainer's held-out validation pass (issue 29): it says how far it is, keeps the heartbeat beating,
and a stop request abandons it after the batch in flight, with a checkpoint and the one resume hint."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from flashdraft.config import load_config
from flashdraft.run_protocol import Heartbeat, resume_hint
from flashdraft.train import validation
from flashdraft.train.checkpoint import list_checkpoints
from flashdraft.train.objective import Objective
from flashdraft.train.trainer import train

from .test_trainer import _overrides, train_file  # noqa: F401 - train_file is a fixture

# 12 held-out samples in batches of 2: six batches per pass
EVAL = {"train.eval_every": 4, "train.max_steps": 8, "train.save_every": 100, "train.batch_size": 2}


class RecordingHeartbeat(Heartbeat):
    """A heartbeat without a run directory that keeps every beat's phase and fields."""

    def __init__(self):
        super().__init__(None)
        self.beats: list[tuple[str | None, dict]] = []

    def beat(self, phase=None, force=False, **fields):
        self.beats.append((phase, fields))
        super().beat(phase, force, **fields)


def _config(target: str, data: Path, out: Path, **extra):
    return load_config(None, _overrides(target, data, out, **{**EVAL, "data.eval": f"[{data}]", **extra}))


def test_a_validation_pass_prints_its_progress_and_beats_every_batch(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
    monkeypatch,
    capsys,
):
    monkeypatch.setattr(validation, "PROGRESS_EVERY_S", 0.0)  # a line per batch: the pass is quick here
    heartbeat = RecordingHeartbeat()
    train(_config(qwen3_target, train_file, tmp_path / "run"), heartbeat)
    printed = capsys.readouterr().out
    for step in (4, 8):
        lines = [line for line in printed.splitlines() if line.startswith(f"step {step}: evaluating, batch")]
        assert [line.split("batch ")[1].split(" ")[0] for line in lines] == [f"{i}/6" for i in range(1, 7)]
    batches = [fields["eval_batch"] for phase, fields in heartbeat.beats if "eval_batch" in fields]
    assert batches == [1, 2, 3, 4, 5, 6] * 2
    assert all(phase == "evaluating" for phase, fields in heartbeat.beats if "eval_batch" in fields)


def test_a_stop_during_validation_abandons_the_pass_and_checkpoints_at_once(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
    monkeypatch,
    capsys,
):
    """SIGTERM arrives during the second batch of step 4's pass: no third batch, no eval row, a checkpoint
    of step 4, the run stopped there with the resume hint of a plain `flashdraft train`."""
    real_call = Objective.__call__
    eval_batches = {"n": 0}

    def call(self, *args, **kwargs):
        out = real_call(self, *args, **kwargs)
        if not self.drafter.training:
            eval_batches["n"] += 1
            if eval_batches["n"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler only sets its stop flag
        return out

    monkeypatch.setattr(Objective, "__call__", call)
    monkeypatch.delenv("FLASHDRAFT_RUN_DIR", raising=False)
    out = tmp_path / "run"
    result = train(_config(qwen3_target, train_file, out))
    assert eval_batches["n"] == 2
    assert result["outcome"] == "stopped" and result["steps"] == 4
    assert [p.name for p in list_checkpoints(out)] == ["step-00000004"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["kind"] == "eval"]
    printed = capsys.readouterr().out
    assert "step 4: evaluation abandoned for the stop request" in printed
    assert f"stopped at step 4; {resume_hint(None)}" in printed and "train.resume=auto" in printed
    assert (
        "checkpoint step 4: " in printed and " MB written in " in printed
    )  # the write, its size and seconds


def test_the_resume_hint_of_a_launched_run_is_the_launch_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLASHDRAFT_RUNS_DIR", raising=False)
    assert resume_hint(tmp_path / "runs" / "demo-1") == "resume with flashdraft launch --resume demo-1"
    elsewhere = tmp_path / "other" / "demo-2"
    assert (
        resume_hint(elsewhere)
        == f"resume with flashdraft launch --resume demo-2 --runs-dir {elsewhere.parent}"
    )
    monkeypatch.setenv("FLASHDRAFT_RUN_DIR", str(tmp_path / "runs" / "demo-3"))
    assert resume_hint() == "resume with flashdraft launch --resume demo-3"
    monkeypatch.delenv("FLASHDRAFT_RUN_DIR")
    assert "flashdraft train" in resume_hint() and "train.resume=auto" in resume_hint()
