"""Real τ during training with several ranks (gloo on the CPU): the main rank decodes, with DDP alone and
with an FSDP-sharded drafter after the whole state is gathered (a collective); every rank leaves the
evaluation together, and the real τ logged is the one-process run's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.processes import run_or_dump

pytestmark = pytest.mark.slow

REAL = {
    "train.device": "cpu",
    "train.max_steps": 4,
    "train.eval_every": 2,
    "train.real_eval_prompts": 2,
    "train.real_eval_new_tokens": 8,
    "train.best_by": "real_tau",
    "train.resume": "never",
    "distributed.timeout_minutes": 2,
}


def _train(setup, out: Path, ranks: int, **settings) -> None:
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    )
    data = setup["root"] / "train.jsonl"
    args = [f"{k}={v}" for k, v in {**REAL, "data.eval": f"[{data}]", **settings}.items()]
    cmd = [sys.executable, *launcher, "-m", "flashdraft", "train", str(setup["config"]), *args]
    proc = run_or_dump([*cmd, f"train.out_dir={out}"], timeout=480)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _real(out: Path) -> dict[int, tuple[float, int]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["real_tau"], r["real_tokens"]) for r in rows if r["kind"] == "eval"}


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_ranks_log_the_real_tau_of_one_process(setup, tmp_path, kind):
    single = tmp_path / "single"
    _train(setup, single, 1, **{"train.batch_size": 4})
    out = tmp_path / kind
    _train(setup, out, 2, **{"train.batch_size": 2, "distributed.data_parallel": kind})
    reference, real = _real(single), _real(out)
    assert sorted(real) == [2, 4] and real == reference
    assert (out / "best" / "model.safetensors").is_file()
