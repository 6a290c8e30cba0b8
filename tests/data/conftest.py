"""Fixtures of the data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashdraft.model.tiny import save_tiny_target

from .helpers import make_tokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny Qwen3 target whose tokenizer is the Qwen-style word tokenizer (vocab fits the embedding)."""
    return save_tiny_target(
        tmp_path_factory.mktemp("t") / "target",
        "qwen3",
        vocab_size=64,
        hidden_size=32,
        num_layers=4,
        tokenizer=make_tokenizer("qwen"),
    )
