"""The run's data: the training and held-out sets, the sampler that orders them, and so the run's length.

The sampler draws global micro-batches (samples, or packed rows: docs/packing.md) of train.batch_size x
the ranks that train; training rank r takes r::ranks of each (distributed/split.py, `micro_share`). The
order does not depend on the number of ranks, which is what lets a resume change it (docs/distributed.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from flashdraft.config import Config
from flashdraft.data.packing import PackedEpochSampler
from flashdraft.data.render import tokenizer_fingerprint
from flashdraft.data.tokens import EpochSampler, TokenDataset, collate, collate_packed, load_token_dataset
from flashdraft.model.target import load_target_tokenizer


@dataclass
class TrainingData:
    train: TokenDataset
    eval: TokenDataset | None
    sampler: EpochSampler  # or its packed subclass
    collate: Callable  # collate or collate_packed, to match the sampler's items
    total_steps: int


def target_tokenizer_fingerprint(target: str) -> dict[str, str] | None:
    """Hashes of the target's tokenizer and template, to check prepared shards against (None: no tokenizer)."""
    tokenizer = load_target_tokenizer(target)
    return None if tokenizer is None else tokenizer_fingerprint(tokenizer)


def load_training_data(config: Config, *, block_size: int, vocab_size: int, train_ranks: int) -> TrainingData:
    """Read data.train and data.eval (checked against the target's vocabulary and tokenizer) and count the
    run's optimizer steps: train.max_steps, else train.epochs over the sampler's epochs."""
    t = config.train
    data_kwargs = {
        "max_length": config.data.max_length,
        "block_size": block_size,
        "vocab_size": vocab_size,
        "fingerprint": target_tokenizer_fingerprint(config.model.target),
        "target": config.model.target,
        "allow_unverified_tokenizer": config.data.allow_unverified_tokenizer,
    }
    train = load_token_dataset(config.data.train, **data_kwargs)
    if config.data.max_samples:
        train = train.first(config.data.max_samples)
    held_out = load_token_dataset(config.data.eval, **data_kwargs) if config.data.eval else None
    global_micro = t.batch_size * train_ranks
    if config.data.packing:
        sampler = PackedEpochSampler(train.lengths(), global_micro, t.seed, config.data.max_length)
        collate_items = collate_packed
    else:
        sampler = EpochSampler(len(train), global_micro, t.seed)
        collate_items = collate
    # Packed epochs differ by a few rows: each epoch's own count (packing them costs ~1 s per 800K samples).
    per_step = global_micro * t.grad_accum
    total = t.max_steps or sum(math.ceil(sampler.items(e) / per_step) for e in range(t.epochs))
    return TrainingData(train, held_out, sampler, collate_items, total)
