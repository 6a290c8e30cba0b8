"""The typed config tree: one dataclass per section, per-field docs, YAML files and dotted overrides.

Unknown keys and ill-typed values are errors that name the file and the dotted key; nothing is guessed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flashdraft.errors import FlashdraftError


def doc(
    default: Any,
    help: str,
    check: str | None = None,
    *,
    choices: tuple[str, ...] | None = None,
    flag: bool = True,
) -> Any:
    """A dataclass field with a default and a one-line description (`flashdraft --help-config` prints the
    config tree's). For the command settings below, the CLI makes a kebab-case flag of each field
    (flashdraft/cli/flags.py): `check` names its validator in `TEXT_CHECKS`, `choices` its allowed values,
    and `flag=False` keeps a field for callers in code only."""
    metadata: dict[str, Any] = {"help": help, "flag": flag}
    if check is not None:
        metadata["check"] = check
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    if dataclasses.is_dataclass(default):  # a nested settings object: each instance gets its own copy
        return field(default_factory=lambda: dataclasses.replace(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# --------------------------------------------------------------------------- values given as text
# The checks of command-line values, by the names `doc(check=...)` gives. They live here, not in the CLI,
# so that other parsers (flashdraft/bench/) share them without importing the CLI.


def _number(kind: type, text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def block_size_value(text: str) -> int:
    value = _number(int, text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be at least 2 (a block holds an anchor and drafts), got {text}"
        )
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def integer(text: str) -> int:
    return _number(int, text)


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


TEXT_CHECKS: dict[str, Callable[[str], Any]] = {
    "positive_int": positive_int,
    "non_negative_int": non_negative_int,
    "block_size": block_size_value,
    "non_negative_float": non_negative_float,
    "probability": probability,
    "int": integer,
    "int_list": int_list,
}


# A new drafter's shape when the config leaves it open (the paper's): see resolve_drafter_fields.
DEFAULT_NUM_LAYERS = 5
DEFAULT_BLOCK_SIZE = 16
# The model fields a drafter directory fixes: with model.drafter they come from it (docs/training-safety.md).
DRAFTER_FIELDS = ("num_layers", "block_size", "target_layer_ids", "mask_token_id")


@dataclass
class ModelConfig:
    target: str = doc("", "Local directory of the Hugging Face causal LM to draft for (frozen).")
    drafter: str = doc(
        "",
        "Existing drafter directory to warm-start from (ours or z-lab's; checked against the target): its "
        "weights with a fresh optimizer and lr schedule (re-warmed), recorded in warm_start.json; empty builds "
        "a new drafter. Its config fixes num_layers, block_size, target_layer_ids and mask_token_id (set "
        "them only to assert its values).",
    )
    num_layers: int | None = doc(
        None, f"Decoder layers of a new drafter; default {DEFAULT_NUM_LAYERS} (paper), or model.drafter's."
    )
    block_size: int | None = doc(
        None,
        f"Block size B (1 anchor + B-1 masked positions); default {DEFAULT_BLOCK_SIZE} (paper), or model.drafter's.",
    )
    target_layer_ids: list[int] | None = doc(
        None,
        "Target layers whose outputs feed the drafter; default spreads num_layers ids from 1 to L-3, "
        "or model.drafter's.",
    )
    mask_token_id: int | None = doc(
        None,
        "Token id used for masked block positions; default from the tokenizer or the Qwen3 convention, "
        "or model.drafter's.",
    )
    arch: str | None = doc(
        None,
        "A new drafter's architecture: 'dflash' (default) or 'dflash2' (grouped dynamic causal convolutions "
        "and a candidate selector, docs/drafters.md §3). model.drafter fixes it, except that 'dflash2' with a "
        "DFlash model.drafter grafts it (identity convolutions: step 0 is the old drafter).",
    )
    layer_types: list[str] | None = doc(
        None,
        "A new drafter's per-layer attention, e.g. [S, S, S, S, F] (S/sliding_attention: a causal sliding "
        "window; F/full_attention: bidirectional); default all full. model.drafter fixes it.",
    )
    sliding_window: int | None = doc(
        None, "Window of the sliding layers of a new drafter; default 2048 when model.layer_types has S."
    )


@dataclass
class DataConfig:
    train: list[str] = doc([], "Training data: shard directories or JSONL files of {input_ids, loss_mask}.")
    eval: list[str] = doc([], "Held-out data in the same format, for simulated acceptance.")
    max_length: int = doc(3072, "Sequences are truncated to this many tokens (paper: 3072).")
    max_samples: int = doc(
        0,
        "Train on only the first N usable samples of data.train, in data order (0: all): the data-volume "
        "knob of the recipe table (benchmarks/gpu_session.sh recipe ROW=data) and a trial run on part of a "
        "large set. data.eval is not cut.",
    )
    packing: bool = doc(
        False,
        "Pack several samples into each row of up to max_length tokens (each sample still sees only itself); "
        "train.batch_size then counts packed rows (docs/packing.md).",
    )
    allow_unverified_tokenizer: bool = doc(
        False,
        "Train on shards even when the target ships no tokenizer files to check their tokenizer against "
        "(refused by default: ids from another tokenizer mean other words; docs/inputs-and-outputs.md).",
    )


EVAL_MAX_NEW_TOKENS = 256  # `flashdraft eval` decodes shorter answers than regeneration writes
BEST_BY = ("simulated_tau", "real_tau", "loss")  # train.best_by: eval row keys tau, real_tau, loss


OPTIMIZERS = ("adamw", "muon")  # what train.optimizer names once resolved
OPTIMIZER_CHOICES = ("auto", *OPTIMIZERS)  # train.optimizer
LR_SCHEDULES = ("cosine", "wsd")  # train.lr_schedule


@dataclass
class TrainConfig:
    out_dir: str = doc("runs/flashdraft", "Run output: checkpoints, metrics.jsonl, TensorBoard events.")
    epochs: int = doc(6, "Passes over the training data (paper: 6).")
    max_steps: int = doc(0, "Stop after this many optimizer steps (0: run all epochs).")
    max_minutes: float = doc(
        0.0,
        "Wall-clock budget of the training loop in minutes (0: none): the step that crosses it is the last, "
        "with a final checkpoint and held-out evaluation, and the lr schedule runs over the budget "
        "(whichever of steps and minutes is spent first). Counts step time; not the steps during which "
        "torch.compile built a graph (reported as compile_minutes), nor evaluating or writing checkpoints "
        "(docs/quality-benchmark.md).",
    )
    batch_size: int = doc(1, "Sequences per micro-batch.")
    grad_accum: int = doc(1, "Micro-batches per optimizer step.")
    lr: float = doc(6e-4, "Peak learning rate of AdamW (paper: 6e-4).")
    weight_decay: float = doc(0.0, "AdamW weight decay (with train.optimizer=muon, Muon's too).")
    optimizer: str = doc(
        "auto",
        "'auto' (default): Muon for a drafter at most 1,024 wide (targets up to ~0.6B), AdamW for a wider "
        "one, and on a resume the optimizer the run started with (train/muon.py's resolve_optimizer; "
        "config.yaml records the choice). 'adamw' (the paper's), or 'muon': Muon (momentum orthogonalised "
        "by Newton-Schulz) for the 2-D weight matrices of the drafter's own layers and its feature fusion fc, "
        "the matrices of hidden layers that Muon is made for, and AdamW for the rest (norms, DFlash2's "
        "selector and base kernels: 1-D, embedding-like or head-like). On SmolLM2 (576 wide) Muon at four "
        "times the AdamW lr beat AdamW by 30% real τ in 5 minutes; on an 8B-wide drafter its update costs "
        "193 ms a step, half the step (docs/training-loop.md). Not with distributed.data_parallel=fsdp "
        "(Muon needs whole matrices; auto picks AdamW there).",
        choices=OPTIMIZER_CHOICES,
    )
    muon_lr: float | None = doc(
        None,
        "Peak learning rate of the Muon part (None: 4 x train.lr, the best of 1x, 2x and 4x measured on "
        "SmolLM2, docs/training-loop.md). Each matrix's step is scaled to AdamW's RMS (torch's "
        "adjust_lr_fn='match_rms_adamw'), so AdamW's rates carry over; it follows the same schedule.",
    )
    muon_momentum: float = doc(0.95, "Muon's momentum (Nesterov; torch's default 0.95).")
    lr_schedule: str = doc(
        "cosine",
        "After the warm-up: cosine, a cosine decay to min_lr_ratio over the rest of the run (paper); wsd "
        "(warmup-stable-decay), train.lr held until the last train.decay_ratio of the run, then a linear "
        "decay to min_lr_ratio. Under train.max_minutes either runs over the steps expected to fit.",
        choices=LR_SCHEDULES,
    )
    decay_ratio: float = doc(0.2, "With lr_schedule wsd: the fraction of the run spent decaying.")
    warmup_ratio: float = doc(0.04, "Fraction of steps with linear warm-up (paper: 0.04).")
    min_lr_ratio: float = doc(0.0, "Floor of the schedule's decay as a fraction of lr.")
    grad_clip: float = doc(1.0, "Global gradient-norm clip (paper: 1.0).")
    num_anchors: int = doc(512, "Anchors (blocks) sampled per sequence, fresh each epoch (paper: 512).")
    anchors: str = doc(
        "per_row",
        "'per_row': up to num_anchors per sample; 'budget': num_anchors * batch_size per micro-batch, shared "
        "in proportion to each sample's candidate positions (docs/packing.md).",
    )
    gamma: float | None = doc(None, "Loss decay exp(-(k-1)/gamma); default 7/5/4 for block size 16/10/8.")
    loss: str = doc(
        "ce",
        "Per-position loss (docs/drafters.md §1): 'ce' (cross-entropy to the data token, paper), 'kl' "
        "(KL to the target's distribution) or 'lk' (the LK loss: acceptance-rate hybrid of KL and TV).",
    )
    position_weight: str = doc(
        "dpace",
        "Block-position weights: 'dpace' (D-PACE: the expected accepted positions each one unlocks, from the "
        "drafter's own confidence; default, measured above 'decay' on the real target, docs/drafters.md §4) "
        "or 'decay' (exp(-(k-1)/gamma), the paper's).",
    )
    dpace_alpha: float = doc(0.5, "D-PACE smoothing: a position counts as accepted with (1-a)·q(label) + a.")
    lk_eta: float = doc(3.0, "LK loss: the KL share is exp(-lk_eta · expected acceptance).")
    selector_alpha: float = doc(
        0.5, "DFlash2: factor of the selector's cross-entropy over its top-k candidates (0: off)."
    )
    selector_warmup_steps: int = doc(0, "DFlash2: optimizer steps before the selector loss starts.")
    selector_ramp_steps: int = doc(
        0, "DFlash2: steps over which the selector factor rises linearly to selector_alpha (0: at once)."
    )
    seed: int = doc(0, "Seed of initialisation, data order and anchor sampling.")
    device: str = doc("auto", "'auto' (cuda if present), 'cuda', 'cuda:N' or 'cpu'.")
    dtype: str = doc("auto", "Compute dtype: 'auto' (bf16 on GPU, fp32 on CPU), 'bf16' or 'fp32'.")
    master_weights: bool = doc(
        True,
        "With bf16: bf16 weights and gradients in the drafter, fp32 master weights, moments "
        "and gradient sums in the optimizer (faster). false: fp32 weights under bf16 autocast.",
    )
    precision: str = doc(
        "bf16",
        "GEMM precision of the drafter's linear layers: 'bf16' or 'fp8' (torchao float8 training on a GPU "
        "of compute capability 8.9+, `pip install 'flashdraft[fp8]'`; weights, master weights, optimizer "
        "and checkpoints stay as with bf16: docs/fp8.md).",
    )
    fp8_recipe: str = doc(
        "tensorwise",
        "With precision=fp8: one dynamic scale per tensor ('tensorwise') or per row ('rowwise').",
    )
    fp8_head: bool = doc(
        False,
        "With precision=fp8: the loss's two GEMMs through the frozen LM head in FP8 too (e4m3 head and rows, "
        "e5m2 logit gradients, one scale per tensor; the teacher's logits for kl/lk stay in the head's dtype: "
        "docs/fp8.md).",
    )
    fused_ce: bool = doc(
        False,
        "Cross-entropy's two passes over each chunk of logits (the row reduction, the gradient) as two Triton "
        "kernels instead of inductor's (train/loss_kernels.py, docs/fp8.md). CUDA, train.loss=ce, DFlash "
        "drafters (not the DFlash2 selector's top-k). On an H100 at shape (a) its kernels take 2.3 ms a step "
        "where inductor's take 6.0, a 1.6% faster FP8 step; off until a whole run has trained with it.",
    )
    attention: str = doc("auto", "'auto' (flex on GPU, sdpa on CPU), 'flex' or 'sdpa'.")
    compile: bool = doc(
        True, "torch.compile the drafter layers and loss on GPU (flex attention requires it)."
    )
    compile_target: bool = doc(
        True,
        "torch.compile the frozen target's decoder layers on GPU for feature extraction (not a hybrid "
        "target's, nor one sharded by distributed.target_parallel): one graph per layer kind, 1.68x the "
        "eager forward on an 8B shape; decoding through it stays on its own path (docs/fp8.md).",
    )
    activation_checkpointing: bool = doc(False, "Recompute drafter layer activations in the backward pass.")
    loss_chunk: int = doc(2048, "Block positions per LM-head chunk of the fused cross-entropy.")
    log_every: int = doc(10, "Optimizer steps between metric lines.")
    profile_steps: int = doc(
        0,
        "Optimizer steps to run under torch.profiler (0: off); each rank writes OUT/profile/rankR_stepsA-B.txt "
        "(operators by device and host time) and a Chrome trace (flashdraft/train/profiling.py).",
    )
    profile_start: int = doc(
        10, "Steps before the profiled ones (past torch.compile's first graphs and the profiler's warm-up)."
    )
    save_every: int = doc(500, "Optimizer steps between checkpoints (a final one is always written).")
    save_every_minutes: float = doc(
        0.0,
        "Training minutes (as train.max_minutes counts them) between extra checkpoints (0: off); with "
        "train.eval_every on, each is also evaluated, so every timed checkpoint has its simulated τ.",
    )
    eval_every: int = doc(0, "Optimizer steps between simulated-acceptance evaluations (0: off).")
    real_eval_prompts: int | None = doc(
        None,
        "At each evaluation also decode this many held-out prompts for real (speculative, greedy: the prompt "
        "part of the first data.eval samples) and log their real τ as real_tau beside the simulated one "
        "(docs/training-loop.md). None: 8 on a GPU, 0 on the CPU (slow there); 0: off.",
    )
    real_eval_new_tokens: int = doc(
        EVAL_MAX_NEW_TOKENS, "Tokens decoded per real-eval prompt at most (as flashdraft eval's default)."
    )
    best_by: str = doc(
        "simulated_tau",
        "What picks best/ at each evaluation: 'simulated_tau' (highest held-out simulated τ), 'real_tau' "
        "(highest real τ: needs the real decode, train.real_eval_prompts) or 'loss' (lowest held-out loss).",
    )
    early_stop_evals: int = doc(
        0,
        "End the run (as finished, with a final checkpoint) after this many evaluations in a row that did not "
        "improve best/ (train.best_by): the drafter has begun to memorise its data, and best/ holds its best "
        "(docs/training-loop.md). 0: never; either way a warning says so after 3.",
    )
    keep_last: int = doc(3, "Checkpoints kept on disk.")
    resume: str = doc(
        "auto",
        "'auto' (latest complete checkpoint in out_dir, falling back past a damaged one), 'never', or a "
        "checkpoint path.",
    )
    resume_allow_changes: bool = doc(
        False,
        "Resume even though trajectory-changing settings (lr, num_anchors, batch size, world size...) differ "
        "from the checkpoint's; false refuses and lists them.",
    )
    max_bad_steps: int = doc(
        8,
        "A step with a non-finite loss or gradient norm is skipped (no update); this many in a row stop the run.",
    )


@dataclass
class DistributedConfig:
    """How several processes (one per GPU, started by torchrun / `flashdraft launch --nproc-per-node`)
    share the training (docs/distributed.md)."""

    data_parallel: str = doc(
        "auto",
        "With more than one process: 'ddp' (replicated drafter, bucketed gradient all-reduce overlapped with "
        "the backward), 'fsdp' (FSDP2: fp32 parameter and optimizer shards, bf16 compute, fp32 reduction) or "
        "'auto' (ddp: 14% faster than fsdp on two H200s, docs/distributed.md). One process needs neither.",
    )
    bucket_mb: float = doc(
        25.0,
        "With ddp: gradient bucket size in MB (torch's default 25). Each bucket is one all-reduce started as "
        "soon as its gradients are ready, and under torch.compile one cut of the compiled layer graph.",
    )
    timeout_minutes: float = doc(
        30.0,
        "A collective that waits longer than this (a dead or hung rank) fails the whole job, naming the rank.",
    )
    mode: str = doc(
        "colocated",
        "'colocated': every process runs the target and a drafter replica. 'split': target ranks only run the "
        "target and send its features to drafter ranks, which train (data-parallel among themselves).",
    )
    target_ranks: int | list[int] = doc(
        1,
        "With mode=split, per node: how many processes run the target (the node's last local ranks), or the "
        "list of their local ranks (not 0: rank 0 trains the drafter).",
    )
    max_in_flight: int = doc(
        2,
        "With mode=split: optimizer steps of features the target side may run ahead of the drafters "
        "(2: double buffering); a slower side makes the other wait.",
    )
    target_parallel: int = doc(
        1,
        "Consecutive ranks that hold ONE target sharded by tensor parallelism (its attention heads and MLP "
        "split across them; docs/distributed.md); each such group runs the target once on its members' "
        "batches together. 1: every rank holds the whole target. Must divide the number of processes; "
        "colocated mode only.",
    )


@dataclass
class Sampling:
    """How answers are generated, by `prepare --regenerate` and `eval` alike: declared once, and the CLI
    makes both commands' flags from these fields."""

    max_new_tokens: int = doc(2048, "tokens generated per answer at most", "positive_int")
    temperature: float = doc(0.0, "0: greedy; above 0: sample at this temperature", "non_negative_float")
    top_p: float = doc(1.0, "nucleus sampling mass (1: off)", "probability")
    top_k: int = doc(0, "sample among the k most likely tokens (0: off)", "non_negative_int")
    seed: int = doc(0, "seed of the sampler", "int")


# --------------------------------------------------------------------------- command settings
# What `prepare`, `eval` and `init` take beside their paths. Each field is one kebab-case flag of its
# command (flashdraft/cli/flags.py makes them from these fields); code builds the same objects directly.

FORCE_HELP = "replace an existing non-empty --out (never the target or an input)"
THINKING = ("on", "off")
REGENERATION_ENGINES = ("auto", "static", "hf", "hf-cb", "vllm")
EVAL_ENGINES = ("auto", "flashdraft", "eager", "fast", "zlab")
DTYPES = ("auto", "bf16", "fp32")


@dataclass
class PrepareSettings:
    """`flashdraft prepare IN... --target DIR --out DIR`: rendering, regeneration and the shard set."""

    max_length: int = doc(3072, "drop samples longer than this many tokens", "positive_int")
    thinking: str | None = doc(None, "chat template thinking switch (Qwen3)", choices=THINKING)
    regenerate: bool = doc(False, "replace every assistant turn with the target's own answer")
    server_url: str | None = doc(None, "OpenAI-compatible server (SGLang, vLLM) to regenerate with")
    server_model: str | None = doc(None, "model name to send to the server")
    concurrency: int = doc(16, "requests in flight to the server", "positive_int")
    batch_size: int = doc(
        0,
        "rows per batch of in-process generation (default: from free GPU memory; on the CPU 16, each batch "
        "journaled as it ends)",
        "positive_int",
    )
    device: str = doc(
        "auto",
        "where in-process regeneration runs: auto (every local GPU, else the CPU), cpu, cuda, cuda:N",
    )
    engine: str = doc(
        "auto",
        "in-process engine: static (flashdraft's decode loop, CUDA graphs on a GPU), hf (batched generate), "
        "hf-cb (continuous batching), vllm; auto: vllm if installed, else static on GPUs, hf on the CPU "
        "(docs/regeneration.md)",
        choices=REGENERATION_ENGINES,
    )
    cut_answers: str = doc(
        "keep",
        "answers cut at --max-new-tokens: keep (train on their tokens, never on an end of turn after them) "
        "or drop the conversation (docs/regeneration.md)",
        choices=("keep", "drop"),
    )
    workers: int = doc(1, "worker processes with --device cpu (GPUs: one each)", "positive_int")
    render_workers: int = doc(
        0,
        "processes that render the samples (default: one below 20,000 conversations, else the cores)",
        "positive_int",
    )
    row_groups: int = doc(
        4,
        "static engine: row groups by prompt length, each reading only its own cached columns (1: every "
        "row reads the batch's full width; docs/regeneration.md)",
        "positive_int",
    )
    max_retries: int = doc(
        5,
        "retries of a server request answered 429 or 5xx or whose connection broke (backoff with jitter)",
        "non_negative_int",
    )
    max_failed_requests: int | None = doc(
        None,
        "server requests that may still fail after their retries (their conversations are left out; "
        "default: 1% of the requests)",
        "non_negative_int",
    )
    retry_backoff: float = doc(
        1.0, "seconds before a server request's first retry, doubled after each", flag=False
    )
    limit: int = doc(0, "use only the first N conversations (0: all)", "non_negative_int")
    min_supervised: int = doc(1, "samples with fewer supervised tokens are dropped", flag=False)
    chunk: int = doc(
        0,
        "conversations per journaled regeneration chunk (default 256; 4096 when regenerating on GPUs)",
        "positive_int",
    )
    skip_bad_records: bool = doc(
        False, "skip malformed or invalid records (each reported with file and line) instead of stopping"
    )
    threads: int | None = doc(
        None,
        "CPU threads (None: from the free cores, flashdraft/cpu_threads.py)",
        flag=False,  # the shared --threads flag of the commands that run models (cli/flags.py)
    )
    sampling: Sampling | None = doc(None, "how answers are regenerated (None: Sampling's defaults)")
    force: bool = doc(False, FORCE_HELP)


@dataclass
class EvalSettings:
    """`flashdraft eval --target DIR --drafter DIR --prompts FILE`: how the prompts are decoded."""

    block_size: int | None = doc(None, "verify block size (default: the drafter's)", "positive_int")
    sampling: Sampling = doc(Sampling(max_new_tokens=EVAL_MAX_NEW_TOKENS), "how answers are decoded")
    thinking: str | None = doc(None, "chat template thinking switch (Qwen3)", choices=THINKING)
    check_lossless: bool | str = doc(
        False,
        "also report where greedy outputs diverge, numerical ties apart from real divergences; "
        "'--check-lossless fp32' reruns the diverged prompts in fp32 to decide",
        flag=False,  # a flag with an optional value: declared by the eval command itself
    )
    max_prompts: int = doc(0, "use only the first N prompts (0: all)", "non_negative_int")
    engine: str = doc(
        "auto",
        "auto: fast on a GPU (or with --batch-size > 1) where it can decode the pair, else eager; "
        "flashdraft or eager: the eager loop (the reference); fast: static buffers and CUDA graphs, "
        "batched with --batch-size (full or sliding attention, Gated DeltaNet hybrids; else eager, "
        "with a note); "
        "zlab: also run z-lab's dflash_generate on the same prompts and report its τ beside ours",
        choices=EVAL_ENGINES,
    )
    dtype: str = doc(
        "auto", "target and drafter dtype (auto: bf16 on a GPU, fp32 on the CPU)", choices=DTYPES
    )
    batch_size: int = doc(
        1, "prompts decoding together on --engine fast, each row refilled as it finishes", "positive_int"
    )
    no_compile: bool = doc(
        False,
        "on --engine fast, run the step's model code eagerly inside the CUDA graphs (by default it is "
        "compiled on a GPU, docs/decoding.md 'Compiled steps'): for debugging, and the reference",
    )


def check_eval_settings(settings: EvalSettings) -> None:
    """The limits of `flashdraft eval`'s flags, also for callers that build settings in code; checked by
    the CLI before anything heavy loads."""
    if settings.sampling.max_new_tokens < 1:
        raise FlashdraftError(f"--max-new-tokens must be at least 1, got {settings.sampling.max_new_tokens}")
    if settings.block_size is not None and settings.block_size < 1:
        raise FlashdraftError(f"--block-size must be at least 1, got {settings.block_size}")
    if settings.max_prompts < 0:
        raise FlashdraftError(f"--max-prompts must be 0 (all) or more, got {settings.max_prompts}")
    if settings.check_lossless not in (False, True, "fp32"):
        raise FlashdraftError(f"--check-lossless {settings.check_lossless!r}: give no value, or fp32")
    if settings.check_lossless and settings.sampling.temperature != 0:
        raise FlashdraftError("--check-lossless compares greedy outputs: use it with --temperature 0")
    if settings.engine not in EVAL_ENGINES:
        raise FlashdraftError(f"--engine {settings.engine}: expected one of {', '.join(EVAL_ENGINES)}")
    if settings.dtype not in DTYPES:
        raise FlashdraftError(f"--dtype {settings.dtype}: expected auto, bf16 or fp32")
    if settings.batch_size < 1:
        raise FlashdraftError(f"--batch-size must be at least 1, got {settings.batch_size}")
    if settings.batch_size > 1 and settings.engine not in ("fast", "auto"):
        raise FlashdraftError(
            f"--batch-size {settings.batch_size}: batched decoding runs on the fast engine: add --engine fast"
        )
    if settings.engine == "zlab" and importlib.util.find_spec("dflash") is None:
        raise FlashdraftError(
            "--engine zlab runs z-lab's own loop, and its package is not installed: "
            "pip install --no-deps dflash==0.1.0"
        )


@dataclass
class InitSettings:
    """`flashdraft init --target DIR --out DIR`: the shape of a new drafter (model/drafter_dir.py)."""

    num_layers: int | None = doc(
        None,
        f"drafter decoder layers (paper: {DEFAULT_NUM_LAYERS}; default {DEFAULT_NUM_LAYERS})",
        "positive_int",
    )
    arch: str = doc(
        "dflash",
        "dflash (paper) or dflash2 (convolutions + candidate selector, docs/drafters.md)",
        choices=("dflash", "dflash2"),
    )
    layer_types: str | None = doc(
        None,
        "per-layer attention, e.g. S,S,S,S,F (S: causal sliding window, F: full, bidirectional); sets the "
        "number of layers",
    )
    block_size: int = doc(DEFAULT_BLOCK_SIZE, "block size B (paper: 16 for Qwen3)", "block_size")
    target_layer_ids: list[int] | None = doc(
        None, "target layers feeding the drafter, e.g. 1,9,17,25,33 (default: the paper's rule)", "int_list"
    )
    mask_token_id: int | None = doc(None, "mask token id (default: from the tokenizer)", "non_negative_int")
    sliding_window: int | None = doc(
        None,
        "sliding-window size (default 2048 with --layer-types); alone: the first layers slide",
        "positive_int",
    )
    sliding_layers: int | None = doc(
        None, "how many leading layers slide (default: all but the last)", "non_negative_int"
    )
    seed: int = doc(0, "seed of the new drafter's initialisation", "int")
    force: bool = doc(False, FORCE_HELP)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats. Errors name `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except FlashdraftError:
                continue
        raise FlashdraftError(f"{where}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and item_tp is str:
            value = [value]
        if not isinstance(value, list):
            raise FlashdraftError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise FlashdraftError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise FlashdraftError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise FlashdraftError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise FlashdraftError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp!r}")


def _section_fields(cls: type) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, f in fields.items():
        f.type = hints[name]
    return fields


def _unknown(key: str, known: list[str], source: str) -> FlashdraftError:
    close = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = (
        f" (did you mean '{key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{close[0]}'?)" if close else ""
    )
    return FlashdraftError(f"{source}: unknown config key '{key}'{hint}")


def _apply(obj: Any, data: dict[str, Any], prefix: str, source: str) -> None:
    fields = _section_fields(type(obj))
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise _unknown(dotted, list(fields), source)
        tp = fields[key].type
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise FlashdraftError(f"{source}: '{dotted}' is a section; expected a mapping, got {value!r}")
            _apply(getattr(obj, key), value, dotted + ".", source)
        else:
            setattr(obj, key, _coerce(value, tp, f"{source}: '{dotted}'"))


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key repeated in one mapping is an error: PyYAML would keep the
    last value without a word, so a setting written twice would silently lose one of them."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` overrides by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader reports it itself
                continue
            if first is not None:
                raise _DuplicateKey(key, key_node.start_mark.line + 1, first)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=1e-4` -> ("train.lr", 1e-4); the value is read as YAML (numbers, lists, true/false, null)."""
    if "=" not in text:
        raise FlashdraftError(f"override '{text}': expected key=value, e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except _DuplicateKey as dup:
        raise FlashdraftError(f"override '{text}': duplicate key '{dup.key}'") from None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides in order; every key is checked."""
    config = Config()
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise FlashdraftError(f"config file {path}: {exc.strerror}") from None
        try:
            data = _load_yaml(text) or {}
        except _DuplicateKey as dup:
            raise FlashdraftError(
                f"config file {path} line {dup.line}: duplicate key '{dup.key}' (first at line "
                f"{dup.first_line}); keep one of them"
            ) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise FlashdraftError(
                f"config file {path}{line}: invalid YAML ({getattr(exc, 'problem', exc)})"
            ) from None
        if not isinstance(data, dict):
            raise FlashdraftError(
                f"config file {path}: expected a mapping of sections, got {type(data).__name__}"
            )
        _apply(config, data, "", str(path))
    for text in overrides or []:
        key, value = parse_override(text)
        _apply(config, _nest(key, value), "", "override")
    validate(config)
    return config


def _float_fields(obj: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every float-valued field, in every section."""
    found = []
    for name, f in _section_fields(type(obj)).items():
        value = getattr(obj, name)
        if dataclasses.is_dataclass(f.type):
            found.extend(_float_fields(value, f"{prefix}{name}."))
        elif isinstance(value, float):
            found.append((f"{prefix}{name}", value))
    return found


_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def validate(config: Config) -> None:
    """Range and finiteness checks that need neither the target nor the drafter (those come in
    `resolve_drafter_fields` and the trainer). Every message names the dotted field."""
    for key, value in _float_fields(config):  # nan and inf pass every comparison below unnoticed
        if not math.isfinite(value):
            raise FlashdraftError(f"config: {key} must be a finite number, got {value}")
    checks = [
        *_model_checks(config.model, config.data),
        *_train_checks(config.train),
        *_distributed_checks(config.distributed),
        *_evaluation_checks(config.train, config.data),
        *_real_eval_checks(config.train, config.data, config.distributed),
        *_optimizer_placement_checks(config.train, config.distributed),
    ]
    for ok, message in checks:
        if not ok:
            raise FlashdraftError(f"config: {message}")


def _model_checks(m: ModelConfig, d: DataConfig) -> list[tuple[bool, str]]:
    """(holds, message if not) of the drafter's shape, and of data.max_length against its block size."""
    block_size = m.block_size if m.block_size is not None else DEFAULT_BLOCK_SIZE
    return [
        (
            m.block_size is None or m.block_size >= 2,
            f"model.block_size must be at least 2, got {m.block_size}",
        ),
        (
            m.num_layers is None or m.num_layers >= 1,
            f"model.num_layers must be at least 1, got {m.num_layers}",
        ),
        (
            m.target_layer_ids is None or (m.target_layer_ids and min(m.target_layer_ids) >= 0),
            f"model.target_layer_ids must be a non-empty list of layer indices >= 0, got {m.target_layer_ids}",
        ),
        (
            m.mask_token_id is None or m.mask_token_id >= 0,
            f"model.mask_token_id must be >= 0, got {m.mask_token_id}",
        ),
        (
            m.drafter
            or d.max_length >= 2 * block_size,  # with a drafter: checked once its block size is known
            f"data.max_length must be at least 2 * model.block_size ({2 * block_size}), got {d.max_length}",
        ),
        (d.max_samples >= 0, f"data.max_samples must be >= 0 (0: all), got {d.max_samples}"),
        (
            m.arch is None or m.arch in ("dflash", "dflash2"),
            f"model.arch must be dflash or dflash2, got {m.arch!r}",
        ),
        (
            m.sliding_window is None or m.sliding_window >= 1,
            f"model.sliding_window must be at least 1, got {m.sliding_window}",
        ),
        (
            not m.drafter
            or (m.arch in (None, "dflash2") and m.layer_types is None and m.sliding_window is None),
            f"model.arch={m.arch}, model.layer_types and model.sliding_window describe a new drafter; "
            f"model.drafter={m.drafter} fixes them (drop them; model.arch=dflash2 alone grafts a DFlash drafter)",
        ),
    ]


def _train_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """(holds, message if not) of the training settings: length, optimizer, objective, device, cadence."""
    return [
        (t.epochs >= 1, f"train.epochs must be at least 1, got {t.epochs}"),
        (t.max_steps >= 0, f"train.max_steps must be >= 0 (0: run all epochs), got {t.max_steps}"),
        (t.max_minutes >= 0, f"train.max_minutes must be >= 0 (0: no budget), got {t.max_minutes}"),
        (
            t.save_every_minutes >= 0,
            f"train.save_every_minutes must be >= 0 (0: off), got {t.save_every_minutes}",
        ),
        (t.batch_size >= 1, f"train.batch_size must be at least 1, got {t.batch_size}"),
        (t.grad_accum >= 1, f"train.grad_accum must be at least 1, got {t.grad_accum}"),
        (t.num_anchors >= 1, f"train.num_anchors must be at least 1, got {t.num_anchors}"),
        (
            t.anchors in ("per_row", "budget"),
            f"train.anchors must be per_row or budget, got {t.anchors!r}",
        ),
        (t.lr > 0, f"train.lr must be positive, got {t.lr}"),
        (t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}"),
        (
            t.lr * t.weight_decay < 1,  # AdamW multiplies the weights by 1 - lr * weight_decay
            f"train.lr * train.weight_decay must be below 1, got {t.lr} * {t.weight_decay}",
        ),
        *_muon_checks(t),
        (0 <= t.warmup_ratio < 1, f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}"),
        (0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}"),
        (
            t.lr_schedule in LR_SCHEDULES,
            f"train.lr_schedule must be {' or '.join(LR_SCHEDULES)}, got {t.lr_schedule!r}",
        ),
        (0 < t.decay_ratio <= 1, f"train.decay_ratio must be in (0, 1], got {t.decay_ratio}"),
        (
            t.lr_schedule != "wsd" or t.warmup_ratio + t.decay_ratio <= 1,
            f"train.warmup_ratio + train.decay_ratio must be at most 1 with lr_schedule wsd, got "
            f"{t.warmup_ratio} + {t.decay_ratio}",
        ),
        (t.grad_clip > 0, f"train.grad_clip must be positive (a global-norm limit), got {t.grad_clip}"),
        (t.gamma is None or t.gamma > 0, f"train.gamma must be positive, got {t.gamma}"),
        (t.loss in ("ce", "kl", "lk"), f"train.loss must be ce, kl or lk, got {t.loss!r}"),
        (
            t.position_weight in ("decay", "dpace"),
            f"train.position_weight must be decay or dpace, got {t.position_weight!r}",
        ),
        (0 <= t.dpace_alpha <= 1, f"train.dpace_alpha must be in [0, 1], got {t.dpace_alpha}"),
        (t.lk_eta >= 0, f"train.lk_eta must be >= 0, got {t.lk_eta}"),
        (t.selector_alpha >= 0, f"train.selector_alpha must be >= 0, got {t.selector_alpha}"),
        (
            t.selector_warmup_steps >= 0,
            f"train.selector_warmup_steps must be >= 0, got {t.selector_warmup_steps}",
        ),
        (t.selector_ramp_steps >= 0, f"train.selector_ramp_steps must be >= 0, got {t.selector_ramp_steps}"),
        (t.seed >= 0, f"train.seed must be >= 0, got {t.seed}"),
        (
            bool(_DEVICE.match(t.device)),
            f"train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}",
        ),
        (t.dtype in ("auto", "bf16", "fp32"), f"train.dtype must be auto, bf16 or fp32, got {t.dtype!r}"),
        (t.precision in ("bf16", "fp8"), f"train.precision must be bf16 or fp8, got {t.precision!r}"),
        (
            t.fp8_recipe in ("tensorwise", "rowwise"),
            f"train.fp8_recipe must be tensorwise or rowwise, got {t.fp8_recipe!r}",
        ),
        (
            not t.fused_ce or t.loss == "ce",
            f"train.fused_ce computes cross-entropy only (its kernels' gradient is q - onehot); got "
            f"train.loss={t.loss}",
        ),
        (
            not t.fp8_head or t.precision == "fp8",
            f"train.fp8_head needs train.precision=fp8 (the head's FP8 GEMMs run on the tensor cores the "
            f"drafter's do), got train.precision={t.precision}",
        ),
        (
            t.precision != "fp8" or t.dtype != "fp32",
            "train.precision=fp8 runs its FP8 GEMMs inside bf16 compute; it needs train.dtype auto or bf16, "
            "not fp32",
        ),
        (
            t.attention in ("auto", "flex", "sdpa"),
            f"train.attention must be auto, flex or sdpa, got {t.attention!r}",
        ),
        (t.loss_chunk >= 1, f"train.loss_chunk must be at least 1, got {t.loss_chunk}"),
        (t.log_every >= 1, f"train.log_every must be at least 1, got {t.log_every}"),
        (t.profile_steps >= 0, f"train.profile_steps must be >= 0 (0: off), got {t.profile_steps}"),
        (t.profile_start >= 0, f"train.profile_start must be >= 0, got {t.profile_start}"),
        (t.save_every >= 1, f"train.save_every must be at least 1, got {t.save_every}"),
        (t.eval_every >= 0, f"train.eval_every must be >= 0 (0: off), got {t.eval_every}"),
        (
            t.real_eval_prompts is None or t.real_eval_prompts >= 0,
            f"train.real_eval_prompts must be >= 0 (0: off), got {t.real_eval_prompts}",
        ),
        (
            t.real_eval_new_tokens >= 1,
            f"train.real_eval_new_tokens must be at least 1, got {t.real_eval_new_tokens}",
        ),
        (
            t.best_by in BEST_BY,
            f"train.best_by must be {', '.join(BEST_BY[:-1])} or {BEST_BY[-1]}, got {t.best_by!r}",
        ),
        (t.keep_last >= 1, f"train.keep_last must be at least 1, got {t.keep_last}"),
        (t.max_bad_steps >= 1, f"train.max_bad_steps must be at least 1, got {t.max_bad_steps}"),
        (bool(t.resume.strip()), "train.resume must be auto, never or a checkpoint path, got ''"),
    ]


# train.muon_lr's default, times train.lr: Muon at 4x beat 2x and 1x on SmolLM2 (docs/training-loop.md)
MUON_LR_SCALE = 4


def muon_peak_lr(t: TrainConfig) -> float:
    """The peak learning rate of Muon's part: train.muon_lr, or MUON_LR_SCALE x train.lr."""
    return t.muon_lr if t.muon_lr is not None else MUON_LR_SCALE * t.lr


def _muon_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """(holds, message if not) of the optimizer choice and Muon's settings."""
    return [
        (
            t.optimizer in OPTIMIZER_CHOICES,
            f"train.optimizer must be {', '.join(OPTIMIZER_CHOICES)}, got {t.optimizer!r}",
        ),
        (t.muon_lr is None or t.muon_lr > 0, f"train.muon_lr must be positive, got {t.muon_lr}"),
        (
            muon_peak_lr(t) * t.weight_decay < 1,  # Muon decays as AdamW does: by 1 - lr * weight_decay
            f"train.muon_lr * train.weight_decay must be below 1, got {muon_peak_lr(t)} * {t.weight_decay}",
        ),
        (0 <= t.muon_momentum < 1, f"train.muon_momentum must be in [0, 1), got {t.muon_momentum}"),
    ]


def _optimizer_placement_checks(t: TrainConfig, dist: DistributedConfig) -> list[tuple[bool, str]]:
    """(holds, message if not) of the optimizer against how the drafter is spread over the ranks."""
    return [
        (
            t.optimizer != "muon" or dist.data_parallel != "fsdp",
            "train.optimizer=muon with distributed.data_parallel=fsdp: Muon orthogonalises each weight matrix "
            "whole, and FSDP gives each rank a shard of it; use distributed.data_parallel=ddp (or auto), or "
            "train.optimizer=adamw",
        ),
    ]


def _evaluation_checks(t: TrainConfig, d: DataConfig) -> list[tuple[bool, str]]:
    """(holds, message if not) of what needs the held-out evaluations."""
    return [
        (
            t.early_stop_evals >= 0 and (not t.early_stop_evals or (t.eval_every > 0 and bool(d.eval))),
            f"train.early_stop_evals={t.early_stop_evals}: give 0 (never) or a count of evaluations, which "
            f"needs evaluations: train.eval_every > 0 and data.eval (got eval_every={t.eval_every}, "
            f"{len(d.eval)} data.eval path(s))",
        ),
    ]


def _real_eval_checks(t: TrainConfig, d: DataConfig, dist: DistributedConfig) -> list[tuple[bool, str]]:
    """(holds, message if not) of the real decode at each evaluation against the data and the topology."""
    return [
        (
            t.best_by != "real_tau" or (t.eval_every > 0 and bool(d.eval) and t.real_eval_prompts != 0),
            "train.best_by=real_tau needs the real decode at each evaluation: train.eval_every > 0, data.eval "
            f"and train.real_eval_prompts above 0 (got eval_every={t.eval_every}, {len(d.eval)} data.eval "
            f"path(s), real_eval_prompts={t.real_eval_prompts})",
        ),
        (
            not t.real_eval_prompts or dist.target_parallel == 1,
            f"train.real_eval_prompts={t.real_eval_prompts} with distributed.target_parallel="
            f"{dist.target_parallel}: the real decode of a tensor-parallel target is not available yet; set "
            "train.real_eval_prompts=0",
        ),
    ]


def _distributed_checks(dist: DistributedConfig) -> list[tuple[bool, str]]:
    """(holds, message if not) of how the ranks share the work."""
    return [
        (
            dist.data_parallel in ("auto", "ddp", "fsdp"),
            f"distributed.data_parallel must be auto, ddp or fsdp, got {dist.data_parallel!r}",
        ),
        (
            dist.timeout_minutes > 0,
            f"distributed.timeout_minutes must be positive, got {dist.timeout_minutes}",
        ),
        (
            0 < dist.bucket_mb < math.inf,
            f"distributed.bucket_mb must be a positive number of MB, got {dist.bucket_mb}",
        ),
        (
            dist.mode in ("colocated", "split"),
            f"distributed.mode must be colocated or split, got {dist.mode!r}",
        ),
        (
            dist.max_in_flight >= 1,
            f"distributed.max_in_flight must be at least 1, got {dist.max_in_flight}",
        ),
        (
            dist.target_parallel >= 1,
            f"distributed.target_parallel must be at least 1, got {dist.target_parallel}",
        ),
        (
            dist.target_parallel == 1 or dist.mode == "colocated",
            f"distributed.target_parallel={dist.target_parallel} with distributed.mode="
            f"{dist.mode}: a tensor-parallel target runs in the colocated mode only (yet); set "
            "distributed.target_parallel=1 or distributed.mode=colocated",
        ),
    ]


def resolve_drafter_fields(config: Config, actual: dict[str, Any], source: str) -> Config:
    """The config with model.num_layers, block_size, target_layer_ids and mask_token_id set to the values
    of the drafter actually trained (`actual`, from its config), so that the config.yaml a run writes
    records what was used. With model.drafter, a value the user set that disagrees with the drafter's is
    an error naming both (docs/training-safety.md)."""
    m = config.model
    if m.drafter:
        for name in DRAFTER_FIELDS:
            given = getattr(m, name)
            if given is not None and given != actual[name]:
                raise FlashdraftError(
                    f"model.{name}={given} disagrees with model.drafter={m.drafter} ({source}: {actual[name]}); "
                    f"drop model.{name} or set it to {actual[name]}"
                )
    resolved = dataclasses.replace(config, model=dataclasses.replace(m, **actual))
    if resolved.data.max_length < 2 * resolved.model.block_size:
        raise FlashdraftError(
            f"config: data.max_length must be at least 2 * model.block_size ({2 * resolved.model.block_size}), "
            f"got {resolved.data.max_length}"
        )
    return resolved


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field: the documentation of the config tree."""
    rows = []
    instance = cls()
    for name, f in _section_fields(cls).items():
        if dataclasses.is_dataclass(f.type):
            rows.extend(describe(f.type, f"{prefix}{name}."))
        else:
            rows.append((f"{prefix}{name}", repr(getattr(instance, name)), f.metadata.get("help", "")))
    return rows
