"""Data parallelism from torch (DDP, FSDP2) under torchrun with gloo on the CPU: N ranks with train.batch_size b
train like one process with batch N·b (same seed, same global micro-batch, same grad_accum), and a checkpoint
written by N ranks resumes on M ranks on the same trajectory.

Tolerance: losses within 1e-5 absolute and gradient norms within 1e-4 relative (fp32 sums in another order
over ranks); the trajectories are not bitwise equal and need not be."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import run_or_dump

pytestmark = pytest.mark.slow

# AdamW on every side: fsdp cannot run Muon (train.optimizer=auto picks AdamW there, Muon for one process of
# this narrow drafter), and Muon's Newton-Schulz magnifies the ranks' summation order past these tolerances
# (its own test below compares it at its own)
COMMON = {
    "train.log_every": 1,
    "train.device": "cpu",
    "distributed.timeout_minutes": 1,
    "train.optimizer": "adamw",
}


def _args(**settings) -> list[str]:
    return [f"{k}={v}" for k, v in {**COMMON, **settings}.items()]


def _train(setup, out: Path, ranks: int, **settings) -> subprocess.CompletedProcess:
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    )
    cmd = [sys.executable, *launcher, "-m", "flashdraft", "train", str(setup["config"])]
    proc = run_or_dump([*cmd, *_args(**settings), f"train.out_dir={out}"], timeout=480)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _curve(out: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"}


def _assert_same(reference: dict, other: dict, steps: list[int]) -> None:
    for step in steps:
        (loss_a, norm_a), (loss_b, norm_b) = reference[step], other[step]
        assert loss_b == pytest.approx(loss_a, abs=1e-5), f"step {step}: loss {loss_b} vs {loss_a}"
        assert norm_b == pytest.approx(norm_a, rel=1e-4), f"step {step}: grad norm {norm_b} vs {norm_a}"


@pytest.fixture(scope="module")
def single(setup, tmp_path_factory):
    """One-process reference curves, one per (global micro-batch, grad_accum, steps)."""
    cache: dict[tuple, dict] = {}

    def get(batch: int, accum: int, steps: int) -> dict:
        if (batch, accum, steps) not in cache:
            out = tmp_path_factory.mktemp("single")
            _train(
                setup,
                out,
                1,
                **{
                    "train.batch_size": batch,
                    "train.grad_accum": accum,
                    "train.max_steps": steps,
                    "train.resume": "never",
                },
            )
            cache[batch, accum, steps] = _curve(out)
        return cache[batch, accum, steps]

    return get


# 16 samples: with 3 ranks x 1 the epoch's last micro-batch holds one sample and two ranks have none (they
# run a zero-weight micro-batch); 2 ranks x 3 with grad_accum 2 cross the epoch inside a step.
CASES = [
    pytest.param("ddp", 2, 3, 2, 4, id="ddp-2x3-accum2"),
    pytest.param("fsdp", 2, 3, 2, 4, id="fsdp-2x3-accum2"),
    pytest.param("ddp", 3, 1, 1, 7, id="ddp-3x1-empty-ranks"),
    pytest.param("fsdp", 3, 1, 1, 7, id="fsdp-3x1-empty-ranks"),
]


@pytest.mark.parametrize("kind,ranks,batch,accum,steps", CASES)
def test_ranks_equal_one_process_with_the_global_batch(
    setup, single, tmp_path, kind, ranks, batch, accum, steps
):
    reference = single(ranks * batch, accum, steps)
    out = tmp_path / kind
    proc = _train(
        setup,
        out,
        ranks,
        **{
            "distributed.data_parallel": kind,
            "train.batch_size": batch,
            "train.grad_accum": accum,
            "train.max_steps": steps,
            "train.resume": "never",
        },
    )
    assert f"x {ranks} process(es)" in proc.stdout
    curve = _curve(out)
    assert sorted(curve) == list(range(1, steps + 1))
    _assert_same(reference, curve, list(curve))
    assert (out / "checkpoints" / f"step-{steps:08d}" / "drafter" / "model.safetensors").is_file()


# A constant learning rate: a run of 3 steps resumed to 6 follows the same schedule as 6 straight steps.
CONSTANT_LR = {"train.warmup_ratio": 0, "train.min_lr_ratio": 1.0}


@pytest.mark.parametrize(
    "first,second,kind",
    [(2, 1, "ddp"), (1, 2, "ddp"), (2, 1, "fsdp"), (1, 2, "fsdp")],
    ids=["2-to-1", "1-to-2", "fsdp-2-to-1", "1-to-fsdp-2"],
)
def test_a_checkpoint_resumes_on_another_world_size_on_the_same_trajectory(
    setup, tmp_path, first, second, kind
):
    straight = tmp_path / "straight"
    _train(setup, straight, 1, **CONSTANT_LR, **{"train.batch_size": 4, "train.max_steps": 6})
    out = tmp_path / "resumed"
    with_kind = {**CONSTANT_LR, "distributed.data_parallel": kind}
    _train(setup, out, first, **with_kind, **{"train.batch_size": 4 // first, "train.max_steps": 3})
    proc = _train(setup, out, second, **with_kind, **{"train.batch_size": 4 // second, "train.max_steps": 6})
    if kind == "fsdp":  # fsdp's optimizer state is keyed by parameter name, one process's by position
        assert "the optimizer state moves from" in proc.stdout
    assert f"{first} -> {second} ranks with the same global micro-batch" in proc.stdout
    assert "resumed from" in proc.stdout and "step-00000003" in proc.stdout
    _assert_same(_curve(straight), _curve(out), [4, 5, 6])


def test_resume_with_another_global_micro_batch_is_refused(setup, tmp_path):
    out = tmp_path / "run"
    _train(setup, out, 1, **{"train.batch_size": 4, "train.max_steps": 2})
    cmd = [sys.executable, "-m", "flashdraft", "train", str(setup["config"])]
    proc = run_or_dump(
        [*cmd, *_args(**{"train.batch_size": 2, "train.max_steps": 4}), f"train.out_dir={out}"], timeout=300
    )
    assert proc.returncode != 0
    assert "global micro-batch (train.batch_size x ranks) 4 x 1 -> 2 x 1" in proc.stderr + proc.stdout


def test_muon_ranks_share_the_newton_schulz_products_and_train_like_one_process(setup, tmp_path):
    """train.optimizer=muon in bf16 (fp32 masters: MasterWeightMuon) on 2 ddp ranks: the ranks split the
    Newton–Schulz products (said at start) and follow one process's curve with the global batch. bf16
    gradients round differently when summed over ranks, hence the looser tolerance."""
    settings = {
        "train.optimizer": "muon",
        "train.dtype": "bf16",
        "train.grad_accum": 1,
        "train.max_steps": 4,
        "train.resume": "never",
    }
    one = tmp_path / "one"
    _train(setup, one, 1, **settings, **{"train.batch_size": 6})
    two = tmp_path / "two"
    proc = _train(setup, two, 2, **settings, **{"train.batch_size": 3, "distributed.data_parallel": "ddp"})
    assert "Newton–Schulz products shared by 2 ranks" in proc.stdout + proc.stderr
    reference, shared = _curve(one), _curve(two)
    assert sorted(shared) == sorted(reference)
    for step in reference:
        (loss_a, norm_a), (loss_b, norm_b) = reference[step], shared[step]
        assert loss_b == pytest.approx(loss_a, rel=1e-3), f"step {step}: loss {loss_b} vs {loss_a}"
        assert norm_b == pytest.approx(norm_a, rel=1e-2), f"step {step}: grad norm {norm_b} vs {norm_a}"
