"""Shared fixtures: tiny random targets saved to temporary directories (no model hub is reachable)."""

from __future__ import annotations

import pytest
import torch

from flashdraft.bench.tiny import save_tiny_target


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny target per supported family: Qwen3, Llama, Qwen3.5 hybrid (multimodal wrapper)."""
    root = tmp_path_factory.mktemp("targets")
    return {
        kind: str(save_tiny_target(root / kind, kind, num_layers=6)) for kind in ("qwen3", "llama", "qwen3_5")
    }


@pytest.fixture(scope="session")
def qwen3_target(target_dirs) -> str:
    return target_dirs["qwen3"]
