"""Building a training run, before its first step: `start_run` (every rank: topology, role, resume point,
drafter, target, data) and `build_trainer` (a rank that trains: placement and compile, objective,
optimizer and schedule, the restored state, the batch prefetcher, logging). train/trainer.py drives what
these build.

Everything that can be refused is checked before the long work: a bad resume setting or a damaged
checkpoint before the target loads, the data's shard sets before the target, the resumed config against
the checkpoint's (train/resume.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from flashdraft.config import Config, TrainConfig, dump_yaml, to_dict
from flashdraft.data.packing import packing_refusal
from flashdraft.data.tokens import check_shard_sets
from flashdraft.distributed.compile_workers import start_compile_workers
from flashdraft.distributed.parallelize import Placement, compile_target, parallelize, resolve_data_parallel
from flashdraft.distributed.roles import SplitDrafterHooks, StepHooks, load_rank_target
from flashdraft.distributed.split import SplitRoles, split_topology
from flashdraft.distributed.target_parallel import check_group_size
from flashdraft.distributed.topology import Topology, init_topology
from flashdraft.durable import atomic_write_json, atomic_write_text
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.target import TargetModel, load_target_config
from flashdraft.outputs import check_writable_dir
from flashdraft.phases import PhaseClock
from flashdraft.run_protocol import Heartbeat
from flashdraft.train.checkpoint import ResumePoint, find_resume, remove_stale_partials
from flashdraft.train.drafter_setup import WARM_START_NAME, build_drafter, resolved_config, warm_start_record
from flashdraft.train.inputs import TrainingData, load_training_data
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from flashdraft.train.real_eval import check_best_by
from flashdraft.train.resume import check_resume_config
from flashdraft.train.resume_transfer import share_resume_point


def say_on_main(topo: Topology, line: str) -> None:
    """The main rank speaks for all."""
    if topo.is_main:
        print(line, flush=True)


@dataclass
class RunStart:
    """What every rank of a run has before it knows whether it trains (a split topology's target ranks
    serve features instead: train/feature_server.py)."""

    config: Config  # resolved: the drafter's shape and the γ in use
    topo: Topology  # the ranks that train the drafter (a split topology's drafter ranks, their own group)
    device: torch.device
    roles: SplitRoles | None  # None: colocated (every rank trains)
    resume_from: ResumePoint | None
    drafter: DFlashDraftModel  # on the CPU, before placement
    target: TargetModel
    data: TrainingData
    startup: PhaseClock  # where the time before the first step goes (said in the "training ..." line)

    @property
    def serves_target(self) -> bool:
        return self.roles is not None and self.roles.is_target

    @property
    def out_dir(self) -> Path:
        return Path(self.config.train.out_dir)


def start_topology(config: Config) -> tuple[Topology, torch.device, SplitRoles | None]:
    """One process per GPU under torchrun (a plain single process otherwise), and in a split topology this
    rank's role: target ranks serve features, drafter ranks train in their own process group."""
    t = config.train
    topo, device = init_topology(t.device, config.distributed.timeout_minutes)
    roles = None
    if config.distributed.mode == "split":
        roles, topo = split_topology(config.distributed.target_ranks, topo)
        if t.eval_every:
            raise FlashdraftError(
                "train.eval_every: held-out evaluation is not available with distributed.mode=split yet (the "
                "drafter ranks hold no target); set train.eval_every=0 or use distributed.mode=colocated"
            )
    check_best_by(t, device, config.distributed)  # a real_tau choice the device's default turns off
    if t.compile and device.type == "cuda" and not (roles is not None and roles.is_target):
        start_compile_workers()  # this rank will compile the drafter
    if config.distributed.target_parallel > 1:  # before any long work (config.py refuses split mode)
        check_group_size(config.distributed.target_parallel, topo.world_size)
    return topo, device, roles


def start_run(config: Config, heartbeat: Heartbeat) -> RunStart:
    """Topology, resume point, drafter, resolved config (written to config.yaml), target and data."""
    startup = PhaseClock()
    heartbeat.beat("loading", force=True)
    topo, device, roles = start_topology(config)
    serves = roles is not None and roles.is_target
    say = partial(say_on_main, topo)
    torch.manual_seed(config.train.seed)
    out_dir = Path(config.train.out_dir)
    if not config.model.target:
        raise FlashdraftError(
            "model.target: no target model directory given (set model.target=/path/to/model)"
        )
    check_writable_dir(out_dir, "train.out_dir")  # every rank: all fail alike, none waits on a dead peer
    if topo.is_main:  # the only writer of checkpoints clears what its dead predecessors left half-written
        for partial_dir in remove_stale_partials(out_dir):
            say(f"removed an incomplete checkpoint left by an earlier run: {partial_dir}")
    # Before any long work or write: a bad resume setting or a damaged checkpoint fails fast.
    resume_from = find_resume(config.train.resume, out_dir, log=say, set_aside=topo.is_main and not serves)
    # every rank continues rank 0's checkpoint, received from it on a node that lacks it
    resume_from = share_resume_point(resume_from, out_dir, log=say)
    startup.mark("setup")

    target_config = load_target_config(config.model.target)
    drafter = build_drafter(config, target_config)
    config = resolved_config(
        config, drafter, resume_from.state["config"] if resume_from is not None else None
    )
    train_ranks = len(roles.drafter_ranks) if roles else topo.world_size
    if resume_from is not None:
        check_resume_config(
            resume_from.state["config"],
            resume_from.state["world_size"],
            to_dict(config),
            train_ranks,
            allow_changes=config.train.resume_allow_changes,
            source=str(resume_from.path),
            log=say,
        )
    if topo.is_main and not serves:
        atomic_write_text(out_dir / "config.yaml", dump_yaml(config))
        warm = warm_start_record(config, drafter)
        if warm is not None and resume_from is None:  # a resume keeps the record of the run's start
            atomic_write_json(out_dir / WARM_START_NAME, warm, indent=2)
            say(
                f"warm start from {warm['drafter']} ({warm['source_arch']}"
                + (f" grafted onto {warm['arch']}" if warm["grafted"] else "")
                + "): fresh optimizer, lr re-warmed from step 0"
            )
    check_shard_sets([*config.data.train, *config.data.eval])  # before the (long) target load
    if config.data.packing and (refusal := packing_refusal(target_config)):
        raise FlashdraftError(refusal)
    if config.data.packing and roles is not None:
        raise FlashdraftError(
            "data.packing=true with distributed.mode=split: target ranks do not pack rows yet; "
            "set data.packing=false or distributed.mode=colocated"
        )
    layer_ids = drafter.spec.target_layer_ids
    target = load_rank_target(
        config.model.target, layer_ids, device, config.distributed.target_parallel, roles
    )
    if config.train.compile_target:
        compile_target(target)  # whole on this GPU: its decoder layers compile at the first step
    startup.mark("target")
    data = load_training_data(
        config, block_size=drafter.spec.block_size, vocab_size=target.vocab_size, train_ranks=train_ranks
    )
    startup.mark("data")
    return RunStart(config, topo, device, roles, resume_from, drafter, target, data, startup)


def bind_objective(
    model: torch.nn.Module, target: TargetModel, t: TrainConfig, loss: WeightedHeadLoss, placement: Placement
) -> Objective:
    """The DFlash objective of this run's settings over `model` (the drafter or its data-parallel form)."""
    return Objective(
        model,
        target,
        num_anchors=t.num_anchors,
        gamma=t.gamma,
        loss=loss,
        anchors=t.anchors,
        attention=placement.attention,
        autocast_dtype=placement.autocast_dtype,
        position_weight=t.position_weight,
        dpace_alpha=t.dpace_alpha,
    )


def place_drafter(run: RunStart) -> Placement:
    """The drafter's device, precision, compile and data parallelism (distributed/parallelize.py), from
    the checkpoint's weights on a resume: data parallelism starts from them."""
    t, config = run.config.train, run.config
    if run.resume_from is not None:
        run.drafter.load_state_dict(run.resume_from.drafter.state_dict())
    return parallelize(
        run.drafter,
        device=run.device,
        attention=t.attention,
        compile=t.compile,
        activation_checkpointing=t.activation_checkpointing,
        dtype=t.dtype,
        master_weights=t.master_weights,
        precision=t.precision,
        fp8_recipe=t.fp8_recipe,
        data_parallel=resolve_data_parallel(config.distributed.data_parallel, run.topo.world_size),
        group=run.topo.group,
        bucket_mb=config.distributed.bucket_mb,
    )


def step_hooks(run: RunStart) -> StepHooks:
    """What this rank's topology adds to each step: nothing (colocated), or a split drafter rank's
    feature receives and control exchange."""
    if run.roles is None:
        return StepHooks()
    return SplitDrafterHooks(
        run.roles,
        run.device,
        run.config.distributed.timeout_minutes * 60,
        run.config.distributed.max_in_flight,
        feature_width=len(run.drafter.spec.target_layer_ids) * run.target.hidden_size,
        feature_dtype=run.target.dtype,
    )
