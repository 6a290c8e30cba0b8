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
from flashdraft.data.regenerate import (
    Messages,
    Regenerated,
    journal_part,
    merge_journal_parts,
    read_journal,
    regenerate,
)
from flashdraft.data.render import prompt_ids
from flashdraft.data.stops import target_stop_ids
from flashdraft.errors import FlashdraftError
from flashdraft.generate.engines import ContinuousBatchingEngine, HFGenerateEngine, VllmEngine
from flashdraft.generate.static import StaticEngine, unsupported_reason
from flashdraft.model.target import default_dtype, load_causal_lm


class LocalEngine:
    """Chat-template prompts -> a token engine -> (text, finish reason, generated ids) per conversation."""

    def __init__(self, engine, tokenizer, thinking: str | None, stops: list[int], note: str | None = None):
        self.engine, self.tokenizer, self.thinking, self.stops = engine, tokenizer, thinking, stops
        self.note = note  # why the engine is not the one chosen, if it is not

    def describe(self) -> dict[str, Any]:
        """The engine's own record (e.g. whether CUDA graphs were captured) for the manifest."""
        return {**self.engine.describe(), **({"note": self.note} if self.note else {})}

    def complete(
        self,
        conversations: list[Messages],
        seeds: list[int],
        on_answer: Callable[[int, int], None] | None = None,
    ) -> list[tuple]:
        """`on_answer(index, tokens)`: called as each answer ends (the engines' `on_answer`), for progress."""
        prompts = [prompt_ids(self.tokenizer, m, self.thinking) for m in conversations]
        if on_answer is None:
            outputs = self.engine.generate_ids(prompts, seeds)
        else:
            outputs = self.engine.generate_ids(
                prompts, seeds, on_answer=lambda i, ids: on_answer(i, len(ids))
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


def build_engine(job: LocalJob, device: str, tokenizer=None) -> LocalEngine:
    from flashdraft.model.target import load_target_tokenizer

    tokenizer = tokenizer or load_target_tokenizer(job.target, required=True)
    stops = target_stop_ids(job.target, tokenizer, job.thinking)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    if job.engine == "vllm":
        return LocalEngine(
            VllmEngine(job.target, job.sampling, stops, torch.device(device)), tokenizer, job.thinking, stops
        )
    from flashdraft.progress import phase

    with phase(f"loading the target {job.target} on {device}"):
        model = load_causal_lm(job.target, device, attention="sdpa")
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
        "dtype": str(default_dtype(devices[0])).removeprefix("torch."),
        "batch_size": job.batch_size or "auto",
        **asdict(job.sampling),
    }


def key_settings(job: LocalJob, devices: list[str]) -> dict[str, Any]:
    """What a local answer depends on besides the conversation and the target: the sampling settings and
    the precision. Not the engine, batch or worker count: greedy answers equal plain `generate`'s and
    sampled ones are seeded per conversation."""
    return {
        "engine": "local",
        "dtype": str(default_dtype(devices[0])).removeprefix("torch."),
        **asdict(job.sampling),
    }
