"""The trainer's safety rules (docs/training-safety.md): checkpoints that cannot run code, that survive a
torn file and a full disk, non-finite steps that are skipped and stop the run, resumes that refuse
changed settings."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.train import checkpoint as checkpoint_module
from flashdraft.train.checkpoint import list_checkpoints, load_trainer_state, verify_checkpoint
from flashdraft.train.objective import Objective
from flashdraft.train.trainer import train
from tests.faults import fault_env
from tests.filesystems import tmpfs
from tests.processes import run_or_dump

from .test_trainer import _overrides, train_file  # noqa: F401 - train_file is a fixture


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _tensors(tree) -> list[torch.Tensor]:
    """Every tensor in a nested state dict (AdamW's, or Muon's with its AdamW part)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list | tuple) else []
    return [t for item in items for t in _tensors(item)]


def _run(target: str, data: Path, out: Path, **extra) -> dict:
    return train(load_config(None, _overrides(target, data, out, **extra)))


class _RunsCode:
    """Unpickling this calls Path.touch(marker): a stand-in for any code a pickle can run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


# --------------------------------------------------------------------------- checkpoints


def test_a_trainer_state_that_would_run_code_is_refused_and_the_code_does_not_run(tmp_path):
    checkpoint = tmp_path / "step-00000002"
    checkpoint.mkdir()
    marker = tmp_path / "ran"
    torch.save({"format": 2, "step": 2, "payload": _RunsCode(marker)}, checkpoint / "trainer_state.pt")
    with pytest.raises(FlashdraftError) as info:
        load_trainer_state(checkpoint)
    message = str(info.value)
    assert "trainer_state.pt: refused" in message and "could run code" in message and "\n" not in message
    assert not marker.exists()


def test_resume_auto_skips_damaged_checkpoints_and_says_which_and_why(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
    capsys,
):
    out = tmp_path / "run"
    _run(qwen3_target, train_file, out, **{"train.max_steps": 6, "train.save_every": 2})
    step2, step4, step6 = list_checkpoints(out)
    torn = step6 / "trainer_state.pt"  # a torn write: the first half of the file
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    weights = step4 / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    dead_writer = out / "checkpoints" / ".step-00000008.999999999-1.partial"  # pid 999999999: not alive
    dead_writer.mkdir()
    capsys.readouterr()

    _run(qwen3_target, train_file, out, **{"train.max_steps": 8, "train.save_every": 2})
    printed = capsys.readouterr().out
    assert "resume: skipping checkpoint step-00000006: " in printed and "trainer_state.pt" in printed
    assert "resume: skipping checkpoint step-00000004: " in printed and "model.safetensors" in printed
    assert f"resumed from {step2} at step 2" in printed
    assert "removed an incomplete checkpoint" in printed and not dead_writer.exists()
    # set aside, so that pruning and later resumes pass them by; the new ones verify
    assert (out / "checkpoints" / "step-00000006.damaged").is_dir()
    assert [p.name for p in list_checkpoints(out)][-1] == "step-00000008"
    verify_checkpoint(out / "checkpoints" / "step-00000008")


def test_a_full_disk_during_a_checkpoint_is_named_and_leaves_earlier_checkpoints_intact(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
):
    # One checkpoint of this drafter (1 layer) takes about 530 kB: the first fits in 800 kB, a second does not.
    with tmpfs(tmp_path / "disk", "800k") as disk:
        out = disk / "run"
        with pytest.raises(FlashdraftError) as info:
            _run(
                qwen3_target,
                train_file,
                out,
                # AdamW's state sizes the disk (Muon's adds its momenta)
                **{
                    "model.num_layers": 1,
                    "train.max_steps": 4,
                    "train.save_every": 2,
                    "train.optimizer": "adamw",
                },
            )
        assert str(info.value).startswith("checkpoint step 4: disk full") and "\n" not in str(info.value)
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]  # no temporary left
        verify_checkpoint(out / "checkpoints" / "step-00000002")


# --------------------------------------------------------------------------- non-finite steps


def _nan_loss_on(monkeypatch, steps: set[int]) -> None:
    """The loss (and so every gradient) is nan on the given optimizer steps (grad_accum 1)."""
    real_call = Objective.__call__
    calls = {"n": 0}

    def call(self, *args, **kwargs):
        out = real_call(self, *args, **kwargs)
        if self.drafter.training:
            calls["n"] += 1
            if calls["n"] in steps:
                out.loss_sum = out.loss_sum * torch.tensor(math.nan)
        return out

    monkeypatch.setattr(Objective, "__call__", call)


def test_non_finite_steps_are_skipped_and_counted_and_the_weights_stay_finite(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
    monkeypatch,
):
    _nan_loss_on(monkeypatch, {3, 5})
    out = tmp_path / "run"
    result = _run(qwen3_target, train_file, out, **{"train.max_steps": 6, "train.max_bad_steps": 2})
    assert result["skipped_steps"] == 2
    rows = {r["step"]: r for r in _rows(out)}
    assert [rows[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 2]
    assert math.isnan(rows[3]["loss"]) and math.isfinite(rows[4]["loss"])
    # a skipped step does not advance the schedule: step 4 is applied with the lr step 3 would have had
    assert rows[3]["lr"] == rows[2]["lr"]
    checkpoint = list_checkpoints(out)[-1]
    drafter = load_drafter(checkpoint / "drafter")
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    state = load_trainer_state(checkpoint)
    assert state["skipped_steps"] == 2
    assert all(torch.isfinite(t).all() for t in _tensors(state["optimizer"]))


def test_too_many_non_finite_steps_in_a_row_stop_the_run_without_a_checkpoint(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
    monkeypatch,
):
    _nan_loss_on(monkeypatch, {3, 4, 5})
    # every write outlasts a step, so step 4's is still in progress when step 5 fails the run: the error
    # surfaces only once that write is complete (it once raced the test's listing of the checkpoints)
    write = checkpoint_module.save_checkpoint

    def slow_write(*args, **kwargs):
        time.sleep(1.0)
        return write(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", slow_write)
    out = tmp_path / "run"
    with pytest.raises(FlashdraftError) as info:
        _run(
            qwen3_target,
            train_file,
            out,
            **{"train.max_steps": 8, "train.save_every": 1, "train.max_bad_steps": 3},
        )
    message = str(info.value)
    assert message.startswith("step 5: 3 steps in a row had a non-finite loss or gradient norm")
    assert "train.lr=" in message and "data.train" in message and "\n" not in message
    assert [p.name for p in list_checkpoints(out)] == [
        "step-00000001",
        "step-00000002",
        "step-00000003",
        "step-00000004",
    ][-3:]  # keep_last 3; nothing written at step 5


def test_a_full_disk_that_fails_the_metrics_before_the_checkpoint_reports_the_checkpoint(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
    monkeypatch,
):
    """The disk fills as step 2's checkpoint is written; under load the next step's metrics row can hit it
    before the background write reports its failure. The error raised is the checkpoint's (the step, the
    earlier checkpoints intact, how to resume), chained from the metrics one, not a bare OSError."""
    from flashdraft.train.metrics import MetricsLogger

    def full_disk_write(out_dir, step, *args, **kwargs):
        time.sleep(1.0)  # outlasts step 3: its metrics row fails first
        raise FlashdraftError(f"checkpoint step {step}: disk full writing {out_dir}: No space left on device")

    log = MetricsLogger.log

    def log_on_a_full_disk(self, step, metrics, kind="train", console=True):
        if step >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return log(self, step, metrics, kind, console)

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", full_disk_write)
    monkeypatch.setattr(MetricsLogger, "log", log_on_a_full_disk)
    with pytest.raises(FlashdraftError, match=r"^checkpoint step 2: disk full") as info:
        _run(qwen3_target, train_file, tmp_path / "run", **{"train.max_steps": 6, "train.save_every": 2})
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path, qwen3_target, train_file):  # noqa: F811
    out, run_dir = tmp_path / "run", tmp_path / "records"
    overrides = _overrides(
        qwen3_target,
        train_file,
        out,
        **{"train.max_steps": 4, "train.batch_size": 1, "train.resume": "never"},
    )
    proc = run_or_dump(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "flashdraft",
            "train",
            *overrides,
        ],
        # rank 1 only; its gradients stay finite
        timeout=480,
        env={**os.environ, **fault_env("inf-loss@3:1"), "FLASHDRAFT_RUN_DIR": str(run_dir)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = [json.loads((run_dir / f"rank{r}" / "final.json").read_text()) for r in (0, 1)]
    assert [f["skipped_steps"] for f in finals] == [1, 1], finals


# --------------------------------------------------------------------------- resume


def test_resume_with_changed_settings_is_refused_listing_them_unless_allowed(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
    capsys,
):
    out = tmp_path / "run"
    _run(qwen3_target, train_file, out, **{"train.max_steps": 2, "train.save_every": 2})
    recorded = (out / "config.yaml").read_text()
    changed = {"train.max_steps": 4, "train.num_anchors": 5, "train.log_every": 3}  # log_every: exempt
    with pytest.raises(FlashdraftError) as info:
        _run(qwen3_target, train_file, out, **changed)
    message = str(info.value)
    assert "train.num_anchors 6 -> 5" in message and "step-00000002" in message
    assert "log_every" not in message and "max_steps" not in message  # a longer run is allowed
    assert (out / "config.yaml").read_text() == recorded  # refused before anything is written
    capsys.readouterr()
    _run(qwen3_target, train_file, out, **changed, **{"train.resume_allow_changes": "true"})
    assert "train.num_anchors 6 -> 5" in capsys.readouterr().out
    assert [p.name for p in list_checkpoints(out)][-1] == "step-00000004"


def test_config_yaml_records_the_drafters_values_and_a_disagreement_is_refused(
    tmp_path,
    qwen3_target,
    train_file,  # noqa: F811
):
    import yaml

    first = tmp_path / "first"
    _run(qwen3_target, train_file, first, **{"train.max_steps": 1})
    drafter = first / "checkpoints" / "step-00000001" / "drafter"
    recorded = yaml.safe_load((first / "config.yaml").read_text())["model"]
    assert recorded["block_size"] == 4 and recorded["target_layer_ids"]  # resolved, not null

    second = tmp_path / "second"
    base = _overrides(qwen3_target, train_file, second, **{"train.max_steps": 1, "model.drafter": drafter})
    unset = [o for o in base if not o.startswith(("model.block_size", "model.num_layers", "model.mask"))]
    train(load_config(None, unset))
    model = yaml.safe_load((second / "config.yaml").read_text())["model"]
    assert (model["block_size"], model["num_layers"], model["mask_token_id"]) == (4, 2, 300)

    with pytest.raises(FlashdraftError, match=r"model.block_size=8 disagrees with model.drafter=.*: 4\)"):
        train(load_config(None, [*unset, "model.block_size=8", f"train.out_dir={tmp_path / 'third'}"]))


def test_a_checkpoint_from_before_a_setting_existed_resumes_when_the_setting_keeps_its_default():
    from flashdraft.config import Config, to_dict
    from flashdraft.train.resume import check_resume_config

    now = to_dict(Config())
    older = to_dict(Config())
    del older["train"]["loss"], older["train"]["position_weight"]  # written before these fields existed
    # position_weight's default has changed since it was added: the old run weighted by 'decay'
    with pytest.raises(FlashdraftError, match=r"train.position_weight 'decay' -> 'dpace'"):
        check_resume_config(older, 1, now, 1, allow_changes=False, source="ckpt", log=lambda _: None)
    now["train"]["position_weight"] = "decay"
    check_resume_config(older, 1, now, 1, allow_changes=False, source="ckpt", log=lambda _: None)
    now["train"]["loss"] = "kl"  # not the default: the old run did not train with it
    with pytest.raises(FlashdraftError, match=r"train.loss 'ce' -> 'kl'"):
        check_resume_config(older, 1, now, 1, allow_changes=False, source="ckpt", log=lambda _: None)
