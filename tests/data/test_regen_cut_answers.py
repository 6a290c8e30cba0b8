"""`prepare --cut-answers keep|drop`: an answer cut at --max-new-tokens is trained on without an end-of-turn
(it ends its sample), or left out; both are counted; the journal key holds --max-new-tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flashdraft.cli import main
from flashdraft.config import Sampling
from flashdraft.data.local_regen import LocalJob, key_settings
from flashdraft.data.regenerate import journal_key, read_journal
from flashdraft.data.render import prompt_ids
from flashdraft.data.shards import open_shards

from .helpers import fake_chat_server, make_tokenizer, supervised_spans

TOK = make_tokenizer("qwen")
END = TOK.convert_tokens_to_ids("<|im_end|>")
CONVS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi there"}]},
    {
        "messages": [
            {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "why"},
            {"role": "assistant", "content": "because"},
        ]
    },
]


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _samples(out: Path) -> list[tuple[list[int], list[int]]]:
    _, shards = open_shards(out)
    return [tuple(map(list, shards.sample(i, 10**6))) for i in range(len(shards))]


def test_a_kept_cut_local_answer_ends_its_sample_on_the_generated_ids(tmp_path, target):
    data = _write(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "why"}]}])
    out = tmp_path / "s"
    args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
    # the random target never ends its turn within 3 tokens
    assert main([*args, "--device", "cpu", "--max-new-tokens", "3", "--engine", "static"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cut_answers"] == {"policy": "keep", "kept": 1, "dropped": 0}
    assert manifest["regeneration"]["engine_details"][0]["engine"] == "static"
    (record,) = read_journal(out / "regenerated.jsonl").values()
    assert record.finish_reasons == ["length"]
    generated = record.token_ids[0]
    prompt = prompt_ids(TOK, record.messages[:1], None)
    ((ids, mask),) = _samples(out)
    assert ids == prompt + generated  # nothing after the answer: no end-of-turn, no newline
    assert mask == [0] * len(prompt) + [1] * len(generated)


def test_a_kept_cut_server_answer_loses_the_templates_end_of_turn_and_later_turns(tmp_path, target):
    def reply(body):
        return ("hi there", "length") if "2+2" in str(body) else "ok"

    with fake_chat_server(reply) as fake:
        data = _write(tmp_path / "in.jsonl", CONVS)
        out = tmp_path / "s"
        args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
        assert main([*args, "--server-url", fake.url, "--max-new-tokens", "7"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cut_answers"] == {"policy": "keep", "kept": 1, "dropped": 0}
    finished, cut = _samples(out)
    assert supervised_spans(TOK, *finished) == ["ok <|im_end|>"]  # a finished answer keeps its end
    assert [span.split() for span in supervised_spans(TOK, *cut)] == [["hi", "there"]]
    assert cut[0][-1] != END and END not in [t for t, m in zip(*cut, strict=True) if m]
    assert "why" not in TOK.decode(cut[0])  # the turns after the cut one are left out


def test_cut_answers_dropped_are_counted(tmp_path, target):
    with fake_chat_server(lambda body: ("cut sho", "length") if "2+2" in str(body) else "ok") as fake:
        data = _write(tmp_path / "in.jsonl", CONVS)
        out = tmp_path / "s"
        args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
        argv = [*args, "--server-url", fake.url, "--max-new-tokens", "7", "--cut-answers", "drop"]
        assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cut_answers"] == {"policy": "drop", "kept": 0, "dropped": 1}
    assert manifest["dropped"]["answer cut at --max-new-tokens 7"] == 1
    assert manifest["samples"] == 1


def test_the_journal_key_holds_max_new_tokens(target):
    def key(max_new: int) -> str:
        job = LocalJob(str(target), Sampling(max_new_tokens=max_new), None, "static")
        return journal_key([{"role": "user", "content": "hi"}], 0, {"engine": key_settings(job, ["cpu"])})

    assert key(512) != key(1024)  # a rerun with a larger limit never reuses an answer cut at the smaller


def _mixed_records() -> list[dict]:
    """Prompt-only conversations (regenerated, several cut at 3 tokens), answered ones, and a bad record
    on line 10."""
    records = [{"messages": [{"role": "user", "content": w}]} for w in ["why", "hi", "2+2", "ok", "sure"]]
    return records + CONVS * 2 + [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}]


def _rendered(data, target, out, *flags: str) -> tuple:
    """`prepare --regenerate` of `data` on the CPU (3 new tokens, bad records skipped) with `flags`: its
    samples, its counts and its bad records."""
    args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
    assert main([*args, "--device", "cpu", "--max-new-tokens", "3", "--skip-bad-records", *flags]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    counts = {k: manifest[k] for k in ("samples", "dropped", "generated_ids", "cut_answers", "tokens")}
    return _samples(out), counts, manifest["bad_records"]


def test_rendering_in_worker_processes_gives_the_same_samples_and_counts(
    tmp_path, target, monkeypatch, capsys
):
    """`--render-workers 2`: the conversations go to two spawned processes in chunks and come back in
    order, so the shards and every count equal one process's; generated ids and cut answers included."""
    from flashdraft.data import render_pool

    monkeypatch.setattr(render_pool, "CHUNK", 3)  # 10 conversations: 4 chunks
    data = _write(tmp_path / "in.jsonl", _mixed_records())
    outcomes = {}
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}"
        outcomes[workers] = _rendered(data, target, out, "--engine", "static", "--render-workers", workers)
    assert "rendering 9 conversations in 2 processes" in capsys.readouterr().out
    assert outcomes["1"] == outcomes["2"]
    _, counts, bad = outcomes["2"]
    assert counts["cut_answers"]["kept"] >= 5 and counts["dropped"] == {"bad record": 1}
    assert len(bad) == 1 and "in.jsonl line 10" in bad[0]  # named as in one process


def test_rendering_in_threads_gives_the_same_samples_and_counts(tmp_path, target, monkeypatch):
    """In one process, from THREADS_FROM conversations on, threads share the tokenizer: chunks come back in
    input order, so the shards, every count and the bad record's name equal a single thread's."""
    from flashdraft.data import render_pool

    data = _write(tmp_path / "in.jsonl", _mixed_records())
    monkeypatch.setattr(render_pool, "_cores", lambda: 4)
    monkeypatch.setattr(render_pool, "THREAD_CHUNK", 2)  # 9 conversations: the first alone, then 4 chunks
    used = []
    original = render_pool._render_in_threads
    monkeypatch.setattr(
        render_pool,
        "_render_in_threads",
        lambda tok, conv, rules, threads: used.append(threads) or original(tok, conv, rules, threads),
    )
    outcomes = {}
    for label, threads_from in (("one thread", 10**9), ("threads", 2)):
        monkeypatch.setattr(render_pool, "THREADS_FROM", threads_from)
        outcomes[label] = _rendered(data, target, tmp_path / label.replace(" ", "_"))
    assert used == [1, 4]
    assert outcomes["one thread"] == outcomes["threads"]
    assert len(outcomes["threads"][2]) == 1 and "in.jsonl line 10" in outcomes["threads"][2][0]


def test_row_groups_flag_reaches_the_static_engine_and_the_answers_stay(tmp_path, target):
    """`--row-groups 1` turns the decode attention's row groups off; the default groups rows by prompt
    length (recorded in the manifest's engine record), and the samples are the same."""
    words = ["why", "hi there friend", "2+2", "ok", "sure thing then, thanks a lot", "be brief please"]
    data = _write(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": w}]} for w in words])
    outcomes = {}
    for groups in ("4", "1"):
        out = tmp_path / f"g{groups}"
        args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
        args += ["--device", "cpu", "--engine", "static", "--max-new-tokens", "4", "--row-groups", groups]
        assert main(args) == 0
        manifest = json.loads((out / "manifest.json").read_text())
        outcomes[groups] = (_samples(out), manifest["regeneration"]["engine_details"][0]["row_groups"])
    assert outcomes["4"][1] and len(outcomes["4"][1]) > 1 and outcomes["1"][1] is None
    assert outcomes["4"][0] == outcomes["1"][0]


class _DiesWhenUnpickled:
    """Unpickled in a render worker, it ends that process at once, as an out-of-memory kill would."""

    def __reduce__(self):
        return (os._exit, (3,))


def test_a_render_worker_that_dies_is_a_clear_error_and_writes_nothing(tmp_path, target, monkeypatch):
    from flashdraft.data import render_pool
    from flashdraft.errors import FlashdraftError
    from flashdraft.model.target import load_target_tokenizer

    monkeypatch.setattr(render_pool, "CHUNK", 2)
    tokenizer = load_target_tokenizer(str(target), required=True)
    conversations = [
        render_pool.Conversation(c["messages"], f"in.jsonl line {i}") for i, c in enumerate(CONVS * 3)
    ]
    with pytest.raises(FlashdraftError, match=r"a render worker process died .* --render-workers"):
        list(render_pool.render_all(tokenizer, conversations, _DiesWhenUnpickled(), workers=2))


def test_turns_left_out_after_a_cut_answer_are_counted_in_the_summary(tmp_path, target, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the summary table on one line per row
    with fake_chat_server(lambda body: ("cut sho", "length")) as fake:  # every answer cut
        data = _write(tmp_path / "in.jsonl", CONVS)
        out = tmp_path / "s"
        args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
        assert main([*args, "--server-url", fake.url, "--max-new-tokens", "7"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cut_answers"] == {"policy": "keep", "kept": 2, "dropped": 0}
    assert manifest["turns_after_cut_answers"] == 1  # the two-turn conversation's second turn
    summary = " ".join(capsys.readouterr().out.split())
    assert "later turns left out after a cut answer" in summary
    assert "1 (a sample ends at its cut answer; raise --max-new-tokens to keep them)" in summary
