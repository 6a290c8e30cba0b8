"""The drafter a run trains: warm-started from `model.drafter`, or new from the target's config and the
model.* settings; and the config as actually trained (what config.yaml records and a resume compares)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_LAYERS, Config, resolve_drafter_fields
from flashdraft.errors import FlashdraftError
from flashdraft.model.dflash2 import graft_dflash2
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import (
    check_against_target,
    load_drafter,
    make_drafter_config,
    new_drafter,
    read_config,
    resolve_mask_token_id,
    weights_sha256,
)
from flashdraft.model.spec import DFlashSpec, default_gamma, parse_layer_types
from flashdraft.train.muon import resolve_optimizer

WARM_START_NAME = "warm_start.json"  # in train.out_dir: what a warm-started run started from


def build_drafter(config: Config, target_config) -> DFlashDraftModel:
    """`model.drafter` checked against the target and loaded, else a new drafter initialised from
    train.seed (its shape from model.num_layers, block_size, layer_types...)."""
    m = config.model
    if m.drafter:
        drafter_config = read_config(m.drafter)
        check_against_target(drafter_config, target_config, f"model.drafter={m.drafter}")
        drafter = load_drafter(m.drafter, target=target_config)
        if m.arch == "dflash2" and drafter.spec.arch == "dflash":
            return graft_dflash2(drafter, generator=torch.Generator().manual_seed(config.train.seed))
        if m.arch is not None and m.arch != drafter.spec.arch:
            raise FlashdraftError(
                f"model.arch={m.arch}: model.drafter={m.drafter} is a {drafter.spec.arch} drafter; only "
                "dflash -> dflash2 is a graft (drop model.arch)"
            )
        return drafter
    layer_types = None if m.layer_types is None else parse_layer_types(m.layer_types, "model.layer_types")
    num_layers = m.num_layers if m.num_layers is not None else len(layer_types or []) or DEFAULT_NUM_LAYERS
    if layer_types is not None and len(layer_types) != num_layers:
        raise FlashdraftError(
            f"config: model.layer_types has {len(layer_types)} entries for model.num_layers={num_layers}"
        )
    mask = resolve_mask_token_id(m.target, target_config, m.mask_token_id)
    drafter_config = make_drafter_config(
        target_config,
        num_layers=num_layers,
        block_size=m.block_size if m.block_size is not None else DEFAULT_BLOCK_SIZE,
        mask_token_id=mask,
        target_layer_ids=m.target_layer_ids,
        layer_types=layer_types,
        sliding_window=m.sliding_window,
        arch=m.arch or "dflash",
    )
    drafter = new_drafter(drafter_config)
    drafter.init_weights(torch.Generator().manual_seed(config.train.seed))
    return drafter


def resolved_config(
    config: Config, drafter: DFlashDraftModel, resumed: dict[str, Any] | None = None
) -> Config:
    """The config as actually trained: the drafter's shape fields, the γ and the optimizer in use (what
    config.yaml records and a resume compares; `resumed`: the resumed checkpoint's recorded config);
    model.* values that disagree with model.drafter are an error."""
    spec = drafter.spec
    actual = {
        "num_layers": int(drafter.config.num_hidden_layers),
        "block_size": spec.block_size,
        "target_layer_ids": [int(i) for i in spec.target_layer_ids],
        "mask_token_id": int(spec.mask_token_id),
    }
    source = f"{config.model.drafter}/config.json" if config.model.drafter else "new drafter"
    resolved = resolve_drafter_fields(config, actual, source)
    gamma = config.train.gamma or default_gamma(spec.block_size)
    train = resolve_optimizer(
        dataclasses.replace(resolved.train, gamma=float(gamma)),
        width=int(drafter.config.hidden_size),
        data_parallel=config.distributed.data_parallel,
        resumed=resumed["train"] if resumed is not None else None,
    )
    return dataclasses.replace(resolved, train=train)


def warm_start_record(config: Config, drafter: DFlashDraftModel) -> dict[str, Any] | None:
    """What a run warm-started from (`warm_start.json`, docs/run-files.md): the source directory and the
    sha256 of its weights, its architecture and whether it was grafted, and that the optimizer and the lr
    schedule start fresh (a warm start is not a resume). None without model.drafter."""
    m = config.model
    if not m.drafter:
        return None
    source = Path(m.drafter)
    source_arch = DFlashSpec.from_config(read_config(source)).arch
    return {
        "drafter": str(source.resolve()),
        "weights_sha256": weights_sha256(source),
        "source_arch": source_arch,
        "arch": drafter.spec.arch,
        "grafted": source_arch != drafter.spec.arch,
        "optimizer": "fresh",
        "lr_schedule": "fresh (warmup from step 0)",
    }
