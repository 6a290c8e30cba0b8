"""`flashdraft prepare`: chat datasets -> (optionally target-regenerated) -> tokenized shards with masks.

The output is checked before any work (docs/inputs-and-outputs.md): it must be absent, empty, a shard
directory `prepare` made (replaced as a whole once the new set is complete), or the user passes --force;
it may never be, hold, or lie inside the target or an input."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from dataclasses import asdict
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


def prepare(
    inputs: list[str],
    target: str,
    out: str,
    settings: PrepareSettings,
    console: Console | None = None,
    command: str | None = None,
    phases: PhaseClock | None = None,
) -> dict[str, Any]:
    """`phases`: the clock this command's phases are booked on (the CLI starts it at the process's
    creation, so the interpreter's start and the imports show as `start-up`); a fresh one otherwise."""
    console = console or Console()
    # Where the command's time goes, phase by phase (the manifest's "seconds" and the summary's last row):
    # regeneration's engine start-up and the work around it show apart from the engine's own record.
    phases = phases or PhaseClock()
    out_dir = Path(out)
    # Everything about the output is checked before the tokenizer loads and before any regeneration.
    protected = {"--target": target, **{f"input {p}": p for p in inputs}}
    check_output_dir(out_dir, "--out", force=settings.force, inputs=protected, ours=not_a_shard_dir)
    if settings.cut_answers not in CUT_POLICIES:
        raise FlashdraftError(
            f"--cut-answers {settings.cut_answers!r}: expected one of {', '.join(CUT_POLICIES)}"
        )
    sampling = settings.sampling or Sampling()
    local = None  # --device, --engine and --workers are refused before any record is read
    if settings.regenerate and not settings.server_url:
        local = local_regeneration(target, sampling, settings)
    phases.mark("checks")
    from flashdraft.progress import phase, track

    with phase(f"loading the tokenizer of {target}"):
        tokenizer = load_target_tokenizer(target, required=True)
    phases.mark("tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise FlashdraftError(f"target {target}: its tokenizer has no chat template to render conversations")
    dropped: Counter[str] = Counter()
    bad_records: list[str] = []

    def skip(exc: FlashdraftError) -> None:  # --skip-bad-records: report, count, carry on
        dropped["bad record"] += 1
        bad_records.append(str(exc))
        console.print(f"[yellow]skipped[/] {exc}", highlight=False, markup=True)

    def bad(exc: FlashdraftError) -> None:
        if not settings.skip_bad_records:
            raise exc
        skip(exc)

    def unreadable(exc: FlashdraftError) -> None:
        nonlocal records_read
        records_read += 1
        skip(exc)

    conversations, records_read = [], 0
    with track("reading and checking conversations", None, unit="conversation") as reading:
        for record, where in iter_records(inputs, unreadable if settings.skip_bad_records else None):
            if settings.limit and len(conversations) >= settings.limit:
                break
            records_read += 1
            reading.advance()
            try:
                conv = normalise(record, where)
                if conv.messages is None:
                    raise FlashdraftError(
                        f"{where}: pre-tokenized records cannot be rendered; give conversations"
                    )
                check_renders(tokenizer, conv.messages, settings.thinking, where)
            except FlashdraftError as exc:
                bad(exc)
                continue
            if not any(m["role"] == "assistant" for m in conv.messages) and not settings.regenerate:
                dropped["no assistant turn"] += 1
                continue
            conversations.append((conv.messages, where))
    phases.mark("read_and_check")

    sampling_record = server_requests = None
    generated: list[list[list[int] | None]] = []  # per kept conversation: the ids generated per turn
    # per kept conversation: whether its last turn is a kept cut answer, and that answer's generated ids
    cut_last: list[bool] = []
    cut_ids: list[list[int] | None] = []
    cut_counts: Counter[str] = Counter()
    turns_after_cut = 0  # assistant turns left out because an earlier answer of theirs was cut
    id_counts: Counter[str] = Counter()
    if settings.regenerate:
        if local is None:
            # one request per assistant turn; a conversation with only a prompt gets one answer too
            requests = sum(
                max(1, [m["role"] for m in messages].count("assistant")) for messages, _ in conversations
            )
            engine = ServerEngine(
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
            engine_record = engine.describe()
            key_engine = engine_record
        else:
            engine_record, key_engine = local["record"], local["key"]
        key_settings = {
            "engine": key_engine,
            "thinking": settings.thinking,
            "target": target_identity(target),
        }
        seen: Counter[str] = Counter()
        items = []
        for messages, _ in conversations:
            # a conversation with only a prompt gets its answer generated too
            if not any(m["role"] == "assistant" for m in messages):
                messages = [*messages, {"role": "assistant", "content": ""}]
            text = json.dumps(messages, sort_keys=True)
            items.append((journal_key(messages, seen[text], key_settings), messages))
            seen[text] += 1
        journal = out_dir / JOURNAL
        try:
            if local is None:
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
        if local is None:
            engine.check_some_succeeded()
        kept = []
        for (key, _), (_, where) in zip(items, conversations, strict=True):
            if REQUEST_FAILED in done[key].finish_reasons:  # not journaled: a rerun asks again
                dropped["server request failed"] += 1
                continue
            # An answer cut at --max-new-tokens is not a finished answer: taught as one, the drafter would
            # learn to end turns where the target does not. `keep` trains on its tokens and ends the sample
            # there (flashdraft/data/cut_answers.py); `drop` leaves the conversation out. Both are counted.
            messages, token_ids = done[key].messages, list(done[key].token_ids)
            cut = first_cut_turn(done[key].finish_reasons)
            if cut is not None and settings.cut_answers == "drop":
                dropped[f"answer cut at --max-new-tokens {sampling.max_new_tokens}"] += 1
                cut_counts["dropped"] += 1
                continue
            if cut is not None:
                turn_index = assistant_turns(messages)[cut]
                turns_after_cut += len(assistant_turns(messages)) - cut - 1
                messages = messages[: turn_index + 1]
                token_ids += [None] * (cut + 1 - len(token_ids))
                cut_ids.append(token_ids[cut])
                token_ids = [*token_ids[:cut], None]  # the cut turn is ended by end_at_cut_answer
                cut_counts["kept"] += 1
            else:
                cut_ids.append(None)
            cut_last.append(cut is not None)
            kept.append((messages, where))
            generated.append(token_ids)
        conversations = kept
        sampling_record = engine_record
        if local is None:
            server_requests = asdict(engine.counts)
        phases.mark("regenerate")

    samples, supervised, total = [], 0, 0
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
            generated[number] if generated else None,
            bool(cut_last) and cut_last[number],
            cut_ids[number] if cut_last else None,
        )
        for number, (messages, where) in enumerate(conversations)
    ]
    workers = render_workers(settings.render_workers, len(jobs))
    if workers > 1:
        console.print(f"rendering {len(jobs)} conversations in {workers} processes")
    with track("rendering", len(jobs), unit="conversation") as bar:
        for outcome in render_all(tokenizer, jobs, rules, workers):
            bar.advance()
            if outcome.error is not None:
                bad(FlashdraftError(outcome.error))
                continue
            dropped.update(outcome.dropped)
            id_counts.update(outcome.id_counts)
            for ids, mask in outcome.samples:
                samples.append((ids, mask))
                supervised += sum(mask)
                total += len(ids)
    if not samples:
        reasons = (
            ", ".join(f"{n} {why}" for why, n in sorted(dropped.items())) or "the inputs hold no records"
        )
        first = f"; first: {bad_records[0]}" if bad_records else ""
        raise FlashdraftError(f"prepare: no sample kept from {', '.join(inputs)} ({reasons}){first}")
    phases.mark("render")
    manifest = {
        **tokenizer_fingerprint(tokenizer),
        "tokenizer_name": getattr(tokenizer, "name_or_path", target),
        "target": str(target),
        "thinking": settings.thinking,
        "max_length": settings.max_length,
        "inputs": [str(p) for p in inputs],
        "conversations": len(conversations),
        "samples": len(samples),
        "dropped": dict(dropped),
        "generated_ids": dict(id_counts),
        "cut_answers": {"policy": settings.cut_answers, "kept": 0, "dropped": 0, **cut_counts}
        if settings.regenerate
        else None,
        "turns_after_cut_answers": turns_after_cut if settings.regenerate else None,
        "tokens": total,
        "supervised_tokens": supervised,
        "regeneration": sampling_record,
        "server_requests": server_requests,
        "command": command or " ".join(sys.argv),
        "bad_records": bad_records[:100],
        "seconds": dict(phases.seconds),  # the phases before the shards were written
    }
    try:
        write_shards(out_dir, samples, manifest)
    except OSError as exc:
        raise _write_failed(exc, out_dir, "writing the shards") from None
    phases.mark("write")

    table = Table(title=f"flashdraft prepare -> {out_dir}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("records read", str(records_read))
    table.add_row("samples kept", str(len(samples)))
    for reason, count in sorted(dropped.items()):
        table.add_row(f"dropped: {reason}", str(count))
    for outcome, count in sorted(id_counts.items()):
        table.add_row(outcome, str(count))
    if settings.regenerate:
        table.add_row(
            f"answers cut at --max-new-tokens {sampling.max_new_tokens}",
            f"{cut_counts['kept']} kept (no end-of-turn taught), {cut_counts['dropped']} dropped",
        )
        if turns_after_cut:
            table.add_row(
                "later turns left out after a cut answer",
                f"{turns_after_cut} (a sample ends at its cut answer; raise --max-new-tokens to keep them)",
            )
    table.add_row("tokens", f"{total:,}")
    table.add_row("supervised fraction", f"{supervised / max(total, 1):.1%}")
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
    console.print(table)
    return manifest
