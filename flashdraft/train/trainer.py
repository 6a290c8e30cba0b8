"""The DFlash trainer, one process per GPU: target forward (no grad) -> drafter forward/backward -> AdamW.

Reads top to bottom: setup, models, data, placement, optimizer, resume, loop. Paper defaults
(../shared/reference/dflash.md §3.1): AdamW lr 6e-4, cosine with 4% warm-up, grad clip 1.0, 6 epochs,
max length 3072, 512 anchors, γ by block size.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import Config, dump_yaml
from flashdraft.data.render import tokenizer_fingerprint
from flashdraft.data.tokens import EpochSampler, TokenDataset, collate, iterate_batches, load_token_dataset
from flashdraft.distributed.parallelize import parallelize
from flashdraft.distributed.topology import (
    all_reduce_sum,
    any_rank,
    barrier,
    init_topology,
    shutdown,
    sum_gradients,
)
from flashdraft.errors import FlashdraftError
from flashdraft.model.checkpoint import (
    check_against_target,
    load_drafter,
    make_drafter_config,
    read_config,
    resolve_mask_token_id,
    save_drafter,
)
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.spec import DFlashSpec, default_gamma
from flashdraft.model.target import TargetModel, load_target_config, load_target_tokenizer
from flashdraft.run_protocol import FAULT_ENV, Heartbeat
from flashdraft.train.checkpoint import load_trainer_state, resolve_resume, save_checkpoint, set_rng_state
from flashdraft.train.flops import peak_tflops, step_flops
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.objective import summarize_acceptance
from flashdraft.train.optim import make_optimizer
from flashdraft.train.step import Objective


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warm-up over warmup_ratio of the steps, then cosine decay to min_ratio."""
    warmup = max(1, math.ceil(total * warmup_ratio)) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _fault_hook(step: int, rank: int = 0) -> None:
    """Fault injection for the supervision tests: FLASHDRAFT_FAULT=kill@N | raise@N | hang@N | oom@N, or
    e.g. raise@N:R for rank R only."""
    fault = os.environ.get(FAULT_ENV, "")
    if not fault or "@" not in fault:
        return
    what, at = fault.split("@", 1)
    at, _, only_rank = at.partition(":")
    if int(at) != step or (only_rank and int(only_rank) != rank):
        return
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "raise":
        raise RuntimeError(f"injected failure at step {step}")
    if what == "hang":
        while True:
            time.sleep(1)
    if what == "oom":
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 20.00 GiB (injected at step {step}). GPU 0 has a total capacity of 139.80 GiB"
        )


def target_tokenizer_fingerprint(target: str) -> dict[str, str] | None:
    """Hashes of the target's tokenizer and template, to check prepared shards against (None: no tokenizer)."""
    tokenizer = load_target_tokenizer(target)
    return None if tokenizer is None else tokenizer_fingerprint(tokenizer)


def _new_window() -> dict[str, Any]:
    """Counters of one logging interval."""
    return {"loss_sum": 0.0, "weight": 0.0, "flops": 0.0, "blocks": 0, "time": 0.0, "stats": None}


def _reduce_window(window: dict[str, Any], device: torch.device, topo, block_size: int) -> dict[str, Any]:
    """Sum a logging window's local counters over ranks (Σw is already global)."""
    if not topo.distributed:
        return window
    if window["stats"] is None:  # this rank had no samples in the window
        zeros = torch.zeros(block_size - 1, dtype=torch.float64)
        window["stats"] = {
            "correct_at": zeros,
            "supervised_at": zeros.clone(),
            "accepted_sum": torch.zeros((), dtype=torch.float64),
            "blocks": torch.zeros((), dtype=torch.float64),
        }
    keys = sorted(window["stats"])
    flat = [
        window["loss_sum"],
        float(window["blocks"]),
        window["flops"],
        *[float(v) for k in keys for v in window["stats"][k].flatten()],
    ]
    flat = all_reduce_sum(flat, device, topo)
    stats, i = {}, 3
    for k in keys:
        n = window["stats"][k].numel()
        stats[k] = torch.tensor(flat[i : i + n], dtype=torch.float64).view_as(window["stats"][k])
        i += n
    return {**window, "loss_sum": flat[0], "blocks": int(flat[1]), "flops": flat[2], "stats": stats}


def build_drafter(config: Config, target_config) -> DFlashDraftModel:
    m = config.model
    if m.drafter:
        drafter_config = read_config(m.drafter)
        check_against_target(drafter_config, target_config, f"model.drafter={m.drafter}")
        return load_drafter(m.drafter, target=target_config)
    mask = resolve_mask_token_id(m.target, target_config, m.mask_token_id)
    drafter_config = make_drafter_config(
        target_config,
        num_layers=m.num_layers,
        block_size=m.block_size,
        mask_token_id=mask,
        target_layer_ids=m.target_layer_ids,
    )
    drafter = DFlashDraftModel(drafter_config)
    drafter.init_weights(torch.Generator().manual_seed(config.train.seed))
    return drafter


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
    topo, device = init_topology(
        t.device
    )  # one process per GPU under torchrun; plain single process otherwise
    torch.manual_seed(t.seed)
    out_dir = Path(t.out_dir)
    if not config.model.target:
        raise FlashdraftError(
            "model.target: no target model directory given (set model.target=/path/to/model)"
        )
    resume_from = resolve_resume(
        t.resume, out_dir
    )  # before any work or write: a bad resume setting fails fast
    out_dir.mkdir(parents=True, exist_ok=True)
    if topo.is_main:
        (out_dir / "config.yaml").write_text(dump_yaml(config))

    # ------------------------------------------------------------------ target and drafter
    target_config = load_target_config(config.model.target)
    drafter = build_drafter(config, target_config)
    spec: DFlashSpec = drafter.spec
    target_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = TargetModel.load(config.model.target, spec.target_layer_ids, device=device, dtype=target_dtype)
    gamma = t.gamma or default_gamma(spec.block_size)

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
    sampler = EpochSampler(
        len(train_data), t.batch_size * topo.world_size, t.seed
    )  # the global batch; rank r takes r::world

    # ------------------------------------------------------------------ placement and compile (one place)
    loss_fn = WeightedHeadLoss(chunk=t.loss_chunk, multiplier=spec.output_multiplier)
    placement = parallelize(
        drafter,
        loss_fn,
        device=device,
        attention=t.attention,
        compile=t.compile,
        activation_checkpointing=t.activation_checkpointing,
        dtype=t.dtype,
        master_weights=t.master_weights,
    )
    objective = Objective(
        drafter,
        target,
        num_anchors=t.num_anchors,
        gamma=gamma,
        loss=loss_fn,
        attention=placement.attention,
        create_block_mask=placement.create_block_mask,
        autocast_dtype=placement.autocast_dtype,
    )

    # ------------------------------------------------------------------ optimizer and schedule
    steps_per_epoch = math.ceil(len(train_data) / (t.batch_size * t.grad_accum * topo.world_size))
    total_steps = t.max_steps or t.epochs * steps_per_epoch
    optimizer = make_optimizer(
        list(drafter.parameters()), lr=t.lr, weight_decay=t.weight_decay, update=placement.optimizer_update
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, total_steps, t.warmup_ratio, t.min_lr_ratio)
    )

    # ------------------------------------------------------------------ resume
    step, best_tau = 0, -math.inf
    if resume_from is not None:
        state = load_trainer_state(resume_from)
        resumed = load_drafter(resume_from / "drafter", dtype=torch.float32)
        drafter.load_state_dict(resumed.state_dict())
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise FlashdraftError(
                f"train.resume: the optimizer state in {resume_from} does not fit this run "
                f"(train.master_weights, train.dtype or the drafter changed?): {exc}"
            ) from None
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        step, best_tau = state["step"], state.get("best_tau", -math.inf)
        if topo.is_main:
            print(f"resumed from {resume_from} at step {step}", flush=True)

    def trainer_state() -> dict[str, Any]:
        return {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(),
            "best_tau": best_tau,
            "total_steps": total_steps,
        }

    # ------------------------------------------------------------------ loop
    logger = MetricsLogger(out_dir, total_steps) if topo.is_main else None
    peak = peak_tflops(device)
    if topo.is_main:
        print(
            f"training {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M drafter parameters on {device} "
            f"x {topo.world_size} process(es) ({placement.attention} attention, compiled={placement.compiled}); "
            f"{len(train_data)} samples ({train_data.dropped['no_anchor']} dropped: no anchor), {total_steps} steps",
            flush=True,
        )
    window = _new_window()
    drafter.train()
    heartbeat.beat(
        "compiling" if placement.compiled else "training", force=True, step=step, total_steps=total_steps
    )
    outcome = "finished"
    while step < total_steps:
        started = time.perf_counter()
        micro = []
        for _ in range(t.grad_accum):
            epoch, indices = sampler.next_batch()
            mine = indices[topo.rank :: topo.world_size]
            if mine:  # at an epoch's end a rank can be left without samples; it still joins the reductions
                # Anchors, blocks and every count below come from the CPU batch: no device sync in the step.
                batch = collate(train_data, epoch, mine, t.seed, placement.pad_multiple)
                blocks = objective.blocks(batch)
                window["blocks"] += int(blocks.keep.sum())
                window["flops"] += step_flops(
                    drafter.config,
                    drafter.layer_kinds(),
                    blocks,
                    int(batch.lengths.sum()),
                    int((blocks.weights > 0).sum()),
                    target.vocab_size,
                ).total
                micro.append((batch.to(device), blocks.to(device), float(blocks.weights.sum())))
        # Normalise by the whole step's global Σw so accumulation and data parallelism equal one large batch.
        (total_weight,) = all_reduce_sum([sum(w for _, _, w in micro)], device, topo)
        for i, (batch, blocks, _) in enumerate(micro):
            out = objective(batch, blocks)
            (out.loss_sum / total_weight).backward()
            if i < len(micro) - 1:
                optimizer.accumulate_gradients()  # bf16 gradients are summed in fp32
            window["loss_sum"] = window["loss_sum"] + out.loss_sum.detach()
            window["stats"] = (
                out.stats
                if window["stats"] is None
                else {k: window["stats"][k] + v for k, v in out.stats.items()}
            )
        window["weight"] += total_weight
        sum_gradients(optimizer.gradients(fp32=topo.distributed), topo)
        grad_norm = optimizer.clip_and_step(t.grad_clip)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        window["time"] += time.perf_counter() - started

        heartbeat.beat(
            "training",
            step=step,
            epoch=sampler.epoch,
            step_seconds=round(time.perf_counter() - started, 4),
            max_memory_GiB=round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if device.type == "cuda"
            else None,
        )
        if step % t.log_every == 0 or step == total_steps:
            seconds = max(window["time"], 1e-9)
            window["loss_sum"] = float(window["loss_sum"])
            window = _reduce_window(window, device, topo, spec.block_size)
            metrics = {
                "loss": window["loss_sum"] / max(window["weight"], 1e-9),
                **summarize_acceptance(window["stats"]),
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "epoch": sampler.epoch,
                "block_tok_s": window["blocks"] * spec.block_size / seconds,
                "tflops": window["flops"] / seconds / 1e12,
            }
            if peak:
                metrics["mfu"] = metrics["tflops"] / peak / topo.world_size
            if logger is not None:
                logger.log(step, metrics)
            heartbeat.beat(loss=metrics["loss"], tau=metrics["tau"], tflops=metrics["tflops"], force=True)
            window = _new_window()
        if (
            topo.is_main
            and eval_data is not None
            and t.eval_every
            and (step % t.eval_every == 0 or step == total_steps)
        ):
            heartbeat.beat("evaluating")
            result = evaluate(objective, eval_data, t.batch_size, t.seed, placement.pad_multiple, device)
            logger.log(step, result, kind="eval")
            heartbeat.beat("training", eval_tau=result["tau"])
            if result["tau"] > best_tau:  # the best checkpoint by simulated acceptance
                best_tau = result["tau"]
                save_drafter(drafter, out_dir / "best", dtype=torch.bfloat16)
        stopping = any_rank(stop.requested, device, topo)  # every rank leaves the loop at the same step
        if topo.is_main and (step % t.save_every == 0 or step == total_steps or stopping):
            heartbeat.beat("checkpointing")
            path = save_checkpoint(out_dir, step, drafter, trainer_state(), t.keep_last)
            heartbeat.beat("training", checkpoint=str(path))
        if stopping:
            outcome = "stopped"
            print(f"stopped at step {step}; resume with train.resume=auto", flush=True)
            break
        _fault_hook(step, topo.rank)
    if logger is not None:
        logger.close()
    barrier(topo)
    shutdown(topo)
    return {"steps": step, "out_dir": str(out_dir), "best_tau": best_tau, "outcome": outcome}
