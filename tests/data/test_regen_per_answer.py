"""Regeneration progress moves per finished answer, not per batch (#29): the engines' `on_answer` hook is
called once per prompt, mid-batch for a row that stops early, with the ids the call returns; `regenerate`
advances its progress by each such answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashdraft.config import Sampling
from flashdraft.data.regenerate import regenerate
from flashdraft.generate.engines import ContinuousBatchingEngine, HFGenerateEngine, cut_at_stop
from flashdraft.generate.static import StaticEngine
from flashdraft.model.tiny import build_model, tiny_config
from tests.data.plain_generate import emitted_stop_ids, plain_greedy

NEW = 12


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(tiny_config("llama", vocab_size=64, hidden_size=32, num_layers=2)).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 20, 1, 4)]


@pytest.fixture(scope="module")
def stops(model, prompts):
    return emitted_stop_ids(model, prompts, NEW)


def _engine(name: str, model, stops):
    sampling = Sampling(max_new_tokens=NEW)
    if name == "hf":
        return HFGenerateEngine(model, sampling, stops, 0, batch_size=8)  # one batch: all prompts
    if name == "hf, two batches":
        return HFGenerateEngine(model, sampling, stops, 0, batch_size=4)
    if name == "static":
        return StaticEngine(model, sampling, stops, 0, batch_size=8, check_every=2)
    if name == "static, two batches":
        return StaticEngine(model, sampling, stops, 0, batch_size=4, check_every=2)
    return ContinuousBatchingEngine(model, sampling, stops, 0)


@pytest.mark.parametrize("name", ["hf", "hf, two batches", "static", "static, two batches", "hf-cb"])
def test_each_answer_is_reported_once_with_the_ids_returned(model, prompts, stops, name):
    expected = [cut_at_stop(plain_greedy(model, p, stops, NEW), stops) for p in prompts]
    early = [i for i, ids in enumerate(expected) if len(ids) < NEW]
    assert early and len(early) < len(prompts), "some answers must stop early and some run to the end"
    reported: list[tuple[int, list[int]]] = []
    out = _engine(name, model, stops).generate_ids(
        prompts, [0] * len(prompts), on_answer=lambda i, ids: reported.append((i, ids))
    )
    assert out == expected
    assert sorted(i for i, _ in reported) == list(range(len(prompts)))  # each prompt exactly once
    assert all(ids == out[i] for i, ids in reported)


@pytest.mark.parametrize("name", ["hf", "static"])
def test_an_answer_that_stops_early_is_reported_before_its_batch_ends(model, prompts, stops, name):
    """One batch of all prompts: a row that emits its stop token is handed on while the others still decode
    (fewer forward passes have run when it is reported than when the batch ends); answers cut at
    --max-new-tokens come after, in the order of their rows."""
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    seen: dict[int, int] = {}  # prompt index -> forward passes run when it was reported
    try:
        out = _engine(name, model, stops).generate_ids(
            prompts, [0] * len(prompts), on_answer=lambda i, ids: seen.setdefault(i, forwards[0])
        )
    finally:
        hook.remove()
    total = forwards[0]
    short = min(range(len(out)), key=lambda i: len(out[i]))
    assert len(out[short]) < NEW - 2  # the stop check (every 2 steps in the static engine) sees it first
    assert seen[short] < total
    assert all(seen[i] == total for i, ids in enumerate(out) if len(ids) == NEW)  # the cut ones: at the end
    order = sorted(seen, key=seen.get)
    assert order.index(short) < min(order.index(i) for i, ids in enumerate(out) if len(ids) == NEW)


class PerAnswerEngine:
    """Answers a batch one by one, calling `on_answer` after each, as the local engines and the server do."""

    def __init__(self):
        self.done_at_each_answer: list[int] = []

    def complete(self, conversations: list, seeds: list[int], on_answer=None) -> list[tuple]:
        replies = []
        for index, conversation in enumerate(conversations):
            ids = list(range(len(conversation[-1]["content"])))
            replies.append((f"answer {index}", "stop", ids))
            if on_answer is not None:
                on_answer(index, len(ids))
        return replies


def test_regenerate_advances_per_answer_within_a_batch(tmp_path: Path) -> None:
    items = [
        (f"k{n}", [{"role": "user", "content": "q" * (n + 1)}, {"role": "assistant", "content": "x"}])
        for n in range(6)
    ]
    beats: list[dict] = []
    regenerate(
        items,
        PerAnswerEngine().complete,
        tmp_path / "j.jsonl",
        answer_batch=6,  # one batch of all six answers
        progress_mode="off",
        heartbeat=lambda progress: beats.append(progress),
    )
    done = [beat["done"] for beat in beats]
    # every answer moves the count by one; the batch's end adds nothing more
    assert [d for i, d in enumerate(done) if i == 0 or d != done[i - 1]] == [1, 2, 3, 4, 5, 6]
    assert beats[-1]["tokens"] == sum(range(1, 7))


def test_a_complete_without_on_answer_still_counts_per_batch(tmp_path: Path) -> None:
    items = [
        (f"k{n}", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]) for n in range(6)
    ]
    beats: list[dict] = []

    def complete(conversations: list, seeds: list[int]) -> list[tuple]:
        return [("a", "stop", [1, 2]) for _ in conversations]

    regenerate(
        items,
        complete,
        tmp_path / "j.jsonl",
        answer_batch=3,
        progress_mode="off",
        heartbeat=lambda progress: beats.append(progress),
    )
    assert sorted({beat["done"] for beat in beats}) == [3, 6]
    assert beats[-1]["tokens"] == 12
