"""A DFlash2 drafter for the fast engine's tests, made from a trained DFlash one."""

from __future__ import annotations

import torch

from flashdraft.model.drafter_dir import make_drafter_config, new_drafter
from flashdraft.model.target import TargetModel


def dflash2_from(drafter, target: TargetModel):
    """A DFlash2 drafter warm-started from the trained DFlash one (a fresh DFlash2 layer computes what a DFlash
    layer does), its convolutions' kernel projections and the selector's codebooks perturbed: the drafts
    go through DFlash2's own forward and candidate walk, and real multi-token acceptances happen."""
    config = make_drafter_config(
        target.config,
        num_layers=len(drafter.layers),
        block_size=drafter.block_size,
        mask_token_id=drafter.mask_token_id,
        target_layer_ids=list(drafter.spec.target_layer_ids),
        intermediate_size=drafter.config.intermediate_size,
        arch="dflash2",
    )
    config.dflash_config["selector_top_k"] = 8
    dflash2 = new_drafter(config)
    dflash2.init_weights(torch.Generator().manual_seed(0))
    dflash2.load_state_dict(drafter.state_dict(), strict=False)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in dflash2.named_parameters():
            if "codebook" in name or "kernel_projection" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=g))
    return dflash2.eval()
