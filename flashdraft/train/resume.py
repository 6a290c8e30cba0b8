"""Resuming: whether a checkpoint may be continued with this run's settings (docs/training-safety.md), and
restoring the trainer's state from it (`restore_training`).

A checkpoint records the resolved config and the world size of the run that wrote it. Resuming with
settings that change the trajectory (learning rate, anchors, γ, global batch, data...) would
silently continue another run, so it is refused with the list of differences, unless
`train.resume_allow_changes` says it is meant. Settings that only change how the run is watched or
executed are exempt, and `train.max_steps` / `train.epochs` may grow: a longer run (its cosine schedule
then stretches over the new total from the resumed step on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashdraft.config import Config, to_dict
from flashdraft.data.tokens import EpochSampler
from flashdraft.distributed.parallelize import load_sharded_optimizer
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.train.checkpoint import ResumePoint, set_rng_state
from flashdraft.train.muon import recorded_muon_lr
from flashdraft.train.optim import named_optimizer_state, positional_optimizer_state
from flashdraft.train.state import TrainState

# Keys that do not change what is computed: logging, checkpoint cadence, evaluation, placement, paths.
EXEMPT = frozenset(
    {
        "model.drafter",  # the warm-start source: after a resume the weights come from the checkpoint
        "data.eval",
        "data.allow_unverified_tokenizer",  # permission to train on data it cannot check, not what is computed
        "train.out_dir",
        "train.resume",
        "train.resume_allow_changes",
        "train.max_bad_steps",
        "train.log_every",
        "train.profile_steps",
        "train.profile_start",
        "train.save_every",
        "train.save_every_minutes",
        "train.eval_every",
        "train.real_eval_prompts",
        "train.real_eval_new_tokens",
        "train.best_by",  # which evaluation best/ holds; a resume with another one starts best/ anew
        "train.keep_last",
        "train.device",
        "train.compile",
        "train.compile_target",  # the same features, computed by compiled kernels
        "train.activation_checkpointing",
        "train.loss_chunk",
        "distributed.timeout_minutes",
        "distributed.data_parallel",  # only rounding differs; the optimizer state's layout is checked apart
        "distributed.mode",  # with target_ranks: how many ranks train, checked as the global micro-batch
        "distributed.target_ranks",
        "distributed.max_in_flight",
        "distributed.bucket_mb",  # how gradients travel, not what they sum to
        "distributed.target_parallel",  # how the frozen target is placed; the features are the same
    }
)
# Keys that may grow: the run goes on longer. 0 means "no step limit" for max_steps.
MAY_GROW = ("train.max_steps", "train.epochs")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _grows(key: str, old: Any, new: Any) -> bool:
    if key == "train.max_steps":
        return old != 0 and (new == 0 or new > old)
    return new > old


# What a checkpoint written before a key existed ran with, where the key's default has changed since it was
# added: train.position_weight was added with 'decay' and became 'dpace' (docs/drafters.md §4).
# train.optimizer was added with 'adamw' and became 'auto' (which config.yaml records resolved).
ABSENT_KEY_MEANT: dict[str, Any] = {"train.position_weight": "decay", "train.optimizer": "adamw"}


def check_resume_config(
    saved: dict[str, Any],
    saved_world_size: int,
    config: dict[str, Any],
    world_size: int,
    *,
    allow_changes: bool,
    source: str,
    log: Callable[[str], None] = print,
) -> None:
    """Refuse to continue `source` when a trajectory-changing setting differs, listing each `key old -> new`."""
    old, new = flatten(saved), flatten(config)
    # A checkpoint written before a setting existed ran with that setting's behaviour of the time: today's
    # default, or the default of then where it has changed since (ABSENT_KEY_MEANT).
    meant = {**flatten(to_dict(Config())), **ABSENT_KEY_MEANT}
    for key in set(new) - set(old):
        if key in meant:
            old[key] = meant[key]
    if old.get("train.optimizer") == "muon":  # the Muon lr it trained at, recorded before or after 4 x lr
        old["train.muon_lr"] = recorded_muon_lr(
            {"muon_lr": old.get("train.muon_lr"), "lr": old.get("train.lr")}
        )
    changes, longer = [], []
    for key in sorted(set(old) | set(new)):
        if key in EXEMPT or key == "train.batch_size" or old.get(key) == new.get(key):
            continue
        if key in MAY_GROW and _grows(key, old.get(key), new.get(key)):
            longer.append(f"{key} {old.get(key)!r} -> {new.get(key)!r}")
            continue
        changes.append(f"{key} {old.get(key)!r} -> {new.get(key)!r}")
    # The world size may change: the sampler's position counts samples of the global order, and each
    # micro-batch takes the next train.batch_size x ranks of them (docs/distributed.md). What must not
    # change is that product, the global micro-batch.
    old_batch, new_batch = old.get("train.batch_size"), new.get("train.batch_size")
    if old_batch * saved_world_size != new_batch * world_size:
        changes.append(
            f"global micro-batch (train.batch_size x ranks) {old_batch} x {saved_world_size} -> "
            f"{new_batch} x {world_size}"
        )
    elif saved_world_size != world_size:
        log(
            f"resume: {saved_world_size} -> {world_size} ranks with the same global micro-batch "
            f"({old_batch} x {saved_world_size} = {new_batch} x {world_size}): the same trajectory"
        )
    if longer:
        log(f"resume: a longer run ({'; '.join(longer)}): the schedule now spans the new total")
    if not changes:
        return
    if allow_changes:
        log(
            f"resume: continuing {source} with changed settings (train.resume_allow_changes): {'; '.join(changes)}"
        )
        return
    raise FlashdraftError(
        f"train.resume: {source} was trained with other settings: {'; '.join(changes)}; resuming would continue "
        "another trajectory. Restore them, start over in another train.out_dir, or set "
        "train.resume_allow_changes=true if the change is meant"
    )


def restore_training(
    point: ResumePoint,
    *,
    drafter: DFlashDraftModel,
    optimizer: torch.optim.Optimizer,
    sharded: bool,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    sampler: EpochSampler,
    state: TrainState,
    log: Callable[[str], None] = print,
) -> None:
    """Continue from a verified checkpoint: the optimizer state (re-keyed when the checkpoint was written
    with the other layout, sharded or replicated), the schedule, the sampler's position, the RNG states
    and the trainer's progress. The drafter's weights are loaded before placement (`parallelize`)."""
    saved = point.state
    layout, optimizer_state = saved.get("optimizer_layout", "replicated"), saved["optimizer"]
    wanted = optimizer_layout(sharded)
    if layout != wanted:  # fsdp <-> ddp or one process: the same state, keyed otherwise
        if isinstance(optimizer_state.get("state"), list):
            raise FlashdraftError(
                f"train.resume: {point.path} holds bf16 weights with fp32 master weights "
                f"(train.master_weights), which cannot move from {layout} to {wanted} training yet; "
                "resume with the checkpoint's distributed.data_parallel"
            )
        names = [name for name, _ in drafter.named_parameters()]
        convert = named_optimizer_state if layout == "replicated" else positional_optimizer_state
        optimizer_state = convert(optimizer_state, names)
        log(f"resume: the optimizer state moves from {layout} to {wanted} training")
    try:
        if sharded:
            load_sharded_optimizer(drafter, optimizer, optimizer_state)
        else:
            optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise FlashdraftError(
            f"train.resume: the optimizer state in {point.path} does not fit this run "
            f"(train.master_weights, train.dtype, train.optimizer or the drafter changed?): {exc}"
        ) from None
    scheduler.load_state_dict(saved["scheduler"])
    sampler.load_state_dict(saved["sampler"])
    set_rng_state(saved["rng"])
    state.load_state_dict(saved)
    log(f"resumed from {point.path} at step {state.step}")


def optimizer_layout(sharded: bool) -> str:
    """How a checkpoint's optimizer state is keyed: FSDP's is saved whole and keyed by parameter name
    ('sharded'); a replica's as torch keeps it ('replicated')."""
    return "sharded" if sharded else "replicated"
