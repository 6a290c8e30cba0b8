"""Tiny drafter + target pairs and token batches for objective and trainer tests."""

from __future__ import annotations

import torch

from flashdraft.data.tokens import TokenBatch
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config
from flashdraft.model.target import TargetModel

MASK_ID = 300


def tiny_pair(
    target_dir: str,
    *,
    num_layers: int = 2,
    block_size: int = 4,
    layer_types=None,
    sliding_window=None,
    seed: int = 0,
) -> tuple[DFlashDraftModel, TargetModel]:
    target = TargetModel.load(target_dir, [1, 4])
    config = make_drafter_config(
        target.config,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=MASK_ID,
        target_layer_ids=[1, 4],
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    drafter = DFlashDraftModel(config)
    drafter.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-trivial norm weights so that every parameter matters to the checks
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return drafter, target


def token_batch(
    lengths: list[int], prompt_lengths: list[int], seq_len: int | None = None, seed: int = 0
) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    s = seq_len or max(lengths)
    ids = torch.zeros(len(lengths), s, dtype=torch.long)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for row, (n, p) in enumerate(zip(lengths, prompt_lengths, strict=True)):
        ids[row, :n] = torch.randint(0, 299, (n,), generator=g)
        mask[row, p:n] = 1
    return TokenBatch(ids, mask, torch.tensor(lengths), seeds=[seed * 100 + i for i in range(len(lengths))])
