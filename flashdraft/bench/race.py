"""The other side of `flashdraft bench quality --against specforge`: the same drafter, trained by SpecForge's
own training code (docs/quality-benchmark.md, "The race").

What is SpecForge's (called through its public modules, never copied; the `specforge` 0.2.0 wheel installed
without its dependencies, as the tests install `dflash`):
  * the drafter module, `specforge.modeling.draft.dflash.DFlashDraftModel` (z-lab's tensor names, so it
    loads the race's initial weights and its checkpoints load as flashdraft drafter directories);
  * the objective, `specforge.algorithms.common.dflash_family_model.OnlineDFlashModel` (anchor sampling, the
    block mask, the noise embedding, the position-decayed cross-entropy), its forward returning the loss;
  * the target's embedding and head, `specforge.modeling.target.target_utils.TargetEmbeddingsAndHead`;
  * the optimizer and lr schedule, `specforge.optimizer.BF16Optimizer` (fp32 master weights, AdamW, global
    gradient clipping, linear warmup then cosine: `specforge.lr_scheduler.CosineAnnealingWarmupLR`, which
    needs its step count up front: sized from a probe, re-sized to the budget as steps are timed).
What is the race's: the batches (the same shards, `--batch-size` sequences per step, shuffled by the seed),
the target's features (the outputs of the drafter's target layers, HF's `hidden_states[id + 1]`, as
SpecForge's HF capture takes them), the clock (the same `--gpu-minutes` of step time as flashdraft's
`train.max_minutes`) and the checkpoints (flashdraft drafter directories at the same curve points).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flashdraft.durable import atomic_write_json
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import WEIGHTS_NAME, read_config, save_drafter
from flashdraft.model.spec import default_gamma
from flashdraft.train.budget import TrainingClock

if TYPE_CHECKING:
    from flashdraft.model.target import TargetModel

SPECFORGE_INSTALL = "pip install --no-deps specforge==0.2.0 (its modules used here need no sglang)"
# SpecForge's DFlash recipe (its Qwen3-8B example, docs/quality-benchmark.md), where the race leaves a
# setting to each trainer; lr, anchors and batch size are the race's, the same on both sides.
WARMUP_RATIO = 0.04
MAX_GRAD_NORM = 1.0
PROBE_STEPS = 3  # untimed steps on a copy: compile warm-up, and the step time that sizes the schedule
RESIZES = 10  # times the schedule is re-sized to the budget from the measured step time


def _resized_schedule(optimizer, total_steps: int, done: int):
    """SpecForge's own warmup + cosine schedule over `total_steps`, advanced to step `done`."""
    from specforge.lr_scheduler import CosineAnnealingWarmupLR

    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"]
    schedule = CosineAnnealingWarmupLR(
        optimizer, total_steps=total_steps, warmup_steps=int(WARMUP_RATIO * total_steps)
    )
    for _ in range(done):
        schedule.step()
    return schedule


def specforge_missing() -> str | None:
    """Why SpecForge's training code cannot run here (None: it can)."""
    if importlib.util.find_spec("specforge") is None:
        return f"the specforge package is not installed: {SPECFORGE_INSTALL}"
    try:
        import specforge.algorithms.common.dflash_family_model
        import specforge.modeling.draft.dflash
        import specforge.modeling.target.target_utils
        import specforge.optimizer  # noqa: F401
    except ImportError as exc:
        return f"specforge's training modules do not import here ({exc})"
    return None


@dataclass
class RaceBatches:
    """The training shards as SpecForge batches: right-padded input_ids and loss_mask, seeded order."""

    samples: list[tuple[list[int], list[int]]]
    batch_size: int
    max_length: int
    seed: int

    @classmethod
    def load(cls, shard_dir: Path, batch_size: int, max_length: int, seed: int) -> RaceBatches:
        from flashdraft.data.shards import open_shards

        _, shards = open_shards(shard_dir)
        samples = []
        for number in range(len(shards)):
            ids, mask = (a.astype("int64").tolist() for a in shards.sample(number, max_length))
            if sum(mask[1:]) >= 2:  # SpecForge needs two consecutive supervised tokens
                samples.append((ids, mask))
        if not samples:
            raise FlashdraftError(f"{shard_dir}: no sample with a supervised answer for the SpecForge side")
        return cls(samples, batch_size, max_length, seed)

    def __iter__(self):
        epoch = 0
        while True:
            order = torch.randperm(
                len(self.samples), generator=torch.Generator().manual_seed(self.seed + epoch)
            )
            for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
                rows = [self.samples[i] for i in order[start : start + self.batch_size].tolist()]
                width = max(len(ids) for ids, _ in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.long)
                for r, (row_ids, row_mask) in enumerate(rows):
                    ids[r, : len(row_ids)] = torch.tensor(row_ids)
                    mask[r, : len(row_mask)] = torch.tensor(row_mask)
                yield ids, mask
            epoch += 1


def _specforge_drafter(init_dir: Path, device: torch.device, dtype: torch.dtype, attention: str):
    """SpecForge's drafter module with the race's initial weights (the same tensors flashdraft starts from)."""
    from safetensors.torch import load_file
    from specforge.modeling.draft.dflash import DFlashDraftModel as SpecForgeDrafter

    config = read_config(init_dir)
    config._attn_implementation = attention
    model = SpecForgeDrafter(config)
    state = load_file(str(init_dir / WEIGHTS_NAME))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise FlashdraftError(
            f"{init_dir}: SpecForge's DFlashDraftModel does not take these weights (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]})"
        )
    return model.to(device=device, dtype=dtype), config


def _save_as_flashdraft(model, config, path: Path) -> Path:
    """SpecForge's drafter weights as a flashdraft drafter directory (the same tensor names)."""
    ours = DFlashDraftModel(config)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    ours.load_state_dict(state)
    return save_drafter(ours, path, overwrite="drafter")


@dataclass
class _SpecForgeSide:
    """SpecForge's side of the race once set up: its drafter module with the initial weights, the target
    (features) and SpecForge's reading of its embedding and head, and the race's batches."""

    drafter: torch.nn.Module
    config: Any  # the drafter's config, as SpecForge's module reads it
    target: TargetModel
    parts: Any  # specforge's TargetEmbeddingsAndHead
    device: torch.device
    dtype: torch.dtype
    attention: str
    num_anchors: int
    data: RaceBatches
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]  # training's order, one pass of `data`

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def gamma(self) -> float:
        return default_gamma(self.block_size)

    def objective(self, model: torch.nn.Module):
        """SpecForge's OnlineDFlashModel around `model`: its anchors, block mask and decayed loss."""
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel

        return OnlineDFlashModel(
            draft_model=model,
            target_lm_head=self.parts.lm_head,
            target_embed_tokens=self.parts.embed_tokens,
            mask_token_id=int(dict(self.config.dflash_config)["mask_token_id"]),
            block_size=self.block_size,
            attention_backend=self.attention,
            num_anchors=self.num_anchors,
            loss_decay_gamma=self.gamma,
            loss_type="dflash",
        )

    def step(self, wrapped, optimizer, source=None) -> tuple[float, float]:
        """One training step on the next batch of `source` (default: training's batches): the race's
        target features, SpecForge's loss, backward and optimizer step. Returns (loss, accuracy)."""
        ids, mask = next(self.batches if source is None else source)
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            features = self.target.features(ids)
        loss, accuracy, _ = wrapped(input_ids=ids, hidden_states=features, loss_mask=mask)
        loss.backward()
        optimizer.step()
        return float(loss.detach()), float(accuracy.detach())

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _set_up(
    target_dir: str,
    init_dir: Path,
    train_shards: Path,
    *,
    num_anchors: int,
    batch_size: int,
    max_length: int,
    seed: int,
    device: str,
) -> _SpecForgeSide:
    """SpecForge's drafter with the initial weights, the target, SpecForge's own reading of the target's
    embedding and head, and the race's batches: bf16 and flex attention on a GPU, fp32 and SDPA on the CPU."""
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead

    from flashdraft.devices import resolve_device
    from flashdraft.model.target import TargetModel, default_dtype

    torch.manual_seed(seed)
    run_device = torch.device(resolve_device(device))
    dtype = default_dtype(run_device)  # bf16 on a GPU (SpecForge's default), fp32 on the CPU
    attention = "flex_attention" if run_device.type == "cuda" else "sdpa"
    drafter, config = _specforge_drafter(init_dir, run_device, dtype, attention)
    layer_ids = dict(config.dflash_config)["target_layer_ids"]
    target = TargetModel.load(target_dir, layer_ids, device=run_device, dtype=dtype)
    parts = TargetEmbeddingsAndHead.from_pretrained(
        str(target_dir), device=run_device.type, dtype=dtype
    )  # SpecForge's own reading of the target's embedding and head
    parts.requires_grad_(False)
    data = RaceBatches.load(train_shards, batch_size, max_length, seed)
    return _SpecForgeSide(
        drafter, config, target, parts, run_device, dtype, attention, num_anchors, data, iter(data)
    )


def _probe_step_seconds(side: _SpecForgeSide, lr: float) -> float:
    """A few steps on a copy, untimed (flex attention compiles here), whose time sizes the schedule:
    SpecForge's cosine needs its total step count up front, flashdraft's runs over the same budget."""
    from specforge.optimizer import BF16Optimizer

    probe_model = copy.deepcopy(side.drafter)
    probe = BF16Optimizer(probe_model, lr=lr, max_grad_norm=MAX_GRAD_NORM, total_steps=100)
    probe_wrapped = side.objective(probe_model)
    data = side.data
    probe_batches = iter(
        RaceBatches(data.samples, data.batch_size, data.max_length, data.seed + 1)
    )  # training's order intact
    side.step(probe_wrapped, probe, probe_batches)
    side.synchronize()
    started = time.perf_counter()
    for _ in range(PROBE_STEPS - 1):
        side.step(probe_wrapped, probe, probe_batches)
    side.synchronize()
    return (time.perf_counter() - started) / (PROBE_STEPS - 1)


@dataclass
class _Progress:
    """The timed run so far."""

    total_steps: int  # the cosine schedule's length, re-sized as steps are timed
    # step time as flashdraft's budget books it: the steps during which torch.compile built a graph apart
    clock: TrainingClock = field(default_factory=TrainingClock)
    steps: int = 0
    compile_steps: int = 0
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    checkpoints: list[tuple[int, float, Path]] = field(default_factory=list)
    resizes: list[int] = field(default_factory=list)

    @property
    def spent(self) -> float:
        """Seconds of step time against the budget."""
        return self.clock.train_seconds

    @property
    def compile_seconds(self) -> float:
        return self.clock.compile_seconds


def _train_for_budget(
    side: _SpecForgeSide,
    optimizer,
    progress: _Progress,
    minutes: float,
    curve_points: int,
    out_dir: Path,
    log,
) -> None:
    """Timed steps until `minutes` of step time are spent: the schedule re-sized to the budget at every
    tenth of it, a flashdraft drafter directory at every curve point and at the end. A step during which
    torch.compile built a graph (flex attention for a new padded width) is booked as compile time, not
    against the budget, exactly as flashdraft's side books its own (flashdraft/train/budget.py)."""
    wrapped = side.objective(side.drafter)
    budget, every = minutes * 60, minutes * 60 / curve_points
    clock = progress.clock
    while progress.spent < budget:
        side.synchronize()
        clock.start()
        loss, accuracy = side.step(wrapped, optimizer)
        side.synchronize()
        compiled = clock.compiling()
        clock.stop()
        progress.steps += 1
        progress.compile_steps += compiled
        progress.losses.append(loss)
        progress.accuracies.append(accuracy)
        spent, steps = progress.spent, progress.steps
        counted = steps - progress.compile_steps
        if counted and spent < budget and spent >= budget * (len(progress.resizes) + 1) / RESIZES:
            # the probe's step time was a guess: at every tenth of the budget the cosine is re-sized to
            # end with it, from the mean counted step time so far (flashdraft's schedule runs over the budget)
            progress.total_steps = steps + max(1, math.ceil((budget - spent) / (spent / counted)))
            optimizer.scheduler = _resized_schedule(optimizer.optimizer, progress.total_steps, steps)
            progress.resizes.append(progress.total_steps)
        if spent >= every * (len(progress.checkpoints) + 1) or spent >= budget:
            path = out_dir / "checkpoints" / f"step-{steps:08d}" / "drafter"
            _save_as_flashdraft(side.drafter, side.config, path)
            progress.checkpoints.append((steps, round(spent / 60, 4), path))
            log(
                f"specforge: step {steps}, {spent / 60:.2f} min, loss {loss:.3f}, acc {accuracy:.3f} -> {path}"
            )


def _summary(side: _SpecForgeSide, progress: _Progress, step_s: float, lr: float) -> dict[str, Any]:
    """SpecForge's side's training summary (summary.json and the race's `training` record)."""
    return {
        "trainer": "specforge",
        "specforge_version": _version("specforge"),
        "steps": progress.steps,
        "train_minutes": round(progress.spent / 60, 4),
        "compile_minutes": round(progress.compile_seconds / 60, 4),
        "compile_steps": progress.compile_steps,
        "budget_spent": True,
        "scheduled_steps": progress.total_steps,
        "schedule_resized_to": progress.resizes,
        "probe_step_s": round(step_s, 4),
        "first_loss": progress.losses[0],
        "last_loss": progress.losses[-1],
        "last_accuracy": progress.accuracies[-1],
        "settings": {
            "lr": lr,
            "num_anchors": side.num_anchors,
            "batch_size": side.data.batch_size,
            "max_length": side.data.max_length,
            "loss_decay_gamma": side.gamma,
            "warmup_ratio": WARMUP_RATIO,
            "max_grad_norm": MAX_GRAD_NORM,
            "lr_scheduler": "cosine",
            "attention_backend": side.attention,
            "dtype": str(side.dtype).removeprefix("torch."),
            "calls": [
                "specforge.modeling.draft.dflash.DFlashDraftModel",
                "specforge.algorithms.common.dflash_family_model.OnlineDFlashModel",
                "specforge.modeling.target.target_utils.TargetEmbeddingsAndHead",
                "specforge.optimizer.BF16Optimizer",
                "specforge.lr_scheduler.CosineAnnealingWarmupLR",
            ],
        },
    }


def train_specforge(
    *,
    target_dir: str,
    init_dir: Path,
    train_shards: Path,
    out_dir: Path,
    minutes: float,
    curve_points: int,
    lr: float,
    num_anchors: int,
    batch_size: int,
    max_length: int,
    seed: int,
    device: str,
    log=print,
) -> dict[str, Any]:
    """Train the drafter in `init_dir` with SpecForge's objective, step and optimizer for `minutes` of step
    time; a flashdraft drafter directory every `minutes / curve_points` (`out_dir/checkpoints/step-N/drafter`).
    Returns the run's summary and its checkpoints as (step, minutes, directory)."""
    why = specforge_missing()
    if why:
        raise FlashdraftError(f"--against specforge: {why}")
    from specforge.optimizer import BF16Optimizer

    side = _set_up(
        target_dir,
        init_dir,
        train_shards,
        num_anchors=num_anchors,
        batch_size=batch_size,
        max_length=max_length,
        seed=seed,
        device=device,
    )
    step_s = _probe_step_seconds(side, lr)
    progress = _Progress(total_steps=max(2, math.ceil(minutes * 60 / step_s)))
    optimizer = BF16Optimizer(
        side.drafter,
        lr=lr,
        max_grad_norm=MAX_GRAD_NORM,
        warmup_ratio=WARMUP_RATIO,
        total_steps=progress.total_steps,
        lr_scheduler="cosine",
    )
    log(
        f"specforge: {sum(p.numel() for p in side.drafter.parameters()) / 1e6:.1f}M drafter parameters on "
        f"{side.device} ({side.attention}, {side.dtype}); probe {step_s:.3f} s/step -> schedule over "
        f"{progress.total_steps} steps"
    )
    _train_for_budget(side, optimizer, progress, minutes, curve_points, out_dir, log)
    summary = _summary(side, progress, step_s, lr)
    atomic_write_json(out_dir / "summary.json", summary, indent=2)
    return {"training": summary, "checkpoints": progress.checkpoints}


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
