"""The one place that decides the drafter's device placement, precision, compilation and activation
checkpointing; it knows the model and the run's settings, nothing of the trainer.

Model code stays plain single-device PyTorch; this module applies, in order (as torchtitan does):
parameter precision (bf16 weights with fp32 master weights in the optimizer, or fp32 weights under
bf16 autocast), activation checkpointing per drafter layer, then torch.compile per layer (fullgraph)
and the compiled BlockMask builder, under compile settings that make every silent degradation an
error. `Placement.compiled` tells the loss and the optimizer to compile their own kernels. Compilation
happens on the calling (main) thread of a process that owns one GPU: torch.compile is not thread-safe,
and a racing or failed compile must never fall back silently to dense attention (docs/processes.md).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel

# Dynamo counts compiles per code object, and all drafter layers share DrafterLayer.forward: each layer
# may compile for training and for evaluation, with a static then a dynamic sequence length. More than
# this per layer is a recompile storm, reported as an error instead of degrading to eager code.
RECOMPILES_PER_LAYER = 8


@dataclass
class Placement:
    device: torch.device
    attention: str  # "flex" or "sdpa"
    compiled: bool
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype  # the drafter's weights; below fp32, the optimizer keeps fp32 master weights
    create_block_mask: Callable | None
    pad_multiple: int  # sequence lengths are padded to this so compiled shapes repeat


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlashdraftError(f"train.device={name}: no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, driver?)")
    return device


def guard_compile(num_layers: int) -> None:
    """Make every silent compile degradation loud (docs/processes.md)."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = RECOMPILES_PER_LAYER * max(1, num_layers)
    cfg.fail_on_recompile_limit_hit = True
    cfg.suppress_errors = False
    if hasattr(cfg, "error_on_nested_fx_trace"):
        cfg.error_on_nested_fx_trace = True
    warnings.filterwarnings("error", message=".*flex_attention called without torch.compile.*")


def parallelize(
    drafter: DFlashDraftModel,
    *,
    device: torch.device,
    attention: str = "auto",
    compile: bool = True,
    activation_checkpointing: bool = False,
    dtype: str = "auto",
    master_weights: bool = True,
) -> Placement:
    on_gpu = device.type == "cuda"
    attention = ("flex" if on_gpu else "sdpa") if attention == "auto" else attention
    compile = compile and on_gpu
    if attention == "flex" and not on_gpu:
        raise FlashdraftError(
            "train.attention=flex needs a CUDA GPU; use train.attention=sdpa (exact) on the CPU"
        )
    if attention == "flex" and not compile:
        raise FlashdraftError(
            "train.attention=flex needs train.compile=true (eager flex_attention materialises dense scores)"
        )
    if dtype == "auto":
        dtype = "bf16" if on_gpu else "fp32"
    autocast_dtype = torch.bfloat16 if dtype == "bf16" else None
    param_dtype = torch.bfloat16 if autocast_dtype is not None and master_weights else torch.float32

    drafter.to(device)
    for param in drafter.parameters():  # parameters only: buffers such as RoPE's inv_freq stay fp32
        param.data = param.data.to(param_dtype)
    drafter.rotary_emb.to(device)
    for layer in drafter.layers:
        if activation_checkpointing:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    create_block_mask = None
    if compile:
        guard_compile(len(drafter.layers))
        for layer in drafter.layers:
            layer.compile(fullgraph=True)
    if attention == "flex":
        from torch.nn.attention.flex_attention import create_block_mask as _create_block_mask

        create_block_mask = torch.compile(_create_block_mask)
    return Placement(
        device,
        attention,
        compile,
        autocast_dtype,
        param_dtype,
        create_block_mask,
        pad_multiple=256 if compile else 1,
    )
