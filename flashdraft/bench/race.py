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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.durable import atomic_write_json
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import WEIGHTS_NAME, read_config, save_drafter
from flashdraft.model.spec import default_gamma

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
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
    from specforge.optimizer import BF16Optimizer

    from flashdraft.devices import resolve_device
    from flashdraft.model.target import TargetModel, default_dtype

    torch.manual_seed(seed)
    run_device = torch.device(resolve_device(device))
    dtype = default_dtype(run_device)  # bf16 on a GPU (SpecForge's default), fp32 on the CPU
    attention = "flex_attention" if run_device.type == "cuda" else "sdpa"
    drafter, config = _specforge_drafter(init_dir, run_device, dtype, attention)
    dflash = dict(config.dflash_config)
    block_size = int(config.block_size)
    gamma = default_gamma(block_size)
    target = TargetModel.load(target_dir, dflash["target_layer_ids"], device=run_device, dtype=dtype)
    parts = TargetEmbeddingsAndHead.from_pretrained(
        str(target_dir), device=run_device.type, dtype=dtype
    )  # SpecForge's own reading of the target's embedding and head
    parts.requires_grad_(False)

    def objective(model):
        return OnlineDFlashModel(
            draft_model=model,
            target_lm_head=parts.lm_head,
            target_embed_tokens=parts.embed_tokens,
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=block_size,
            attention_backend=attention,
            num_anchors=num_anchors,
            loss_decay_gamma=gamma,
            loss_type="dflash",
        )

    data = RaceBatches.load(train_shards, batch_size, max_length, seed)
    batches = iter(data)

    def step(wrapped, optimizer, source=batches) -> tuple[float, float]:
        ids, mask = next(source)
        ids, mask = ids.to(run_device), mask.to(run_device)
        with torch.no_grad():
            features = target.features(ids)
        loss, accuracy, _ = wrapped(input_ids=ids, hidden_states=features, loss_mask=mask)
        loss.backward()
        optimizer.step()
        return float(loss.detach()), float(accuracy.detach())

    def synchronize() -> None:
        if run_device.type == "cuda":
            torch.cuda.synchronize(run_device)

    # Probe: a few steps on a copy, untimed (flex attention compiles here), whose time sizes the schedule:
    # SpecForge's cosine needs its total step count up front, flashdraft's runs over the same budget.
    probe_model = copy.deepcopy(drafter)
    probe = BF16Optimizer(probe_model, lr=lr, max_grad_norm=MAX_GRAD_NORM, total_steps=100)
    probe_wrapped = objective(probe_model)
    probe_batches = iter(
        RaceBatches(data.samples, batch_size, max_length, seed + 1)
    )  # training's order intact
    step(probe_wrapped, probe, probe_batches)
    synchronize()
    started = time.perf_counter()
    for _ in range(PROBE_STEPS - 1):
        step(probe_wrapped, probe, probe_batches)
    synchronize()
    step_s = (time.perf_counter() - started) / (PROBE_STEPS - 1)
    del probe, probe_model, probe_wrapped
    total_steps = max(2, math.ceil(minutes * 60 / step_s))
    optimizer = BF16Optimizer(
        drafter,
        lr=lr,
        max_grad_norm=MAX_GRAD_NORM,
        warmup_ratio=WARMUP_RATIO,
        total_steps=total_steps,
        lr_scheduler="cosine",
    )
    wrapped = objective(drafter)
    log(
        f"specforge: {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M drafter parameters on {run_device} "
        f"({attention}, {dtype}); probe {step_s:.3f} s/step -> schedule over {total_steps} steps"
    )
    spent, steps, losses, accuracies, checkpoints = 0.0, 0, [], [], []
    every = minutes * 60 / curve_points
    resizes = []
    while spent < minutes * 60:
        synchronize()
        started = time.perf_counter()
        loss, accuracy = step(wrapped, optimizer)
        synchronize()
        spent += time.perf_counter() - started
        steps += 1
        losses.append(loss)
        accuracies.append(accuracy)
        if spent < minutes * 60 and spent >= minutes * 60 * (len(resizes) + 1) / RESIZES:
            # the probe's step time was a guess: at every tenth of the budget the cosine is re-sized to
            # end with it, from the mean step time so far (flashdraft's schedule runs over the budget)
            total_steps = steps + max(1, math.ceil((minutes * 60 - spent) / (spent / steps)))
            optimizer.scheduler = _resized_schedule(optimizer.optimizer, total_steps, steps)
            resizes.append(total_steps)
        if spent >= every * (len(checkpoints) + 1) or spent >= minutes * 60:
            path = out_dir / "checkpoints" / f"step-{steps:08d}" / "drafter"
            _save_as_flashdraft(drafter, config, path)
            checkpoints.append((steps, round(spent / 60, 4), path))
            log(
                f"specforge: step {steps}, {spent / 60:.2f} min, loss {loss:.3f}, acc {accuracy:.3f} -> {path}"
            )
    summary = {
        "trainer": "specforge",
        "specforge_version": _version("specforge"),
        "steps": steps,
        "train_minutes": round(spent / 60, 4),
        "budget_spent": True,
        "scheduled_steps": total_steps,
        "schedule_resized_to": resizes,
        "probe_step_s": round(step_s, 4),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "last_accuracy": accuracies[-1],
        "settings": {
            "lr": lr,
            "num_anchors": num_anchors,
            "batch_size": batch_size,
            "max_length": max_length,
            "loss_decay_gamma": gamma,
            "warmup_ratio": WARMUP_RATIO,
            "max_grad_norm": MAX_GRAD_NORM,
            "lr_scheduler": "cosine",
            "attention_backend": attention,
            "dtype": str(dtype).removeprefix("torch."),
            "calls": [
                "specforge.modeling.draft.dflash.DFlashDraftModel",
                "specforge.algorithms.common.dflash_family_model.OnlineDFlashModel",
                "specforge.modeling.target.target_utils.TargetEmbeddingsAndHead",
                "specforge.optimizer.BF16Optimizer",
                "specforge.lr_scheduler.CosineAnnealingWarmupLR",
            ],
        },
    }
    atomic_write_json(out_dir / "summary.json", summary, indent=2)
    return {"training": summary, "checkpoints": checkpoints}


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
