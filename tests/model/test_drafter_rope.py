"""A drafter loaded in bf16 keeps RoPE's inverse frequencies in fp32: a bf16 inv_freq puts the rotary
phases of positions past ~1,000 visibly off, which lowers acceptance on long prompts."""

from __future__ import annotations

import pytest
import torch

from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import load_drafter, make_drafter_config, save_drafter
from flashdraft.model.tiny import tiny_config


def test_bf16_drafter_keeps_fp32_rotary_frequencies(tmp_path):
    target = tiny_config("qwen3", vocab_size=64, hidden_size=64, num_layers=4)
    config = make_drafter_config(target, num_layers=1, block_size=4, mask_token_id=63)
    drafter = DFlashDraftModel(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    path = save_drafter(drafter, tmp_path / "drafter")

    full = load_drafter(path, dtype=torch.float32)
    half = load_drafter(path, dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16
    assert half.rotary_emb.inv_freq.dtype == torch.float32

    positions = torch.arange(3990, 4010)[None]
    like = torch.zeros(1, dtype=torch.float32)
    cos_full, sin_full = full.rotary_emb(like, positions)
    cos_half, sin_half = half.rotary_emb(like, positions)
    assert torch.equal(cos_half, cos_full) and torch.equal(sin_half, sin_full)
    # and what the layers use, in bf16: the fp32 phases rounded once
    cos, sin = half.rope(positions, torch.zeros(1, dtype=torch.bfloat16))
    assert torch.equal(cos, cos_full.bfloat16()) and torch.equal(sin, sin_full.bfloat16())


@pytest.mark.gpu
def test_a_cpu_generator_gives_the_same_init_on_the_gpu():
    """`bench train --data` builds its drafter on the GPU and seeds it with a CPU generator, as the trainer
    seeds one built on the CPU: both must give the same weights (it failed with a device error once)."""
    target = tiny_config("qwen3", vocab_size=64, hidden_size=64, num_layers=4)
    config = make_drafter_config(target, num_layers=1, block_size=4, mask_token_id=63)
    on_cpu = DFlashDraftModel(config)
    on_cpu.init_weights(torch.Generator().manual_seed(3))
    with torch.device("cuda"):
        on_gpu = DFlashDraftModel(config)
    on_gpu.init_weights(torch.Generator().manual_seed(3))
    for (name, a), b in zip(on_cpu.state_dict().items(), on_gpu.state_dict().values(), strict=True):
        assert torch.equal(a, b.cpu()), name
