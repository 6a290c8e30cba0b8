"""Regeneration: every assistant turn replaced by the target's own continuation of the conversation so far
(DFlash drafters are trained on target-generated responses, docs/dflash.md §3).

Two ways to answer: `ServerEngine` asks any OpenAI-compatible server the user already runs (SGLang,
vLLM) with concurrent requests; the local engines (flashdraft/data/local_regen.py, one process per GPU,
each journaling to its own part of the journal) generate with the target itself (docs/regeneration.md). Progress is a JSONL journal: each finished conversation is
appended and flushed as one line, so a crash or Ctrl-C keeps every finished sample, and a restart skips
them (a torn last line is ignored). Each answer is keyed by a hash of its conversation, the sampling
settings and the target (`journal_key`), never by position: a rerun with other input, settings or
target never reuses a stale answer (docs/inputs-and-outputs.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.config import Sampling
from flashdraft.errors import FlashdraftError

Messages = list[dict[str, str]]


# An answer and why it ended, in the OpenAI API's words: "stop" (an end-of-turn token), "length" (cut at
# --max-new-tokens: not a finished answer, docs/inputs-and-outputs.md), or None when an engine does not say.
Answer = tuple[str, str | None]


class ServerEngine:
    """POST /v1/chat/completions to an OpenAI-compatible server, `concurrency` requests in flight."""

    def __init__(
        self,
        url: str,
        model: str | None,
        sampling: Sampling,
        thinking: str | None,
        concurrency: int = 16,
        timeout: float = 600.0,
    ):
        self.url = url.rstrip("/") + (
            "" if url.rstrip("/").endswith("/chat/completions") else "/v1/chat/completions"
        )
        self.model, self.sampling, self.thinking = model, sampling, thinking
        self.concurrency, self.timeout = concurrency, timeout

    def _one(self, messages: Messages) -> Answer:
        body = {
            "model": self.model or "default",
            "messages": messages,
            "max_tokens": self.sampling.max_new_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "seed": self.sampling.seed,
        }
        if self.sampling.top_k:
            body["top_k"] = self.sampling.top_k
        if self.thinking is not None:  # SGLang and vLLM pass this to the chat template
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking == "on"}
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise FlashdraftError(f"server {self.url}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, TimeoutError) as exc:
            raise FlashdraftError(f"server {self.url}: {getattr(exc, 'reason', exc)}") from None
        try:
            choice = reply["choices"][0]
            return choice["message"]["content"], choice.get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise FlashdraftError(f"server {self.url}: unexpected reply {str(reply)[:300]}") from None

    def complete(self, conversations: list[Messages]) -> list[Answer]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, conversations))

    def describe(self) -> dict:
        return {"engine": "server", "url": self.url, "model": self.model, **asdict(self.sampling)}


def journal_key(messages: Messages, occurrence: int, settings: dict[str, Any]) -> str:
    """What an answer depends on: the conversation, which repeat of it this is (identical conversations
    are sampled separately), and `settings` (engine, sampling, thinking switch, target identity)."""
    blob = json.dumps([messages, occurrence, settings], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def answer_seed(key: str, turn: int) -> int:
    """The sampling seed of one answer: from its conversation's journal key (which already holds the
    sampling settings and --seed) and its turn, so it never depends on batch or worker."""
    return int(hashlib.sha256(f"{key}:{turn}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


@dataclass
class Regenerated:
    messages: Messages
    finish_reasons: list[str | None]  # one per regenerated assistant turn, in order
    # per regenerated assistant turn: the ids the local engine generated (None: a server answered)
    token_ids: list[list[int] | None] = field(default_factory=list)


def journal_parts(path: Path) -> list[Path]:
    """The per-worker parts of a journal (`NAME.part-RANK`), written beside it by parallel regeneration."""
    return sorted(path.parent.glob(f"{path.name}.part-*")) if path.parent.is_dir() else []


def journal_part(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.name}.part-{rank}")


def _records(path: Path) -> Iterator[dict]:
    with path.open("rb") as handle:
        for raw in handle:
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict) and isinstance(record.get("key"), str) and "messages" in record:
                yield record


def read_journal(path: Path) -> dict[str, Regenerated]:
    """Finished conversations by `journal_key`, from the journal and its worker parts; a torn last line (a
    crash mid-write) and lines of an older journal format (keyed by position, which cannot be trusted) are
    dropped."""
    done: dict[str, Regenerated] = {}
    for part in [path] * path.is_file() + journal_parts(path):
        for record in _records(part):
            done[record["key"]] = Regenerated(
                record["messages"], record.get("finish_reasons") or [], record.get("token_ids") or []
            )
    return done


def merge_journal_parts(path: Path) -> None:
    """Append the parts' whole records that the journal lacks to it, make that durable, then remove the
    parts: afterwards the journal alone holds every finished answer."""
    parts = journal_parts(path)
    if not parts:
        return
    known = {record["key"] for record in _records(path)} if path.is_file() else set()
    with path.open("a") as handle:
        for part in parts:
            for record in _records(part):
                if record["key"] not in known:
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                    known.add(record["key"])
        handle.flush()
        os.fsync(handle.fileno())
    for part in parts:
        part.unlink()


# complete(conversations, seeds) -> one (text, finish reason[, generated ids]) per conversation
Complete = Callable[[list[Messages], list[int]], list[tuple]]


def regenerate(
    items: list[tuple[str, Messages]],
    complete: Complete,
    journal: Path,
    chunk: int = 256,
    on_progress: Callable[[int, int], None] | None = None,
    write_to: Path | None = None,
) -> dict[str, Regenerated]:
    """Regenerate every assistant turn of every (key, conversation), turn by turn (turn k sees the
    regenerated turns before it), `chunk` conversations at a time; finished ones are journaled as they
    complete (to `write_to`, default the journal itself: a worker writes its own part). Returns the
    regenerated conversation of every key in `items`, with why each answer ended."""
    done = read_journal(journal)
    wanted = {key for key, _ in items}
    todo = [(key, m) for key, m in items if key not in done]
    target = write_to or journal
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as handle:
        for start in range(0, len(todo), chunk):
            group = todo[start : start + chunk]
            convs: dict[str, Messages] = {key: [] for key, _ in group}
            reasons: dict[str, list[str | None]] = {key: [] for key, _ in group}
            ids: dict[str, list[list[int] | None]] = {key: [] for key, _ in group}
            remaining = {key: list(m) for key, m in group}
            while remaining:
                asking = []
                for key, rest in list(remaining.items()):
                    while rest and rest[0]["role"] != "assistant":
                        convs[key].append(rest.pop(0))
                    if rest:
                        asking.append(key)
                    else:
                        del remaining[key]
                if not asking:
                    break
                seeds = [answer_seed(key, len(reasons[key])) for key in asking]
                answers = complete([convs[key] for key in asking], seeds)
                for key, (answer, reason, *generated) in zip(asking, answers, strict=True):
                    remaining[key].pop(0)  # the original assistant turn is replaced
                    convs[key].append({"role": "assistant", "content": answer})
                    reasons[key].append(reason)
                    ids[key].append(generated[0] if generated else None)
            for key, _ in group:
                record = {"key": key, "messages": convs[key], "finish_reasons": reasons[key]}
                if any(turn is not None for turn in ids[key]):
                    record["token_ids"] = ids[key]
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                done[key] = Regenerated(convs[key], reasons[key], ids[key])
            handle.flush()
            os.fsync(handle.fileno())
            if on_progress:
                on_progress(sum(key in done for key in wanted), len(wanted))
    return {key: done[key] for key in wanted}
