"""`flashdraft prepare`: chat datasets -> (optionally target-regenerated) -> tokenized shards with masks.

The output is checked before any work (docs/inputs-and-outputs.md): it must be absent, empty, a shard
directory `prepare` made (replaced as a whole once the new set is complete), or the user passes --force;
it may never be, hold, or lie inside the target or an input."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flashdraft.config import PrepareSettings, Sampling  # PrepareSettings: importable from here too
from flashdraft.data.chat import normalise
from flashdraft.data.cut_answers import CUT_POLICIES, first_cut_turn
from flashdraft.data.regenerate import REQUEST_FAILED, ServerEngine, journal_key, regenerate
from flashdraft.data.render import (
    assistant_turns,
    check_renders,
    end_of_turn_id,
    reasoning_placement,
    tokenizer_fingerprint,
)
from flashdraft.data.render_pool import Conversation as RenderConversation
from flashdraft.data.render_pool import RenderRules, render_all, render_workers
from flashdraft.data.shards import JOURNAL, not_a_shard_dir, write_shards
from flashdraft.data.sources import iter_records
from flashdraft.durable import disk_full_reason
from flashdraft.errors import FlashdraftError
from flashdraft.model.target import check_safetensors_weights, load_target_tokenizer
from flashdraft.outputs import check_output_dir
from flashdraft.phases import PhaseClock

# Answers per journaled batch on the CPU: a kill loses at most this many; a server gets a few rounds of its
# concurrent requests per batch, so stragglers hold up little.
CPU_ANSWER_BATCH = 16
SERVER_ROUNDS_PER_BATCH = 4


def target_identity(target: str | Path) -> dict[str, Any]:
    """What identifies the target's weights cheaply: its real path, config and weight files' sizes and
    modification times (hashing gigabytes of weights on every run would be too slow)."""
    path = Path(target).resolve()
    config = path / "config.json"
    weights = sorted(
        (p.name, p.stat().st_size, int(p.stat().st_mtime))
        for p in path.glob("*")
        if p.suffix in (".safetensors", ".bin") and p.is_file()
    )
    return {
        "path": str(path),
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "weights": weights,
    }


def _write_failed(exc: OSError, where: Path, what: str) -> FlashdraftError:
    reason = disk_full_reason(exc, where) or exc.strerror or str(exc)
    return FlashdraftError(f"--out {where}: {what} failed: {reason}; the previous shard set is unchanged")


def local_regeneration(target: str, sampling: Sampling, settings: PrepareSettings) -> dict[str, Any]:
    """Devices, engine and job of in-process regeneration, decided (and bad flags refused) before work."""
    import torch

    from flashdraft.cpu_threads import available_cpus, configure_threads
    from flashdraft.data.local_regen import LocalJob, describe, key_settings
    from flashdraft.devices import resolve_devices
    from flashdraft.generate.engines import choose_engine

    check_safetensors_weights(target)  # before any worker tries to unpickle a pytorch_model.bin
    devices = resolve_devices(settings.device, settings.workers)
    engine, why = choose_engine(settings.engine, torch.device(devices[0]), sampling)
    auto = settings.engine == "auto"
    threads = 0
    if devices[0] == "cpu" and len(devices) > 1:  # workers share the cores this process may use
        threads = settings.threads or max(1, available_cpus() // len(devices))
    elif devices[0] == "cpu":
        threads = configure_threads(settings.threads, "cpu")
    # a GPU engine runs a chunk as a few large batches: small chunks would leave it mostly idle
    chunk = settings.chunk or (4096 if devices[0].startswith("cuda") else 256)
    job = LocalJob(
        target,
        sampling,
        settings.thinking,
        engine,
        settings.batch_size,
        chunk,
        threads,
        auto,
        settings.row_groups,
        # on the CPU a batch of answers takes minutes: journal (and report) a small batch at a time
        answer_batch=None if devices[0].startswith("cuda") else (settings.batch_size or CPU_ANSWER_BATCH),
    )
    return {
        "job": job,
        "devices": devices,
        "record": describe(job, devices, why),
        "key": key_settings(job, devices),
    }


@dataclass
class Tally:
    """What `prepare` counts on its way (the manifest's counts, the summary's rows), and what it does with
    a bad record: raise it, or with --skip-bad-records report it, count it and carry on."""

    console: Console
    skip_bad_records: bool
    records_read: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    bad_records: list[str] = field(default_factory=list)
    id_counts: Counter[str] = field(default_factory=Counter)
    cut_counts: Counter[str] = field(default_factory=Counter)
    turns_after_cut: int = 0  # assistant turns left out because an earlier answer of theirs was cut

    def skip(self, exc: FlashdraftError) -> None:
        self.dropped["bad record"] += 1
        self.bad_records.append(str(exc))
        self.console.print(f"[yellow]skipped[/] {exc}", highlight=False, markup=True)

    def bad(self, exc: FlashdraftError) -> None:
        if not self.skip_bad_records:
            raise exc
        self.skip(exc)

    def unreadable(self, exc: FlashdraftError) -> None:
        """A record the reader could not parse (only with --skip-bad-records): it was read, and skipped."""
        self.records_read += 1
        self.skip(exc)


@dataclass
class Answers:
    """The conversations to render, and for each, when regenerated: the ids generated per turn, whether its
    last turn is a kept cut answer, and that answer's generated ids (empty lists: not regenerated)."""

    conversations: list[tuple[list[dict], str]]
    generated: list[list[list[int] | None]] = field(default_factory=list)
    cut_last: list[bool] = field(default_factory=list)
    cut_ids: list[list[int] | None] = field(default_factory=list)
    record: dict[str, Any] | None = None  # the engine's description (the manifest's "regeneration")
    server_requests: dict[str, int] | None = None  # a server's request counts


def prepare(
    inputs: list[str],
    target: str,
    out: str,
    settings: PrepareSettings,
    console: Console | None = None,
    command: str | None = None,
    phases: PhaseClock | None = None,
) -> dict[str, Any]:
    """Check, read, (regenerate,) render, write the shards, print the summary; returns the manifest.

    `phases`: the clock this command's phases are booked on (the CLI starts it at the process's
    creation, so the interpreter's start and the imports show as `start-up`); a fresh one otherwise."""
    console = console or Console()
    # Where the command's time goes, phase by phase (the manifest's "seconds" and the summary's last row):
    # regeneration's engine start-up and the work around it show apart from the engine's own record.
    phases = phases or PhaseClock()
    out_dir = Path(out)
    sampling = settings.sampling or Sampling()
    local = check_before_work(inputs, target, out_dir, settings, sampling)
    phases.mark("checks")
    from flashdraft.progress import phase

    with phase(f"loading the tokenizer of {target}"):
        tokenizer = load_target_tokenizer(target, required=True)
    phases.mark("tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise FlashdraftError(f"target {target}: its tokenizer has no chat template to render conversations")
    tally = Tally(console, settings.skip_bad_records)
    answers = Answers(read_conversations(inputs, tokenizer, settings, tally))
    phases.mark("read_and_check")
    if settings.regenerate:
        answers = regenerate_answers(
            answers.conversations, target, tokenizer, out_dir, settings, sampling, local, tally
        )
        phases.mark("regenerate")
    samples, supervised, total = render_samples(tokenizer, answers, settings, tally, console)
    if not samples:
        reasons = (
            ", ".join(f"{n} {why}" for why, n in sorted(tally.dropped.items()))
            or "the inputs hold no records"
        )
        first = f"; first: {tally.bad_records[0]}" if tally.bad_records else ""
        raise FlashdraftError(f"prepare: no sample kept from {', '.join(inputs)} ({reasons}){first}")
    phases.mark("render")
    manifest = {
        **tokenizer_fingerprint(tokenizer),
        "tokenizer_name": getattr(tokenizer, "name_or_path", target),
        "target": str(target),
        "thinking": settings.thinking,
        "max_length": settings.max_length,
        "inputs": [str(p) for p in inputs],
        "conversations": len(answers.conversations),
        "samples": len(samples),
        "dropped": dict(tally.dropped),
        "generated_ids": dict(tally.id_counts),
        "cut_answers": {"policy": settings.cut_answers, "kept": 0, "dropped": 0, **tally.cut_counts}
        if settings.regenerate
        else None,
        "turns_after_cut_answers": tally.turns_after_cut if settings.regenerate else None,
        "tokens": total,
        "supervised_tokens": supervised,
        "regeneration": answers.record,
        "server_requests": answers.server_requests,
        "command": command or " ".join(sys.argv),
        "bad_records": tally.bad_records[:100],
        "seconds": dict(phases.seconds),  # the phases before the shards were written
    }
    try:
        write_shards(out_dir, samples, manifest)
    except OSError as exc:
        raise _write_failed(exc, out_dir, "writing the shards") from None
    phases.mark("write")
    console.print(summary_table(out_dir, manifest, tally, settings, sampling, phases))
    return manifest


def check_before_work(
    inputs: list[str], target: str, out_dir: Path, settings: PrepareSettings, sampling: Sampling
) -> dict[str, Any] | None:
    """Everything about the output and the flags, checked before the tokenizer loads and before any
    regeneration; returns in-process regeneration's plan (`local_regeneration`), None without it."""
    protected = {"--target": target, **{f"input {p}": p for p in inputs}}
    check_output_dir(out_dir, "--out", force=settings.force, inputs=protected, ours=not_a_shard_dir)
    if settings.cut_answers not in CUT_POLICIES:
        raise FlashdraftError(
            f"--cut-answers {settings.cut_answers!r}: expected one of {', '.join(CUT_POLICIES)}"
        )
    # --device, --engine and --workers are refused before any record is read
    if settings.regenerate and not settings.server_url:
        return local_regeneration(target, sampling, settings)
    return None


def read_conversations(
    inputs: list[str], tokenizer, settings: PrepareSettings, tally: Tally
) -> list[tuple[list[dict], str]]:
    """The conversations of the inputs (up to --limit), each checked to render, with where it was read;
    without --regenerate those with no assistant turn are dropped (nothing to supervise)."""
    from flashdraft.progress import track

    conversations = []
    with track("reading and checking conversations", None, unit="conversation") as reading:
        for record, where in iter_records(inputs, tally.unreadable if settings.skip_bad_records else None):
            if settings.limit and len(conversations) >= settings.limit:
                break
            tally.records_read += 1
            reading.advance()
            try:
                conv = normalise(record, where)
                if conv.messages is None:
                    raise FlashdraftError(
                        f"{where}: pre-tokenized records cannot be rendered; give conversations"
                    )
                check_renders(tokenizer, conv.messages, settings.thinking, where)
            except FlashdraftError as exc:
                tally.bad(exc)
                continue
            if not any(m["role"] == "assistant" for m in conv.messages) and not settings.regenerate:
                tally.dropped["no assistant turn"] += 1
                continue
            conversations.append((conv.messages, where))
    return conversations


def regenerate_answers(
    conversations: list[tuple[list[dict], str]],
    target: str,
    tokenizer,
    out_dir: Path,
    settings: PrepareSettings,
    sampling: Sampling,
    local: dict[str, Any] | None,
    tally: Tally,
) -> Answers:
    """--regenerate: the target answers every assistant turn, through a server (`local` None) or in this
    process, journaled under --out so that a rerun resumes where a kill stopped (docs/regeneration.md)."""
    engine = None
    if local is None:
        engine = server_engine(conversations, tokenizer, settings, sampling)
        engine_record = key_engine = engine.describe()
    else:
        engine_record, key_engine = local["record"], local["key"]
    key_settings = {
        "engine": key_engine,
        "thinking": settings.thinking,
        "target": target_identity(target),
    }
    items = journal_items(conversations, key_settings)
    journal = out_dir / JOURNAL
    try:
        if engine is not None:
            done = regenerate(
                items,
                engine.complete,
                journal,
                chunk=settings.chunk or 256,
                answer_batch=settings.concurrency * SERVER_ROUNDS_PER_BATCH,
            )
        else:
            from flashdraft.data.local_regen import regenerate_locally

            done, details = regenerate_locally(items, local["job"], local["devices"], journal, tokenizer)
            engine_record = {**engine_record, "engine_details": details}
    except OSError as exc:
        raise _write_failed(exc, out_dir, f"writing the journal {journal}") from None
    if engine is not None:
        engine.check_some_succeeded()
    answers = keep_answers(items, conversations, done, settings.cut_answers, sampling, tally)
    answers.record = engine_record
    answers.server_requests = asdict(engine.counts) if engine is not None else None
    return answers


def server_engine(
    conversations: list[tuple[list[dict], str]], tokenizer, settings: PrepareSettings, sampling: Sampling
) -> ServerEngine:
    """The OpenAI-compatible server's client; by default 1% of the requests may fail for good."""
    # one request per assistant turn; a conversation with only a prompt gets one answer too
    requests = sum(max(1, [m["role"] for m in messages].count("assistant")) for messages, _ in conversations)
    return ServerEngine(
        settings.server_url,
        settings.server_model,
        sampling,
        settings.thinking,
        settings.concurrency,
        reasoning=reasoning_placement(tokenizer, settings.thinking),
        max_retries=settings.max_retries,
        max_failed=(
            requests // 100 if settings.max_failed_requests is None else settings.max_failed_requests
        ),
        backoff=settings.retry_backoff,
    )


def journal_items(
    conversations: list[tuple[list[dict], str]], key_settings: dict[str, Any]
) -> list[tuple[str, list[dict]]]:
    """(journal key, messages) per conversation: the key names the conversation, its repeat number among
    identical ones and what decides its answers, so a rerun with other settings regenerates."""
    seen: Counter[str] = Counter()
    items = []
    for messages, _ in conversations:
        # a conversation with only a prompt gets its answer generated too
        if not any(m["role"] == "assistant" for m in messages):
            messages = [*messages, {"role": "assistant", "content": ""}]
        text = json.dumps(messages, sort_keys=True)
        items.append((journal_key(messages, seen[text], key_settings), messages))
        seen[text] += 1
    return items


def keep_answers(
    items: list[tuple[str, list[dict]]],
    conversations: list[tuple[list[dict], str]],
    done: dict[str, Any],
    cut_answers: str,
    sampling: Sampling,
    tally: Tally,
) -> Answers:
    """The regenerated conversations to render: failed requests dropped, answers cut at --max-new-tokens
    kept up to the cut or dropped (--cut-answers), each counted."""
    answers = Answers([])
    for (key, _), (_, where) in zip(items, conversations, strict=True):
        if REQUEST_FAILED in done[key].finish_reasons:  # not journaled: a rerun asks again
            tally.dropped["server request failed"] += 1
            continue
        # An answer cut at --max-new-tokens is not a finished answer: taught as one, the drafter would
        # learn to end turns where the target does not. `keep` trains on its tokens and ends the sample
        # there (flashdraft/data/cut_answers.py); `drop` leaves the conversation out. Both are counted.
        messages, token_ids = done[key].messages, list(done[key].token_ids)
        cut = first_cut_turn(done[key].finish_reasons)
        if cut is not None and cut_answers == "drop":
            tally.dropped[f"answer cut at --max-new-tokens {sampling.max_new_tokens}"] += 1
            tally.cut_counts["dropped"] += 1
            continue
        if cut is not None:
            turn_index = assistant_turns(messages)[cut]
            tally.turns_after_cut += len(assistant_turns(messages)) - cut - 1
            messages = messages[: turn_index + 1]
            token_ids += [None] * (cut + 1 - len(token_ids))
            answers.cut_ids.append(token_ids[cut])
            token_ids = [*token_ids[:cut], None]  # the cut turn is ended by end_at_cut_answer
            tally.cut_counts["kept"] += 1
        else:
            answers.cut_ids.append(None)
        answers.cut_last.append(cut is not None)
        answers.conversations.append((messages, where))
        answers.generated.append(token_ids)
    return answers


def render_samples(
    tokenizer, answers: Answers, settings: PrepareSettings, tally: Tally, console: Console
) -> tuple[list[tuple[list[int], list[int]]], int, int]:
    """Every conversation rendered into samples of (ids, loss mask), in worker processes when there are
    many; returns the samples, their supervised tokens and their tokens."""
    from flashdraft.progress import track

    samples, supervised, total = [], 0, 0
    cut_last = answers.cut_last
    rules = RenderRules(
        thinking=settings.thinking,
        max_length=settings.max_length,
        min_supervised=settings.min_supervised,
        end_of_turn=end_of_turn_id(tokenizer, settings.thinking) if any(cut_last) else None,
    )
    jobs = [
        RenderConversation(
            messages,
            where,
            answers.generated[number] if answers.generated else None,
            bool(cut_last) and cut_last[number],
            answers.cut_ids[number] if cut_last else None,
        )
        for number, (messages, where) in enumerate(answers.conversations)
    ]
    workers = render_workers(settings.render_workers, len(jobs))
    if workers > 1:
        console.print(f"rendering {len(jobs)} conversations in {workers} processes")
    with track("rendering", len(jobs), unit="conversation") as bar:
        for outcome in render_all(tokenizer, jobs, rules, workers):
            bar.advance()
            if outcome.error is not None:
                tally.bad(FlashdraftError(outcome.error))
                continue
            tally.dropped.update(outcome.dropped)
            tally.id_counts.update(outcome.id_counts)
            for ids, mask in outcome.samples:
                samples.append((ids, mask))
                supervised += sum(mask)
                total += len(ids)
    return samples, supervised, total


def summary_table(
    out_dir: Path,
    manifest: dict[str, Any],
    tally: Tally,
    settings: PrepareSettings,
    sampling: Sampling,
    phases: PhaseClock,
) -> Table:
    """The summary printed at the end: what was read, kept, dropped and why, how it was regenerated, and
    where the time went."""
    table = Table(title=f"flashdraft prepare -> {out_dir}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("records read", str(tally.records_read))
    table.add_row("samples kept", str(manifest["samples"]))
    for reason, count in sorted(tally.dropped.items()):
        table.add_row(f"dropped: {reason}", str(count))
    for outcome, count in sorted(tally.id_counts.items()):
        table.add_row(outcome, str(count))
    if settings.regenerate:
        cut_counts = tally.cut_counts
        table.add_row(
            f"answers cut at --max-new-tokens {sampling.max_new_tokens}",
            f"{cut_counts['kept']} kept (no end-of-turn taught), {cut_counts['dropped']} dropped",
        )
        if tally.turns_after_cut:
            table.add_row(
                "later turns left out after a cut answer",
                f"{tally.turns_after_cut} (a sample ends at its cut answer; raise --max-new-tokens to keep them)",
            )
    total, supervised = manifest["tokens"], manifest["supervised_tokens"]
    table.add_row("tokens", f"{total:,}")
    table.add_row("supervised fraction", f"{supervised / max(total, 1):.1%}")
    sampling_record, server_requests = manifest["regeneration"], manifest["server_requests"]
    if sampling_record:
        where = ", ".join(sampling_record.get("devices") or [sampling_record.get("url", "")])
        table.add_row("regenerated", f"yes: {sampling_record['engine']} on {where}")
        if sampling_record.get("engine_choice"):
            table.add_row("engine choice", sampling_record["engine_choice"])
        for rank, detail in enumerate(sampling_record.get("engine_details") or []):
            said = detail.get("note") or detail.get("cuda_graphs_failed")
            if "cuda_graphs" in detail or said:
                graphs = "CUDA graphs" if detail.get("cuda_graphs") else "eager steps"
                table.add_row(
                    f"engine run (worker {rank})",
                    f"{detail['engine']}, {graphs}" + (f"; {said}" if said else ""),
                )
    else:
        table.add_row("regenerated", "no")
    if server_requests:
        table.add_row("server requests", str(server_requests["requests"]))
        table.add_row("server requests retried", str(server_requests["retried"]))
        table.add_row("server requests failed", str(server_requests["failed"]))
    table.add_row("time by phase", phases.summary())
    return table
