"""On the device machine with 2 GPUs (marker `gpu`): a cut Qwen3.6-27B-shaped random target (the hybrid
layer pattern: three Gated-DeltaNet layers to each full-attention layer) sharded over 2 GPUs, with the
drafter trained data-parallel on the same 2 GPUs, through the benchmark's one command:
`python -m pytest -m gpu tests/distributed/test_target_parallel_gpu.py -q`. The full 64-layer target:
`flashdraft bench train --nproc-per-node 2 --target qwen3.6-27b --target-parallel 2 --out tp2.json`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one target sharded over both)")
def test_a_cut_27b_target_sharded_over_two_gpus_trains(tmp_path):
    out = tmp_path / "tp2.json"
    command = [sys.executable, "-m", "flashdraft", "bench", "train", "--nproc-per-node", "2"]
    command += ["--target", "qwen3.6-27b", "--target-layers", "8", "--target-parallel", "2"]
    command += ["--steps", "3", "--warmup", "2", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["target_parallel"] == 2 and result["gpus"] == 2 and result["target_layers"] == 8
    assert result["samples_per_s"] > 0
