"""`flashdraft prepare`: chat datasets -> (optionally target-regenerated) -> tokenized shards with masks."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flashdraft.data.chat import normalise
from flashdraft.data.regenerate import LocalEngine, Sampling, ServerEngine, regenerate
from flashdraft.data.render import render_conversation, tokenizer_fingerprint
from flashdraft.data.shards import write_shards
from flashdraft.data.sources import iter_records
from flashdraft.errors import FlashdraftError
from flashdraft.model.target import load_target_tokenizer


@dataclass
class PrepareSettings:
    max_length: int = 3072
    thinking: str | None = None
    regenerate: bool = False
    server_url: str | None = None
    server_model: str | None = None
    concurrency: int = 16
    batch_size: int = 64
    limit: int = 0
    min_supervised: int = 1
    chunk: int = 256
    skip_bad_records: bool = False
    sampling: Sampling | None = None


def prepare(
    inputs: list[str],
    target: str,
    out: str,
    settings: PrepareSettings,
    console: Console | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    console = console or Console()
    tokenizer = load_target_tokenizer(target, required=True)
    out_dir = Path(out)
    dropped: Counter[str] = Counter()
    bad_records: list[str] = []

    def skip(exc: FlashdraftError) -> None:  # --skip-bad-records: report, count, carry on
        dropped["bad record"] += 1
        bad_records.append(str(exc))
        console.print(f"[yellow]skipped[/] {exc}")

    on_error = skip if settings.skip_bad_records else None
    conversations = []
    for record, where in iter_records(inputs, on_error):
        if settings.limit and len(conversations) >= settings.limit:
            break
        try:
            conv = normalise(record, where)
        except FlashdraftError as exc:
            if on_error is None:
                raise
            on_error(exc)
            continue
        if conv.messages is None:
            raise FlashdraftError(f"{where}: pre-tokenized records cannot be rendered; give conversations")
        if not any(m["role"] == "assistant" for m in conv.messages) and not settings.regenerate:
            dropped["no assistant turn"] += 1
            continue
        conversations.append((len(conversations), conv.messages, where))

    sampling_record = None
    if settings.regenerate:
        sampling = settings.sampling or Sampling()
        if settings.server_url:
            engine = ServerEngine(
                settings.server_url, settings.server_model, sampling, settings.thinking, settings.concurrency
            )
        else:
            from flashdraft.model.target import TargetModel

            model = TargetModel.load(target, [0]).model
            engine = LocalEngine(model, tokenizer, sampling, settings.thinking, settings.batch_size)
        # a conversation with only a prompt gets its answer generated too
        items = [
            (i, m if any(x["role"] == "assistant" for x in m) else [*m, {"role": "assistant", "content": ""}])
            for i, m, _ in conversations
        ]
        done = regenerate(
            items,
            engine.complete,
            out_dir / "regenerated.jsonl",
            chunk=settings.chunk,
            on_progress=lambda n, total: console.print(f"regenerated {n}/{total}"),
        )
        conversations = [(i, done[i], where) for i, _, where in conversations]
        sampling_record = engine.describe()

    samples, supervised, total = [], 0, 0
    for _, messages, where in conversations:
        for rendered in render_conversation(tokenizer, messages, settings.thinking, where):
            n_sup = sum(rendered.loss_mask)
            if len(rendered.input_ids) > settings.max_length:
                dropped[f"longer than {settings.max_length} tokens"] += 1
                continue
            if n_sup < settings.min_supervised:
                dropped["no supervised tokens"] += 1
                continue
            samples.append((rendered.input_ids, rendered.loss_mask))
            supervised += n_sup
            total += len(rendered.input_ids)
    if not samples:
        raise FlashdraftError(f"prepare: no sample kept ({dict(dropped)})")
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
        "tokens": total,
        "supervised_tokens": supervised,
        "regeneration": sampling_record,
        "command": command or " ".join(sys.argv),
        "bad_records": bad_records[:100],
    }
    write_shards(out_dir, samples, manifest)

    table = Table(title=f"flashdraft prepare -> {out_dir}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row(
        "records read", str(len(conversations) + dropped["no assistant turn"] + dropped["bad record"])
    )
    table.add_row("samples kept", str(len(samples)))
    for reason, count in sorted(dropped.items()):
        table.add_row(f"dropped: {reason}", str(count))
    table.add_row("tokens", f"{total:,}")
    table.add_row("supervised fraction", f"{supervised / max(total, 1):.1%}")
    table.add_row("regenerated", "yes: " + sampling_record["engine"] if sampling_record else "no")
    console.print(table)
    return manifest
