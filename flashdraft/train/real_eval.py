"""Real τ during training: at each held-out evaluation, a few held-out prompts decoded for real beside the
teacher-forced simulated τ of train/validation.py (docs/training-loop.md, "Real τ").

- The prompts are the prompt part of the first `train.real_eval_prompts` samples of data.eval: their
  tokens before the first supervised one, which is the chat template's prompt up to the first assistant
  answer (what `flashdraft eval` renders for a one-turn conversation).
- Decoding is greedy speculative decoding of the run's target with the drafter as it is at that step: on
  the fast engine (generate/fast.py) where it can decode the pair, else on the eager loop
  (generate/speculative.py). The drafter is a plain, uncompiled copy holding the trained weights (the
  same tensors when their dtype is the target's), so torch.compile's training graphs never see a
  decoding shape.
- τ is `mean_tau`, the one `flashdraft eval` reports; it stops at the target's stop ids (data/stops.py).
- A stop request is honoured after the prompt in flight; progress lines and heartbeats come from
  flashdraft/progress.py.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flashdraft.config import Config, DistributedConfig, TrainConfig
from flashdraft.data.shards import read_manifest
from flashdraft.data.stops import target_stop_ids
from flashdraft.data.tokens import TokenDataset
from flashdraft.errors import FlashdraftError
from flashdraft.generate.fast import FastEngine, unsupported_reason
from flashdraft.generate.speculative import Generation, generate, mean_tau
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import new_drafter
from flashdraft.model.target import DecodingCache, TargetModel, load_target_tokenizer
from flashdraft.progress import track

# train.real_eval_prompts=None on a GPU: 8 prompts of 256 tokens take a few seconds on the fast engine, a
# small share of an evaluation pass. On the CPU decoding is slow and the default is off.
GPU_PROMPTS = 8


def prompt_count(t: TrainConfig, device: torch.device, distributed: DistributedConfig) -> int:
    """How many held-out prompts each evaluation decodes: train.real_eval_prompts, or its default."""
    if t.real_eval_prompts is not None:
        return t.real_eval_prompts
    return GPU_PROMPTS if device.type == "cuda" and distributed.target_parallel == 1 else 0


def check_best_by(t: TrainConfig, device: torch.device, distributed: DistributedConfig) -> None:
    """train.best_by=real_tau on a device where the default turns the real decode off (before any long work;
    config.py refuses an explicit 0)."""
    if t.best_by == "real_tau" and prompt_count(t, device, distributed) == 0:
        raise FlashdraftError(
            f"train.best_by=real_tau: the real decode is off on {device} by default; set "
            "train.real_eval_prompts=N (N held-out prompts decoded at each evaluation)"
        )


def held_out_prompts(data: TokenDataset, count: int) -> list[Tensor]:
    """The prompt part [1, P] of the first `count` held-out samples that have one (tokens before the first
    supervised token)."""
    prompts = []
    for i in range(len(data)):
        if len(prompts) == count:
            break
        sample = data[i]
        supervised = sample.loss_mask.nonzero()[0]
        first = int(supervised[0]) if len(supervised) else len(sample.loss_mask)
        if first > 0:
            prompts.append(torch.tensor(sample.input_ids[:first].astype("int64"))[None])
    return prompts


def held_out_thinking(paths: list[str]) -> str | None:
    """The chat template's thinking switch the held-out shards were rendered with (their manifest's), for
    the end-of-turn token among the stop ids; None when no manifest says."""
    for raw in paths:
        path = Path(raw)
        manifest = read_manifest(path) if path.is_dir() else None
        if manifest is not None:
            return manifest.get("thinking")
    return None


@dataclass
class RealDecoder:
    """What each evaluation decodes for real, and with what."""

    target: TargetModel
    prompts: list[Tensor]
    new_tokens: int
    stop_ids: list[int]
    engine: str  # "fast" or "eager"

    def describe(self) -> str:
        return (
            f"real τ at each evaluation: {len(self.prompts)} held-out prompts x {self.new_tokens} tokens "
            f"({self.engine} engine)"
        )

    def decode(
        self,
        drafter: DFlashDraftModel,
        label: str,
        heartbeat: Callable[..., Any] | None,
        should_stop: Callable[[], bool],
    ) -> dict[str, Any] | None:
        """Greedy speculative decoding of every prompt; the eval row's real_* keys, or None when a stop
        request came (checked after each prompt)."""
        block = drafter.block_size
        if self.engine == "fast":
            engine = FastEngine(
                self.target,
                drafter,
                self.new_tokens,
                block_size=block,
                stop_token_ids=self.stop_ids,
                rows=1,
                compile=False,  # the trainer's compiles and recompile budget stay its own
            )

            # one width for every prompt: the buffers and CUDA graphs are made once per evaluation
            width = max(p.shape[1] for p in self.prompts) + self.new_tokens + block

            def run(prompt: Tensor) -> Generation:
                return engine.generate([prompt], min_width=width)[0]
        else:

            def run(prompt: Tensor) -> Generation:
                return generate(
                    self.target,
                    drafter,
                    prompt,
                    self.new_tokens,
                    block_size=block,
                    stop_token_ids=self.stop_ids,
                )

        started = time.perf_counter()
        runs: list[Generation] = []
        with track(label, len(self.prompts), unit="prompt", heartbeat=heartbeat) as bar:
            for prompt in self.prompts:
                runs.append(run(prompt))
                bar.advance(tokens=len(runs[-1].tokens), tau=mean_tau(runs))
                if should_stop():
                    return None
        return {
            "real_tau": mean_tau(runs),
            "real_prompts": len(runs),
            "real_tokens": sum(len(r.tokens) for r in runs),
            "real_seconds": time.perf_counter() - started,
            "real_engine": self.engine,
        }


def choose_engine(target: TargetModel, drafter: DFlashDraftModel) -> tuple[str, str | None]:
    """The engine that can decode this pair ("fast" or "eager") and, when neither can, why."""
    if unsupported_reason(target, drafter, 0.0) is None:
        return "fast", None
    try:
        DecodingCache(target)  # the eager loop's cache refuses a target it cannot roll back
    except FlashdraftError as exc:
        return "eager", str(exc)
    return "eager", None


def plan_real_eval(
    config: Config,
    device: torch.device,
    target: TargetModel,
    drafter: DFlashDraftModel,
    held_out: TokenDataset | None,
    say: Callable[[str], None],
) -> RealDecoder | None:
    """The real decode of this run's evaluations, or None when it is off (train.real_eval_prompts 0, no
    evaluation, or, by default only, a target neither engine decodes: then a line says so)."""
    t = config.train
    count = prompt_count(t, device, config.distributed)
    if not count or not t.eval_every or held_out is None:
        return None
    engine, refusal = choose_engine(target, drafter)
    if refusal is not None:
        if t.real_eval_prompts is None and t.best_by != "real_tau":
            say(f"real τ during training is off: {refusal}")
            return None
        raise FlashdraftError(f"train.real_eval_prompts: the target cannot be decoded here: {refusal}")
    prompts = held_out_prompts(held_out, count)
    if not prompts:
        raise FlashdraftError(
            f"train.real_eval_prompts={count}: no data.eval sample has a prompt before its first supervised token"
        )
    tokenizer = load_target_tokenizer(config.model.target)
    thinking = held_out_thinking(config.data.eval)
    stop_ids = target_stop_ids(config.model.target, tokenizer, thinking, required=False)
    # the drafter's own feature layers: a kl/lk loss adds the target's last layer to the trainer's capture
    # (train/objective.py), which the decode must not feed the drafter
    decoding_target = copy.copy(target)
    decoding_target.layer_ids = list(drafter.spec.target_layer_ids)
    return RealDecoder(decoding_target, prompts, t.real_eval_new_tokens, stop_ids, engine)


def decoding_copy(
    drafter: DFlashDraftModel, weights: dict[str, Tensor], device: torch.device, dtype: torch.dtype
) -> DFlashDraftModel:
    """A plain drafter for decoding holding `weights` (the trained drafter's whole state) on `device` in
    the target's `dtype`, as `flashdraft eval` loads a checkpoint: built on the meta device and assigned,
    so tensors already in place and dtype are shared, not copied. RoPE is the trained drafter's own (fp32,
    rebuilt nowhere)."""
    with torch.device("meta"):
        copy = new_drafter(drafter.config)
    copy.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in weights.items()}, assign=True)
    copy.rotary_emb = drafter.rotary_emb
    copy.requires_grad_(False)
    return copy.eval()
