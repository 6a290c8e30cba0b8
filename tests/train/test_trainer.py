"""The trainer end to end on CPU: learning happens, accumulation is exact, resume after SIGKILL is exact."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.train import checkpoint
from flashdraft.train.checkpoint import CheckpointWriter, list_checkpoints, load_trainer_state
from flashdraft.train.schedule import lr_lambda
from flashdraft.train.trainer import train
from tests.faults import fault_env


def crash_after_checkpoint(monkeypatch, step: int) -> None:
    """An exception right after the step-`step` checkpoint is written (a crash, in-process). The writer's
    thread writes it; the training thread raises the error at its next step's poll."""
    real_save = checkpoint.save_checkpoint

    def save_then_raise(out_dir, at, *args, **kwargs):
        path = real_save(out_dir, at, *args, **kwargs)
        if at == step:
            raise RuntimeError(f"injected failure at step {at}")
        return path

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_raise)


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    lines = []
    for i in range(12):  # period-3 sequences: learnable from the context within a few dozen steps
        n, p = 30 + 3 * i, 4 + i % 5
        cycle = [(11 * i) % 290, (11 * i + 97) % 290, (11 * i + 181) % 290]
        ids = [cycle[j % 3] for j in range(n)]
        lines.append(json.dumps({"input_ids": ids, "loss_mask": [0] * p + [1] * (n - p)}))
    path.write_text("\n".join(lines) + "\n")
    return path


# Tests that check the loss falls by a fixed amount use the paper's position weights: the thresholds are in its
# loss units (D-PACE, the default, normalises differently).
PAPER_WEIGHTS = {"train.position_weight": "decay"}


def _overrides(target: str, data: Path, out: Path, **extra) -> list[str]:
    base = {
        "model.target": target,
        "model.mask_token_id": 300,
        "model.num_layers": 2,
        "model.block_size": 4,
        "data.train": f"[{data}]",
        "train.out_dir": str(out),
        "train.max_steps": 8,
        "train.log_every": 1,
        "train.num_anchors": 6,
        "train.batch_size": 2,
        "train.save_every": 4,
        "train.lr": 2e-3,
        "train.resume": "auto",
        "train.device": "cpu",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_resume_after_sigkill_is_exact_and_logs_each_step_once(tmp_path, qwen3_target, train_file):
    straight = tmp_path / "straight"
    train(load_config(None, _overrides(qwen3_target, train_file, straight)))

    killed = tmp_path / "killed"
    args = ["train", *_overrides(qwen3_target, train_file, killed)]
    proc = subprocess.run(
        [sys.executable, "-m", "flashdraft", *args],
        env={**os.environ, **fault_env("kill-after-log@6")},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    # step 4's checkpoint is written in the background: complete, or (a write slower than two steps on a
    # loaded machine) not there at all, never half there
    written = [p.name for p in list_checkpoints(killed)]
    assert written in (["step-00000004"], []), written
    # train.resume=auto picks up step 4 and replays steps 5 and 6, whose rows the killed run had logged
    proc = subprocess.run([sys.executable, "-m", "flashdraft", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("resumed from" in proc.stdout) == bool(written)

    a, b = _losses(straight), _losses(killed)
    assert sorted(a) == list(range(1, 9)) and sorted(b) == list(range(1, 9))
    assert all(a[s] == b[s] for s in range(1, 9)), (a, b)
    logged = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 9)), logged


# Muon's Newton-Schulz magnifies the summation order's rounding in the gradient; AdamW's update does not
@pytest.mark.parametrize(("optimizer", "tolerance"), [("adamw", 1e-5), ("muon", 1e-3)])
def test_gradient_accumulation_equals_large_batch(tmp_path, qwen3_target, train_file, optimizer, tolerance):
    big = tmp_path / "big"
    acc = tmp_path / "acc"
    train(
        load_config(
            None,
            _overrides(
                qwen3_target,
                train_file,
                big,
                **{"train.max_steps": 3, "train.batch_size": 4, "train.optimizer": optimizer},
            ),
        )
    )
    train(
        load_config(
            None,
            _overrides(
                qwen3_target,
                train_file,
                acc,
                **{
                    "train.max_steps": 3,
                    "train.batch_size": 2,
                    "train.grad_accum": 2,
                    "train.optimizer": optimizer,
                },
            ),
        )
    )
    # Same samples per step (the sampler order does not depend on the micro-batch size), same Σw normalisation.
    a, b = _losses(big), _losses(acc)
    assert all(abs(a[s] - b[s]) < tolerance for s in (1, 2, 3)), (a, b)


def test_the_default_optimizer_is_muon_for_a_narrow_drafter_and_a_resume_keeps_the_runs_own(
    tmp_path, qwen3_target, train_file
):
    """train.optimizer=auto: Muon at 4 x train.lr for this narrow drafter, recorded resolved in config.yaml; a
    run that started with AdamW (explicitly, or before auto existed) resumes under the defaults with AdamW."""
    fresh = tmp_path / "fresh"
    train(load_config(None, _overrides(qwen3_target, train_file, fresh, **{"train.max_steps": 4})))
    recorded = yaml.safe_load((fresh / "config.yaml").read_text())["train"]
    assert (recorded["optimizer"], recorded["muon_lr"]) == ("muon", pytest.approx(8e-3))
    assert set(load_trainer_state(list_checkpoints(fresh)[-1])["optimizer"]) == {"adamw", "muon"}
    adamw = tmp_path / "adamw"
    train(load_config(None, _overrides(qwen3_target, train_file, adamw, **{"train.optimizer": "adamw"})))
    train(load_config(None, _overrides(qwen3_target, train_file, adamw, **{"train.max_steps": 12})))
    assert yaml.safe_load((adamw / "config.yaml").read_text())["train"]["optimizer"] == "adamw"
    assert max(_losses(adamw)) == 12


def test_training_learns_and_keeps_last_checkpoints(tmp_path, qwen3_target, train_file):
    out = tmp_path / "run"
    train(
        load_config(
            None,
            _overrides(
                qwen3_target,
                train_file,
                out,
                **{"train.max_steps": 40, "train.save_every": 10, "train.keep_last": 2, "train.lr": 5e-3},
                **PAPER_WEIGHTS,
            ),
        )
    )
    losses = _losses(out)
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(36, 41)) / 5
    assert last < first - 0.4, (first, last)
    assert [p.name for p in list_checkpoints(out)] == ["step-00000030", "step-00000040"]
    assert (out / "checkpoints" / "step-00000040" / "drafter" / "model.safetensors").is_file()
    assert (out / "tensorboard").is_dir()
    assert not list((out / "checkpoints").glob(".*tmp*"))


def test_warm_start_from_drafter_directory(tmp_path, qwen3_target, train_file):
    out = tmp_path / "first"
    train(load_config(None, _overrides(qwen3_target, train_file, out, **{"train.max_steps": 2})))
    drafter = out / "checkpoints" / "step-00000002" / "drafter"
    second = tmp_path / "second"
    train(
        load_config(
            None,
            _overrides(qwen3_target, train_file, second, **{"train.max_steps": 2, "model.drafter": drafter}),
        )
    )
    assert _losses(second)[1] != _losses(out)[1]


def test_bad_data_names_file_and_line(tmp_path, qwen3_target):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n{"input_ids": [1, 2\n')
    with pytest.raises(FlashdraftError, match=r"bad.jsonl line 2: invalid JSON"):
        train(load_config(None, _overrides(qwen3_target, bad, tmp_path / "o")))
    bad.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}\n')
    with pytest.raises(FlashdraftError, match=r"bad.jsonl line 1: 'loss_mask'"):
        train(load_config(None, _overrides(qwen3_target, bad, tmp_path / "o")))


def test_schedule_warms_up_then_decays_to_floor():
    values = [lr_lambda(s, 100, 0.04, 0.1) for s in range(100)]
    assert values[0] == 0.25 and values[3] == 1.0 and values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(values[3:])) and values[-1] > 0.1


def test_wsd_schedule_holds_the_peak_then_decays_linearly_over_the_last_share():
    values = [lr_lambda(s, 100, 0.04, 0.1, "wsd", 0.2) for s in range(100)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]  # the same warm-up as the cosine
    assert values[4:81] == [1.0] * 77  # the peak held until the last 20 steps
    decay = values[80:]
    steps = [a - b for a, b in itertools.pairwise(decay)]
    assert all(d == pytest.approx(0.9 / 20) for d in steps)  # linear, reaching 0.1 at step 100
    assert decay[-1] == pytest.approx(0.1 + 0.9 / 20)
    # a decay longer than what the warm-up leaves starts right after it
    short = [lr_lambda(s, 10, 0.5, 0.0, "wsd", 0.9) for s in range(10)]
    assert short[:5] == [0.2, 0.4, 0.6, 0.8, 1.0] and short[5:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])


def test_a_run_with_the_wsd_schedule_trains_at_the_peak_then_decays(tmp_path, qwen3_target, train_file):
    out = tmp_path / "wsd"
    overrides = {"train.lr_schedule": "wsd", "train.decay_ratio": 0.25, "train.warmup_ratio": 0.125}
    train(load_config(None, _overrides(qwen3_target, train_file, out, **overrides)))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if r["kind"] == "train"}
    # 8 steps: 1 of warm-up, the peak until the last 2, each logged lr the one its step trained at
    expected = [2e-3 * lr_lambda(s, 8, 0.125, 0.0, "wsd", 0.25) for s in range(8)]
    assert [lrs[s] for s in range(1, 9)] == pytest.approx(expected)
    assert expected[:6] == [2e-3] * 6 and expected[6:] == pytest.approx([2e-3, 1e-3])


def test_held_out_simulated_acceptance_picks_the_best_checkpoint(tmp_path, qwen3_target, train_file):
    from flashdraft.model.drafter_dir import load_drafter

    out = tmp_path / "run"
    train(
        load_config(
            None,
            _overrides(
                qwen3_target,
                train_file,
                out,
                **{
                    "train.max_steps": 12,
                    "train.eval_every": 4,
                    "data.eval": f"[{train_file}]",
                    "train.lr": 5e-3,
                },
            ),
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12] and all(
        1.0 <= r["tau"] <= 4.0 and "acc@1" in r for r in evals
    )
    best = load_drafter(out / "best")
    assert best.spec.block_size == 4


def _straight_then_crash_and_resume(tmp_path, target, data, monkeypatch, settings) -> tuple[dict, dict, dict]:
    """A straight run, and a run that crashes after its step-4 checkpoint and resumes: their losses by
    step and the crashed run's step-4 trainer state. Each process reserves the checkpoint writer's host
    buffers once, after its first step (1, 1, then 5 for the resume)."""
    reserved: list[int] = []
    real_reserve = CheckpointWriter.reserve

    def recording_reserve(self, drafter, trainer_state):
        reserved.append(trainer_state["step"])
        return real_reserve(self, drafter, trainer_state)

    monkeypatch.setattr(CheckpointWriter, "reserve", recording_reserve)
    straight = tmp_path / "straight"
    train(load_config(None, _overrides(target, data, straight, **settings)))
    crashed = tmp_path / "crashed"
    with monkeypatch.context() as patch:
        crash_after_checkpoint(patch, 4)
        with pytest.raises(RuntimeError, match="injected failure at step 4"):
            train(load_config(None, _overrides(target, data, crashed, **settings)))
    state = torch.load(crashed / "checkpoints" / "step-00000004" / "trainer_state.pt", weights_only=True)
    train(load_config(None, _overrides(target, data, crashed, **settings)))
    assert reserved == [1, 1, 5], reserved
    return _losses(straight), _losses(crashed), state


def _assert_exact_resume_that_learns(a: dict, b: dict) -> None:
    assert sorted(b) == list(range(1, 13)) and all(a[s] == b[s] for s in range(1, 13)), (a, b)
    assert sum(a[s] for s in (10, 11, 12)) < sum(a[s] for s in (1, 2, 3)) - 0.3, a


def test_bf16_master_weights_resume_exactly_and_learn(tmp_path, qwen3_target, train_file, monkeypatch):
    """train.dtype=bf16: bf16 drafter weights, fp32 masters in the optimizer state; a crash after the step-4
    checkpoint and a resume give the straight run's losses exactly, and the loss still falls."""
    bf16 = {
        "train.optimizer": "adamw",  # AdamW's masters (test_muon_resumes_exactly_and_learns: Muon's)
        "train.dtype": "bf16",
        "train.lr": 5e-3,
        "train.max_steps": 12,
        "train.grad_accum": 2,
        "train.batch_size": 1,
        **PAPER_WEIGHTS,
    }
    a, b, state = _straight_then_crash_and_resume(tmp_path, qwen3_target, train_file, monkeypatch, bf16)
    assert all(s["master"].dtype == torch.float32 for s in state["optimizer"]["state"])
    # the drafter copy is in the weights' dtype (bf16): the fp32 masters are in the optimizer state
    weights = load_file(
        tmp_path / "crashed" / "checkpoints" / "step-00000004" / "drafter" / "model.safetensors"
    )
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    _assert_exact_resume_that_learns(a, b)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_muon_resumes_exactly_and_learns(tmp_path, qwen3_target, train_file, monkeypatch, dtype):
    """train.optimizer=muon in both precisions (torch's Muon over fp32 weights; fp32 masters of bf16 ones):
    a crash after the step-4 checkpoint and a resume give the straight run's losses exactly (the
    momenta, masters and both parts' lr schedule restored), and the loss falls."""
    muon = {
        "train.optimizer": "muon",
        "train.dtype": dtype,
        "train.lr": 5e-3,
        "train.max_steps": 12,
        "train.grad_accum": 2,
        "train.batch_size": 1,
        **PAPER_WEIGHTS,
    }
    a, b, state = _straight_then_crash_and_resume(tmp_path, qwen3_target, train_file, monkeypatch, muon)
    assert set(state["optimizer"]) == {"adamw", "muon"}
    _assert_exact_resume_that_learns(a, b)


def test_a_fresh_start_into_an_earlier_runs_checkpoints_is_refused(tmp_path, qwen3_target, train_file):
    """resume=never into an out_dir with checkpoints would interleave two runs' step directories (and a later
    resume=auto could pick the older run's last step): refused before any work, naming the way out."""
    from flashdraft.train.checkpoint import find_resume

    out = tmp_path / "run"
    train(
        load_config(
            None, _overrides(qwen3_target, train_file, out, **{"train.max_steps": 2, "train.save_every": 2})
        )
    )
    with pytest.raises(FlashdraftError, match=r"train.resume=never.*step-00000002.*train.resume=auto"):
        train(
            load_config(
                None, _overrides(qwen3_target, train_file, out, **{"train.resume": "never", "train.lr": 1.0})
            )
        )
    assert "lr: 1.0" not in (out / "config.yaml").read_text()  # the earlier run's files are untouched
    assert find_resume("auto", out).path == out / "checkpoints" / "step-00000002"


def test_resume_with_another_precision_names_the_checkpoint(tmp_path, qwen3_target, train_file):
    out = tmp_path / "run"
    train(
        load_config(
            None,
            _overrides(
                qwen3_target,
                train_file,
                out,
                **{"train.max_steps": 2, "train.save_every": 2, "train.dtype": "bf16"},
            ),
        )
    )
    # The recorded config shows the change first; allowed, the optimizer state itself does not fit.
    with pytest.raises(FlashdraftError, match=r"train.dtype 'bf16' -> 'auto'"):
        train(load_config(None, _overrides(qwen3_target, train_file, out, **{"train.max_steps": 4})))
    allowed = {"train.max_steps": 4, "train.resume_allow_changes": "true"}
    with pytest.raises(FlashdraftError, match=r"optimizer state in .*step-00000002 does not fit this run"):
        train(load_config(None, _overrides(qwen3_target, train_file, out, **allowed)))


def test_profile_steps_write_a_report_of_the_loops_own_steps(tmp_path, qwen3_target, train_file, capsys):
    from flashdraft.train.trainer import train

    out = tmp_path / "run"
    extra = {"train.max_steps": 5, "train.profile_start": 1, "train.profile_steps": 2}
    train(load_config(None, _overrides(str(qwen3_target), train_file, out, **extra)))
    (report,) = (out / "profile").glob("*.txt")
    assert report.name == "rank0_steps2-3.txt"
    text = report.read_text()
    assert text.startswith("steps 2-3 on cpu (rank 0): ") and "ms per step wall" in text
    assert "aten::mm" in text or "aten::addmm" in text  # the drafter's own matmuls were recorded
    trace = json.loads((out / "profile" / "rank0_steps2-3.trace.json").read_text())
    assert trace["traceEvents"]
    printed = capsys.readouterr().out
    assert "profile of steps 2-3" in printed
    # the start-up line says where the time before the first step went
    assert "set up in " in printed and "target " in printed and "drafter_and_optimizer " in printed
    assert not [p for p in (out / "profile").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_a_profile_cut_short_by_the_end_of_training_is_still_written(tmp_path, qwen3_target, train_file):
    from flashdraft.train.trainer import train

    out = tmp_path / "run"
    extra = {"train.max_steps": 3, "train.profile_start": 1, "train.profile_steps": 10}
    train(load_config(None, _overrides(str(qwen3_target), train_file, out, **extra)))
    assert [p.name for p in (out / "profile").glob("*.txt")] == ["rank0_steps2-3.txt"]


def test_device_busy_time_is_the_union_of_kernel_intervals():
    from flashdraft.train.profiling import device_busy_seconds

    events = [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "ts": 5, "dur": 10},  # overlaps the first: 0..15
        {"ph": "X", "cat": "gpu_memcpy", "ts": 20, "dur": 5},
        {"ph": "X", "cat": "gpu_user_annotation", "ts": 0, "dur": 100},  # a range, not work
        {"ph": "X", "cat": "cpu_op", "ts": 30, "dur": 50},
        {"ph": "X", "cat": "kernel", "ts": 21, "dur": 2},  # inside the copy
    ]
    assert device_busy_seconds({"traceEvents": events}) == pytest.approx(20e-6)
