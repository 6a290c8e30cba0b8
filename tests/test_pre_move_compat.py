"""What flashdraft wrote before the house moved (issue 30) still loads: tests/fixtures/pre_move/ was
written by commit a3e2a80 (tests/fixtures/make_pre_move.py says how): a tiny target, a shard set from
`prepare`, and a run stopped after its step-4 checkpoint. Today's trainer resumes that run and trains
steps 5-8 to the very losses the old code's straight run had; the old run's config tree loads; every
flag of every old command is still a flag of that command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flashdraft.cli import build_parser
from flashdraft.config import load_config
from flashdraft.train.trainer import train
from tests.fixtures.make_pre_move import command_flags, overrides

FIXTURE = Path(__file__).parent / "fixtures" / "pre_move"


@pytest.fixture
def old(tmp_path, monkeypatch) -> Path:
    """A copy of the fixture, the working directory (its run's settings hold paths relative to it)."""
    root = tmp_path / "pre_move"
    shutil.copytree(FIXTURE, root)
    monkeypatch.chdir(root)
    return root


def test_a_run_from_before_the_move_resumes_to_the_old_codes_own_losses(old, capsys):
    train(load_config(None, overrides(Path("target"), Path("shards"), Path("run"), 8)))
    assert "resumed from" in capsys.readouterr().out
    rows = [json.loads(line) for line in Path("run/metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))  # each step logged once
    straight = json.loads(Path("straight_losses.json").read_text())
    assert losses == pytest.approx({int(step): loss for step, loss in straight.items()}, rel=1e-6, abs=0)


def test_the_old_runs_config_tree_loads():
    config = load_config(FIXTURE / "run" / "config.yaml")
    assert config.train.max_steps == 8 and config.model.num_layers == 1 and config.model.mask_token_id == 60


def test_every_old_commands_flags_are_still_its_flags():
    old = json.loads((FIXTURE / "cli_flags.json").read_text())
    now = command_flags(build_parser())
    assert not [c for c in old if c not in now]
    assert {c: sorted(set(flags) - set(now[c])) for c, flags in old.items() if set(flags) - set(now[c])} == {}
