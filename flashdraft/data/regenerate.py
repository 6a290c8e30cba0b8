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

import contextlib
import email.utils
import hashlib
import http.client
import inspect
import json
import os
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flashdraft.config import Sampling
from flashdraft.data.chat import check_tool_calls
from flashdraft.data.render import reasoning_refusal, split_tools
from flashdraft.errors import FlashdraftError

Messages = list[dict[str, str]]


# An answer (its text, or the server's whole assistant message) and why it ended, in the OpenAI API's words:
# "stop" (an end-of-turn token), "length" (cut at --max-new-tokens: not a finished answer,
# docs/inputs-and-outputs.md), REQUEST_FAILED, or None when an engine does not say.
Answer = tuple[str | dict, str | None]


class ServerEngine:
    """POST /v1/chat/completions to an OpenAI-compatible server, `concurrency` requests in flight.

    A request answered 429 or 5xx, or whose connection broke, is retried up to `max_retries` times with
    exponential backoff and jitter (a `Retry-After` header is honoured); one that still fails is counted and
    its conversation left out (not journaled, so a rerun asks again), until more than `max_failed` requests
    have failed. Other 4xx answers are not retried; 401, 403 and 404 (wrong key, URL or model name: every
    request would get the same) stop the run at once with the server's message (docs/inputs-and-outputs.md).
    """

    def __init__(
        self,
        url: str,
        model: str | None,
        sampling: Sampling,
        thinking: str | None,
        concurrency: int = 16,
        timeout: float = 600.0,
        *,
        reasoning: str | None = None,
        max_retries: int = 5,
        max_failed: int = 0,
        backoff: float = 1.0,
    ):
        self.url = url.rstrip("/") + (
            "" if url.rstrip("/").endswith("/chat/completions") else "/v1/chat/completions"
        )
        self.model, self.sampling, self.thinking = model, sampling, thinking
        self.concurrency, self.timeout = concurrency, timeout
        # where the target's template puts reasoning (render.reasoning_placement); None: it cannot, and a
        # reply with reasoning stops the run before hours of answers that cannot be rendered
        self.reasoning = reasoning
        self.max_retries, self.max_failed, self.backoff = max_retries, max_failed, backoff
        self.counts = RequestCounts()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _body(self, messages: Messages, seed: int | None) -> dict:
        messages, tools = split_tools(messages)
        body = {
            "model": self.model or "default",
            "messages": messages,
            "max_tokens": self.sampling.max_new_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "seed": self.sampling.seed if seed is None else seed,
        }
        if tools:
            body["tools"] = tools
        if self.sampling.top_k:
            body["top_k"] = self.sampling.top_k
        if self.thinking is not None:  # SGLang and vLLM pass this to the chat template
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking == "on"}
        return body

    def _one(self, messages: Messages, seed: int | None = None) -> Answer:
        request = urllib.request.Request(
            self.url,
            data=json.dumps(self._body(messages, seed)).encode(),
            headers={"Content-Type": "application/json"},
        )
        with self._lock:
            self.counts.requests += 1
        for attempt in range(self.max_retries + 1):
            if self._stop.is_set():
                return FAILED_ANSWER
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    reply = json.loads(response.read())
                return self._answer(reply)
            except urllib.error.HTTPError as exc:
                failure = f"HTTP {exc.code}: {_snippet(exc.read())}"
                if exc.code in (401, 403, 404):
                    self._stop.set()
                    raise FlashdraftError(f"--server-url {self.url}: {failure}") from None
                if exc.code != 429 and exc.code < 500:
                    return self._failed(failure)
                wait = _retry_after(exc.headers.get("Retry-After"))
            except (ConnectionError, http.client.HTTPException) as exc:  # reset, refused, cut off mid-reply
                failure, wait = f"connection failed: {exc!r}", None
            except urllib.error.URLError as exc:
                if not isinstance(exc.reason, ConnectionError):
                    return self._failed(str(exc.reason))
                failure, wait = f"connection failed: {exc.reason!r}", None
            except (TimeoutError, json.JSONDecodeError) as exc:
                return self._failed(f"{type(exc).__name__}: {exc}")
            if attempt == self.max_retries:
                break
            with self._lock:
                self.counts.retries += 1
                self.counts.retried += attempt == 0
            if (
                wait is None
            ):  # exponential backoff, jittered so that concurrent requests do not retry together
                wait = min(BACKOFF_CAP_SECONDS, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)
            self._stop.wait(wait)
        return self._failed(failure)

    def _answer(self, reply) -> Answer:
        try:
            choice = reply["choices"][0]
            message, reason = choice["message"], choice.get("finish_reason")
            content = message.get("content") or ""
            if not isinstance(content, str):
                raise TypeError
        except (KeyError, IndexError, TypeError, AttributeError):
            raise FlashdraftError(f"server {self.url}: unexpected reply {str(reply)[:300]}") from None
        answer = {"role": "assistant", "content": content}
        # servers with a reasoning parser split the thinking off the content (newer vLLM calls it `reasoning`)
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            if self.reasoning is None:
                self._stop.set()
                raise reasoning_refusal(f"--server-url {self.url}")
            answer["reasoning_content"] = reasoning
        if message.get("tool_calls"):
            answer["tool_calls"] = check_tool_calls(message["tool_calls"], f"server {self.url}: reply")
        return answer, reason

    def _failed(self, failure: str) -> Answer:
        with self._lock:
            self.counts.failed += 1
            self.counts.last_failure = failure
            if self.counts.failed > self.max_failed:
                self._stop.set()
                raise FlashdraftError(
                    f"--server-url {self.url}: {_requests(self.counts.failed)} failed (more than "
                    f"--max-failed-requests {self.max_failed}); last: {failure}"
                )
        return FAILED_ANSWER

    def complete(
        self,
        conversations: list[Messages],
        seeds: list[int] | None = None,
        on_answer: Callable[[int, int], None] | None = None,
    ) -> list[Answer]:
        """One answer per conversation; `seeds` (one per answer) replace the sampling seed, so that repeats
        of a conversation are sampled apart and an answer does not depend on what it was sent with.
        `on_answer(index, 0)` is called as each reply arrives (progress; a server's token count is not kept)."""
        seeds = seeds or [None] * len(conversations)
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = {
                pool.submit(self._one, c, s): i
                for i, (c, s) in enumerate(zip(conversations, seeds, strict=True))
            }
            answers: list[Answer | None] = [None] * len(conversations)
            try:
                for future in as_completed(futures):
                    answers[futures[future]] = future.result()
                    if on_answer is not None:
                        on_answer(futures[future], 0)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        return answers  # type: ignore[return-value]

    def check_some_succeeded(self) -> None:
        """Every request failing is never a data set, whatever --max-failed-requests allows."""
        c = self.counts
        if c.requests and c.failed == c.requests:
            raise FlashdraftError(
                f"--server-url {self.url}: all {c.requests} requests failed; last: {c.last_failure}"
            )

    def describe(self) -> dict:
        return {"engine": "server", "url": self.url, "model": self.model, **asdict(self.sampling)}


# The finish reason of an answer whose request failed after its retries: never journaled (a rerun asks
# again), its conversation is left out and counted.
REQUEST_FAILED = "request failed"
FAILED_ANSWER: Answer = ({"role": "assistant", "content": ""}, REQUEST_FAILED)
BACKOFF_CAP_SECONDS = 60.0
RETRY_AFTER_CAP_SECONDS = 600.0


@dataclass
class RequestCounts:
    """What the server client did, for the summary and manifest.json (never part of the journal key)."""

    requests: int = 0  # answers asked for
    retried: int = 0  # requests that needed at least one retry
    retries: int = 0  # extra attempts in all
    failed: int = 0  # requests that still failed (their conversations are left out)
    last_failure: str | None = None


def _requests(n: int) -> str:
    return f"{n} request" + ("" if n == 1 else "s")


def _snippet(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError):
        error = json.loads(text).get("error", {})  # OpenAI style: {"error": {"message": ...}}
        text = error.get("message", text) if isinstance(error, dict) else str(error)
    return " ".join(text.split())[:300] or "(empty body)"


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date), capped; None when absent."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = (email.utils.parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP_SECONDS)


def assistant_message(answer: str | dict) -> dict:
    """An engine's answer as an assistant message: the server's comes whole (with its reasoning and tool
    calls), a local engine's is the text."""
    return answer if isinstance(answer, dict) else {"role": "assistant", "content": answer}


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
    crash mid-write), lines of an older journal format (keyed by position, which cannot be trusted) and
    partial records (a conversation some of whose turns are answered, `read_partial`) are dropped."""
    done: dict[str, Regenerated] = {}
    for part in [path] * path.is_file() + journal_parts(path):
        for record in _records(part):
            if not record.get("partial"):
                done[record["key"]] = _regenerated(record)
    return done


def read_partial(path: Path) -> dict[str, Regenerated]:
    """Conversations journaled part-way (their first turns answered, `"partial": true`) and not finished
    since, by key: the most-answered record of each, so a rerun answers only the turns still missing."""
    started: dict[str, Regenerated] = {}
    finished: set[str] = set()
    for part in [path] * path.is_file() + journal_parts(path):
        for record in _records(part):
            if not record.get("partial"):
                finished.add(record["key"])
                continue
            known = started.get(record["key"])
            if known is None or len(record.get("finish_reasons") or []) > len(known.finish_reasons):
                started[record["key"]] = _regenerated(record)
    return {key: value for key, value in started.items() if key not in finished}


def _regenerated(record: dict) -> Regenerated:
    return Regenerated(record["messages"], record.get("finish_reasons") or [], record.get("token_ids") or [])


def merge_journal_parts(path: Path) -> None:
    """Append the parts' whole records that the journal lacks to it (partial ones only for conversations
    finished nowhere), make that durable, then remove the parts: afterwards the journal alone holds every
    answer."""
    parts = journal_parts(path)
    if not parts:
        return
    known = {r["key"] for r in _records(path) if not r.get("partial")} if path.is_file() else set()
    records = [record for part in parts for record in _records(part)]
    finished = known | {r["key"] for r in records if not r.get("partial")}
    with path.open("a") as handle:
        for record in records:
            if record.get("partial"):
                if record["key"] in finished:
                    continue
            elif record["key"] in known:
                continue
            else:
                known.add(record["key"])
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    for part in parts:
        part.unlink()


# complete(conversations, seeds[, on_answer=]) -> one (text, finish reason[, generated ids]) per conversation;
# a `complete` that takes `on_answer` calls on_answer(index, tokens) as each answer ends (progress per answer)
Complete = Callable[..., list[tuple]]


def _takes_on_answer(complete: Complete) -> bool:
    try:
        return "on_answer" in inspect.signature(complete).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


class _AnswerCount:
    """A `complete`'s on_answer for one batch: each answer moves the progress at once; what it counted is
    kept, so the batch's end adds only the rest."""

    def __init__(self, bar: Any):
        self.bar, self.answers, self.tokens = bar, 0, 0

    def __call__(self, index: int, tokens: int) -> None:
        self.answers += 1
        self.tokens += tokens
        self.bar.advance(1, tokens=tokens)


def _answers_left(messages: Messages) -> int:
    return sum(m["role"] == "assistant" for m in messages)


def regenerate(
    items: list[tuple[str, Messages]],
    complete: Complete,
    journal: Path,
    chunk: int = 256,
    on_progress: Callable[[int, int], None] | None = None,
    write_to: Path | None = None,
    *,
    answer_batch: int | None = None,
    progress_label: str = "regenerating",
    progress_mode: str | None = None,
    heartbeat: Callable[..., Any] | None = None,
) -> dict[str, Regenerated]:
    """Regenerate every assistant turn of every (key, conversation), turn by turn (turn k sees the
    regenerated turns before it), `chunk` conversations at a time, each turn's answers asked for
    `answer_batch` at a time (None: all the chunk's at once). After every batch of answers the journal
    (`write_to`, default the journal itself: a worker writes its own part) gets each conversation of the
    batch: whole when finished, else as a partial record that a rerun continues from, so a kill loses at
    most one batch of answers. Progress (answers, tokens/s, ETA) goes to stderr (flashdraft/progress.py):
    per answer when `complete` takes `on_answer`, else per batch.

    Returns the regenerated conversation of every key in `items`, with why each answer ended; a
    conversation whose request failed (REQUEST_FAILED) is returned but not journaled, so a rerun asks
    again."""
    from flashdraft.progress import track

    done = read_journal(journal)
    started = read_partial(journal)
    per_answer = _takes_on_answer(complete)
    failed: dict[str, Regenerated] = {}
    wanted = {key for key, _ in items}
    todo = [(key, m) for key, m in items if key not in done]
    target = write_to or journal
    target.parent.mkdir(parents=True, exist_ok=True)
    answers = sum(_answers_left(m[len(started[key].messages) :] if key in started else m) for key, m in todo)
    with (
        target.open("a") as handle,
        track(progress_label, answers, unit="answer", heartbeat=heartbeat, mode=progress_mode) as bar,
    ):
        if done or started:
            bar.note(
                f"{progress_label}: resuming from {journal}: {len(done)} conversations finished, "
                f"{len(started)} part-way, {answers} answers to go"
            )
        for start in range(0, len(todo), chunk):
            group = todo[start : start + chunk]
            _regenerate_chunk(group, started, complete, per_answer, answer_batch, handle, bar, done, failed)
            if on_progress:
                on_progress(sum(key in done for key in wanted), len(wanted))
    return {key: done[key] if key in done else failed[key] for key in wanted}


@dataclass
class _Chunk:
    """One chunk's conversations while they are regenerated, by key: the messages so far (`convs`), why
    each answer ended, the ids generated per answer, and the original messages still to go."""

    convs: dict[str, Messages] = field(default_factory=dict)
    reasons: dict[str, list[str | None]] = field(default_factory=dict)
    ids: dict[str, list[list[int] | None]] = field(default_factory=dict)
    remaining: dict[str, Messages] = field(default_factory=dict)

    @classmethod
    def begin(cls, group: list[tuple[str, Messages]], started: dict[str, Regenerated]) -> _Chunk:
        """The chunk, each conversation continued from its partial journal record if it has one."""
        chunk = cls()
        for key, messages in group:
            begun = started.get(key)
            chunk.convs[key] = list(begun.messages) if begun else []
            chunk.reasons[key] = list(begun.finish_reasons) if begun else []
            chunk.ids[key] = list(begun.token_ids) if begun else []
            chunk.ids[key] += [None] * (len(chunk.reasons[key]) - len(chunk.ids[key]))
            chunk.remaining[key] = list(messages[len(chunk.convs[key]) :])
        return chunk

    def asking(self) -> list[str]:
        """The keys with an answer to give next: each conversation's messages up to its next assistant
        turn are carried over; one with no assistant turn left leaves `remaining`."""
        asking = []
        for key, rest in list(self.remaining.items()):
            while rest and rest[0]["role"] != "assistant":
                self.convs[key].append(rest.pop(0))
            if rest:
                asking.append(key)
            else:
                del self.remaining[key]
        return asking

    def journal(self, handle, key: str, partial: bool) -> None:
        """Write the conversation's journal record (whole, or partial: a rerun continues from it)."""
        record: dict[str, Any] = {
            "key": key,
            "messages": self.convs[key],
            "finish_reasons": self.reasons[key],
        }
        if any(turn is not None for turn in self.ids[key]):
            record["token_ids"] = self.ids[key]
        if partial:
            record["partial"] = True
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    def finished(self, key: str) -> Regenerated:
        return Regenerated(self.convs[key], self.reasons[key], self.ids[key])


def _regenerate_chunk(
    group: list[tuple[str, Messages]],
    started: dict[str, Regenerated],
    complete: Complete,
    per_answer: bool,
    answer_batch: int | None,
    handle,
    bar,
    done: dict[str, Regenerated],
    failed: dict[str, Regenerated],
) -> None:
    """One chunk, turn by turn, each turn's answers asked `answer_batch` at a time (None: all at once) and
    the journal synced after every batch; finished conversations go to `done`, failed ones to `failed`."""
    chunk = _Chunk.begin(group, started)
    written: set[str] = set()
    while asking := chunk.asking():
        step = answer_batch or len(asking)
        for first in range(0, len(asking), step):
            batch = asking[first : first + step]
            _answer_batch(chunk, batch, complete, per_answer, handle, bar, done, failed, written)
            handle.flush()
            os.fsync(handle.fileno())
    for key, _ in group:  # conversations with no answer to give (nothing was asked)
        if key not in failed and key not in written:
            chunk.journal(handle, key, partial=False)
            done[key] = chunk.finished(key)
    handle.flush()
    os.fsync(handle.fileno())


def _answer_batch(
    chunk: _Chunk,
    batch: list[str],
    complete: Complete,
    per_answer: bool,
    handle,
    bar,
    done: dict[str, Regenerated],
    failed: dict[str, Regenerated],
    written: set[str],
) -> None:
    """Ask for one batch of answers and journal each conversation (whole once its last answer is in,
    else partial); a failed request ends its conversation. Progress moves per answer where `complete`
    reports them (`per_answer`), the rest at the batch's end."""
    seeds = [answer_seed(key, len(chunk.reasons[key])) for key in batch]
    asked, counted = [chunk.convs[key] for key in batch], _AnswerCount(bar)
    replies = complete(asked, seeds, on_answer=counted) if per_answer else complete(asked, seeds)
    tokens = 0
    for key, (answer, reason, *generated) in zip(batch, replies, strict=True):
        chunk.remaining[key].pop(0)  # the original assistant turn is replaced
        chunk.convs[key].append(assistant_message(answer))
        chunk.reasons[key].append(reason)
        chunk.ids[key].append(generated[0] if generated else None)
        tokens += len(generated[0]) if generated and generated[0] else 0
        if reason == REQUEST_FAILED:  # a later turn would build on no answer
            failed[key] = Regenerated(chunk.convs[key], chunk.reasons[key])
            bar.set_total((bar.total or 0) - _answers_left(chunk.remaining.pop(key)))
        elif not _answers_left(chunk.remaining[key]):
            chunk.convs[key] += chunk.remaining.pop(key)  # the messages after its last answer
            chunk.journal(handle, key, partial=False)
            written.add(key)
            done[key] = chunk.finished(key)
        else:
            chunk.journal(handle, key, partial=True)
    # what on_answer did not count (an engine that reports nothing, or not every answer)
    bar.advance(max(0, len(batch) - counted.answers), tokens=max(0, tokens - counted.tokens))
