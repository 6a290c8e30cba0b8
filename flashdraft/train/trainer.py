"""The DFlash training loop, one process per GPU: target forward (no grad) -> drafter forward/backward -> AdamW.

`Trainer.train` is the loop: draw a batch, step, guard, log, evaluate, checkpoint, stop. What it drives is
built in train/build.py (topology, target, drafter, data, placement, optimizer, resume); the state a step
advances is one `TrainState` (train/state.py). Paper defaults (docs/dflash.md): AdamW lr 6e-4, cosine with
4% warm-up, grad clip 1.0, 6 epochs, max length 3072, 512 anchors, γ by block size. The safety rules
(non-finite steps skipped, checkpoints a stranger can hand you, resume refused on changed settings) are
in docs/training-safety.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from flashdraft.config import Config, to_dict
from flashdraft.distributed.float8 import float8_head
from flashdraft.distributed.parallelize import Placement, full_state_dicts, pad_multiple, unsharded_copy
from flashdraft.distributed.roles import StepHooks
from flashdraft.distributed.topology import (
    Topology,
    all_reduce_sum,
    any_rank_flags,
    barrier,
    shutdown,
    sum_gradients,
)
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import save_drafter
from flashdraft.model.target import TargetModel  # also re-exported: tests patch its loader here
from flashdraft.progress import Progress
from flashdraft.run_protocol import Heartbeat, resume_hint
from flashdraft.train import compile_report
from flashdraft.train.build import (
    RunStart,
    bind_objective,
    place_drafter,
    say_on_main,
    start_run,
    step_hooks,
)
from flashdraft.train.checkpoint import CheckpointWriter
from flashdraft.train.drafter_setup import build_drafter  # noqa: F401 - re-exported: tests build drafters here
from flashdraft.train.feature_server import serve_features
from flashdraft.train.flops import peak_tflops
from flashdraft.train.inputs import TrainingData
from flashdraft.train.loss import WeightedHeadLoss, selector_weight
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.muon import drafter_optimizer
from flashdraft.train.objective import Objective
from flashdraft.train.prefetch import DrawnStep, StepPrefetcher
from flashdraft.train.profiling import StepProfiler
from flashdraft.train.real_eval import RealDecoder, decoding_copy, plan_real_eval
from flashdraft.train.resume import optimizer_layout, restore_training
from flashdraft.train.schedule import TimedSaves, make_scheduler
from flashdraft.train.state import TrainState
from flashdraft.train.stop import StopRequest
from flashdraft.train.validation import PassProgress, held_out_acceptance
from flashdraft.train.window import LogWindow


@dataclass
class Trainer:
    """One training rank: the parts `build_trainer` puts together, and the loop that drives them."""

    config: Config  # resolved (train/drafter_setup.py)
    topo: Topology
    device: torch.device
    drafter: DFlashDraftModel  # the drafter itself: its parameters, its config
    target: TargetModel  # frozen: the objective's features and head (closed before the group is destroyed)
    placement: Placement  # device, precision, compile; `.data_parallel.module` is what trains
    objective: Objective  # over what trains (the DDP wrapper, the FSDP shards or the drafter)
    eval_objective: Objective  # the main rank's replica, or the shards (a collective)
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    data: TrainingData
    prefetch: StepPrefetcher
    hooks: StepHooks  # what the topology adds to a step (nothing, or a split drafter rank's messages)
    state: TrainState
    heartbeat: Heartbeat
    stop: StopRequest
    logger: MetricsLogger | None  # the main rank's
    profiler: StepProfiler
    timed_saves: TimedSaves
    writer: CheckpointWriter  # checkpoints off the step's path (the main rank writes)
    window: LogWindow  # the counters since the last metrics row
    peak_tflops: float | None  # the device's bf16 peak (MFU), None where unknown
    real_eval: RealDecoder | None = None  # held-out prompts decoded for real at each evaluation (None: off)
    applied_lr: float | None = None  # the lr the last applied step trained at (what its metrics row shows)
    early_stopped: bool = False  # train.early_stop_evals ended the run

    def train(self) -> dict[str, Any]:
        """Draw a batch, step, guard, log, evaluate, checkpoint, stop: until the last step, the time budget
        (train.max_minutes) or a stop request."""
        self.first_step = self.state.step  # 0, or the step a resume starts from
        # a line at least every 8 s between the metric rows (steps of seconds each on a CPU), main rank only
        self.steps_progress = Progress(
            "training" if not self.state.step else f"training from step {self.state.step}",
            self.data.total_steps - self.state.step,
            unit="step",
            mode=None if self.topo.is_main else "off",
        )
        try:
            return self._train()
        except BaseException as exc:
            # a failing run still completes the checkpoint it is writing before its error surfaces: the
            # caller (a test, a supervisor, the user) finds every checkpoint the run said it would keep
            error = self.writer.settle(exc, self.out_dir)
            if error is exc:
                raise
            raise error from exc
        finally:  # however the loop ends: no ticker left writing after it
            self.steps_progress.close()

    def _train(self) -> dict[str, Any]:
        t, state = self.config.train, self.state
        outcome, over_budget = "finished", False
        while state.step < self.data.total_steps:
            self.profiler.before_step(state.step + 1)
            timer = self.begin_step()
            drawn = self.prefetch.next_step()
            losses, stats, total_weight = self.forward_backward(drawn)
            if self.hooks.draw_during_step:  # the next step is collated while this one's kernels run
                self.prefetch.draw_ahead(1)
            grad_norm = self.reduce_gradients()
            bad, stopping, over_budget = self.agree_on_flags(losses, grad_norm)
            state.step += 1
            state.sampler = drawn.sampler_state
            if bad:
                self.skip_step(losses, grad_norm)
            else:
                self.apply_step(losses, stats, total_weight, grad_norm)
            stopping = self.end_step(timer, stopping, over_budget)
            last = state.step == self.data.total_steps or over_budget
            if self.profiler.after_step(state.step, last=last or stopping):
                self.say(
                    f"profile of steps {self.profiler.first}-{state.step}: {self.profiler.report} (and a Chrome trace beside it)"
                )
            timed = self.timed_saves.due(state.clock.train_seconds)
            self.beat_step(timer)
            self.steps_progress.advance()
            if state.step % t.log_every == 0 or last:
                self.log_window(grad_norm)
            if self.validation_due(last, timed):
                stopping = self.validate() or stopping
            self.writer.poll()  # a finished background write's line and heartbeat; a failed one's error
            if state.step == self.first_step + 1:  # the optimizer's state exists from now on
                self.reserve_checkpoint_memory()
            if self.checkpoint_due(last, stopping, timed):
                self.save_checkpoint()
            if stopping and self.early_stopped:  # a finished run: its held-out metric stopped improving
                self.say(
                    f"train.early_stop_evals={t.early_stop_evals}: stopped at step {state.step} with a final "
                    f"checkpoint; best/ holds step {state.best_step}"
                )
                break
            if stopping:
                outcome = "stopped"
                self.say(f"stopped at step {state.step}; {resume_hint()}")
                break
            if over_budget:  # a finished run: it trained for the time it was given
                self.say(
                    f"train.max_minutes={t.max_minutes} spent at step {state.step}: final checkpoint written"
                )
                break
        return self.finish(outcome, over_budget)

    # ------------------------------------------------------------------ one step

    def begin_step(self) -> StepTimer:
        timer = StepTimer(time.perf_counter(), compile_report.now())
        self.state.clock.start()
        self.hooks.step_started()
        return timer

    def forward_backward(self, drawn: DrawnStep) -> tuple[list[Tensor], list[dict[str, Tensor]], float]:
        """Every micro-batch's forward and backward; returns their summed losses and acceptance sums (device
        tensors, no sync) and the step's global Σw."""
        t, parallel = self.config.train, self.placement.data_parallel
        for micro in drawn.micro:
            if not micro.padding:
                self.window.add_work(*micro.work)
        # Normalise by the whole step's global Σw so accumulation and data parallelism equal one large batch.
        (total_weight,) = all_reduce_sum([sum(m.weight for m in drawn.micro)], self.device, self.topo)
        self.objective.selector_weight = selector_weight(
            self.state.step, t.selector_alpha, t.selector_warmup_steps, t.selector_ramp_steps
        )
        losses, stats = [], []
        for i, micro in enumerate(drawn.micro):
            last = i == len(drawn.micro) - 1
            features = self.hooks.features()
            if not micro.padding:
                self.hooks.trained(micro.batch.input_ids.shape[0])
            with parallel.sync(last):  # DDP/FSDP reduce in the last micro-batch's backward only
                out = self.objective(micro.batch, micro.blocks, features=features)
                # a padding micro-batch weighs 0
                loss = out.loss_sum * 0.0 if micro.padding else out.loss_sum / total_weight
                loss.backward()
            if not last and not parallel.reduces_gradients:
                self.optimizer.accumulate_gradients()  # bf16 gradients are summed in fp32
            if not micro.padding:
                losses.append(out.loss_sum.detach())
                stats.append(out.stats)
        return losses, stats, total_weight

    def reduce_gradients(self) -> Tensor:
        """Gradients summed over ranks (where the backward did not already), and their global norm."""
        if not self.placement.data_parallel.reduces_gradients:  # one process: a no-op
            sum_gradients(self.optimizer.gradients(fp32=self.topo.distributed), self.topo)
        return self.optimizer.grad_norm()

    def agree_on_flags(self, losses: list[Tensor], grad_norm: Tensor) -> list[bool]:
        """The step's one host read, before any update: a non-finite loss or gradient norm on any rank skips
        the step on every rank, a stop request on any rank stops every rank after it, and the budget flag
        too (ranks' clocks differ slightly, and all must stop after the same step)."""
        over_budget = self.state.clock.would_exceed(self.config.train.max_minutes * 60)
        return any_rank_flags(
            [non_finite(losses, grad_norm), self.stop.requested, over_budget], self.device, self.topo
        )

    def skip_step(self, losses: list[Tensor], grad_norm: Tensor) -> None:
        """The guard: no weight, moment or schedule update; too many in a row end the run."""
        t, state = self.config.train, self.state
        self.optimizer.discard_gradients()
        state.skipped += 1
        state.bad_in_a_row += 1
        loss_now = float(sum(losses)) if losses else math.nan
        self.say(
            f"step {state.step}: non-finite loss {loss_now} or gradient norm {float(grad_norm)} on some rank; "
            f"step skipped ({state.bad_in_a_row} in a row, {state.skipped} in all)"
        )
        self.heartbeat.beat(step=state.step, skipped_steps=state.skipped, force=True)
        if state.bad_in_a_row >= t.max_bad_steps:
            raise FlashdraftError(
                f"step {state.step}: {state.bad_in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(train.max_bad_steps={t.max_bad_steps}; last: loss {loss_now}, grad norm {float(grad_norm)}); "
                f"they were skipped and no checkpoint of this state is written. Likely causes: train.lr="
                f"{t.lr} too high, or bad samples in data.train; lower the lr or fix the data, then "
                f"{resume_hint()} (from the last checkpoint)"
            )

    def apply_step(
        self, losses: list[Tensor], stats: list[dict[str, Tensor]], total_weight: float, grad_norm: Tensor
    ) -> None:
        self.optimizer.clip_and_step(self.config.train.grad_clip, grad_norm)
        self.applied_lr = self.scheduler.get_last_lr()[0]  # after step() it is the next step's
        self.scheduler.step()
        self.optimizer.discard_gradients()
        self.state.bad_in_a_row = 0
        self.window.add_step(losses, stats, total_weight)

    def end_step(self, timer: StepTimer, stopping: bool, over_budget: bool) -> bool:
        """Wait for the step's kernels, book its time (training or compiling), let the topology join in;
        returns whether the run stops after this step (the other side of a split topology may ask)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.window.seconds += time.perf_counter() - timer.started
        asked = self.hooks.step_finished(
            time.perf_counter() - timer.started, stopping or over_budget, self.state.step
        )
        stopping = stopping or (asked and not over_budget)
        compiled = self.state.clock.compiling()
        step_seconds = self.state.clock.stop()
        if compiled:
            self.report_compiles(timer, step_seconds)
        return stopping

    def report_compiles(self, timer: StepTimer, step_seconds: float) -> None:
        """Where a compiling step's time went, graph by graph (train/compile_report.py), and a warning where
        the drafter's layers compiled one graph each instead of one per kind."""
        graphs = compile_report.graphs_compiled_since(timer.compiles_since)
        if not graphs:
            return
        self.say(f"step {self.state.step}: " + compile_report.describe(graphs, step_seconds))
        layers = self.drafter.layers
        kinds = len(set(self.drafter.layer_kinds()))
        repeated = compile_report.repeated_layer_graphs(graphs, type(layers[0]).forward, len(layers), kinds)
        if repeated:
            self.say(f"step {self.state.step}: warning: {repeated}")
        if self.logger is not None:  # each graph's compile stages, for whoever asks why it was slow
            graph_records = [dataclasses.asdict(g) for g in graphs]
            self.logger.log(self.state.step, {"graphs": graph_records}, kind="compile", console=False)

    # ------------------------------------------------------------------ after the step

    def beat_step(self, timer: StepTimer) -> None:
        memory = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        self.heartbeat.beat(
            "training",
            step=self.state.step,
            epoch=self.state.epoch,
            skipped_steps=self.state.skipped,
            step_seconds=round(time.perf_counter() - timer.started, 4),
            max_memory_GiB=None if memory is None else round(memory, 2),
        )

    def log_window(self, grad_norm: Tensor) -> None:
        """One metrics row for the window since the last (summed over ranks), then a new window."""
        state, window = self.state, self.window
        window.all_reduce(self.device, self.topo)
        metrics = {
            **window.metrics(),
            "lr": self.scheduler.get_last_lr()[0] if self.applied_lr is None else self.applied_lr,
            "grad_norm": float(grad_norm),
            "epoch": state.epoch,
            "skipped_steps": state.skipped,
            "train_minutes": state.clock.train_seconds / 60,
            "compile_minutes": state.clock.compile_seconds / 60,
        }
        if self.peak_tflops:
            metrics["mfu"] = metrics["tflops"] / self.peak_tflops / self.topo.world_size
        report = self.hooks.window_report()  # a split topology's balance over this window
        metrics.update({f"balance/{k}": v for k, v in report.items() if k != "advice"})
        if report.get("advice"):
            self.say(f"balance at step {state.step}: {report['advice']}")
        if self.logger is not None:
            self.logger.log(state.step, metrics)
        self.heartbeat.beat(
            loss=metrics["loss"],
            tau=metrics["tau"],
            tflops=metrics["tflops"],
            **({"balance": report} if report else {}),
            force=True,
        )
        self.window = LogWindow(self.drafter.spec.block_size)

    def validation_due(self, last: bool, timed: bool) -> bool:
        every = self.config.train.eval_every
        return self.data.eval is not None and bool(every) and (self.state.step % every == 0 or last or timed)

    def validate(self) -> bool:
        """Held-out validation (train/validation.py) and the best checkpoint by it; returns whether a stop
        was requested meanwhile, on any rank (then the pass is abandoned after its batch in flight)."""
        # A sharded drafter or a group-sharded target makes validation a collective: every rank runs it.
        collective = self.placement.data_parallel.sharded or self.config.distributed.target_parallel > 1
        abandoned = False
        if self.topo.is_main or collective:
            abandoned = self.validation_pass(collective)
        stale = self.config.train.early_stop_evals
        early = bool(stale) and self.state.evals_since_best >= stale  # the main rank's count decides
        stopping, self.early_stopped = any_rank_flags(
            [abandoned or self.stop.requested, early and not abandoned], self.device, self.topo
        )
        return stopping or self.early_stopped

    def validation_pass(self, collective: bool) -> bool:
        """One pass over data.eval (and the real decode of a few of its prompts), logged as an eval row,
        and best/ by train.best_by; returns True when a stop abandoned it."""
        t, state = self.config.train, self.state
        self.heartbeat.beat("evaluating")
        after_batch = partial(self.after_validation_batch, PassProgress(state.step, self.say), collective)
        result = held_out_acceptance(
            self.eval_objective,
            self.data.eval,
            t.batch_size,
            t.seed,
            self.placement.pad_multiple,
            self.device,
            after_batch=after_batch,
        )
        if result is not None and self.real_eval is not None:
            real = self.real_decode(collective)
            result = None if real is None else {**result, **real}
        if result is None:
            self.say(f"step {state.step}: evaluation abandoned for the stop request")
            return True
        result["train_minutes"] = state.clock.train_seconds / 60
        self.heartbeat.beat(
            "training",
            eval_tau=result["tau"],
            **({"eval_real_tau": result["real_tau"]} if "real_tau" in result else {}),
        )
        # best/ by train.best_by; the same decision on every rank of a collective pass (its write is one)
        value = result.get(BEST_BY_KEY[t.best_by])
        if state.record_evaluation(value):
            self.save_best()
            result["best"] = True  # this evaluation's drafter is best/ (infer/report.py reads it)
        result["evals_since_best"] = state.evals_since_best
        if state.evals_since_best == min(STALE_EVALS_WARNING, t.early_stop_evals or STALE_EVALS_WARNING):
            self.say(self.memorising_line(value))
        if self.logger is not None:
            self.logger.log(state.step, result, kind="eval")
        return False

    def memorising_line(self, value: float) -> str:
        """What a run whose held-out metric stopped improving is told (never silent: a drafter that goes on
        training past its best only memorises its answers, and the user's lever is the data)."""
        t, state = self.config.train, self.state
        metric = t.best_by.replace("_", " ")
        since = "" if state.best_step is None else f" at step {state.best_step}"
        epoch = (
            "" if state.epoch is None else f", in epoch {state.epoch + 1} over {len(self.data.train)} samples"
        )
        stop = (
            f"train.early_stop_evals={t.early_stop_evals} ends the run"
            if t.early_stop_evals
            else "train.early_stop_evals=N ends such a run"
        )
        return (
            f"step {state.step}: held-out {metric} has not improved for {state.evals_since_best} evaluations "
            f"(best {state.best:.4g}{since}, now {value:.4g}){epoch}: the drafter is likely memorising its "
            f"training data. best/ holds its best; more answers (prepare --regenerate on more prompts) raise "
            f"τ where more steps do not; {stop}"
        )

    def real_decode(self, collective: bool) -> dict[str, Any] | None:
        """The real decode of the held-out prompts (train/real_eval.py) on the main rank, with a plain
        copy of the drafter (a sharded drafter's whole state gathered first: a collective); its eval row
        keys, or None when a stop request came. In a collective pass every rank gets the main rank's
        outcome (real_tau and the stop), so that all decide best/ alike."""
        parallel, state = self.placement.data_parallel, self.state
        weights = full_state_dicts(parallel, self.drafter)[0]
        real, stopped = None, False
        if self.topo.is_main:
            drafter = decoding_copy(self.drafter, weights, self.device, self.real_eval.target.dtype)
            real = self.real_eval.decode(
                drafter, f"step {state.step}: real τ", self.heartbeat.beat, lambda: self.stop.requested
            )
            stopped = real is None
        del weights
        if not collective:
            return real
        shared_stop, shared_tau = all_reduce_sum(
            [float(stopped), real["real_tau"] if real else 0.0], self.device, self.topo
        )
        if shared_stop:
            return None
        return real if self.topo.is_main else {"real_tau": shared_tau}

    def after_validation_batch(self, progress: PassProgress, collective: bool, done: int, total: int) -> bool:
        """Progress of the pass (heartbeat and a line every few seconds); whether a stop abandons it."""
        self.heartbeat.beat("evaluating", eval_batch=done, eval_batches=total)
        progress(done, total)
        if collective:  # every rank leaves the pass after the same batch
            return any_rank_flags([self.stop.requested], self.device, self.topo)[0]
        return self.stop.requested

    def save_best(self) -> None:
        """best/: the drafter in the export format (a collective with a sharded drafter)."""
        parallel, best = self.placement.data_parallel, self.drafter
        if parallel.sharded:  # the whole state lands on the main rank
            weights = full_state_dicts(parallel, self.drafter)[0]
            best = unsharded_copy(self.drafter, weights) if self.topo.is_main else self.drafter
        if self.topo.is_main:
            save_drafter(best, self.out_dir / "best", dtype=torch.bfloat16)

    def checkpoint_due(self, last: bool, stopping: bool, timed: bool) -> bool:
        if not (self.topo.is_main or self.placement.data_parallel.sharded):  # the ranks that take part
            return False
        return self.state.step % self.config.train.save_every == 0 or last or stopping or timed

    def save_checkpoint(self) -> None:
        """checkpoints/step-N: the drafter and everything a resume needs (train/checkpoint.py). With a
        sharded drafter a collective; the main rank hands the state to the background writer, which copies
        it to host memory and writes it while the next steps run. Both parts are whole: a checkpoint does
        not depend on the world size that wrote it."""
        self.heartbeat.beat("checkpointing")
        drafter, trainer_state = self.checkpoint_contents()
        if self.topo.is_main:
            self.writer.save(
                self.out_dir, self.state.step, drafter, trainer_state, self.config.train.keep_last
            )
            self.heartbeat.beat("training")

    def reserve_checkpoint_memory(self) -> None:
        """The background writer's host buffers, allocated now off the step's path rather than by the first
        save on it. The main rank of an unsharded drafter alone: a sharded state gathers to the CPU."""
        if self.topo.is_main and not self.placement.data_parallel.sharded:
            self.writer.reserve(*self.checkpoint_contents())

    def checkpoint_contents(self) -> tuple[DFlashDraftModel, dict[str, Any]]:
        parallel = self.placement.data_parallel
        weights, optimizer_state = full_state_dicts(parallel, self.drafter, self.optimizer)
        drafter = (
            unsharded_copy(self.drafter, weights) if parallel.sharded and self.topo.is_main else self.drafter
        )
        return drafter, {
            **self.state.state_dict(),
            "optimizer": optimizer_state,
            "optimizer_layout": optimizer_layout(parallel.sharded),
            "scheduler": self.scheduler.state_dict(),
            "total_steps": self.data.total_steps,
            "config": to_dict(self.config),
            "world_size": self.topo.world_size,
        }

    def finish(self, outcome: str, over_budget: bool) -> dict[str, Any]:
        """Close what the loop opened, in an order that cannot hang, and sum up the run."""
        self.steps_progress.close()
        self.writer.wait()  # the final (or the stop's) checkpoint is complete before the run reports its end
        self.hooks.close()
        if self.logger is not None:
            self.logger.close()
        barrier(self.topo)
        self.placement.data_parallel.close()  # DDP's reducer must not outlive the process group (a hang at exit)
        self.target.close()  # nor a sharded target's mesh (an abort at exit)
        shutdown(self.topo)
        clock = self.state.clock
        return {
            "steps": self.state.step,
            "out_dir": str(self.out_dir),
            "best_by": self.state.best_by,
            "best": self.state.best,  # best/'s value of that metric (None: no evaluation ran)
            "outcome": outcome,
            "skipped_steps": self.state.skipped,
            "train_minutes": clock.train_seconds / 60,
            "compile_minutes": clock.compile_seconds / 60,
            "budget_spent": over_budget,
            "best_step": self.state.best_step,
            "early_stopped": self.early_stopped,
        }

    @property
    def out_dir(self) -> Path:
        return Path(self.config.train.out_dir)

    def say(self, line: str) -> None:
        say_on_main(self.topo, line)


# train.best_by -> the eval row key it picks best/ by (config.BEST_BY)
BEST_BY_KEY = {"simulated_tau": "tau", "real_tau": "real_tau", "loss": "loss"}
# evaluations in a row without a better best/ after which the run says it is likely memorising its data
STALE_EVALS_WARNING = 3


@dataclass
class StepTimer:
    started: float  # time.perf_counter() at the step's start
    compiles_since: float  # compile_report.now() at the step's start


def non_finite(losses: list[Tensor], grad_norm: Tensor) -> Tensor:
    """A device flag: is any loss or the gradient norm nan or inf? (No sync: read with the step's flags.)"""
    total = grad_norm.float()
    for loss in losses:
        total = total + loss.float()  # nan or inf in any term leaves the sum non-finite
    return ~torch.isfinite(total)


def build_trainer(run: RunStart, heartbeat: Heartbeat, stop: StopRequest) -> Trainer:
    """Placement and compile, objective, optimizer and schedule, the restored state, prefetch, logging."""
    config, t, topo = run.config, run.config.train, run.topo
    placement = place_drafter(run)
    parallel = placement.data_parallel
    spec = run.drafter.spec
    loss = WeightedHeadLoss(
        chunk=t.loss_chunk,
        multiplier=spec.output_multiplier,
        loss=t.loss,
        lk_eta=t.lk_eta,
        head=float8_head(run.target.lm_head_weight) if t.fp8_head else None,
        compile=placement.compiled,
        fused=fused_ce_allowed(t.fused_ce, run.device),
    )
    objective = bind_objective(parallel.module, run.target, t, loss, placement)
    if loss.fused and loss.top_k:  # bind_objective gave the loss the DFlash2 selector's top-k
        raise FlashdraftError(
            "train.fused_ce: a DFlash2 drafter's selector needs the head's top-k candidates, which the fused "
            "kernels do not compute; set train.fused_ce=false"
        )
    # Validation runs on the main rank alone with a replica (no collective), on every rank with shards (of
    # the drafter, or of the target: distributed.target_parallel).
    eval_objective = (
        objective if parallel.sharded else bind_objective(run.drafter, run.target, t, loss, placement)
    )
    # every rank of an unsharded run steps from the same summed gradients: Muon shares its products among them
    optimizer = drafter_optimizer(
        run.drafter,
        t,
        compile=placement.compiled,
        split_ranks=topo.distributed and not parallel.sharded,
        group=topo.group,
    )
    if getattr(optimizer, "split_ranks", False):  # Muon with bf16 weights (MasterWeightMuon) on several ranks
        say_on_main(
            topo,
            f"Muon: the Newton–Schulz products shared by {topo.world_size} ranks (each orthogonalises its "
            "share of the matrices and broadcasts it)",
        )
    state = TrainState(best_by=t.best_by)
    scheduler = make_scheduler(optimizer, t, run.data.total_steps, state)
    if run.resume_from is not None:
        restore_training(
            run.resume_from,
            drafter=run.drafter,
            optimizer=optimizer,
            sharded=parallel.sharded,
            scheduler=scheduler,
            sampler=run.data.sampler,
            state=state,
            log=partial(say_on_main, topo),
        )
        run.resume_from = None  # frees the loaded state and the verified CPU copy of the drafter
    run.startup.mark("drafter_and_optimizer")
    hooks = step_hooks(run)
    prefetch = StepPrefetcher(
        run.data,
        objective,
        run.drafter,
        topo=topo,
        device=run.device,
        grad_accum=t.grad_accum,
        seed=t.seed,
        pad_multiple=placement.pad_multiple,
        vocab_size=run.target.vocab_size,
        first_step=state.step,
        hooks=hooks,
    )
    logger = MetricsLogger(run.out_dir, run.data.total_steps, start_step=state.step) if topo.is_main else None
    real_eval = plan_real_eval(
        config, run.device, run.target, run.drafter, run.data.eval, partial(say_on_main, topo)
    )
    if (line := state.choose_best_by(t.best_by)) is not None:  # a resume with another train.best_by
        say_on_main(topo, line)
    say_on_main(topo, training_line(run, placement))
    if real_eval is not None:
        say_on_main(topo, f"{real_eval.describe()}; best/ by train.best_by={t.best_by}")
    run.drafter.train()
    phase = "compiling" if placement.compiled else "training"
    heartbeat.beat(phase, force=True, step=state.step, total_steps=run.data.total_steps)
    return Trainer(
        config=config,
        topo=topo,
        device=run.device,
        drafter=run.drafter,
        target=run.target,
        placement=placement,
        objective=objective,
        eval_objective=eval_objective,
        optimizer=optimizer,
        scheduler=scheduler,
        data=run.data,
        prefetch=prefetch,
        hooks=hooks,
        state=state,
        heartbeat=heartbeat,
        stop=stop,
        logger=logger,
        profiler=StepProfiler(run.out_dir, t.profile_start, t.profile_steps, topo.rank, run.device),
        timed_saves=TimedSaves(t.save_every_minutes, state.clock.train_seconds),
        writer=CheckpointWriter(heartbeat, partial(say_on_main, topo)),
        window=LogWindow(spec.block_size),
        peak_tflops=peak_tflops(run.device),
        real_eval=real_eval,
    )


def fused_ce_allowed(asked: bool, device: torch.device) -> bool:
    """train.fused_ce where its Triton kernels run (a CUDA device), refused elsewhere."""
    if asked and device.type != "cuda":
        raise FlashdraftError(
            f"train.fused_ce runs Triton kernels on a CUDA GPU; this run is on {device.type}: set "
            "train.fused_ce=false"
        )
    return asked


def training_line(run: RunStart, placement: Placement) -> str:
    """The start-up summary: what trains where, on how much data, and where the time before it went."""
    parameters = sum(p.numel() for p in run.drafter.parameters()) / 1e6
    data, startup = run.data, run.startup
    return (
        f"training {parameters:.1f}M drafter parameters on {run.device} "
        f"x {run.topo.world_size} process(es) ({placement.attention} attention, compiled={placement.compiled}); "
        f"{len(data.train)} samples ({data.train.dropped_summary()}), {data.total_steps} steps; "
        f"set up in {sum(startup.seconds.values()):.1f} s ({startup.summary()})"
        + ("; the first steps compile" if placement.compiled else "")
    )


def train(config: Config, heartbeat: Heartbeat | None = None) -> dict[str, Any]:
    """Train a drafter as `config` says (the entry of `flashdraft train`, `launch` and the tests); returns
    the run's summary. A split topology's target ranks serve features instead (train/feature_server.py)."""
    heartbeat = heartbeat or Heartbeat(None)
    stop = StopRequest()
    run = start_run(config, heartbeat)
    if run.serves_target:
        return serve_features(
            run.config,
            run.roles,
            run.target,
            run.data.train,
            run.data.sampler,
            run.resume_from.state if run.resume_from is not None else None,
            run.data.total_steps,
            pad_multiple(run.config.train.compile and run.device.type == "cuda"),
            heartbeat,
            lambda: stop.requested,
        )
    return build_trainer(run, heartbeat, stop).train()
