"""The DFlash trainer, one process per GPU: target forward (no grad) -> drafter forward/backward -> AdamW.

Reads top to bottom: setup, models, data, placement, optimizer, resume, loop. Paper defaults
(docs/dflash.md): AdamW lr 6e-4, cosine with 4% warm-up, grad clip 1.0, 6 epochs, max length 3072,
512 anchors, γ by block size. The safety rules (non-finite steps skipped, checkpoints a stranger can hand
you, resume refused on changed settings) are in docs/training-safety.md.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flashdraft.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_LAYERS,
    Config,
    dump_yaml,
    resolve_drafter_fields,
    to_dict,
)
from flashdraft.data.packing import PackedEpochSampler, packing_refusal
from flashdraft.data.render import tokenizer_fingerprint
from flashdraft.data.tokens import (
    EpochSampler,
    TokenDataset,
    check_shard_sets,
    collate,
    collate_packed,
    iterate_batches,
    load_token_dataset,
)
from flashdraft.distributed.compile_workers import start_compile_workers
from flashdraft.distributed.parallelize import (
    full_state_dicts,
    load_sharded_optimizer,
    pad_multiple,
    parallelize,
    resolve_data_parallel,
    unsharded_copy,
)
from flashdraft.distributed.split import (
    Control,
    FeatureReceiver,
    SideClock,
    SplitRoles,
    balance,
    micro_share,
    split_roles,
)
from flashdraft.distributed.target_parallel import check_group_size, load_group_target
from flashdraft.distributed.topology import (
    Topology,
    all_reduce_sum,
    any_rank_flags,
    barrier,
    init_topology,
    local_world_size,
    shutdown,
    sum_gradients,
)
from flashdraft.durable import atomic_write_text
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import (
    check_against_target,
    load_drafter,
    make_drafter_config,
    new_drafter,
    read_config,
    resolve_mask_token_id,
    save_drafter,
)
from flashdraft.model.spec import DFlashSpec, default_gamma, parse_layer_types
from flashdraft.model.target import TargetModel, default_dtype, load_target_config, load_target_tokenizer
from flashdraft.phases import PhaseClock
from flashdraft.run_protocol import Heartbeat, resume_hint
from flashdraft.train import compile_report
from flashdraft.train.blocks import summarize_acceptance
from flashdraft.train.budget import TrainingClock, budget_schedule_position
from flashdraft.train.checkpoint import CheckpointWriter, find_resume, remove_stale_partials, set_rng_state
from flashdraft.train.feature_server import serve_features
from flashdraft.train.flops import peak_tflops, step_flops
from flashdraft.train.loss import WeightedHeadLoss, selector_weight
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.objective import Objective
from flashdraft.train.optim import make_optimizer, named_optimizer_state, positional_optimizer_state
from flashdraft.train.profiling import StepProfiler
from flashdraft.train.resume import check_resume_config
from flashdraft.train.window import LogWindow


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warm-up over warmup_ratio of the steps, then cosine decay to min_ratio."""
    warmup = max(1, math.ceil(total * warmup_ratio)) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def target_tokenizer_fingerprint(target: str) -> dict[str, str] | None:
    """Hashes of the target's tokenizer and template, to check prepared shards against (None: no tokenizer)."""
    tokenizer = load_target_tokenizer(target)
    return None if tokenizer is None else tokenizer_fingerprint(tokenizer)


def non_finite(losses: list[Tensor], grad_norm: Tensor) -> Tensor:
    """A device flag: is any loss or the gradient norm nan or inf? (No sync: read with the step's flags.)"""
    total = grad_norm.float()
    for loss in losses:
        total = total + loss.float()  # nan or inf in any term leaves the sum non-finite
    return ~torch.isfinite(total)


def build_drafter(config: Config, target_config) -> DFlashDraftModel:
    m = config.model
    if m.drafter:
        drafter_config = read_config(m.drafter)
        check_against_target(drafter_config, target_config, f"model.drafter={m.drafter}")
        return load_drafter(m.drafter, target=target_config)
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


def resolved_config(config: Config, drafter: DFlashDraftModel) -> Config:
    """The config as actually trained: the drafter's shape fields and the γ in use (what config.yaml
    records and a resume compares); model.* values that disagree with model.drafter are an error."""
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
    return dataclasses.replace(resolved, train=dataclasses.replace(resolved.train, gamma=float(gamma)))


@torch.no_grad()
def evaluate(
    objective: Objective, data: TokenDataset, batch_size: int, seed: int, pad_multiple: int, device
) -> dict[str, float]:
    """Teacher-forced simulated acceptance on held-out data (fixed anchors: comparable across steps)."""
    objective.drafter.eval()
    loss_sum, weight_sum, stats = 0.0, 0.0, None
    for batch in iterate_batches(data, batch_size, seed, pad_multiple):
        out = objective(batch.to(device), objective.blocks(batch).to(device))
        loss_sum += float(out.loss_sum)
        weight_sum += float(out.weight_sum)
        stats = out.stats if stats is None else {k: stats[k] + v for k, v in out.stats.items()}
    objective.drafter.train()
    return {"loss": loss_sum / max(weight_sum, 1e-9), **summarize_acceptance(stats)}


class _StopRequest:
    """SIGTERM asks for a graceful stop: finish the step, write a checkpoint, exit cleanly."""

    def __init__(self):
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, _frame) -> None:
        print(
            f"received {signal.Signals(signum).name}: stopping after this step with a checkpoint", flush=True
        )
        self.requested = True


def _serves(roles: SplitRoles | None) -> bool:
    """This rank runs the target for drafter ranks (split topology)."""
    return roles is not None and roles.is_target


def train(config: Config, heartbeat: Heartbeat | None = None) -> dict[str, Any]:
    t = config.train
    heartbeat = heartbeat or Heartbeat(None)
    stop = _StopRequest()
    startup = PhaseClock()  # where the time before the first step goes, said in the "training ..." line
    # ------------------------------------------------------------------ setup
    heartbeat.beat("loading", force=True)
    # One process per GPU under torchrun; a plain single process otherwise.
    topo, device = init_topology(t.device, config.distributed.timeout_minutes)
    roles = None
    if config.distributed.mode == "split":
        # Target ranks serve features (train/feature_server.py); the drafter ranks are the topology that
        # trains, with their own process group (docs/distributed.md).
        if not topo.distributed:
            raise FlashdraftError(
                "distributed.mode=split needs at least 2 processes (flashdraft launch --nproc-per-node N)"
            )
        roles = split_roles(config.distributed.target_ranks, topo.rank, topo.world_size, local_world_size())
        group = dist.new_group(list(roles.drafter_ranks))  # every rank takes part in creating it
        if not roles.is_target:
            topo = Topology(
                roles.drafter_ranks.index(topo.rank), len(roles.drafter_ranks), topo.local_rank, group
            )
        if t.eval_every:
            raise FlashdraftError(
                "train.eval_every: held-out evaluation is not available with distributed.mode=split yet (the "
                "drafter ranks hold no target); set train.eval_every=0 or use distributed.mode=colocated"
            )

    if t.compile and device.type == "cuda" and not _serves(roles):  # a rank that will compile the drafter
        start_compile_workers()
    if config.distributed.target_parallel > 1:  # before any long work (config.py refuses split mode)
        check_group_size(config.distributed.target_parallel, topo.world_size)

    def say(line: str) -> None:  # the main rank speaks for all
        if topo.is_main:
            print(line, flush=True)

    torch.manual_seed(t.seed)
    out_dir = Path(t.out_dir)
    if not config.model.target:
        raise FlashdraftError(
            "model.target: no target model directory given (set model.target=/path/to/model)"
        )
    if topo.is_main:  # the only writer of checkpoints clears what its dead predecessors left half-written
        for partial in remove_stale_partials(out_dir):
            say(f"removed an incomplete checkpoint left by an earlier run: {partial}")
    # Before any long work or write: a bad resume setting or a damaged checkpoint fails fast.
    resume_from = find_resume(t.resume, out_dir, log=say, set_aside=topo.is_main and not _serves(roles))

    startup.mark("setup")
    # ------------------------------------------------------------------ target and drafter
    target_config = load_target_config(config.model.target)
    drafter = build_drafter(config, target_config)
    spec: DFlashSpec = drafter.spec
    config = resolved_config(config, drafter)
    t = config.train
    if resume_from is not None:
        check_resume_config(
            resume_from.state["config"],
            resume_from.state["world_size"],
            to_dict(config),
            len(roles.drafter_ranks) if roles else topo.world_size,
            allow_changes=t.resume_allow_changes,
            source=str(resume_from.path),
            log=say,
        )
    if topo.is_main and not _serves(roles):
        atomic_write_text(out_dir / "config.yaml", dump_yaml(config))
    check_shard_sets([*config.data.train, *config.data.eval])  # before the (long) target load
    if config.data.packing and (refusal := packing_refusal(target_config)):
        raise FlashdraftError(refusal)
    if config.data.packing and roles is not None:
        raise FlashdraftError(
            "data.packing=true with distributed.mode=split: target ranks do not pack rows yet; "
            "set data.packing=false or distributed.mode=colocated"
        )
    if config.distributed.target_parallel > 1:  # one target sharded over each group of ranks
        target = load_group_target(
            config.model.target, spec.target_layer_ids, device, config.distributed.target_parallel
        )
    elif roles is None or roles.is_target:
        target = TargetModel.load(config.model.target, spec.target_layer_ids, device=device)
    else:  # a drafter rank of a split topology needs only the target's embedding and LM head on its device
        target = TargetModel.load(config.model.target, spec.target_layer_ids, dtype=default_dtype(device))
        target.embed_weight = target.embed_weight.to(device)
        target.lm_head_weight = target.lm_head_weight.to(device)

    startup.mark("target")
    # ------------------------------------------------------------------ data
    data_kwargs = {
        "max_length": config.data.max_length,
        "block_size": spec.block_size,
        "vocab_size": target.vocab_size,
        "fingerprint": target_tokenizer_fingerprint(config.model.target),
        "target": config.model.target,
    }
    train_data = load_token_dataset(config.data.train, **data_kwargs)
    eval_data = load_token_dataset(config.data.eval, **data_kwargs) if config.data.eval else None
    # The global micro-batch (samples, or packed rows: docs/packing.md); drafter rank r takes r::ranks
    # (train_ranks: all ranks, or the drafter ranks of a split topology).
    train_ranks = len(roles.drafter_ranks) if roles else topo.world_size
    if config.data.packing:
        sampler = PackedEpochSampler(
            train_data.lengths(), t.batch_size * train_ranks, t.seed, config.data.max_length
        )
        collate_items = collate_packed
    else:
        sampler = EpochSampler(len(train_data), t.batch_size * train_ranks, t.seed)
        collate_items = collate
    # Packed epochs differ by a few rows: each epoch's own count (packing them costs ~1 s per 800K samples).
    per_step = t.batch_size * t.grad_accum * train_ranks
    total_steps = t.max_steps or sum(math.ceil(sampler.items(e) / per_step) for e in range(t.epochs))
    startup.mark("data")
    if _serves(roles):
        return serve_features(
            config,
            roles,
            target,
            train_data,
            sampler,
            resume_from.state if resume_from is not None else None,
            total_steps,
            pad_multiple(t.compile and device.type == "cuda"),
            heartbeat,
            lambda: stop.requested,
        )

    # ------------------------------------------------------------------ placement and compile (one place)
    if resume_from is not None:  # before placement: data parallelism starts from the checkpoint's weights
        drafter.load_state_dict(resume_from.drafter.state_dict())
    placement = parallelize(
        drafter,
        device=device,
        attention=t.attention,
        compile=t.compile,
        activation_checkpointing=t.activation_checkpointing,
        dtype=t.dtype,
        master_weights=t.master_weights,
        data_parallel=resolve_data_parallel(config.distributed.data_parallel, topo.world_size),
        group=topo.group,
        bucket_mb=config.distributed.bucket_mb,
    )
    parallel = placement.data_parallel
    loss_fn = WeightedHeadLoss(
        chunk=t.loss_chunk,
        multiplier=spec.output_multiplier,
        loss=t.loss,
        lk_eta=t.lk_eta,
        compile=placement.compiled,
    )

    def bind(model) -> Objective:
        return Objective(
            model,
            target,
            num_anchors=t.num_anchors,
            gamma=t.gamma,
            loss=loss_fn,
            anchors=t.anchors,
            attention=placement.attention,
            autocast_dtype=placement.autocast_dtype,
            position_weight=t.position_weight,
            dpace_alpha=t.dpace_alpha,
        )

    objective = bind(parallel.module)  # the DDP wrapper, the FSDP-sharded drafter, or the drafter
    # Evaluation runs on the main rank alone with a replica (no collective), on every rank with shards (of
    # the drafter, or of the target: distributed.target_parallel).
    eval_objective = objective if parallel.sharded else bind(drafter)

    # ------------------------------------------------------------------ optimizer and schedule
    optimizer = make_optimizer(
        list(drafter.parameters()), lr=t.lr, weight_decay=t.weight_decay, compile=placement.compiled
    )
    # train.max_minutes: a budget of training time (step time only; evaluation, checkpoint writes and steps
    # that compiled are not counted), and under it the schedule runs over the budget (train/budget.py).
    budget_seconds = t.max_minutes * 60
    training_time = TrainingClock()

    def schedule_position(s: int) -> int:
        if not budget_seconds:
            return s
        return budget_schedule_position(
            s, total_steps, budget_seconds, training_time.train_seconds, training_time.recent
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(schedule_position(s), total_steps, t.warmup_ratio, t.min_lr_ratio)
    )

    # ------------------------------------------------------------------ resume
    step, best_tau, skipped = 0, -math.inf, 0
    # FSDP's optimizer state is saved whole and keyed by parameter name; a replica's as torch keeps it.
    optimizer_layout = "sharded" if parallel.sharded else "replicated"
    if resume_from is not None:
        state = resume_from.state
        layout, optimizer_state = state.get("optimizer_layout", "replicated"), state["optimizer"]
        if layout != optimizer_layout:  # fsdp <-> ddp or one process: the same state, keyed otherwise
            if isinstance(optimizer_state.get("state"), list):
                raise FlashdraftError(
                    f"train.resume: {resume_from.path} holds bf16 weights with fp32 master weights "
                    f"(train.master_weights), which cannot move from {layout} to {optimizer_layout} training yet; "
                    "resume with the checkpoint's distributed.data_parallel"
                )
            names = [name for name, _ in drafter.named_parameters()]
            convert = named_optimizer_state if layout == "replicated" else positional_optimizer_state
            optimizer_state = convert(optimizer_state, names)
            say(f"resume: the optimizer state moves from {layout} to {optimizer_layout} training")
        try:
            if parallel.sharded:
                load_sharded_optimizer(drafter, optimizer, optimizer_state)
            else:
                optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise FlashdraftError(
                f"train.resume: the optimizer state in {resume_from.path} does not fit this run "
                f"(train.master_weights, train.dtype or the drafter changed?): {exc}"
            ) from None
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        step, best_tau, skipped = state["step"], state["best_tau"], state["skipped_steps"]
        training_time = TrainingClock(
            float(state.get("train_seconds", 0.0)), float(state.get("compile_seconds", 0.0))
        )
        say(f"resumed from {resume_from.path} at step {step}")
        del state
        resume_from = None  # frees the loaded state and the verified CPU copy of the drafter

    def checkpoint_parts() -> tuple[DFlashDraftModel, dict[str, Any]]:
        """The drafter to write and the trainer state; with shards a collective (every rank calls it), and
        both are whole: a checkpoint does not depend on the world size that wrote it."""
        weights, optimizer_state = full_state_dicts(parallel, drafter, optimizer)  # whole on the main rank
        return (unsharded_copy(drafter, weights) if parallel.sharded and topo.is_main else drafter), {
            "step": step,
            "optimizer": optimizer_state,
            "optimizer_layout": optimizer_layout,
            "scheduler": scheduler.state_dict(),
            "sampler": sampler_state,
            "best_tau": best_tau,
            "total_steps": total_steps,
            "skipped_steps": skipped,
            "train_seconds": training_time.train_seconds,
            "compile_seconds": training_time.compile_seconds,
            "config": to_dict(config),
            "world_size": topo.world_size,
        }

    startup.mark("drafter_and_optimizer")
    # ------------------------------------------------------------------ loop
    logger = MetricsLogger(out_dir, total_steps, start_step=step) if topo.is_main else None
    writer = CheckpointWriter(heartbeat, say)  # checkpoints off the step's path
    peak = peak_tflops(device)
    say(
        f"training {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M drafter parameters on {device} "
        f"x {topo.world_size} process(es) ({placement.attention} attention, compiled={placement.compiled}); "
        f"{len(train_data)} samples ({train_data.dropped['no_anchor']} dropped: no anchor), {total_steps} steps; "
        f"set up in {sum(startup.seconds.values()):.1f} s ({startup.summary()})"
        + ("; the first steps compile" if placement.compiled else "")
    )
    window = LogWindow(spec.block_size)
    bad_in_a_row = 0
    drafter.train()
    heartbeat.beat(
        "compiling" if placement.compiled else "training", force=True, step=step, total_steps=total_steps
    )
    outcome = "finished"
    timed_every = t.save_every_minutes * 60
    next_timed_save = (
        (math.floor(training_time.train_seconds / timed_every) + 1) * timed_every if timed_every else math.inf
    )

    # Split topology: this drafter rank's features come from its target rank, received ahead of use.
    receiver = clock = control = None
    if roles is not None:
        clock = SideClock()
        receiver = FeatureReceiver(
            roles.source_of(roles.rank), config.distributed.timeout_minutes * 60, clock
        )
        control = Control(roles, device, config.distributed.timeout_minutes * 60)
        feature_width = len(spec.target_layer_ids) * target.hidden_size
    totals_before: dict[str, float] | None = None

    def draw_step(index: int) -> tuple[list[tuple], dict[str, Any]]:
        """Step `index`'s micro-batches, prepared on the host and queued to the device (their features'
        receives posted, in a split topology), and the sampler state after drawing them (what a checkpoint
        of that step records)."""
        micro = []
        for m in range(t.grad_accum):
            epoch, indices = sampler.next_batch()
            # At an epoch's end a rank can be left without samples. DDP and FSDP need every rank in every
            # backward: such a rank runs one sample at weight zero (no gradient, no metric, no work).
            mine, padding = micro_share(indices, topo.rank, topo.world_size)
            batch = collate_items(train_data, epoch, mine, t.seed, placement.pad_multiple)
            if receiver is not None:
                header = [index, m, *batch.input_ids.shape, feature_width]
                receiver.post(header, target.dtype, device)
            blocks = objective.blocks(batch)
            if padding:
                micro.append((batch.to(device), blocks.to(device), 0.0, None))
            else:
                # Anchors, blocks and every count below come from the CPU batch: no device sync in the step.
                work = (
                    int(blocks.keep.sum()),
                    step_flops(
                        drafter.config,
                        drafter.layer_kinds(),
                        blocks,
                        int(batch.lengths.sum()),
                        len(blocks.rows),
                        target.vocab_size,
                    ).total,
                )
                micro.append(
                    (batch.to(device), blocks.to(device), float(objective.normalizer(blocks.weights)), work)
                )
        return micro, sampler.state_dict()

    pending: collections.deque = collections.deque()
    next_draw = step

    def draw_ahead(count: int) -> None:
        nonlocal next_draw
        while len(pending) < count and next_draw < total_steps:
            pending.append(draw_step(next_draw))
            next_draw += 1

    profiler = StepProfiler(out_dir, t.profile_start, t.profile_steps, topo.rank, device)
    over_budget = False
    while step < total_steps:
        profiler.before_step(step + 1)
        started = time.perf_counter()
        compiles_since = compile_report.now()
        training_time.start()
        waited_before = clock.waiting if clock else 0.0
        # Split: the receives of the next max_in_flight - 1 steps are posted before this one trains.
        draw_ahead(config.distributed.max_in_flight if roles else 1)
        micro, sampler_state = pending.popleft()
        for _, _, _, work in micro:
            if work is not None:
                window.add_work(*work)
        # Normalise by the whole step's global Σw so accumulation and data parallelism equal one large batch.
        (total_weight,) = all_reduce_sum([sum(w for _, _, w, _ in micro)], device, topo)
        losses, stats = [], []
        objective.selector_weight = selector_weight(
            step, t.selector_alpha, t.selector_warmup_steps, t.selector_ramp_steps
        )
        for i, (batch, blocks, _, work) in enumerate(micro):
            last = i == len(micro) - 1
            features = receiver.take() if receiver is not None else None
            if clock is not None and work is not None:
                clock.samples += batch.input_ids.shape[0]
            with parallel.sync(last):  # DDP/FSDP reduce in the last micro-batch's backward only
                out = objective(batch, blocks, features=features)
                # a padding micro-batch weighs 0
                loss = out.loss_sum / total_weight if work is not None else out.loss_sum * 0.0
                loss.backward()
            if not last and not parallel.reduces_gradients:
                optimizer.accumulate_gradients()  # bf16 gradients are summed in fp32
            if work is not None:
                losses.append(out.loss_sum.detach())
                stats.append(out.stats)
        # The next step's batches are read and collated on the host while the GPU runs this step's
        # kernels (queued above, not yet waited for); the order of samples is the same as without it.
        if roles is None:
            draw_ahead(1)
        if not parallel.reduces_gradients:  # one process: a no-op
            sum_gradients(optimizer.gradients(fp32=topo.distributed), topo)
        grad_norm = optimizer.grad_norm()
        # The step's one host read, before any update: a non-finite loss or gradient norm on any rank
        # skips the step on every rank, and a stop request on any rank stops every rank after it.
        # The budget flag too: ranks' clocks differ slightly, and all must stop after the same step.
        over_budget = training_time.would_exceed(budget_seconds)
        bad, stopping, over_budget = any_rank_flags(
            [non_finite(losses, grad_norm), stop.requested, over_budget], device, topo
        )
        step += 1
        if bad:
            optimizer.discard_gradients()  # no weight, moment or schedule update
            skipped += 1
            bad_in_a_row += 1
            loss_now = float(sum(losses)) if losses else math.nan
            say(
                f"step {step}: non-finite loss {loss_now} or gradient norm {float(grad_norm)} on some rank; "
                f"step skipped ({bad_in_a_row} in a row, {skipped} in all)"
            )
            heartbeat.beat(step=step, skipped_steps=skipped, force=True)
            if bad_in_a_row >= t.max_bad_steps:
                raise FlashdraftError(
                    f"step {step}: {bad_in_a_row} steps in a row had a non-finite loss or gradient norm "
                    f"(train.max_bad_steps={t.max_bad_steps}; last: loss {loss_now}, grad norm {float(grad_norm)}); "
                    f"they were skipped and no checkpoint of this state is written. Likely causes: train.lr="
                    f"{t.lr} too high, or bad samples in data.train; lower the lr or fix the data, then resume "
                    f"from the last checkpoint with {resume_hint()}"
                )
        else:
            optimizer.clip_and_step(t.grad_clip, grad_norm)
            scheduler.step()
            optimizer.discard_gradients()
            bad_in_a_row = 0
            window.add_step(losses, stats, total_weight)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        window.seconds += time.perf_counter() - started
        if control is not None:  # the target side learns of a stop here, and reports its clock
            clock.busy += time.perf_counter() - started - (clock.waiting - waited_before)
            totals = control.exchange(stopping or over_budget, clock, step)
            stopping = stopping or (totals["stop"] > 0 and not over_budget)
        compiled = training_time.compiling()
        step_seconds = training_time.stop()
        if compiled:  # where a compiling step's time went, graph by graph (train/compile_report.py)
            graphs = compile_report.graphs_compiled_since(compiles_since)
            if graphs:
                say(f"step {step}: " + compile_report.describe(graphs, step_seconds))
                if logger is not None:  # each graph's compile stages, for whoever asks why it was slow
                    logger.log(
                        step,
                        {"graphs": [dataclasses.asdict(g) for g in graphs]},
                        kind="compile",
                        console=False,
                    )
        last = step == total_steps or over_budget
        if profiler.after_step(step, last=last or stopping):
            say(f"profile of steps {profiler.first}-{step}: {profiler.report} (and a Chrome trace beside it)")
        timed = training_time.train_seconds >= next_timed_save  # a checkpoint every train.save_every_minutes
        while next_timed_save <= training_time.train_seconds:
            next_timed_save += timed_every

        heartbeat.beat(
            "training",
            step=step,
            epoch=sampler_state["epoch"],
            skipped_steps=skipped,
            step_seconds=round(time.perf_counter() - started, 4),
            max_memory_GiB=round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if device.type == "cuda"
            else None,
        )
        if step % t.log_every == 0 or last:
            window.all_reduce(device, topo)
            metrics = {
                **window.metrics(),
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "epoch": sampler_state["epoch"],
                "skipped_steps": skipped,
                "train_minutes": training_time.train_seconds / 60,
                "compile_minutes": training_time.compile_seconds / 60,
            }
            if peak:
                metrics["mfu"] = metrics["tflops"] / peak / topo.world_size
            report = {}
            if control is not None:  # the balance report of the split topology, over this window
                report = balance(totals, totals_before, len(roles.target_ranks), len(roles.drafter_ranks))
                totals_before = totals
                metrics.update({f"balance/{k}": v for k, v in report.items() if k != "advice"})
                if report.get("advice"):
                    say(f"balance at step {step}: {report['advice']}")
            if logger is not None:
                logger.log(step, metrics)
            heartbeat.beat(
                loss=metrics["loss"],
                tau=metrics["tau"],
                tflops=metrics["tflops"],
                **({"balance": report} if report else {}),
                force=True,
            )
            window = LogWindow(spec.block_size)
        evaluating = eval_data is not None and t.eval_every and (step % t.eval_every == 0 or last or timed)
        # A sharded drafter or a group-sharded target makes evaluation a collective: every rank runs it.
        if evaluating and (topo.is_main or parallel.sharded or config.distributed.target_parallel > 1):
            heartbeat.beat("evaluating")
            result = evaluate(eval_objective, eval_data, t.batch_size, t.seed, placement.pad_multiple, device)
            result["train_minutes"] = training_time.train_seconds / 60
            heartbeat.beat("training", eval_tau=result["tau"])
            if logger is not None:
                logger.log(step, result, kind="eval")
            if (
                result["tau"] > best_tau
            ):  # the best checkpoint by simulated acceptance (the same on every rank)
                best_tau = result["tau"]
                best = drafter
                if parallel.sharded:  # a collective; the whole state lands on the main rank
                    weights = full_state_dicts(parallel, drafter)[0]
                    best = unsharded_copy(drafter, weights) if topo.is_main else drafter
                if topo.is_main:
                    save_drafter(best, out_dir / "best", dtype=torch.bfloat16)
        writer.poll()  # a finished background write's line and heartbeat; a failed one's error, here
        if (topo.is_main or parallel.sharded) and (step % t.save_every == 0 or last or stopping or timed):
            heartbeat.beat("checkpointing")
            to_write, state = checkpoint_parts()
            if topo.is_main:  # copied to the host here, written in the writer's thread
                writer.save(out_dir, step, to_write, state, t.keep_last)
                heartbeat.beat("training")
            del to_write, state
        if stopping:
            outcome = "stopped"
            say(f"stopped at step {step}; resume with {resume_hint()}")
            break
        if over_budget:  # a finished run: it trained for the time it was given
            say(f"train.max_minutes={t.max_minutes} spent at step {step}: final checkpoint written")
            break
    writer.wait()  # the final (or the stop's) checkpoint is complete before the job reports its end
    if receiver is not None:  # a stop leaves received-ahead features of steps not trained: take and drop them
        receiver.drain()
    if logger is not None:
        logger.close()
    barrier(topo)
    parallel.close()  # DDP's reducer must not outlive the process group (a hang at exit otherwise)
    shutdown(topo)
    return {
        "steps": step,
        "out_dir": str(out_dir),
        "best_tau": best_tau,
        "outcome": outcome,
        "skipped_steps": skipped,
        "train_minutes": training_time.train_seconds / 60,
        "compile_minutes": training_time.compile_seconds / 60,
        "budget_spent": over_budget,
    }
