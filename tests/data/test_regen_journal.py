"""Regeneration journals every batch of answers (partial conversations included) and a rerun resumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashdraft.data.regenerate import (
    REQUEST_FAILED,
    journal_part,
    merge_journal_parts,
    read_journal,
    read_partial,
    regenerate,
)


def conversation(n: int, turns: int) -> list[dict[str, str]]:
    messages = []
    for t in range(turns):
        messages += [{"role": "user", "content": f"q{n}.{t}"}, {"role": "assistant", "content": "old"}]
    return messages


ITEMS = [(f"k{n}", conversation(n, turns)) for n, turns in enumerate([1, 2, 3, 1, 2])]
ANSWERS = sum(turns for turns in [1, 2, 3, 1, 2])


class FakeEngine:
    """Answers from the prompt and seed (deterministic, like a seeded target); raises after `stop_after`
    calls, as a kill would end the run."""

    def __init__(self, stop_after: int | None = None):
        self.calls = 0
        self.asked = 0
        self.stop_after = stop_after

    def complete(self, conversations: list, seeds: list[int]) -> list[tuple]:
        if self.stop_after is not None and self.calls >= self.stop_after:
            raise KeyboardInterrupt
        self.calls += 1
        self.asked += len(conversations)
        return [
            (f"answer to {c[-1]['content']} ({seed})", "stop", [len(c), seed % 7])
            for c, seed in zip(conversations, seeds, strict=True)
        ]


def test_a_kill_keeps_every_finished_batch_and_a_rerun_asks_only_the_rest(tmp_path: Path) -> None:
    journal = tmp_path / "regenerated.jsonl"
    whole = regenerate(
        ITEMS, FakeEngine().complete, tmp_path / "whole.jsonl", answer_batch=2, progress_mode="off"
    )

    killed = FakeEngine(stop_after=3)  # turn 0 takes 3 batches of 2 (5 conversations): killed before turn 1
    with pytest.raises(KeyboardInterrupt):
        regenerate(ITEMS, killed.complete, journal, answer_batch=2, progress_mode="off")
    finished, partial = read_journal(journal), read_partial(journal)
    assert set(finished) == {"k0", "k3"}  # one-turn conversations: finished at their only answer
    assert set(partial) == {"k1", "k2", "k4"}  # their first answers kept
    assert all(len(p.finish_reasons) == 1 for p in partial.values())

    rerun = FakeEngine()
    resumed = regenerate(ITEMS, rerun.complete, journal, answer_batch=2, progress_mode="off")
    assert rerun.asked == ANSWERS - 5  # only the answers not journaled
    assert {k: v.messages for k, v in resumed.items()} == {k: v.messages for k, v in whole.items()}
    assert {k: v.token_ids for k, v in resumed.items()} == {k: v.token_ids for k, v in whole.items()}
    assert read_partial(journal) == {}
    assert set(read_journal(journal)) == {key for key, _ in ITEMS}


def test_a_failed_request_is_not_journaled_even_part_way(tmp_path: Path) -> None:
    journal = tmp_path / "regenerated.jsonl"

    def complete(conversations: list, seeds: list[int]) -> list[tuple]:
        return [("a", REQUEST_FAILED if c[-1]["content"] == "q2.1" else "stop", None) for c in conversations]

    result = regenerate(ITEMS, complete, journal, answer_batch=1, progress_mode="off")
    assert REQUEST_FAILED in result["k2"].finish_reasons
    assert "k2" not in read_journal(journal)
    assert "k2" in read_partial(journal)  # its first answer is kept; a rerun asks again from turn 1


def test_merging_parts_keeps_partials_only_where_nothing_finished(tmp_path: Path) -> None:
    journal = tmp_path / "regenerated.jsonl"
    killed = FakeEngine(stop_after=3)
    with pytest.raises(KeyboardInterrupt):
        regenerate(
            ITEMS,
            killed.complete,
            journal,
            answer_batch=2,
            write_to=journal_part(journal, 0),
            progress_mode="off",
        )
    regenerate(
        ITEMS[:2],
        FakeEngine().complete,
        journal,
        answer_batch=2,
        write_to=journal_part(journal, 1),
        progress_mode="off",
    )
    merge_journal_parts(journal)
    assert not list(tmp_path.glob("*.part-*"))
    assert set(read_journal(journal)) == {"k0", "k1", "k3"}
    assert set(read_partial(journal)) == {"k2", "k4"}


def test_progress_counts_answers_in_plain_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("flashdraft.progress.DEFAULT_INTERVAL_S", 0)  # a line per batch
    regenerate(ITEMS, FakeEngine().complete, tmp_path / "j.jsonl", answer_batch=4, progress_mode="plain")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5  # 4 batches (4 + 1 answers of turn 0, 3 of turn 1, 1 of turn 2), the final line
    last = lines[-1]
    assert last.startswith(f"regenerating: {ANSWERS}/{ANSWERS} answers (100%)")
    assert "tokens/s" in last
