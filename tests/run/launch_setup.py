"""The tiny run the supervision tests launch (a 1-layer drafter on the tests' 6-layer target), on the CPU
(tests/run/conftest.py) or on the GPUs (tests/run/test_launch_cycle_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path


def write_launch_setup(root: Path, target: str, device: str = "cpu") -> dict:
    """The tiny run the supervision tests launch: 16 short samples and a config for `device`."""
    data = root / "train.jsonl"
    with data.open("w") as f:
        for i in range(16):
            n = 40 + i
            f.write(
                json.dumps(
                    {"input_ids": [(i + 3 * j) % 290 for j in range(n)], "loss_mask": [0] * 4 + [1] * (n - 4)}
                )
                + "\n"
            )
    config = root / "cfg.yaml"
    config.write_text(
        f"model:\n  target: {target}\n  mask_token_id: 300\n  num_layers: 1\n  block_size: 4\n"
        f"data:\n  train: [{data}]\n"
        "train:\n  max_steps: 12\n  num_anchors: 8\n  batch_size: 2\n  log_every: 2\n  save_every: 4\n"
        f"  device: {device}\n"
    )
    return {"root": root, "config": config}
