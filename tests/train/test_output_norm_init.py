"""model.output_norm_init=calibrated: the new drafter's final norm scaled so that its untrained guess is not the
tied head's confident mask-token direction (docs/training-loop.md, Initial output)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.config import load_config
from flashdraft.errors import FlashdraftError
from flashdraft.model.tiny import save_tiny_target
from flashdraft.train.drafter_setup import calibrate_output_norm
from flashdraft.train.trainer import train
from tests.train.helpers import MASK_ID, tiny_pair


@pytest.fixture(scope="module")
def tied_target(tmp_path_factory) -> str:
    """A tied-embedding target whose embedding rows are large next to what an untrained drafter's layers
    add, as SmolLM2's are: the head then scores the mask token's own direction far ahead."""
    root = tmp_path_factory.mktemp("tied")
    return str(save_tiny_target(root, "qwen3", num_layers=6, tie_word_embeddings=True, initializer_range=0.3))


def masked_logits(drafter, target) -> torch.Tensor:
    """The untrained drafter's logits at the masked rows of one block after a short context."""
    ids = torch.arange(5, 25)[None]
    block = torch.full((1, drafter.block_size), MASK_ID)
    block[0, 0] = 7
    with torch.no_grad():
        hidden = drafter(
            target.embed(block),
            target.features(ids),
            torch.arange(20)[None],
            torch.arange(20, 20 + drafter.block_size)[None],
            None,
        )
        return drafter.compute_logits(hidden[0, 1:], target.lm_head_weight)


def test_calibration_matches_the_brute_force_scale_and_tames_the_first_guess(tied_target):
    drafter, target = tiny_pair(tied_target)
    assert target.embed_weight.data_ptr() == target.lm_head_weight.data_ptr()  # tied
    with torch.no_grad():
        drafter.norm.weight.fill_(1.0)
    before = masked_logits(drafter, target).std(-1).mean()
    row = target.embed_weight[MASK_ID].double()
    normed = row / (row.pow(2).mean() + drafter.norm.eps).sqrt()
    expected = 1.0 / float((target.lm_head_weight.double() @ normed).std())

    scale = calibrate_output_norm(drafter, target.embed_weight, target.lm_head_weight)

    assert scale == pytest.approx(expected, rel=1e-4) and scale < 0.5
    assert torch.equal(drafter.norm.weight, torch.full_like(drafter.norm.weight, scale))
    after = masked_logits(drafter, target).std(-1).mean()
    assert before > 2.0 and after < min(1.5, before / 2), (before, after)


def _run(target: str, data, out, init: str, steps: int = 1) -> dict:
    overrides = {
        "model.target": target,
        "model.mask_token_id": MASK_ID,
        "model.num_layers": 2,
        "model.block_size": 4,
        "model.output_norm_init": init,
        "data.train": f"[{data}]",
        "train.out_dir": str(out),
        "train.max_steps": steps,
        "train.log_every": 1,
        "train.num_anchors": 6,
        "train.batch_size": 2,
        "train.save_every": 1,
        "train.lr": 1e-3,
        "train.device": "cpu",
    }
    train(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["kind"] == "train" and r["step"] == 1)


def test_a_calibrated_run_starts_from_the_scaled_norm_with_a_lower_first_loss(tmp_path, tied_target):
    data = tmp_path / "train.jsonl"
    ids = [(7 * i) % 290 for i in range(40)]
    data.write_text(
        "\n".join(json.dumps({"input_ids": ids, "loss_mask": [0] * 4 + [1] * 36}) for _ in range(4))
    )
    unit = _run(tied_target, data, tmp_path / "unit", "unit")
    calibrated = _run(tied_target, data, tmp_path / "calibrated", "calibrated")
    assert calibrated["loss"] < unit["loss"] / 2, (calibrated["loss"], unit["loss"])
    weights = load_file(
        tmp_path / "calibrated" / "checkpoints" / "step-00000001" / "drafter" / "model.safetensors"
    )
    drafter, target = tiny_pair(tied_target)
    scale = calibrate_output_norm(drafter, target.embed_weight, target.lm_head_weight)
    # one AdamW step moves each weight by at most about the lr
    assert torch.allclose(
        weights["norm.weight"].float(), torch.full((weights["norm.weight"].numel(),), scale), atol=2e-3
    )


def test_calibration_is_for_a_new_drafter_only(tmp_path, qwen3_target):
    with pytest.raises(
        FlashdraftError, match=r"model\.output_norm_init=calibrated initialises a new drafter"
    ):
        load_config(
            None,
            [
                f"model.target={qwen3_target}",
                f"model.drafter={tmp_path}",
                "model.output_norm_init=calibrated",
            ],
        )
    with pytest.raises(FlashdraftError, match=r"model\.output_norm_init must be unit or calibrated"):
        load_config(None, [f"model.target={qwen3_target}", "model.output_norm_init=small"])
