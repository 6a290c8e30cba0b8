"""Regeneration with the target on this machine: devices, the chosen engine, and one process per device.

`--device auto` takes every local GPU (else the CPU); each GPU gets its own process (spawned: CUDA and
compiled code do not survive fork or share a process well), which loads the target in bf16 with SDPA
attention, takes an interleaved slice of the pending conversations and journals to its own part of the
journal (`regenerated.jsonl.part-RANK`); reading the journal merges the parts, and the parts are folded
into the journal when the workers stop. A worker that fails stops the others and fails `prepare` with
its rank and error; every answer finished until then stays journaled (docs/regeneration.md).
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import Sampling
from flashdraft.data.decode_loop import StaticEngine, unsupported_reason
from flashdraft.data.engines import (
    ContinuousBatchingEngine,
    HFGenerateEngine,
    VllmEngine,
    stop_token_ids,
)
from flashdraft.data.regenerate import (
    Messages,
    Regenerated,
    journal_part,
    merge_journal_parts,
    read_journal,
    regenerate,
)
from flashdraft.data.render import end_of_turn_id, prompt_ids
from flashdraft.errors import FlashdraftError


def resolve_devices(device: str, workers: int) -> list[str]:
    """One entry per worker: `auto` is every local GPU (else the CPU), `cuda` every GPU, `cuda:N` that one,
    `cpu` the CPU `workers` times (--workers is for the CPU; on GPUs there is one worker per GPU)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu":
        return ["cpu"] * workers
    if workers != 1:
        raise FlashdraftError(
            f"--workers {workers}: only with --device cpu (on GPUs one worker runs per GPU)"
        )
    if device == "auto":
        return [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    if device == "cuda":
        if not gpus:
            raise FlashdraftError("--device cuda: no CUDA GPU is visible on this machine")
        return [f"cuda:{i}" for i in range(gpus)]
    if device.startswith("cuda:") and device[5:].isdigit():
        if int(device[5:]) >= gpus:
            raise FlashdraftError(f"--device {device}: this machine has {gpus} visible CUDA GPU(s)")
        return [device]
    raise FlashdraftError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")


def load_for_generation(target: str | Path, device: str):
    """The target on `device`: bf16 on a GPU, fp32 on the CPU, SDPA attention."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa")
    except (ValueError, OSError) as exc:
        raise FlashdraftError(f"target {target}: cannot load as a causal LM: {exc}") from None
    return model.to(device).eval()


class LocalEngine:
    """Chat-template prompts -> a token engine -> (text, finish reason, generated ids) per conversation."""

    def __init__(self, engine, tokenizer, thinking: str | None, stops: list[int], note: str | None = None):
        self.engine, self.tokenizer, self.thinking, self.stops = engine, tokenizer, thinking, stops
        self.note = note  # why the engine is not the one chosen, if it is not

    def describe(self) -> dict[str, Any]:
        """The engine's own record (e.g. whether CUDA graphs were captured) for the manifest."""
        return {**self.engine.describe(), **({"note": self.note} if self.note else {})}

    def complete(self, conversations: list[Messages], seeds: list[int]) -> list[tuple]:
        outputs = self.engine.generate_ids(
            [prompt_ids(self.tokenizer, m, self.thinking) for m in conversations], seeds
        )
        return [
            (
                self.tokenizer.decode(ids, skip_special_tokens=True),
                "stop" if ids and ids[-1] in self.stops else "length",
                ids,
            )
            for ids in outputs
        ]


@dataclass
class LocalJob:
    """What every worker needs to build its engine (picklable: it crosses into spawned processes)."""

    target: str
    sampling: Sampling
    thinking: str | None
    engine: str  # a chosen engine: static, hf, hf-cb or vllm
    batch_size: int = 0
    chunk: int = 256
    threads: int = 0  # CPU threads per worker (0: torch's default)
    auto: bool = False  # chosen by --engine auto: `static` may fall back to `hf` for a target it cannot drive
    row_groups: int = 4  # the static engine's decode attention row groups (1: off)
    answer_batch: int | None = None  # answers per journaled batch (None: a chunk's turn at once)


def target_stop_ids(target: str | Path, tokenizer, thinking: str | None) -> list[int]:
    """The ids that end an answer of this target (engines.stop_token_ids), its generation config read
    when it ships one."""
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(target)
    except (OSError, ValueError):
        generation_config = None  # no generation_config.json: the tokenizer and template name the stops
    stops = stop_token_ids(tokenizer, generation_config, end_of_turn_id(tokenizer, thinking))
    if not stops:
        raise FlashdraftError(
            f"target {target}: no end-of-turn token (no eos in its tokenizer or generation config)"
        )
    return stops


def build_engine(job: LocalJob, device: str, tokenizer=None) -> LocalEngine:
    from flashdraft.model.target import load_target_tokenizer

    tokenizer = tokenizer or load_target_tokenizer(job.target, required=True)
    stops = target_stop_ids(job.target, tokenizer, job.thinking)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    if job.engine == "vllm":
        return LocalEngine(
            VllmEngine(job.target, job.sampling, stops, torch.device(device)), tokenizer, job.thinking, stops
        )
    model = load_for_generation(job.target, device)
    note = None
    reason = unsupported_reason(model) if job.engine == "static" and job.auto else None
    if reason:
        note = f"auto chose static, but it cannot drive this target ({reason}): ran hf"
        print(f"note: {note}", flush=True)
    if job.engine == "hf-cb":
        engine = ContinuousBatchingEngine(model, job.sampling, stops, pad)
    elif job.engine == "static" and note is None:
        engine = StaticEngine(model, job.sampling, stops, pad, job.batch_size, row_groups=job.row_groups)
    else:
        engine = HFGenerateEngine(model, job.sampling, stops, pad, job.batch_size)
    return LocalEngine(engine, tokenizer, job.thinking, stops, note)


def _worker(rank: int, device: str, job: LocalJob, items: list, journal: Path, errors) -> None:
    """One spawned worker: its own engine on its own device, journaling to its own part."""
    try:
        if job.threads:
            torch.set_num_threads(job.threads)
        if device.startswith("cuda") and job.engine != "vllm":  # vllm picks its GPU by visibility
            torch.cuda.set_device(torch.device(device))
        engine = build_engine(job, device)
        regenerate(
            items,
            engine.complete,
            journal,
            job.chunk,
            write_to=journal_part(journal, rank),
            answer_batch=job.answer_batch,
            progress_label=f"worker {rank} ({device}): regenerating",
            progress_mode="plain",  # one rich bar per process would garble a shared terminal
        )
        errors.put((rank, engine.describe()))  # not an error: the engine's record, for the manifest
    except BaseException as exc:
        message = (
            str(exc)
            if isinstance(exc, FlashdraftError)
            else "".join(traceback.format_exception_only(type(exc), exc)).strip()
        )
        errors.put((rank, message))
        raise SystemExit(1) from None


def run_workers(
    items: list[tuple[str, Messages]],
    job: LocalJob,
    devices: list[str],
    journal: Path,
    worker: Callable[..., None] = _worker,
) -> list[dict[str, Any]]:
    """Spawn one `worker` per device over interleaved slices of the pending items; wait; fold the journal
    parts into the journal whatever happens; a failed worker stops the others and raises with its rank.
    Returns the engine records the workers reported (one per worker, by rank)."""
    done = read_journal(journal)
    pending = sorted(
        [(key, m) for key, m in items if key not in done],
        key=lambda item: -sum(len(turn.get("content") or "") for turn in item[1]),
    )
    context = multiprocessing.get_context("spawn")
    errors = context.SimpleQueue()
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.touch()  # an --out holding only parts would not be recognised as prepare's on a rerun
    processes = [
        context.Process(
            target=worker, args=(rank, device, job, pending[rank :: len(devices)], journal, errors)
        )
        for rank, device in enumerate(devices)
    ]
    failed: tuple[int, str] | None = None
    try:
        for process in processes:
            process.start()
        running = {process.sentinel: rank for rank, process in enumerate(processes)}
        while running and failed is None:
            for sentinel in wait(list(running)):
                rank = running.pop(sentinel)
                processes[rank].join()
                if processes[rank].exitcode != 0:
                    failed = (rank, f"exit code {processes[rank].exitcode}")
                    break
        reported, details = {}, {}
        while not errors.empty():
            rank, message = errors.get()
            (details if isinstance(message, dict) else reported)[rank] = message
        if failed is not None and reported:
            failed = min(reported.items())
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
        merge_journal_parts(journal)
    if failed is not None:
        rank, message = failed
        raise FlashdraftError(
            f"regeneration worker {rank} ({devices[rank]}) failed: {message}; the answers finished so far "
            f"are kept in {journal}: rerun the same command to resume"
        )
    return [details[rank] for rank in sorted(details)]


def regenerate_locally(
    items: list[tuple[str, Messages]],
    job: LocalJob,
    devices: list[str],
    journal: Path,
    tokenizer=None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Regenerated], list[dict[str, Any]]]:
    """Every item's regenerated conversation, and each engine's own record (one per worker): in this
    process on a single device, else one worker each."""
    if len(devices) == 1:
        if job.threads:
            torch.set_num_threads(job.threads)
        engine = build_engine(job, devices[0], tokenizer)
        merge_journal_parts(journal)  # parts left by an interrupted parallel run
        done = regenerate(
            items, engine.complete, journal, job.chunk, on_progress, answer_batch=job.answer_batch
        )
        return done, [engine.describe()]
    details = run_workers(items, job, devices, journal)
    done = read_journal(journal)
    return {key: done[key] for key, _ in items}, details


def describe(job: LocalJob, devices: list[str], why: str) -> dict[str, Any]:
    """The engine record of the manifest and the summary: which engine, why, where."""
    return {
        "engine": job.engine,
        "engine_choice": why,
        "devices": devices,
        "dtype": "bfloat16" if devices[0].startswith("cuda") else "float32",
        "batch_size": job.batch_size or "auto",
        **asdict(job.sampling),
    }


def key_settings(job: LocalJob, devices: list[str]) -> dict[str, Any]:
    """What a local answer depends on besides the conversation and the target: the sampling settings and
    the precision. Not the engine, batch or worker count: greedy answers equal plain `generate`'s and
    sampled ones are seeded per conversation."""
    return {
        "engine": "local",
        "dtype": "bfloat16" if devices[0].startswith("cuda") else "float32",
        **asdict(job.sampling),
    }
