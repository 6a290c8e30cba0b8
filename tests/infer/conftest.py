"""A tiny target and a drafter trained on its own greedy outputs for a few dozen steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashdraft.config import load_config
from flashdraft.model.tiny import make_target_generated_data, save_tiny_target
from flashdraft.train.trainer import train

MASK = 511


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trained")
    target = save_tiny_target(root / "target", "qwen3", vocab_size=512, hidden_size=64, num_layers=4, seed=0)
    make_target_generated_data(target, root / "train.jsonl", num_samples=48, seed=1, max_new_tokens=48)
    train(
        load_config(
            None,
            [
                f"model.target={target}",
                "model.num_layers=2",
                "model.block_size=6",
                f"model.mask_token_id={MASK}",
                f"data.train=[{root / 'train.jsonl'}]",
                f"train.out_dir={root / 'run'}",
                "train.max_steps=40",
                "train.batch_size=8",
                "train.num_anchors=24",
                "train.lr=3e-3",
                "train.log_every=20",
                "train.save_every=40",
                "train.device=cpu",
                "train.resume=never",
            ],
        )
    )
    return {"target": target, "drafter": root / "run" / "checkpoints" / "step-00000040" / "drafter"}
