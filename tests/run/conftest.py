"""The tiny training setup that the supervision tests launch (a 1-layer drafter on a 6-layer target), and
the cleanup after each test: a run it launched and left live (a failed assertion before its `stop`) is
force-stopped, so that no job outlives its test."""

from __future__ import annotations

import contextlib
import json

import pytest


@pytest.fixture(scope="session")
def setup(tmp_path_factory, qwen3_target) -> dict:
    root = tmp_path_factory.mktemp("faults")
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
        f"model:\n  target: {qwen3_target}\n  mask_token_id: 300\n  num_layers: 1\n  block_size: 4\n"
        f"data:\n  train: [{data}]\n"
        "train:\n  max_steps: 12\n  num_anchors: 8\n  batch_size: 2\n  log_every: 2\n  save_every: 4\n  device: cpu\n"
    )
    return {"root": root, "config": config}


@pytest.fixture(autouse=True)
def no_run_outlives_its_test(request):
    yield
    if "setup" not in request.fixturenames:
        return
    from flashdraft.errors import FlashdraftError
    from flashdraft.run.monitor import is_live, list_runs, run_state, stop_run

    for run_dir in list_runs(request.getfixturevalue("setup")["root"] / "runs"):
        if is_live(run_state(run_dir)):
            with contextlib.suppress(FlashdraftError):  # no job pid recorded yet: nothing to stop
                stop_run(run_dir, force=True, timeout=5)
