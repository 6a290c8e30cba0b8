"""GPU checks (marker `gpu`) of what the lead measures: every train.loss / train.position_weight choice and
DFlash2 (with sliding layers) run compiled with flex attention and equal the exact SDPA path; the trainer
runs them end to end. Run on the device machine: `python -m pytest -m gpu tests/model/test_dflash2_gpu.py`."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from flashdraft.distributed.parallelize import parallelize
from flashdraft.model.drafter_dir import make_drafter_config, new_drafter
from flashdraft.model.target import TargetModel
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from tests.train.helpers import token_batch

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    torch._dynamo.reset()
    yield


def _pair(target_dir: str, arch: str, sliding: bool):
    target = TargetModel.load(target_dir, [1, 4], device=CUDA, dtype=torch.float32)
    config = make_drafter_config(
        target.config,
        num_layers=2,
        block_size=4,
        mask_token_id=300,
        target_layer_ids=[1, 4],
        layer_types=["sliding_attention", "full_attention"] if sliding else None,
        sliding_window=7 if sliding else None,
        arch=arch,
    )
    drafter = new_drafter(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from the identity convolutions and unit norms: every parameter matters
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return drafter, target


@pytest.mark.parametrize(
    "arch,loss,weighting,sliding",
    [
        ("dflash", "kl", "decay", False),
        ("dflash", "lk", "dpace", True),
        ("dflash", "ce", "dpace", False),
        ("dflash2", "ce", "decay", True),
        ("dflash2", "lk", "dpace", False),
    ],
)
def test_compiled_flex_equals_sdpa(qwen3_target, arch, loss, weighting, sliding):
    torch.backends.cuda.matmul.allow_tf32 = False
    drafter, target = _pair(qwen3_target, arch, sliding)
    flex_drafter = copy.deepcopy(drafter)
    results = []
    for model, attention in ((drafter, "sdpa"), (flex_drafter, "flex")):
        placement = parallelize(
            model, device=CUDA, attention=attention, compile=attention == "flex", dtype="fp32"
        )
        objective = Objective(
            model,
            target,
            num_anchors=12,
            gamma=3.0,
            loss=WeightedHeadLoss(chunk=64, loss=loss, compile=placement.compiled),
            attention=placement.attention,
            position_weight=weighting,
        )
        objective.selector_weight = 0.5
        batch = token_batch([200, 130], prompt_lengths=[10, 20], seq_len=256).to(CUDA)
        out = objective(batch)
        (out.loss_sum / out.weight_sum).backward()
        results.append(
            (float(out.loss_sum / out.weight_sum), {n: p.grad for n, p in model.named_parameters()})
        )
    assert abs(results[0][0] - results[1][0]) < 1e-4
    for name, g in results[0][1].items():
        assert torch.allclose(g, results[1][1][name], atol=1e-4, rtol=1e-3), name


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "model.arch=dflash2",
            "model.layer_types=[S, F]",
            "model.sliding_window=64",
            "train.selector_ramp_steps=4",
        ],
        ["train.loss=lk", "train.position_weight=dpace", "model.layer_types=[S, F]"],
        ["train.loss=kl"],
    ],
)
def test_trainer_runs_each_choice_compiled_in_bf16(tmp_path, qwen3_target, overrides):
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    data = tmp_path / "d.jsonl"
    with data.open("w") as f:
        for i in range(16):
            n = 100 + 37 * i
            ids = [(i * 5 + j) % 290 for j in range(n)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 8 + [1] * (n - 8)}) + "\n")
    out = tmp_path / "run"
    base = [
        f"model.target={qwen3_target}",
        "model.mask_token_id=300",
        "model.block_size=4",
        f"data.train=[{data}]",
        f"data.eval=[{data}]",
        f"train.out_dir={out}",
        "train.max_steps=10",
        "train.log_every=5",
        "train.eval_every=5",
        "train.num_anchors=32",
        "train.batch_size=2",
        "train.resume=never",
    ]
    train(load_config(None, [*base, *overrides]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "eval"
    assert all(r["loss"] == r["loss"] for r in rows if "loss" in r)  # finite, not NaN
