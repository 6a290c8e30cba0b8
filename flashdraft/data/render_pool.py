"""`prepare`'s render phase: conversations (with any regenerated ids) into training samples, in this
process's threads or, for large inputs, in a pool of processes.

Rendering is chat-template and tokenizer work on the host, about 1 ms a conversation on one core
(docs/inputs-and-outputs.md), so 800K conversations would take about 15 minutes on one core. In this
process, threads share the tokenizer: its Rust encoder releases the GIL, the chat template's Jinja
rendering does not (about a third of a render), so a few threads help and more add little. Each worker
process gets a pickled copy of the target's tokenizer once and imports no torch. Either way
conversations go out in chunks and come back in input order, so the samples and every count are the same
whatever the thread or worker count. Workers are spawned rather than forked, because forking a process
that has started torch's threads can hang.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from flashdraft.data.cut_answers import end_at_cut_answer
from flashdraft.data.generated_ids import use_generated_ids
from flashdraft.data.render import assistant_turns, prompt_ids, render_conversation
from flashdraft.errors import FlashdraftError

# Below this many conversations one process renders them: a spawned worker's imports (~3 s) cost more.
POOL_FROM = 20_000
CHUNK = 512  # conversations per task
MAX_AUTO_WORKERS = 16
# In this process: threads from this many conversations on, in chunks of THREAD_CHUNK, at most MAX_THREADS
# (the GIL-bound third of a render bounds the gain: 1.6-1.8x with 2 threads on 2 cores,
# docs/inputs-and-outputs.md)
THREADS_FROM = 256
THREAD_CHUNK = 64
MAX_THREADS = 8


@dataclass
class Conversation:
    """One kept conversation and what regeneration gave it (picklable: it travels to a worker)."""

    messages: list[dict]
    where: str
    generated: list[list[int] | None] | None = None  # ids per assistant turn (None where not local)
    cut_last: bool = False  # its last turn is a kept answer cut at --max-new-tokens
    cut_ids: list[int] | None = None  # that answer's generated ids


@dataclass
class RenderRules:
    thinking: str | None
    max_length: int
    min_supervised: int
    end_of_turn: int | None  # the end-of-turn id a cut answer is ended without (None: no cut answers)


@dataclass
class Outcome:
    """One conversation's samples, or why it gave none."""

    samples: list[tuple[list[int], list[int]]] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    id_counts: Counter[str] = field(default_factory=Counter)
    error: str | None = None  # a bad record (the message names its file and line)


def render_one(tokenizer, conversation: Conversation, rules: RenderRules) -> Outcome:
    outcome = Outcome()
    messages = conversation.messages
    try:
        rendered_turns = render_conversation(tokenizer, messages, rules.thinking, conversation.where)
    except FlashdraftError as exc:
        outcome.error = str(exc)
        return outcome
    turns = assistant_turns(messages)
    prompts: dict[int, list[int]] = {}  # a turn's prompt ids, asked for by both steps below

    def prompt_of(turn_index: int) -> list[int]:
        if turn_index not in prompts:
            prompts[turn_index] = prompt_ids(tokenizer, messages[:turn_index], rules.thinking)
        return prompts[turn_index]

    generated = conversation.generated
    if generated and any(ids is not None for ids in generated):
        rendered_turns = use_generated_ids(rendered_turns, turns, generated, prompt_of, outcome.id_counts)
    if conversation.cut_last:
        ended = end_at_cut_answer(
            rendered_turns[-1],
            prompt_of(turns[-1]),
            conversation.cut_ids,
            rules.end_of_turn,
            outcome.id_counts,
        )
        if ended is None:
            outcome.dropped["cut answer whose end cannot be located in its rendering"] += 1
            return outcome
        rendered_turns = [*rendered_turns[:-1], ended]
    for rendered in rendered_turns:
        if len(rendered.input_ids) > rules.max_length:
            outcome.dropped[f"longer than {rules.max_length} tokens"] += 1
        elif sum(rendered.loss_mask) < rules.min_supervised:
            outcome.dropped["no supervised tokens"] += 1
        else:
            outcome.samples.append((rendered.input_ids, rendered.loss_mask))
    return outcome


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def render_workers(requested: int, conversations: int) -> int:
    """`requested` when set (>= 1); else (0) one process below POOL_FROM conversations, else the cores."""
    if requested:
        return requested
    if conversations < POOL_FROM:
        return 1
    return max(1, min(MAX_AUTO_WORKERS, _cores()))


def render_all(
    tokenizer, conversations: list[Conversation], rules: RenderRules, workers: int
) -> Iterator[Outcome]:
    """Each conversation's outcome, in input order; `workers` > 1 renders in that many processes, each
    with a copy of `tokenizer` (pickled: the very same tokenizer, and the workers import no torch);
    otherwise this process renders, in threads from THREADS_FROM conversations on."""
    if workers <= 1 or len(conversations) <= CHUNK:
        threads = min(MAX_THREADS, _cores()) if len(conversations) >= THREADS_FROM else 1
        yield from _render_in_threads(tokenizer, conversations, rules, threads)
        return
    chunks = [conversations[i : i + CHUNK] for i in range(0, len(conversations), CHUNK)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_receive, initargs=(tokenizer,)
    ) as pool:
        try:
            for outcomes in pool.map(_render_chunk, chunks, [rules] * len(chunks)):
                yield from outcomes
        except BrokenProcessPool:
            raise FlashdraftError(
                f"prepare: a render worker process died (of {workers}; killed, or out of memory?); no shard "
                "was written (regenerated answers stay in the journal). Rerun with fewer --render-workers "
                "(1 renders in this process)"
            ) from None
        finally:  # a bad record stops the run: the chunks not yet started are not rendered
            pool.shutdown(wait=True, cancel_futures=True)


_worker_tokenizer = None


def _receive(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _render_chunk(chunk: list[Conversation], rules: RenderRules) -> list[Outcome]:
    return [render_one(_worker_tokenizer, conversation, rules) for conversation in chunk]


def _render_in_threads(
    tokenizer, conversations: list[Conversation], rules: RenderRules, threads: int
) -> Iterator[Outcome]:
    """In this process, in input order. The first conversation renders alone: a fast tokenizer settles its
    truncation and padding state on its first call (a write), after which the threads only read it."""
    if threads <= 1 or len(conversations) <= 1:
        for conversation in conversations:
            yield render_one(tokenizer, conversation, rules)
        return
    yield render_one(tokenizer, conversations[0], rules)
    rest = conversations[1:]
    chunks = [rest[i : i + THREAD_CHUNK] for i in range(0, len(rest), THREAD_CHUNK)]
    with ThreadPoolExecutor(threads, thread_name_prefix="render") as pool:
        try:
            for outcomes in pool.map(lambda chunk: [render_one(tokenizer, c, rules) for c in chunk], chunks):
                yield from outcomes
        finally:  # a bad record stops the run: the chunks not yet started are not rendered
            pool.shutdown(wait=True, cancel_futures=True)
