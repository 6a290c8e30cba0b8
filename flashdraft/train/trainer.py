"""The DFlash trainer, one process per GPU: target forward (no grad) -> drafter forward/backward -> AdamW.

Reads top to bottom: setup, models, data, placement, optimizer, resume, loop. Paper defaults
(docs/dflash.md): AdamW lr 6e-4, cosine with 4% warm-up, grad clip 1.0, 6 epochs, max length 3072,
512 anchors, γ by block size. The safety rules (non-finite steps skipped, checkpoints a stranger can hand
you, resume refused on changed settings) are in docs/training-safety.md.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flashdraft.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_LAYERS,
    Config,
    dump_yaml,
    resolve_drafter_fields,
    to_dict,
)
from flashdraft.data.render import tokenizer_fingerprint
from flashdraft.data.tokens import (
    EpochSampler,
    TokenDataset,
    check_shard_sets,
    collate,
    iterate_batches,
    load_token_dataset,
)
from flashdraft.distributed.parallelize import parallelize
from flashdraft.distributed.topology import (
    all_reduce_sum,
    any_rank_flags,
    barrier,
    init_topology,
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
    read_config,
    resolve_mask_token_id,
    save_drafter,
)
from flashdraft.model.spec import DFlashSpec, default_gamma
from flashdraft.model.target import TargetModel, load_target_config, load_target_tokenizer
from flashdraft.run_protocol import Heartbeat
from flashdraft.train.blocks import summarize_acceptance
from flashdraft.train.checkpoint import find_resume, remove_stale_partials, save_checkpoint, set_rng_state
from flashdraft.train.flops import peak_tflops, step_flops
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.objective import Objective
from flashdraft.train.optim import make_optimizer
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
    mask = resolve_mask_token_id(m.target, target_config, m.mask_token_id)
    drafter_config = make_drafter_config(
        target_config,
        num_layers=m.num_layers if m.num_layers is not None else DEFAULT_NUM_LAYERS,
        block_size=m.block_size if m.block_size is not None else DEFAULT_BLOCK_SIZE,
        mask_token_id=mask,
        target_layer_ids=m.target_layer_ids,
    )
    drafter = DFlashDraftModel(drafter_config)
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


def train(config: Config, heartbeat: Heartbeat | None = None) -> dict[str, Any]:
    t = config.train
    heartbeat = heartbeat or Heartbeat(None)
    stop = _StopRequest()
    # ------------------------------------------------------------------ setup
    heartbeat.beat("loading", force=True)
    # One process per GPU under torchrun; a plain single process otherwise.
    topo, device = init_topology(t.device)

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
    resume_from = find_resume(t.resume, out_dir, log=say, set_aside=topo.is_main)

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
            topo.world_size,
            allow_changes=t.resume_allow_changes,
            source=str(resume_from.path),
            log=say,
        )
    if topo.is_main:
        atomic_write_text(out_dir / "config.yaml", dump_yaml(config))
    check_shard_sets([*config.data.train, *config.data.eval])  # before the (long) target load
    target = TargetModel.load(config.model.target, spec.target_layer_ids, device=device)

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
    # The global batch; rank r takes r::world.
    sampler = EpochSampler(len(train_data), t.batch_size * topo.world_size, t.seed)

    # ------------------------------------------------------------------ placement and compile (one place)
    placement = parallelize(
        drafter,
        device=device,
        attention=t.attention,
        compile=t.compile,
        activation_checkpointing=t.activation_checkpointing,
        dtype=t.dtype,
        master_weights=t.master_weights,
    )
    loss_fn = WeightedHeadLoss(
        chunk=t.loss_chunk, multiplier=spec.output_multiplier, compile=placement.compiled
    )
    objective = Objective(
        drafter,
        target,
        num_anchors=t.num_anchors,
        gamma=t.gamma,
        loss=loss_fn,
        attention=placement.attention,
        create_block_mask=placement.create_block_mask,
        autocast_dtype=placement.autocast_dtype,
    )

    # ------------------------------------------------------------------ optimizer and schedule
    steps_per_epoch = math.ceil(len(train_data) / (t.batch_size * t.grad_accum * topo.world_size))
    total_steps = t.max_steps or t.epochs * steps_per_epoch
    optimizer = make_optimizer(
        list(drafter.parameters()), lr=t.lr, weight_decay=t.weight_decay, compile=placement.compiled
    )
    # train.max_minutes: a budget of training time (step time only; evaluation and checkpoint writes are
    # not counted), and under it the schedule runs over the budget (docs/quality-benchmark.md).
    budget_seconds = t.max_minutes * 60
    train_seconds = 0.0

    def schedule_position(s: int) -> int:
        """The step the lr schedule is at: under a time budget, the share of the budget spent when ahead."""
        if not budget_seconds:
            return s
        return max(s, int(train_seconds / budget_seconds * total_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(schedule_position(s), total_steps, t.warmup_ratio, t.min_lr_ratio)
    )

    # ------------------------------------------------------------------ resume
    step, best_tau, skipped = 0, -math.inf, 0
    if resume_from is not None:
        state = resume_from.state
        drafter.load_state_dict(resume_from.drafter.state_dict())
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise FlashdraftError(
                f"train.resume: the optimizer state in {resume_from.path} does not fit this run "
                f"(train.master_weights, train.dtype or the drafter changed?): {exc}"
            ) from None
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        step, best_tau, skipped = state["step"], state["best_tau"], state["skipped_steps"]
        train_seconds = float(state.get("train_seconds", 0.0))
        say(f"resumed from {resume_from.path} at step {step}")
        del state
        resume_from = None  # frees the loaded state and the verified CPU copy of the drafter

    def trainer_state() -> dict[str, Any]:
        return {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "sampler": sampler_state,
            "best_tau": best_tau,
            "total_steps": total_steps,
            "skipped_steps": skipped,
            "train_seconds": train_seconds,
            "config": to_dict(config),
            "world_size": topo.world_size,
        }

    # ------------------------------------------------------------------ loop
    logger = MetricsLogger(out_dir, total_steps, start_step=step) if topo.is_main else None
    peak = peak_tflops(device)
    say(
        f"training {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M drafter parameters on {device} "
        f"x {topo.world_size} process(es) ({placement.attention} attention, compiled={placement.compiled}); "
        f"{len(train_data)} samples ({train_data.dropped['no_anchor']} dropped: no anchor), {total_steps} steps"
    )
    window = LogWindow(spec.block_size)
    bad_in_a_row = 0
    drafter.train()
    heartbeat.beat(
        "compiling" if placement.compiled else "training", force=True, step=step, total_steps=total_steps
    )
    outcome = "finished"
    timed_every = t.save_every_minutes * 60
    next_timed_save = (math.floor(train_seconds / timed_every) + 1) * timed_every if timed_every else math.inf

    def draw_step() -> tuple[list[tuple], dict[str, Any]]:
        """The next step's micro-batches, prepared on the host and queued to the device, and the sampler
        state after drawing them (what a checkpoint of that step records)."""
        micro = []
        for _ in range(t.grad_accum):
            epoch, indices = sampler.next_batch()
            mine = indices[topo.rank :: topo.world_size]
            if mine:  # at an epoch's end a rank can be left without samples; it still joins the reductions
                # Anchors, blocks and every count below come from the CPU batch: no device sync in the step.
                batch = collate(train_data, epoch, mine, t.seed, placement.pad_multiple)
                blocks = objective.blocks(batch)
                work = (
                    int(blocks.keep.sum()),
                    step_flops(
                        drafter.config,
                        drafter.layer_kinds(),
                        blocks,
                        int(batch.lengths.sum()),
                        int((blocks.weights > 0).sum()),
                        target.vocab_size,
                    ).total,
                )
                micro.append((batch.to(device), blocks.to(device), float(blocks.weights.sum()), work))
        return micro, sampler.state_dict()

    over_budget = False
    upcoming = draw_step() if step < total_steps else None
    while step < total_steps:
        started = time.perf_counter()
        micro, sampler_state = upcoming
        for _, _, _, work in micro:
            window.add_work(*work)
        # Normalise by the whole step's global Σw so accumulation and data parallelism equal one large batch.
        (total_weight,) = all_reduce_sum([sum(w for _, _, w, _ in micro)], device, topo)
        losses, stats = [], []
        for i, (batch, blocks, _, _) in enumerate(micro):
            out = objective(batch, blocks)
            (out.loss_sum / total_weight).backward()
            if i < len(micro) - 1:
                optimizer.accumulate_gradients()  # bf16 gradients are summed in fp32
            losses.append(out.loss_sum.detach())
            stats.append(out.stats)
        # The next step's batches are read and collated on the host while the GPU runs this step's
        # kernels (queued above, not yet waited for); the order of samples is the same as without it.
        upcoming = draw_step() if step + 1 < total_steps else None
        sum_gradients(optimizer.gradients(fp32=topo.distributed), topo)
        grad_norm = optimizer.grad_norm()
        # The step's one host read, before any update: a non-finite loss or gradient norm on any rank
        # skips the step on every rank, and a stop request on any rank stops every rank after it.
        # The budget flag too: ranks' clocks differ slightly, and all must stop after the same step.
        over_budget = bool(budget_seconds) and train_seconds + time.perf_counter() - started >= budget_seconds
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
                    "from the last checkpoint with train.resume=auto"
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
        train_seconds += time.perf_counter() - started
        last = step == total_steps or over_budget
        timed = train_seconds >= next_timed_save  # a checkpoint every train.save_every_minutes
        while next_timed_save <= train_seconds:
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
                "train_minutes": train_seconds / 60,
            }
            if peak:
                metrics["mfu"] = metrics["tflops"] / peak / topo.world_size
            if logger is not None:
                logger.log(step, metrics)
            heartbeat.beat(loss=metrics["loss"], tau=metrics["tau"], tflops=metrics["tflops"], force=True)
            window = LogWindow(spec.block_size)
        if (
            topo.is_main
            and eval_data is not None
            and t.eval_every
            and (step % t.eval_every == 0 or last or timed)
        ):
            heartbeat.beat("evaluating")
            result = evaluate(objective, eval_data, t.batch_size, t.seed, placement.pad_multiple, device)
            result["train_minutes"] = train_seconds / 60
            logger.log(step, result, kind="eval")
            heartbeat.beat("training", eval_tau=result["tau"])
            if result["tau"] > best_tau:  # the best checkpoint by simulated acceptance
                best_tau = result["tau"]
                save_drafter(drafter, out_dir / "best", dtype=torch.bfloat16)
        if topo.is_main and (step % t.save_every == 0 or last or stopping or timed):
            heartbeat.beat("checkpointing")
            path = save_checkpoint(out_dir, step, drafter, trainer_state(), t.keep_last)
            heartbeat.beat("training", checkpoint=str(path))
        if stopping:
            outcome = "stopped"
            say(f"stopped at step {step}; resume with train.resume=auto")
            break
        if over_budget:  # a finished run: it trained for the time it was given
            say(f"train.max_minutes={t.max_minutes} spent at step {step}: final checkpoint written")
            break
    if logger is not None:
        logger.close()
    barrier(topo)
    shutdown(topo)
    return {
        "steps": step,
        "out_dir": str(out_dir),
        "best_tau": best_tau,
        "outcome": outcome,
        "skipped_steps": skipped,
        "train_minutes": train_seconds / 60,
        "budget_spent": over_budget,
    }
