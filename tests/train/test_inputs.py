"""`data.max_samples`: training on the first N usable samples of data.train (the recipe table's data-volume
row, benchmarks/gpu_session.sh recipe ROW=data), counted apart from the samples dropped for other reasons."""

from __future__ import annotations

import pytest

from flashdraft.config import load_config
from flashdraft.data.tokens import load_token_dataset
from flashdraft.errors import FlashdraftError
from flashdraft.model.tiny import save_tiny_target
from flashdraft.train.inputs import load_training_data

from .test_packing import write_samples


def _config(target, data, *extra: str):
    return load_config(
        None,
        [
            f"model.target={target}",
            f"data.train=[{data}]",
            f"data.eval=[{data}]",
            "data.max_length=64",
            "model.block_size=4",
            "train.batch_size=2",
            "train.epochs=2",
            "data.allow_unverified_tokenizer=true",
            *extra,
        ],
    )


def test_max_samples_keeps_the_first_usable_samples_in_data_order_and_counts_the_rest(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    # the second sample has no anchor (its one supervised token has no whole block after it)
    data = write_samples(tmp_path / "s.jsonl", [23, 3, 15, 20, 9, 30], [5, 2, 9, 3, 2, 4])
    full = load_token_dataset([str(data)], max_length=64, block_size=4)
    assert len(full) == 5

    cut = load_training_data(
        _config(target, data, "data.max_samples=3"), block_size=4, vocab_size=300, train_ranks=1
    )
    assert len(cut.train) == 3 and cut.total_steps == 2 * 2  # two epochs of ceil(3 / 2) steps
    assert [cut.train[i].input_ids.tolist() for i in range(3)] == [
        full[i].input_ids.tolist() for i in range(3)
    ]
    assert cut.train.dropped_summary() == "1 dropped: no anchor; 2 past data.max_samples left out"
    assert len(cut.eval) == 5  # the held-out data is never cut

    every = load_training_data(
        _config(target, data, "data.max_samples=50"), block_size=4, vocab_size=300, train_ranks=1
    )
    assert len(every.train) == 5 and every.train.dropped_summary() == "1 dropped: no anchor"
    assert (
        len(load_training_data(_config(target, data), block_size=4, vocab_size=300, train_ranks=1).train) == 5
    )

    with pytest.raises(FlashdraftError, match=r"data\.max_samples must be >= 0 \(0: all\), got -1"):
        _config(target, data, "data.max_samples=-1")
